"""The device a peer trains on, and what memory this machine and that device have free."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch


def pick_device(requested: str) -> torch.device:
    """'auto' -> CUDA when available, else CPU; 'cuda' without a GPU is a clear error (RuntimeError)."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but torch sees no CUDA GPU: use --device cpu or auto")
    return torch.device(requested)


def autocast(device: torch.device):
    """bf16 autocast on CUDA; nothing on the CPU (whose training stays fp32)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def available_memory() -> Optional[int]:
    """Bytes of memory available to new processes (MemAvailable), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def device_memory(device: str) -> Optional[tuple[str, int]]:
    """(name, free bytes) of the CUDA device, None for the CPU."""
    if device == "cpu":
        return None
    return torch.cuda.get_device_name(), torch.cuda.mem_get_info()[0]
