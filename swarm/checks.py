"""A `Check` (one verdict with a one-line message: cause and fix) and the checks of this machine's disk and memory
against what a recipe's model needs (swarm.model.memory's estimates): part of `swarm-peer doctor` and of `join`'s
start-up (swarm.doctor)."""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from swarm.config import Recipe, RecipeError, load_recipe
from swarm.data.paths import local_files
from swarm.model.device import available_memory, device_memory, pick_device
from swarm.model.memory import estimate_needs, fmt_bytes, resolve_stages, stage_needs
from swarm.settings import PeerSettings


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


def load_resolved(path: str | Path, data_dir: str | Path) -> Recipe:
    """The recipe in the file at `path`, its pipeline.stages made a number (resolve_stages)."""
    return resolve_stages(load_recipe(path), data_dir)


def require_recipe(path: str | Path, data_dir: str | Path, swarm_recipe: Recipe) -> None:
    """Raise RecipeError, naming the fields that differ, unless the recipe in `path` is the swarm's."""
    local = load_resolved(path, data_dir)
    if local.digest() != swarm_recipe.digest():
        raise RecipeError(f"local recipe {path} differs from the swarm's in: "
                          f"{', '.join(local.differing_fields(swarm_recipe))}")


def check_checkpoint_dir(directory: Optional[str]) -> Check:
    """Whether checkpoints can be written under --checkpoint-dir at all (a directory there, or one that can be made,
    writable by us): checked before a peer trains, not when its first checkpoint is due."""
    if directory is None:
        return Check("checkpoint dir", True, "none given: this peer writes no checkpoints")
    path = Path(directory).expanduser().absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        what = "is a file" if existing == path else f"would be made under {existing}, which is a file"
        return Check("checkpoint dir", False, f"--checkpoint-dir {directory} {what}, not a directory: give a "
                                              "directory (a missing one is created)", {"directory": directory},
                     fatal=True)
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be made: {existing} is not writable"
        return Check("checkpoint dir", False, f"--checkpoint-dir {directory} {what} by this user: give one this "
                                              "user can write", {"directory": directory}, fatal=True)
    return Check("checkpoint dir", True, f"{directory} {'is writable' if existing == path else 'can be made'}",
                 {"directory": directory})


def check_disk(directory: Optional[str], checkpoint: int, keep: int) -> Check:
    if directory is None:
        return Check("disk", True, "no --checkpoint-dir: this peer writes no checkpoints")
    free = _free_space(directory)
    need = checkpoint * (keep + 1)  # a new checkpoint is written before the oldest is removed
    details = {"directory": directory, "free": free, "need": need, "checkpoint": checkpoint}
    if free >= need:
        return Check("disk", True, f"{fmt_bytes(free)} free for checkpoints of {fmt_bytes(checkpoint)}", details)
    return Check("disk", False, f"{fmt_bytes(free)} free in {directory} but {keep} checkpoints and the one being "
                                f"written need {fmt_bytes(need)}: free space there, pass a --checkpoint-dir on a "
                                "larger disk, or lower --keep-checkpoints", details)


def check_outer_state_disk(directory: str, need: int) -> Check:
    free = _free_space(directory)
    details = {"directory": directory, "free": free, "need": need}
    if free >= need:
        return Check("outer state", True, f"{fmt_bytes(free)} free in {directory} for the outer state's "
                                          f"{fmt_bytes(need)}", details)
    return Check("outer state", False, f"{fmt_bytes(free)} free in {directory} but the outer state needs "
                                       f"{fmt_bytes(need)}: free space there or give --outer-state-dir on a larger "
                                       "disk", details)


def _free_space(directory: str) -> int:
    existing = Path(directory).expanduser().absolute()
    while not existing.exists():  # the file system the directory will be made on
        existing = existing.parent
    return shutil.disk_usage(existing).free


def check_memory(need: int, free: Optional[int], replay: Optional[float]) -> Check:
    if free is None:
        return Check("memory", True, f"about {fmt_bytes(need)} needed; this system does not say how much is free")
    details = {"need": need, "free": free}
    if free >= need:
        return Check("memory", True, f"{fmt_bytes(free)} available, about {fmt_bytes(need)} needed", details)
    log = f"--replay-log-mb {replay:g}" if replay is not None else "--replay-log-mb, one state's size by default"
    return Check("memory", False, f"{fmt_bytes(free)} of memory available but this peer needs about "
                                  f"{fmt_bytes(need)}: close other programs, lower {log}, or keep the outer "
                                  "state on disk (--outer-state-dir)", details)


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
    if shared and recipe.model.config_file is not None and config_file is None:
        return [Check("resources", True, "estimated once the run's dataset (with the model config) is here")]
    try:
        device = pick_device(settings.device).type
        model = recipe.model.model_copy(update={"config_file": config_file}) if config_file else \
            local_files(recipe, settings.data_dir or settings.cache_dir)[2]  # where join reads config_file
        needs = estimate_needs(recipe.model_copy(update={"model": model}), device, settings.replay_log_mb,
                               settings.recompute_activations, outer_on_disk=settings.outer_state_dir is not None)
    except RuntimeError as e:  # --device cuda without a GPU
        return [Check("device", False, str(e), fatal=True)]
    except (RecipeError, OSError, ValueError) as e:
        return [Check("resources", False, f"not estimated: the recipe's model cannot be built here ({e}): fix "
                                          "model.config_file or --data-dir")]
    checks = [check_disk(settings.checkpoints.dir, needs.checkpoint, settings.checkpoints.keep),
              check_memory(needs.host, available_memory(), settings.replay_log_mb)]
    if settings.outer_state_dir is not None:
        checks.append(check_outer_state_disk(settings.outer_state_dir, 8 * needs.params))
    if settings.max_memory is not None:
        checks.append(check_max_memory(recipe.model_copy(update={"model": model}), settings.max_memory))
    gpu = device_memory(device)
    if gpu is not None:
        name, free = gpu
        checks.append(check_device_memory(name, need=needs.device, free=free))
    return checks
