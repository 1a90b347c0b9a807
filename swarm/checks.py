"""A `Check` (one verdict with a one-line message: cause and fix) and the checks of this machine's disk and memory
against what a recipe's model needs: part of `swarm-peer doctor` and of `join`'s start-up (swarm.doctor)."""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from swarm.config import PeerSettings, Recipe, RecipeError
from swarm.data.paths import local_files


@dataclass(frozen=True)
class Check:
    """One check's verdict. `message` is one line: on a problem, its cause and its fix."""

    name: str
    ok: bool
    message: str
    details: dict = field(default_factory=dict)
    fatal: bool = False  # a peer cannot run with this problem: join stops with the message

    def line(self) -> str:
        return f"{'ok' if self.ok else 'PROBLEM':7} {self.name}: {self.message}"

    def to_json(self) -> dict:
        return asdict(self)



# ---- disk and memory --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Needs:
    """What a peer of a recipe needs, in bytes (estimates)."""

    params: int
    checkpoint: int  # one checkpoint: global params and outer momentum (+ error feedback), fp32
    host: int  # the CPU's share: global state, replay log, all-reduce buffers (+ training on a CPU device)
    device: int  # training on a GPU: weights, gradients, AdamW moments, activations


def estimate_needs(recipe: Recipe, device: str, replay_log_mb: Optional[float]) -> Needs:
    """Counts the model's parameters on the meta device (nothing allocated). Raises RecipeError for a model the
    recipe cannot build."""
    import torch

    from swarm.peer.model import build_model

    with torch.device("meta"):
        n = sum(p.numel() for p in build_model(recipe.model, recipe.data.vocab_size).parameters())
    d, m = recipe.data, recipe.model
    activations = 4 * d.batch_size * d.seq_len * (m.num_layers * (34 * m.hidden_size + 5 * m.num_heads * d.seq_len)
                                                  + 3 * d.vocab_size)
    training = 16 * n + activations  # fp32 weights and gradients, AdamW's two moments
    replay = 8 * n if replay_log_mb is None else int(replay_log_mb * 1e6)
    host = 8 * n + replay + 12 * n + (training if device == "cpu" else 0)
    return Needs(n, 12 * n, host, training if device != "cpu" else 0)


def _fmt(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def check_disk(directory: Optional[str], checkpoint: int, keep: int) -> Check:
    if directory is None:
        return Check("disk", True, "no --checkpoint-dir: this peer writes no checkpoints")
    existing = Path(directory).expanduser().absolute()
    while not existing.exists():  # the file system the directory will be made on
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    need = checkpoint * (keep + 1)  # a new checkpoint is written before the oldest is removed
    details = {"directory": directory, "free": free, "need": need, "checkpoint": checkpoint}
    if free >= need:
        return Check("disk", True, f"{_fmt(free)} free for checkpoints of {_fmt(checkpoint)}", details)
    return Check("disk", False, f"{_fmt(free)} free in {directory} but {keep} checkpoints and the one being written "
                                f"need {_fmt(need)}: free space there, pass a --checkpoint-dir on a larger disk, or "
                                "lower --keep-checkpoints", details)


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
    import torch

    return torch.cuda.get_device_name(), torch.cuda.mem_get_info()[0]


def check_memory(need: int, free: Optional[int], replay: Optional[float]) -> Check:
    if free is None:
        return Check("memory", True, f"about {_fmt(need)} needed; this system does not say how much is free")
    details = {"need": need, "free": free}
    if free >= need:
        return Check("memory", True, f"{_fmt(free)} available, about {_fmt(need)} needed", details)
    log = f"--replay-log-mb {replay:g}" if replay is not None else "--replay-log-mb, one state's size by default"
    return Check("memory", False, f"{_fmt(free)} of memory available but this peer needs about {_fmt(need)}: close "
                                  f"other programs, or lower {log}", details)


def check_device_memory(name: str, need: int, free: int) -> Check:
    details = {"device": name, "need": need, "free": free}
    if free >= need:
        return Check("device memory", True, f"{name}: {_fmt(free)} free, about {_fmt(need)} needed", details)
    return Check("device memory", False, f"{name} has {_fmt(free)} free but training this model needs about "
                                         f"{_fmt(need)}: free the GPU (`nvidia-smi` shows who holds it), or join "
                                         "with --device cpu", details)


def resource_checks(recipe: Recipe, settings: PeerSettings, shared: bool = False,
                    config_file: Optional[str] = None) -> list[Check]:
    """Disk for checkpoints, memory and device memory against what the recipe's model needs. A run that `shared` its
    dataset delivers the model config with it: `config_file`, the copy fetched (none yet: checked later)."""
    from swarm.peer.training import pick_device

    if shared and recipe.model.config_file is not None and config_file is None:
        return [Check("resources", True, "estimated once the run's dataset (with the model config) is here")]
    try:
        device = pick_device(settings.device).type
        model = recipe.model.model_copy(update={"config_file": config_file}) if config_file else \
            local_files(recipe, settings.data_dir or settings.cache_dir)[2]  # where join reads config_file
        needs = estimate_needs(recipe.model_copy(update={"model": model}), device, settings.replay_log_mb)
    except RuntimeError as e:  # --device cuda without a GPU
        return [Check("device", False, str(e), fatal=True)]
    except (RecipeError, OSError, ValueError) as e:
        return [Check("resources", False, f"not estimated: the recipe's model cannot be built here ({e}): fix "
                                          "model.config_file or --data-dir")]
    checks = [check_disk(settings.checkpoints.dir, needs.checkpoint, settings.checkpoints.keep),
              check_memory(needs.host, available_memory(), settings.replay_log_mb)]
    gpu = device_memory(device)
    if gpu is not None:
        checks.append(check_device_memory(*gpu, needs.device))
    return checks
