"""A `Check` (one verdict with a one-line message: cause and fix) and the checks of this machine's disk and memory
against what a recipe's model needs: part of `swarm-peer doctor` and of `join`'s start-up (swarm.doctor)."""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from swarm.config import Recipe, RecipeError, load_recipe
from swarm.settings import PeerSettings
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
    n = sum(params for params, _, _ in part_params(recipe))
    training = training_bytes(recipe, n, recipe.model.num_layers, last=True)
    replay = 8 * n if replay_log_mb is None else int(replay_log_mb * 1e6)
    host = 8 * n + replay + 12 * n + (training if device == "cpu" else 0)
    return Needs(n, 12 * n, host, training if device != "cpu" else 0)


def part_params(recipe: Recipe, model=None) -> list[tuple[int, int, bool]]:
    """(parameters, blocks, whether it holds the head) of each pipeline stage of the recipe's model (one entry for
    a whole-model run): of `model`, or of one built on the meta device."""
    from swarm.peer.model import build_model, n_blocks
    from swarm.peer.stages import Stage, even_bounds

    if model is None:
        model = build_model(recipe.model, recipe.data.vocab_size, meta=True)
    blocks = n_blocks(model)
    if recipe.pipeline.stages == 1:
        return [(sum(p.numel() for p in model.parameters()), blocks, True)]
    return [(sum(p.numel() for p in Stage(model, a, b).parameters()), b - a, b == blocks)
            for a, b in even_bounds(blocks, recipe.pipeline.stages)]


def check_max_memory(recipe: Recipe, limit_mb: float) -> Check:
    """Whether the whole model, or some stage of a pipelined run, trains within --max-memory."""
    stages = recipe.pipeline.stages
    needs = stage_needs(recipe)
    limit, details = int(limit_mb * 1e6), {"limit": int(limit_mb * 1e6), "needs": needs}
    fits = [k for k, need in enumerate(needs) if need <= limit]
    if stages == 1 and fits:
        return Check("max memory", True, f"training the model needs about {fmt_bytes(needs[0])} of "
                                         f"{fmt_bytes(limit)}", details)
    if stages == 1:
        return Check("max memory", False, f"training the whole model needs about {fmt_bytes(needs[0])} but "
                                          f"--max-memory allows {fmt_bytes(limit)}: join a run cut into pipeline "
                                          "stages, or raise --max-memory", details, fatal=True)
    if fits:
        many = len(fits) > 1
        return Check("max memory", True, f"stage{'s' if many else ''} {', '.join(map(str, fits))} of {stages} "
                                         f"fit{'' if many else 's'} in {fmt_bytes(limit)}", details)
    return Check("max memory", False, f"no stage fits in --max-memory {fmt_bytes(limit)}: the smallest needs about "
                                      f"{fmt_bytes(min(needs))}; raise --max-memory", details, fatal=True)


def stage_needs(recipe: Recipe, model=None, parts: Optional[list[tuple[int, int, bool]]] = None) -> list[int]:
    """The memory to train each pipeline stage (one entry for a whole-model run; `parts`: part_params, if known):
    training_bytes, plus on the first stage of a pipeline the two copies of its weights its stream of microbatches
    keeps (swarm/peer/microbatches.py: two batches in flight, each on the weights it started with)."""
    parts = part_params(recipe, model) if parts is None else parts
    stream = len(parts) > 1 and recipe.pipeline.schedule == "stream"
    return [training_bytes(recipe, *part) + (8 * part[0] if k == 0 and stream else 0) for k, part in enumerate(parts)]


def load_resolved(path: str | Path, data_dir: str | Path) -> Recipe:
    """The recipe in the file at `path`, its pipeline.stages made a number (resolve_stages)."""
    return resolve_stages(load_recipe(path), data_dir)


def require_recipe(path: str | Path, data_dir: str | Path, swarm_recipe: Recipe) -> None:
    """Raise RecipeError, naming the fields that differ, unless the recipe in `path` is the swarm's."""
    local = load_resolved(path, data_dir)
    if local.digest() != swarm_recipe.digest():
        raise RecipeError(f"local recipe {path} differs from the swarm's in: "
                          f"{', '.join(local.differing_fields(swarm_recipe))}")


def resolve_stages(recipe: Recipe, data_dir: str | Path) -> Recipe:
    """`recipe` with `pipeline.stages: auto` made a number: the fewest even stages each of which trains within
    `pipeline.stage_memory` MB as stage_needs estimates (1, the whole model, when it fits), the model built on the
    meta device from the recipe (a `config_file` read inside `data_dir`). A recipe with a number is returned as it
    is. Raises RecipeError, saying what to do, when even one block a stage does not fit."""
    if recipe.pipeline.stages != "auto":
        return recipe
    from swarm.peer.model import build_model, n_blocks

    here = recipe.model_copy(update={"model": local_files(recipe, data_dir)[2]})
    blocks = n_blocks(build_model(here.model, recipe.data.vocab_size, meta=True))
    limit = int(recipe.pipeline.stage_memory * 1e6)
    for stages in range(1, blocks + 1):
        pipeline = recipe.pipeline.model_copy(update={"stages": stages})
        needs = stage_needs(here.model_copy(update={"pipeline": pipeline}))
        if max(needs) <= limit:
            return recipe.model_copy(update={"pipeline": pipeline})
    raise RecipeError(f"pipeline.stages: auto: even one block a stage needs about {fmt_bytes(max(needs))} to train, "
                      f"over pipeline.stage_memory {fmt_bytes(limit)}: raise stage_memory, or train a smaller model")


def training_bytes(recipe: Recipe, params: int, layers: int, last: bool) -> int:
    """Memory to train `params` parameters in `layers` blocks (and the LM head's logits when `last`): fp32 weights
    and gradients, AdamW's two moments, and one microbatch's activations."""
    d, m = recipe.data, recipe.model
    per_block = 34 * m.hidden_size + 5 * m.num_heads * d.seq_len
    return 16 * params + 4 * d.batch_size * d.seq_len * (layers * per_block + (3 * d.vocab_size if last else 0))


def fmt_bytes(n: float) -> str:
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
        return Check("disk", True, f"{fmt_bytes(free)} free for checkpoints of {fmt_bytes(checkpoint)}", details)
    return Check("disk", False, f"{fmt_bytes(free)} free in {directory} but {keep} checkpoints and the one being written "
                                f"need {fmt_bytes(need)}: free space there, pass a --checkpoint-dir on a larger disk, or "
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
        return Check("memory", True, f"about {fmt_bytes(need)} needed; this system does not say how much is free")
    details = {"need": need, "free": free}
    if free >= need:
        return Check("memory", True, f"{fmt_bytes(free)} available, about {fmt_bytes(need)} needed", details)
    log = f"--replay-log-mb {replay:g}" if replay is not None else "--replay-log-mb, one state's size by default"
    return Check("memory", False, f"{fmt_bytes(free)} of memory available but this peer needs about {fmt_bytes(need)}: close "
                                  f"other programs, or lower {log}", details)


def check_device_memory(name: str, *, need: int, free: int) -> Check:
    details = {"device": name, "need": need, "free": free}
    if free >= need:
        return Check("device memory", True, f"{name}: {fmt_bytes(free)} free, about {fmt_bytes(need)} needed", details)
    return Check("device memory", False, f"{name} has {fmt_bytes(free)} free but training this model needs about "
                                         f"{fmt_bytes(need)}: free the GPU (`nvidia-smi` shows who holds it), or join "
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
    if settings.max_memory is not None:
        checks.append(check_max_memory(recipe.model_copy(update={"model": model}), settings.max_memory))
    gpu = device_memory(device)
    if gpu is not None:
        name, free = gpu
        checks.append(check_device_memory(name, need=needs.device, free=free))
    return checks
