"""The outer optimizer's arithmetic and what DiLoCo keeps of it: the fragments Streaming DiLoCo cuts the params
into, one outer step along a flat averaged pseudo-gradient (torch's SGD, bit for bit, a parameter at a time), and
the record of an applied step (OuterStep) that a peer behind replays.

OuterStore keeps DiLoCo's outer state (global params and outer momentum, 8 bytes a parameter) in a file instead of
the peer's memory (`--outer-state-dir`), and its replay log's averages (2.5 bytes a parameter by default) in files
beside it. A CPU peer touches the state once a sync, a fragment at a time (the pseudo-gradient, the outer step,
the state's hash), and at a checkpoint or a state download; in between it is 8 bytes a parameter of the peer's
memory that nothing reads.

The file is mapped shared (`torch.from_file`), and unlinked at once: it lives as long as the peer's mapping, so a
peer that dies by any signal leaves no file behind. After each use `release` drops the pages from the peer's
memory (madvise MADV_DONTNEED, which on a shared file mapping keeps their contents in the kernel's page cache, dirty
ones included); the kernel writes them out and frees that memory when it needs it, and a later read pages them in
again. The values are those of memory: every computation on them is the same, bit for bit.

The replay log's steps are read only when a peer behind the swarm asks for them: each step's bytes go to a file of
their own (`spill`, unlinked from the start), mapped, and the step holds views of that mapping; the file goes
with the step."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from swarm.compression import decode
from swarm.config import RecipeError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OuterStep:
    """One applied outer step, enough to redo it: the averaged pseudo-gradient and tokens that took the state of
    round `round` with state digest `digest` (round, params and outer momentum) to the state digest `after`. The
    average is kept as the encoded chunks every member of the group decoded (`wire`: (start, end, bytes), in
    order), so it costs what it cost on the wire (int8: about a byte a param), or in fp32 where it never travelled
    encoded (the ring's)."""

    round: int
    digest: str
    after: str
    tokens: int
    average: Optional[torch.Tensor] = None
    wire: Optional[tuple[tuple[int, int, bytes], ...]] = None

    @property
    def nbytes(self) -> int:
        if self.wire is not None:
            return sum(len(payload) for _, _, payload in self.wire)
        return self.average.numel() * 4

    def vector(self, numel: int) -> torch.Tensor:
        """The average, flat fp32; ValueError if it does not hold `numel` values."""
        if self.wire is None:
            if self.average is None or self.average.numel() != numel:
                raise ValueError(f"outer step of round {self.round} has no average of {numel} values")
            return self.average.to(torch.float32)
        out, at = torch.empty(numel, dtype=torch.float32), 0
        for start, end, payload in self.wire:
            if start != at or not start < end <= numel:
                raise ValueError(f"outer step of round {self.round}: chunks do not cover its {numel} values")
            part = decode(payload, max_numel=end - start)
            if part.numel() != end - start or not torch.isfinite(part).all():
                raise ValueError(f"outer step of round {self.round}: a chunk of the wrong size or not finite")
            out[start:end] = part
            at = end
        if at != numel:
            raise ValueError(f"outer step of round {self.round}: chunks do not cover its {numel} values")
        return out


def fragment_bounds(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """Cut parameters of `sizes` elements, in order, into `parts` runs [start, end) of parameter indices, none
    empty, each ending at the parameter boundary nearest to its share of the total. RecipeError if there are fewer
    parameters than parts."""
    if not 1 <= parts <= len(sizes):
        raise RecipeError(f"the recipe's outer.fragments {parts}: cannot cut {len(sizes)} parameters into {parts} "
                          f"fragments: set outer.fragments to at most {len(sizes)}")
    total, bounds, start, running = sum(sizes), [], 0, 0
    for k in range(1, parts):
        target, end = total * k / parts, start + 1
        running += sizes[start]
        while end < len(sizes) - (parts - k) and abs(running + sizes[end] - target) < abs(running - target):
            running += sizes[end]
            end += 1
        bounds.append((start, end))
        start = end
    bounds.append((start, len(sizes)))
    return bounds


def momenta(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[Optional[torch.Tensor]]:
    return [optimizer.state.get(p, {}).get("momentum_buffer") for p in params]


def outer_update(params: list[torch.Tensor], optimizer: torch.optim.SGD, average: torch.Tensor,
                 slots: Optional[list[torch.Tensor]] = None) -> None:
    """One outer step of `optimizer` (torch's SGD, Nesterov or not) on `params` along the flat averaged
    pseudo-gradient, one parameter at a time: the same arithmetic as SGD.step on the CPU (bit for bit), without
    a whole model's worth of gradients set first. The momentum buffers stay in `optimizer.state`; a parameter's
    first one is a copy of its gradient, as torch's, made in `slots` (one a param, where given) if not anew."""
    hyper = optimizer.param_groups[0]
    lr, momentum, dampening, nesterov = hyper["lr"], hyper["momentum"], hyper["dampening"], hyper["nesterov"]
    if hyper["weight_decay"] or hyper.get("maximize"):
        raise ValueError("the outer optimizer takes neither weight decay nor maximize")
    offset = 0
    with torch.no_grad():
        for k, param in enumerate(params):
            grad = average[offset:offset + param.numel()].view_as(param).to(torch.float32)
            offset += param.numel()
            if momentum:
                state = optimizer.state[param]
                buffer = state.get("momentum_buffer")
                if buffer is None:
                    buffer = state["momentum_buffer"] = \
                        torch.clone(grad).detach() if slots is None else slots[k].copy_(grad)
                else:
                    buffer.mul_(momentum).add_(grad, alpha=1 - dampening)
                grad = grad.add(buffer, alpha=momentum) if nesterov else buffer
            param.add_(grad, alpha=-lr)


MADV_DONTNEED = 4


def _madvise() -> Optional[Callable[[int, int, int], int]]:
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def _file_system(directory: Path) -> str:
    """The type of the file system `directory` lies on, from /proc/mounts ('' where that cannot be read)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return ""
    path, found, longest = str(directory.resolve()), "", -1
    for point, kind in mounts:
        point = point.replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > longest:
            found, longest = kind, len(point)
    return found


class OuterStore:
    """`numel` fp32 global params then `numel` fp32 momentum slots, in an unlinked file under `directory`."""

    def __init__(self, directory: str | Path, numel: int):
        directory = self.directory = Path(directory).expanduser()
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix="outer-state-", suffix=".f32", dir=directory)
            os.close(fd)
            try:
                self.flat = torch.from_file(path, shared=True, size=2 * numel, dtype=torch.float32)
            finally:
                os.unlink(path)  # (the mapping keeps the file while the peer lives)
        except (OSError, RuntimeError) as e:
            raise RuntimeError(f"--outer-state-dir {directory}: cannot keep the outer state there ({e}); give a "
                               f"writable directory on a disk with {8 * numel / 1e9:.2f} GB free") from e
        self.numel = numel
        kind = _file_system(directory)
        if kind in ("tmpfs", "ramfs"):
            logger.warning("--outer-state-dir %s is in memory (a %s): the outer state takes as much memory there as "
                           "in the peer; give a directory on a disk", directory, kind)
        self._madvise = _madvise()
        self._spill_failed = False
        if self._madvise is None:
            logger.warning("no madvise here: the outer state in %s stays in memory once read", directory)

    def params(self, shapes: list[torch.Size]) -> list[torch.Tensor]:
        """Views of the global params' part, one a shape, in order."""
        return self._views(0, shapes)

    def momentum_slots(self, shapes: list[torch.Size]) -> list[torch.Tensor]:
        """Views of the momentum part, one a shape, in order (what a slot holds before the first outer step is
        never read: DiLoCo puts a buffer in it then)."""
        return self._views(self.numel, shapes)

    def _views(self, at: int, shapes: list[torch.Size]) -> list[torch.Tensor]:
        views = []
        for shape in shapes:
            size = int(torch.Size(shape).numel())
            views.append(self.flat[at:at + size].view(shape))
            at += size
        return views

    def spill(self, parts: list) -> list[memoryview]:
        """`parts` (bytes-like) written one after the other to a new unlinked file here, and read back as views of
        its mapping (writable, copy on write: nothing writes to them), one a part; parts as they were where
        writing fails (a full disk: the log stays in memory, said once)."""
        size = sum(len(part) for part in parts)
        if size == 0:
            return [memoryview(part) for part in parts]
        try:
            with tempfile.TemporaryFile(dir=self.directory) as file:  # (no name: O_TMPFILE, or unlinked at once)
                for part in parts:
                    file.write(part)
                file.flush()
                view = memoryview(mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY))
        except (OSError, ValueError) as e:
            if not self._spill_failed:
                logger.warning("the replay log stays in memory: cannot write it to %s (%s)", self.directory, e)
                self._spill_failed = True
            return [memoryview(part) for part in parts]
        views, at = [], 0
        for part in parts:
            views.append(view[at:at + len(part)])
            at += len(part)
        return views

    def release(self) -> None:
        """Drop the whole file's pages from the peer's memory (their contents stay: see the module's docstring).
        Safe at any moment, beside readers and writers on other threads: a page they touch after it is paged
        in again."""
        if self._madvise is None:
            return
        start = self.flat.data_ptr()
        length = self.flat.numel() * 4
        length += -length % mmap.PAGESIZE
        if self._madvise(start, length, MADV_DONTNEED) != 0:
            logger.warning("madvise on the outer state failed (errno %d): it stays in memory once read",
                           ctypes.get_errno())
            self._madvise = None
