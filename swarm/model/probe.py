"""What a peer can give, measured at start-up before it has trained: its device (kind, name, memory) and its
training throughput on this run's model, from a few timed forward/backward steps on random tokens.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass

import torch

from swarm.model.build import lm_loss

MAX_NAME = 128


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # torch device type: cpu or cuda
    name: str  # GPU model, or CPU model where the OS says it
    memory_bytes: int  # GPU memory, or system memory for a CPU peer; 0 if unknown


def describe_device(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return DeviceInfo("cuda", properties.name[:MAX_NAME], int(properties.total_memory))
    return DeviceInfo(device.type, _cpu_name()[:MAX_NAME], _system_memory())


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _system_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX, or the OS does not say
        return 0


def measure_tokens_per_s(model: torch.nn.Module, batch_size: int, seq_len: int, device: torch.device,
                         steps: int = 3) -> float:
    """Training tokens/s of `model` on `device`: forward and backward passes (as an inner step does them) on
    random (batch_size, seq_len + 1) token batches, timed after one warm-up pass.

    Leaves the parameters and the RNG state untouched; clears the gradients, so call it before training."""
    vocab_size = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator)
               for _ in range(steps + 1)]
    was_training = model.training
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    elapsed = 0.0
    with torch.random.fork_rng(devices=rng_devices):  # dropout, if a model has it, must not shift training's RNG
        model.train()
        try:
            for i, batch in enumerate(batches):
                started = time.perf_counter()
                lm_loss(model, batch, device).backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i:  # the first pass pays for allocation and kernel selection
                    elapsed += time.perf_counter() - started
                model.zero_grad(set_to_none=True)
        finally:
            model.zero_grad(set_to_none=True)
            model.train(was_training)
    return steps * batch_size * seq_len / elapsed if elapsed > 0 else 0.0
