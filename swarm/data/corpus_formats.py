"""Readers of corpus files: plain text and markdown (long ones cut into pieces at blank lines), jsonl records, and
the parquet/arrow files of the Hugging Face datasets layout (read locally with pyarrow), text formats optionally
gzip or zstd compressed. Readers yield (doc_id, text) lazily, so a corpus larger than memory streams through.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["FORMATS", "FileError", "corpus_format", "piece_chars", "read_documents"]

TEXT_SUFFIXES = (".txt", ".md")
RECORD_SUFFIXES = (".jsonl", ".parquet", ".arrow")
COMPRESSED_SUFFIXES = (".gz", ".zst")  # for text and jsonl; parquet and arrow compress inside the format
FORMATS = ".txt, .md, .jsonl (each optionally .gz or .zst), .parquet, .arrow"

CUT_ABOVE_BYTES = 1 << 20
"""A text file larger than this (on disk) is cut into pieces, even inside a directory, so no text document holds
more than a few MiB of memory while it is tokenized (the bundled plays are 200 KB at most, and stay whole)."""

_CHUNK_CHARS = 1 << 20


class FileError(Exception):
    """One corpus file cannot be read; the message names the file (file:line for a record) and why."""


def corpus_format(name: str) -> tuple[str, str] | None:
    """(format suffix, compression suffix or "") of a corpus file name, or None if it is not a corpus file.
    "a.jsonl.zst" -> (".jsonl", ".zst"); "a.parquet" -> (".parquet", ""); "a.csv" -> None."""
    stem, compression = name, ""
    for suffix in COMPRESSED_SUFFIXES:
        if name.endswith(suffix):
            stem, compression = name[: -len(suffix)], suffix
    for suffix in (*TEXT_SUFFIXES, ".jsonl"):
        if stem.endswith(suffix):
            return suffix, compression
    if not compression and name.endswith((".parquet", ".arrow")):
        return Path(name).suffix, ""
    return None


def piece_chars(file_bytes: int) -> int:
    """Target length in characters of the pieces a text file of `file_bytes` bytes is cut into: about 256
    pieces, each between 4 KiB and 256 KiB (so a 50 MB file gives ~256 pieces, a 122 MB one ~470, a 40 GB one
    ~160,000): pieces are documents, held whole in memory while tokenized."""
    return min(max(file_bytes // 256, 4 << 10), 256 << 10)


def read_documents(doc_id: str, path: Path, text_field: str = "text", cut: bool = False) -> Iterator[tuple[str, str]]:
    """Yield (doc_id, text) for every non-blank document of the file, in file order, reading it as a stream.

    Text files are one document `doc_id`, or with `cut` (or when larger than CUT_ABOVE_BYTES) the pieces of
    `cut_pieces`, named "<doc_id>#<k>" from k = 0. jsonl files give one document per non-blank line from the string
    field `text_field` ("<doc_id>:<line>", lines from 1); parquet and arrow files one per row of the string
    column `text_field` ("<doc_id>:<row>", rows from 0; null rows skipped). Text is decoded as UTF-8 with
    universal newlines. Raises FileError (naming the file, and the line for a bad jsonl record) for any file
    that cannot be read, decompressed, decoded or parsed, or lacks the text field."""
    kind = corpus_format(path.name)
    if kind is None:
        raise FileError(f"{path}: not a corpus file ({FORMATS})")
    suffix, compression = kind
    try:
        if suffix in TEXT_SUFFIXES:
            with _open_text(path, compression) as stream:
                if cut or path.stat().st_size > CUT_ABOVE_BYTES:
                    for k, piece in enumerate(cut_pieces(stream, piece_chars(path.stat().st_size))):
                        yield f"{doc_id}#{k}", piece
                else:
                    text = stream.read()
                    if text.strip():
                        yield doc_id, text
        elif suffix == ".jsonl":
            with _open_text(path, compression) as stream:
                yield from _jsonl(doc_id, path, stream, text_field)
        else:
            yield from _table(doc_id, path, text_field, suffix)
    except UnicodeDecodeError as error:
        raise FileError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except (OSError, EOFError) as error:  # gzip.BadGzipFile is an OSError
        raise FileError(f"{path}: cannot read ({getattr(error, 'strerror', None) or error})") from None
    except Exception as error:  # zstandard.ZstdError and pyarrow.ArrowInvalid share no base class we can name
        if type(error).__module__.split(".")[0] in ("zstandard", "pyarrow"):
            raise FileError(f"{path}: cannot read ({type(error).__name__}: {error})") from None
        raise


def cut_pieces(stream: IO[str], target: int) -> Iterator[str]:
    """The text of `stream` cut into consecutive pieces that together are the whole text: a piece ends at the
    first blank line ("\\n\\n") at or after `target` characters; if none comes before 2 * target characters, at
    the first newline at or after `target`, else at exactly 2 * target characters. Blank pieces are dropped. The
    cuts depend only on the text, not on how the stream delivers it."""
    buffer, done = "", False
    while not done or buffer:
        if not done and len(buffer) <= 2 * target:
            chunk = stream.read(_CHUNK_CHARS)
            buffer, done = buffer + chunk, not chunk
            continue
        if len(buffer) < target and done:
            end = len(buffer)
        else:
            blank = buffer.find("\n\n", target, 2 * target)
            if blank != -1:
                end = blank + 2
            elif done and len(buffer) <= 2 * target:
                end = len(buffer)
            else:
                newline = buffer.find("\n", target, 2 * target)
                end = newline + 1 if newline != -1 else 2 * target
        piece, buffer = buffer[:end], buffer[end:]
        if piece.strip():
            yield piece


def _open_text(path: Path, compression: str) -> IO[str]:
    if compression == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    if compression == ".zst":
        import zstandard  # imported here: only zstd corpora need it

        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True),
                                encoding="utf-8")
    return open(path, encoding="utf-8")


def _jsonl(doc_id: str, path: Path, stream: IO[str], text_field: str) -> Iterator[tuple[str, str]]:
    for line_number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise FileError(f"{path}:{line_number}: not valid JSON ({error.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise FileError(f'{path}:{line_number}: expected a JSON object with a string field "{text_field}"')
        if record[text_field].strip():
            yield f"{doc_id}:{line_number}", record[text_field]


def _table(doc_id: str, path: Path, text_field: str, suffix: str) -> Iterator[tuple[str, str]]:
    import pyarrow as pa  # imported here: a second to import, and only table corpora need it
    import pyarrow.parquet as pq

    if suffix == ".parquet":
        parquet = pq.ParquetFile(path)
        if text_field not in parquet.schema_arrow.names:
            raise FileError(f'{path}: no column "{text_field}" (columns: {", ".join(parquet.schema_arrow.names)})')
        batches = parquet.iter_batches(batch_size=1024, columns=[text_field])
    else:
        source = pa.memory_map(str(path))
        try:  # `datasets` writes the IPC stream format; plain Arrow files use the file format
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
        schema = reader.schema
        if text_field not in schema.names:
            raise FileError(f'{path}: no column "{text_field}" (columns: {", ".join(schema.names)})')
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) \
            if isinstance(reader, pa.ipc.RecordBatchFileReader) else reader
    row = 0
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(text_field))
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise FileError(f'{path}: column "{text_field}" holds {column.type}, not strings')
        for text in column.to_pylist():
            if text is not None and text.strip():
                yield f"{doc_id}:{row}", text
            row += 1
