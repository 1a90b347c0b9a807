"""Atomic, verifiable checkpoints of a peer's global state: global params, outer momentum and extra tensors
(e.g. error-feedback residuals) in safetensors, metadata in JSON with the file's sha256. A write is
temp-dir + fsync + rename, so a crash mid-write leaves the previous checkpoint loadable; a corrupted checkpoint
is detected on load and skipped in favour of the previous one.

A peer writes them on a thread of its own (`CheckpointWriter`), one at a time, from the state in place: the next
change of the state (the next outer step) waits for the write, not the training in between.

Besides the newest few, a directory keeps a series of intermediate checkpoints, as Pythia and OLMo publish them:
log-spaced early (rounds 1, 2, 4, 8, ...) and then every `series_every` rounds, each with its round, tokens seen
and losses in its metadata, and all of them listed in `checkpoints.json`.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import load_file

logger = logging.getLogger(__name__)
PREFIX = "round-"
INDEX = "checkpoints.json"


def in_series(round_no: int, series_every: int) -> bool:
    """Whether a checkpoint of `round_no` belongs to the kept series: a power of two, or a multiple of
    `series_every` (0: no series)."""
    if series_every <= 0 or round_no <= 0:
        return False
    return round_no & (round_no - 1) == 0 or round_no % series_every == 0


@dataclass
class Checkpoint:
    path: Path
    round: int
    tokens_seen: int
    meta: dict
    tensors: dict[str, torch.Tensor]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], each: Callable[[], None] = lambda: None) -> str:
    """Write `tensors` in the safetensors format (what safetensors' load_file reads), straight from their memory
    (safetensors' own save_file makes a bytes copy of every tensor first: the whole state once more), hashing
    as it writes, and fsync; returns the file's sha256. `each` is called after each tensor is written (DiLoCo's
    release: a state kept in a file is paged in a tensor at a time)."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in sorted(tensors.items())}
    header, offset = {}, 0
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPES:
            raise ValueError(f"tensor {name}: dtype {tensor.dtype} has no safetensors name here")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset,
                                                                                                    offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # (the data starts 8-byte aligned, as safetensors writes it)
    digest = hashlib.sha256()
    with open(path, "wb") as file:
        for part in (len(text).to_bytes(8, "little"), text):
            digest.update(part)
            file.write(part)
        for tensor in tensors.values():
            if tensor.numel():
                data = tensor.view(-1).view(torch.uint8).numpy()
                digest.update(data)
                file.write(data)
                each()
        file.flush()
        os.fsync(file.fileno())
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(directory: str | Path, round_no: int, tokens_seen: int, tensors: dict[str, torch.Tensor],
                    meta: dict, keep: int = 3, series_every: int = 0,
                    each: Callable[[], None] = lambda: None) -> Path:
    """Write `round-NNNNNNNN/` atomically; keep the newest `keep` checkpoints plus the series (see in_series);
    returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{PREFIX}{round_no:08d}"
    staging = directory / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    tensor_path = staging / "state.safetensors"
    sha256 = write_safetensors(tensor_path, tensors, each)
    full_meta = {**meta, "round": round_no, "tokens_seen": tokens_seen, "sha256": sha256}
    with open(staging / "meta.json", "w") as file:
        json.dump(full_meta, file, indent=1, sort_keys=True)
        file.flush()
        os.fsync(file.fileno())
    _fsync_dir(staging)
    if final.exists():  # rewriting the same round (e.g. after a re-sync): replace it whole
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(directory)
    for old in sorted(list_checkpoints(directory))[:-keep] if keep > 0 else []:
        if not in_series(_round_of(old), series_every):
            shutil.rmtree(old, ignore_errors=True)
    _write_index(directory)
    return final


class CheckpointWriter:
    """Writes a peer's checkpoints on a thread of its own, one at a time, reading the global state in place (its
    next change waits for the write: DiLoCo.read_in_background). Once a checkpoint is on disk it is logged, and
    so are the `checkpoint` event and the metrics (PeerMetrics.checkpoint_written); a write that fails is said in
    one line and the previous checkpoint stays."""

    def __init__(self, directory: str | Path, keep: int, series_every: int, metrics, events):
        self.directory, self.keep, self.series_every = Path(directory), keep, series_every
        self.metrics, self.events = metrics, events
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._pending: Optional[concurrent.futures.Future] = None
        self.last_round = -1  # the round of the last checkpoint handed to the writer

    def write(self, diloco, extra: dict[str, torch.Tensor], meta: dict) -> None:
        """Start writing `diloco`'s state of now, with `extra` tensors (never changed in place afterwards) and
        `meta`, once the previous write is done."""
        self.wait()
        round_no, tokens_seen = diloco.round, diloco.tokens_seen
        self.last_round = round_no
        tensors = {**diloco.state_views(), **extra}

        def write() -> None:
            started = time.monotonic()
            try:
                path = save_checkpoint(self.directory, round_no, tokens_seen, tensors, meta, keep=self.keep,
                                       series_every=self.series_every, each=diloco.release)
            except Exception as e:  # noqa: BLE001 - a full disk must not take the peer down
                logger.error("checkpoint of round %d not written (%s); the previous one stays: free space in %s or "
                             "pass another --checkpoint-dir", round_no, e, self.directory)
                return
            seconds = time.monotonic() - started
            self.metrics.checkpoint_written(round_no)
            logger.info("checkpoint written: %s (%.1f s, in the background)", path, seconds)
            self.events.emit("checkpoint", round=round_no, path=str(path), seconds=round(seconds, 3))

        self._pending = diloco.read_in_background(write, self._executor)

    def wait(self, timeout: Optional[float] = None) -> float:
        """Wait for the write in progress, if any (at most `timeout` seconds); the seconds waited."""
        started = time.monotonic()
        if self._pending is not None:
            concurrent.futures.wait([self._pending], timeout)
        return time.monotonic() - started

    def close(self, timeout: Optional[float] = None) -> None:
        """Finish the write in progress (a stop waits for it: it is the newest state we have), then stop."""
        self.wait(timeout)
        self._executor.shutdown(wait=False)


def _round_of(path: Path) -> int:
    try:
        return int(path.name[len(PREFIX):])
    except ValueError:
        return -1


def _write_index(directory: Path) -> None:
    """checkpoints.json: every checkpoint kept, oldest first, with what its metadata says about it."""
    entries = []
    for path in list_checkpoints(directory):
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError):
            continue
        entries.append({"path": path.name, **{k: meta.get(k) for k in ("round", "tokens_seen", "loss", "val_loss",
                                                                        "digest")}})
    staging = directory / f".{INDEX}.tmp-{os.getpid()}"
    staging.write_text(json.dumps(entries, indent=1))
    os.replace(staging, directory / INDEX)


def list_checkpoints(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def load_latest(directory: str | Path) -> Optional[Checkpoint]:
    """The newest checkpoint that verifies, or None; corrupted ones are logged and skipped."""
    for path in reversed(list_checkpoints(directory)):
        try:
            meta = json.loads((path / "meta.json").read_text())
            tensor_path = path / "state.safetensors"
            if _sha256(tensor_path) != meta.get("sha256"):
                raise ValueError("state.safetensors does not match the sha256 in meta.json")
            tensors = load_file(str(tensor_path))
            return Checkpoint(path, int(meta["round"]), int(meta["tokens_seen"]), meta, tensors)
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped, never fatal
            logger.warning("checkpoint %s is corrupted (%s); trying the previous one", path, str(e).splitlines()[0])
    return None


def resume(checkpoint: Checkpoint, diloco, error_feedback) -> bool:
    """Load `checkpoint` into `diloco` (global params, outer momentum, round, tokens seen) and its error-feedback
    residual into `error_feedback`; False (nothing loaded) if it does not fit this run's model."""
    try:
        diloco.load_state_tensors(checkpoint.tensors, checkpoint.round, checkpoint.tokens_seen)
    except ValueError as e:
        logger.warning("checkpoint %s does not fit this run's model (%s); not using it", checkpoint.path, e)
        return False
    residual = {key.split(".", 1)[1]: value for key, value in checkpoint.tensors.items()
                if key.startswith("error_feedback.")}
    error_feedback.load_state_dict(residual)  # (those of our fragments' sizes)
    logger.info("resumed from checkpoint %s (round %d, %d tokens seen)", checkpoint.path, checkpoint.round,
                checkpoint.tokens_seen)
    return True
