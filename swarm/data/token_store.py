"""A corpus's token stream as shards on disk: raw numpy id files named by the sha256 of their bytes and listed in a
small JSON manifest, tokenized once per (tokenizer, corpus) and memory-mapped for reading, so a corpus larger than
memory is prepared in one pass of bounded memory and read window by window. The hashes let shards be fetched
from other peers and checked later.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["MANIFEST", "SHARD_TOKENS", "BuildStats", "TokenStore", "build_store", "encoding_chunks", "load_store"]

MANIFEST = "manifest.json"
SHARD_TOKENS = 1 << 25
"""Ids per shard file (the last one holds the rest): 64 MiB at 2 bytes an id. Preparation never holds a shard in
memory (files are written as tokens come), so this only sets the unit a swarm could hand out."""

_FORMAT = 1
# Text handed to the tokenizer at once, in chunks: its encodings take ~250 bytes a token while they live, so these
# bound preparation memory to tens of MB whatever the documents' sizes, and still keep its threads busy.
_BATCH_CHARS = 1 << 18
_CHUNK_CHARS = 1 << 16


@dataclass(frozen=True)
class TokenStore:
    """The token stream, as consecutive shards (each `shard_tokens` long except the last). Shards are read-only
    memory maps when loaded from disk, so only the windows read are paged in."""

    shards: tuple[np.ndarray, ...]
    shard_tokens: int

    @property
    def total(self) -> int:
        return sum(len(shard) for shard in self.shards)

    def read(self, start: int, stop: int) -> np.ndarray:
        """A copy of tokens [start, stop) of the stream, which may span shards; int64."""
        if not 0 <= start <= stop <= self.total:
            raise IndexError(f"tokens [{start}, {stop}) outside a stream of {self.total}")
        parts = []
        while start < stop:
            shard, offset = divmod(start, self.shard_tokens)
            taken = self.shards[shard][offset: offset + stop - start]
            parts.append(taken)
            start += len(taken)
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


@dataclass(frozen=True)
class BuildStats:
    """What a preparation did: tokens written, characters read, seconds taken, shards written."""

    tokens: int
    chars: int
    seconds: float
    shards: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 when every id fits (vocabularies up to 65,536 entries), else little-endian int32."""
    return np.dtype("<u2" if vocab_size <= 1 << 16 else "<i4")


def build_store(texts: Iterable[str], encode: Callable[[list[str]], list[list[int]]], eos: int, vocab_size: int,
                directory: Path | None, shard_tokens: int = SHARD_TOKENS,
                progress: Callable[[int, int], None] | None = None) -> tuple[TokenStore, BuildStats]:
    """Tokenize `texts` into a store: each text's ids followed by `eos`, in order. `encode` is given about 256 KiB
    of text at a time, long texts cut by encoding_chunks; `progress(chars, tokens)` is called after each batch.

    With `directory`, each shard is streamed to a file of raw little-endian ids named "<sha256 of the file>.bin"
    (hashed while written, never held in memory) and listed in MANIFEST (format, dtype, shard_tokens, total tokens,
    and each shard's file, sha256 and tokens); the store read back is memory-mapped. The directory appears at
    once, complete, by renaming a temporary one, so peers sharing a cache may race: the first rename wins and the
    others read its files. Memory: the tokenizer's work on one batch (tens of MB), not a shard. Without
    `directory`, the shards are built in memory."""
    dtype = token_dtype(vocab_size)
    chars, started = 0, time.monotonic()
    staging = None
    if directory is not None:
        staging = directory.with_name(f".{directory.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        staging.mkdir(parents=True)
    writer = _ShardWriter(staging, dtype, shard_tokens)
    try:
        batch: list[tuple[str, bool]] = []  # (chunk, whether it ends its text)
        batch_chars = 0
        for text in itertools.chain(texts, [None]):
            if text is not None:
                chunks = encoding_chunks(text)
                batch += [(chunk, i == len(chunks) - 1) for i, chunk in enumerate(chunks)]
                batch_chars += len(text)
            if batch and (text is None or batch_chars >= _BATCH_CHARS):
                for ids, (_, last) in zip(encode([chunk for chunk, _ in batch]), batch, strict=True):
                    writer.append(ids)
                    if last:
                        writer.append([eos])
                chars += batch_chars
                batch, batch_chars = [], 0
                if progress is not None:
                    progress(chars, writer.total)
        writer.finish()
        stats = BuildStats(writer.total, chars, time.monotonic() - started, len(writer.entries or writer.arrays))
        if staging is None:
            return TokenStore(tuple(writer.arrays), shard_tokens), stats
        manifest = {"format": _FORMAT, "dtype": dtype.str, "shard_tokens": shard_tokens, "tokens": writer.total,
                    "shards": writer.entries}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        try:
            os.rename(staging, directory)
        except OSError:
            if load_store(directory) is None:  # not a complete store that another process renamed first
                raise
        return load_store(directory), stats
    finally:
        writer.close()
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


class _ShardWriter:
    """Appends ids to consecutive shards of `shard_tokens` ids: into files under `staging`, hashed as they are
    written, or into arrays in memory when `staging` is None."""

    def __init__(self, staging: Path | None, dtype: np.dtype, shard_tokens: int) -> None:
        self.staging, self.dtype, self.shard_tokens = staging, dtype, shard_tokens
        self.entries: list[dict] = []
        self.arrays: list[np.ndarray] = []
        self.parts: list[np.ndarray] = []
        self.filled = self.total = 0
        self.file, self.hasher = None, hashlib.sha256()

    def append(self, ids: list[int] | np.ndarray) -> None:
        ids = np.asarray(ids, dtype=self.dtype)
        while len(ids):
            part, ids = ids[: self.shard_tokens - self.filled], ids[self.shard_tokens - self.filled:]
            if self.staging is None:
                self.parts.append(part)
            else:
                if self.file is None:
                    self.file = open(self.staging / "shard.partial", "wb")
                self.file.write(memoryview(part))
                self.hasher.update(memoryview(part))
            self.filled += len(part)
            self.total += len(part)
            if self.filled == self.shard_tokens:
                self._end_shard()

    def finish(self) -> None:
        if self.filled or not (self.entries or self.arrays):
            self._end_shard()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def _end_shard(self) -> None:
        if self.staging is None:
            self.arrays.append(np.concatenate(self.parts) if self.parts else np.zeros(0, self.dtype))
            self.parts = []
        else:
            if self.file is None:
                self.file = open(self.staging / "shard.partial", "wb")
            self.file.close()
            digest = self.hasher.hexdigest()
            os.replace(self.staging / "shard.partial", self.staging / f"{digest}.bin")
            self.entries.append({"file": f"{digest}.bin", "sha256": digest, "tokens": self.filled})
            self.file, self.hasher = None, hashlib.sha256()
        self.filled = 0


def encoding_chunks(text: str, limit: int = _CHUNK_CHARS) -> list[str]:
    """`text` cut into consecutive chunks of at most about `limit` characters, each (but the last) ending just after
    a newline that lies between two non-whitespace characters. Byte-level BPE (GPT-2's pre-tokenizer regex) always
    ends a pre-token there and merges only within pre-tokens, so the chunks' ids joined equal the whole text's
    ids; for other tokenizers the cut is deterministic, so every peer still gets the same ids. A stretch of
    `limit` characters without such a newline is cut at `limit`."""
    chunks, start = [], 0
    while len(text) - start > limit:
        cut, newline = start + limit, text.rfind("\n", start + 1, start + limit)
        while newline > start:
            if newline + 1 < len(text) and not text[newline - 1].isspace() and not text[newline + 1].isspace():
                cut = newline + 1
                break
            newline = text.rfind("\n", start + 1, newline)
        chunks.append(text[start:cut])
        start = cut
    chunks.append(text[start:])
    return chunks


def load_store(directory: Path, verify: bool = False) -> TokenStore | None:
    """The store in `directory`, memory-mapped; None if it is missing, incomplete or not of this format (the
    caller rebuilds it). With `verify`, each shard file's sha256 is checked too (reads every byte)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        if manifest.get("format") != _FORMAT:
            return None
        dtype = np.dtype(manifest["dtype"])
        shards = []
        for entry in manifest["shards"]:
            path = directory / entry["file"]
            if path.stat().st_size != entry["tokens"] * dtype.itemsize:
                return None
            if verify:
                with open(path, "rb") as file:
                    if hashlib.file_digest(file, "sha256").hexdigest() != entry["sha256"]:
                        return None
            shards.append(np.memmap(path, dtype=dtype, mode="r") if entry["tokens"] else np.zeros(0, dtype))
        store = TokenStore(tuple(shards), int(manifest["shard_tokens"]))
        return store if store.total == manifest["tokens"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
