"""A run's data as the swarm delivers it: content-addressed files that hold exactly what a peer trains and
evaluates on, listed in a manifest whose sha256 (the dataset id) the run owner signs with its recipe.

The files are the tokenizer (its tokenizers JSON), the model config when the recipe names one, the validation
windows, and one file per data shard: shard k holds training windows k, k + S, k + 2S, ... (S = data.num_shards),
the very windows `WindowDataset.batches` gives a peer reading shard k. So a peer that joins needs only the file of
the shard its stream starts at to train, fetches the next shard's file while it reads this one, and reads the same
tokens, window for window, as a peer that tokenized the corpus itself. Every file is named by its sha256 and
written only once its bytes match it, so a holder serving other bytes wastes time but cannot change what anyone
trains on. Serving and fetching are in swarm.data.share.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from swarm.config import ModelRecipe, Recipe
from swarm.data.corpus import CorpusError
from swarm.data.paths import local_files
from swarm.data.prepare import EVAL_BATCHES, RunData, WindowDataset, prepare_run_data
from swarm.data.tokenizer import JsonTokenizer, tokenizer_digest
from swarm.data.token_store import token_dtype
from swarm.words import shown

__all__ = ["DATASETS_DIR", "Dataset", "DatasetError", "FileEntry", "FileStore", "Manifest", "ShardedDataset",
           "Incoming", "export_dataset", "prepare_local", "share_dataset"]

DATASETS_DIR = "datasets"  # under the cache dir: every file by its sha256
_FORMAT = 1
MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists num_shards + 3 files at ~100 bytes each
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_EXPORT_BLOCK_WINDOWS = 1 << 14  # windows read from the token stream at once while writing shard files
_OPEN_FILES = 256  # shard files written at once (more shards take more passes over the stream)


class DatasetError(CorpusError):
    """A manifest or dataset file that is malformed or cannot be had; the message says which and what to do."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a dataset: its sha256 and size in bytes."""

    sha256: str
    size: int

    def to_wire(self) -> dict:
        return {"sha256": self.sha256, "size": self.size}

    @classmethod
    def from_wire(cls, value: Any, what: str) -> "FileEntry":
        if not isinstance(value, dict) or not isinstance(value.get("sha256"), str) or \
                not _SHA256.match(value["sha256"]) or not _count(value.get("size")):
            raise DatasetError(f"dataset manifest: {what} is not a {{sha256, size}} entry")
        return cls(value["sha256"], value["size"])


@dataclass(frozen=True)
class Manifest:
    """What a dataset holds. `shards[k]` holds the training windows k, k + num_shards, ...; `validation` the
    validation windows (batch_size rows a batch); `tokenizer` the tokenizers JSON, with eos/pad tokens and its
    `tokenizer_digest`; `model_config` the transformers config.json, if the recipe names one."""

    seq_len: int
    num_shards: int
    num_windows: int
    dtype: str
    vocab_size: int
    train_tokens: int
    train_docs: int
    val_docs: int
    tokenizer: FileEntry
    eos_token: str
    pad_token: str
    tokenizer_digest: str
    validation: FileEntry
    model_config: Optional[FileEntry]
    shards: tuple[FileEntry, ...]

    def to_bytes(self) -> bytes:
        """The canonical JSON whose sha256 is the dataset id."""
        body = {
            "format": _FORMAT, "seq_len": self.seq_len, "num_shards": self.num_shards,
            "num_windows": self.num_windows, "dtype": self.dtype, "vocab_size": self.vocab_size,
            "train_tokens": self.train_tokens, "train_docs": self.train_docs, "val_docs": self.val_docs,
            "tokenizer": self.tokenizer.to_wire(), "eos_token": self.eos_token, "pad_token": self.pad_token,
            "tokenizer_digest": self.tokenizer_digest, "validation": self.validation.to_wire(),
            "model_config": None if self.model_config is None else self.model_config.to_wire(),
            "shards": [entry.to_wire() for entry in self.shards],
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @property
    def id(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @property
    def files(self) -> list[FileEntry]:
        """Every file, in the order a joiner wants them: what it needs to start, then the shards."""
        return [self.tokenizer, *([self.model_config] if self.model_config else []), self.validation, *self.shards]

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    def shard_windows(self, shard: int) -> int:
        return len(range(shard, self.num_windows, self.num_shards))

    @classmethod
    def from_bytes(cls, payload: bytes) -> "Manifest":
        """Parse and check a manifest (DatasetError naming the field that is wrong)."""
        try:
            body = json.loads(payload)
        except (ValueError, RecursionError):  # (not JSON, a number of over 4300 digits, nested too deep)
            raise DatasetError("dataset manifest is not JSON") from None
        if not isinstance(body, dict) or body.get("format") != _FORMAT:
            raise DatasetError(f"dataset manifest is not of format {_FORMAT}: upgrade swarm on this peer")
        for name in ("seq_len", "num_shards", "num_windows", "vocab_size", "train_tokens", "train_docs",
                     "val_docs"):
            if not _count(body.get(name)):
                raise DatasetError(f"dataset manifest: {name} is not a count")
        if body.get("dtype") not in ("<u2", "<i4") or token_dtype(body["vocab_size"]).str != body["dtype"]:
            raise DatasetError("dataset manifest: dtype does not fit the vocabulary size")
        for name in ("eos_token", "pad_token", "tokenizer_digest"):
            if not isinstance(body.get(name), str):
                raise DatasetError(f"dataset manifest: {name} is not a string")
        shards = body.get("shards")
        if not isinstance(shards, list) or len(shards) != body["num_shards"] or \
                body["num_windows"] < body["num_shards"] or body["seq_len"] < 1:
            raise DatasetError("dataset manifest: shards do not match num_shards and num_windows")
        manifest = cls(
            seq_len=body["seq_len"], num_shards=body["num_shards"], num_windows=body["num_windows"],
            dtype=body["dtype"], vocab_size=body["vocab_size"], train_tokens=body["train_tokens"],
            train_docs=body["train_docs"], val_docs=body["val_docs"],
            tokenizer=FileEntry.from_wire(body.get("tokenizer"), "tokenizer"), eos_token=body["eos_token"],
            pad_token=body["pad_token"], tokenizer_digest=body["tokenizer_digest"],
            validation=FileEntry.from_wire(body.get("validation"), "validation"),
            model_config=None if body.get("model_config") is None else
            FileEntry.from_wire(body["model_config"], "model_config"),
            shards=tuple(FileEntry.from_wire(entry, f"shard {k}") for k, entry in enumerate(shards)))
        row = (manifest.seq_len + 1) * np.dtype(manifest.dtype).itemsize
        for k, entry in enumerate(manifest.shards):
            if entry.size != manifest.shard_windows(k) * row:
                raise DatasetError(f"dataset manifest: shard {k} is not {manifest.shard_windows(k)} windows long")
        if manifest.validation.size == 0 or manifest.validation.size % row:
            raise DatasetError("dataset manifest: validation is not a whole number of windows")
        return manifest


class FileStore:
    """Content-addressed files in one directory: `<sha256>`, written only whole and verified."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def path(self, sha256: str) -> Path:
        if not _SHA256.match(sha256):
            raise DatasetError(f"{shown(sha256)} is not a sha256")
        return self.directory / sha256

    def has(self, entry: FileEntry) -> bool:
        path = self.path(entry.sha256)
        try:
            return path.stat().st_size == entry.size
        except OSError:
            return False

    def put(self, sha256: str, payload: bytes | bytearray) -> bool:
        """Store `payload` if it hashes to `sha256` (atomically; False, storing nothing, if it does not)."""
        incoming = self.incoming(sha256)
        incoming.write(payload)
        return incoming.commit() is not None

    def add(self, payload: bytes | bytearray) -> FileEntry:
        """Store `payload` under its own sha256."""
        incoming = self.incoming(None)
        incoming.write(payload)
        return incoming.commit()

    def incoming(self, sha256: Optional[str]) -> "Incoming":
        """A file written piece by piece into a temporary file and hashed as it comes (memory: one piece, whatever
        the file's size): `commit()` keeps it under its sha256, if that is `sha256` (or none was expected);
        `discard()` drops it."""
        if sha256 is not None:
            self.path(sha256)  # a name that is not a sha256 is refused before anything is written
        self.directory.mkdir(parents=True, exist_ok=True)
        return Incoming(self, sha256, self.directory / f".{sha256 or 'new'}.{os.getpid()}.{uuid.uuid4().hex}.tmp")

    def read(self, entry: FileEntry, offset: int = 0, length: Optional[int] = None) -> bytes:
        with open(self.path(entry.sha256), "rb") as file:
            file.seek(offset)
            return file.read(entry.size - offset if length is None else length)


class Incoming:
    """See FileStore.incoming."""

    def __init__(self, store: FileStore, expected: Optional[str], tmp: Path):
        self.store, self.expected, self.tmp, self.size = store, expected, tmp, 0
        self._hash = hashlib.sha256()
        self._file = open(tmp, "wb")

    def write(self, piece: bytes | bytearray) -> None:
        self._hash.update(piece)
        self._file.write(piece)
        self.size += len(piece)

    def commit(self) -> Optional[FileEntry]:
        """Keep the file under its sha256; None (and nothing kept) if that is not the one expected."""
        self._file.close()
        sha256 = self._hash.hexdigest()
        if self.expected is not None and sha256 != self.expected:
            self.tmp.unlink(missing_ok=True)
            return None
        os.replace(self.tmp, self.store.path(sha256))
        return FileEntry(sha256, self.size)

    def discard(self) -> None:
        self._file.close()
        self.tmp.unlink(missing_ok=True)


def export_dataset(data: RunData, model_config: Optional[str | Path], num_shards: int, batch_size: int,
                   store: FileStore) -> Manifest:
    """Write the files of the dataset `data` makes (see the module docstring) into `store`, the manifest too;
    returns the manifest (its `id` names the dataset). Memory: one block of windows, whatever the corpus size."""
    train, tokenizer = data.train, data.tokenizer
    if tokenizer is None:
        raise DatasetError("run data without its tokenizer cannot be exported")
    if train.num_windows < num_shards:
        raise DatasetError(f"{num_shards} shards need at least as many windows, but the corpus has only "
                           f"{train.num_windows}: lower data.num_shards")
    dtype = token_dtype(data.vocab_size)
    tokenizer_entry = store.add(tokenizer.backend_tokenizer.to_str().encode("utf-8"))
    config_entry = None if model_config is None else store.add(Path(model_config).read_bytes())
    validation_entry = store.add(torch.cat(data.eval_batches).numpy().astype(dtype).tobytes())
    shards: list[FileEntry] = []
    for first in range(0, num_shards, _OPEN_FILES):
        group = range(first, min(first + _OPEN_FILES, num_shards))
        shards += _write_shards(train, group, num_shards, dtype, store)
    manifest = Manifest(
        seq_len=train.seq_len, num_shards=num_shards, num_windows=train.num_windows, dtype=dtype.str,
        vocab_size=data.vocab_size, train_tokens=len(train), train_docs=data.n_train_docs,
        val_docs=data.n_val_docs, tokenizer=tokenizer_entry, eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token, tokenizer_digest=tokenizer_digest(tokenizer), validation=validation_entry,
        model_config=config_entry, shards=tuple(shards))
    store.add(manifest.to_bytes())  # under its sha256: the dataset id
    return manifest


def prepare_local(recipe: Recipe, cache_dir: str | Path, data_dir: str | Path | None) -> tuple[RunData, ModelRecipe]:
    """The recipe's data prepared from its local files (read inside `data_dir`, default `cache_dir`; tokenizer and
    token files cached in `cache_dir`), and its model recipe with the config file's path resolved there."""
    source, tokenizer, model = local_files(recipe, data_dir or cache_dir)
    d = recipe.data
    data = prepare_run_data(source, tokenizer, d.vocab_size, d.val_fraction, d.seq_len, d.batch_size, d.seed,
                            cache_dir, EVAL_BATCHES, d.text_field)
    return data, model


def share_dataset(recipe: Recipe, cache_dir: str | Path, data_dir: str | Path | None) -> Manifest:
    """Prepare the recipe's data (see prepare_local) and export it as a dataset into `cache_dir`'s dataset store:
    what a run owner shares (CorpusError/RecipeError with one line)."""
    config = local_files(recipe, data_dir or cache_dir)[2].config_file
    if config is not None and not Path(config).is_file():
        raise DatasetError(f"model.config_file {config} does not exist: give a path to a transformers config.json "
                           f"inside the data directory")
    data, _ = prepare_local(recipe, cache_dir, data_dir)
    return export_dataset(data, config, recipe.data.num_shards, recipe.data.batch_size,
                          FileStore(Path(cache_dir) / DATASETS_DIR))


def _write_shards(train: WindowDataset, group: range, num_shards: int, dtype: np.dtype,
                  store: FileStore) -> list[FileEntry]:
    """The shard files of `group`, written (and hashed) in one pass over the training windows."""
    files = {k: store.incoming(None) for k in group}
    try:
        for first in range(0, train.num_windows, _EXPORT_BLOCK_WINDOWS):
            block = train.windows(torch.arange(first, min(first + _EXPORT_BLOCK_WINDOWS, train.num_windows)))
            block = block.numpy().astype(dtype)
            for k in group:
                files[k].write(block[(k - first) % num_shards::num_shards].tobytes())
    except BaseException:
        for file in files.values():
            file.discard()
        raise
    return [files[k].commit() for k in group]


class ShardedDataset(WindowDataset):
    """The training windows of a dataset, read from its shard files as memory maps. A shard file that is not
    here yet is asked of `fetch(k)`, which returns once it is (or raises DatasetError); training then waits."""

    def __init__(self, manifest: Manifest, store: FileStore, fetch: Callable[[int], None]):
        self.manifest, self.store, self._fetch = manifest, store, fetch
        self.seq_len, self.num_windows = manifest.seq_len, manifest.num_windows
        self._maps: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.manifest.train_tokens

    def held(self) -> int:
        """Shard files on disk."""
        return sum(self.store.has(entry) for entry in self.manifest.shards)

    def shard(self, k: int) -> np.ndarray:
        """Shard k's windows, shape (windows, seq_len + 1); fetched first if it is not here."""
        with self._lock:
            rows = self._maps.get(k)
        if rows is not None:
            return rows
        entry = self.manifest.shards[k]
        if not self.store.has(entry):
            self._fetch(k)
        rows = np.memmap(self.store.path(entry.sha256), dtype=np.dtype(self.manifest.dtype), mode="r") \
            .reshape(-1, self.seq_len + 1)
        with self._lock:
            self._maps[k] = rows
        return rows

    def windows(self, indices: torch.Tensor) -> torch.Tensor:
        width, shards = self.seq_len + 1, self.manifest.num_shards
        rows = [self.shard(i % shards)[i // shards] for i in indices.tolist()]
        return torch.from_numpy(np.stack(rows).astype(np.int64)) if rows else torch.zeros((0, width), dtype=torch.long)


@dataclass(frozen=True)
class Dataset:
    """A dataset whose start files are here: what the peer trains on (`train`), evaluates on, and its tokenizer."""

    manifest: Manifest
    train: ShardedDataset
    eval_batches: list[torch.Tensor]
    tokenizer: JsonTokenizer
    model_config: Optional[Path]

    @property
    def n_train_docs(self) -> int:
        return self.manifest.train_docs

    @property
    def n_val_docs(self) -> int:
        return self.manifest.val_docs


def open_dataset(manifest: Manifest, store: FileStore, batch_size: int, fetch: Callable[[int], None]) -> Dataset:
    """The dataset whose tokenizer, model config and validation files are in `store` (DatasetError if one is
    missing or its tokenizer is not the one the manifest names)."""
    for entry, what in ((manifest.tokenizer, "tokenizer"), (manifest.validation, "validation windows"),
                        (manifest.model_config, "model config")):
        if entry is not None and not store.has(entry):
            raise DatasetError(f"dataset {manifest.id[:12]}: its {what} file is not here")
    try:
        tokenizer = JsonTokenizer.from_file(store.path(manifest.tokenizer.sha256), manifest.eos_token,
                                           manifest.pad_token)
    except Exception as error:  # noqa: BLE001 - tokenizers raises its own exception types for a bad file
        raise DatasetError(f"dataset {manifest.id[:12]}: its tokenizer does not load ({error})") from None
    if tokenizer_digest(tokenizer) != manifest.tokenizer_digest or len(tokenizer) != manifest.vocab_size:
        raise DatasetError(f"dataset {manifest.id[:12]}: its tokenizer is not the one its manifest names")
    rows = np.frombuffer(store.read(manifest.validation), dtype=np.dtype(manifest.dtype)) \
        .reshape(-1, manifest.seq_len + 1).astype(np.int64)
    evaluation = [torch.from_numpy(rows[i:i + batch_size].copy()) for i in range(0, len(rows), batch_size)]
    config = None if manifest.model_config is None else store.path(manifest.model_config.sha256)
    return Dataset(manifest, ShardedDataset(manifest, store, fetch), evaluation, tokenizer, config)


def shard_order(start: int, num_shards: int) -> Iterator[int]:
    """The shards a stream starting at `start` reads, epoch by epoch: the order to fetch them in."""
    return ((start + e) % num_shards for e in range(num_shards))


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
