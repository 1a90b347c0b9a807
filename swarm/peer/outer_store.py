"""DiLoCo's outer state (global params and outer momentum, 8 bytes a parameter) in a file instead of the peer's
memory (`--outer-state-dir`), and its replay log's averages (2.5 bytes a parameter by default) in files beside it.
A CPU peer touches the state once a sync, a fragment at a time (the pseudo-gradient, the outer step, the state's
hash), and at a checkpoint or a state download; in between it is 8 bytes a parameter of the peer's memory that
nothing reads.

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
from pathlib import Path
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)

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
        if _file_system(directory) in ("tmpfs", "ramfs"):
            logger.warning("--outer-state-dir %s is in memory (a %s): the outer state takes as much memory there as "
                           "in the peer; give a directory on a disk", directory, _file_system(directory))
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
