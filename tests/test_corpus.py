"""Any corpus shape: single files cut into pieces, jsonl/parquet/arrow with a chosen text field, gzip/zstd, bad
files skipped and counted, a split computed while the corpus streams, and tokens kept in content-addressed
memory-mapped shards that give the same windows as one in-memory stream."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import zstandard

from swarm.data.corpus import (BUNDLED_CORPUS, Corpus, CorpusError, Document, _bundled_files, _without_hard_breaks,
                                load_corpus, plan_split, split_by_keys, split_documents)
from swarm.data.corpus_formats import cut_pieces, piece_chars, read_documents
from swarm.data.prepare import TokenDataset, load_tokenizer, prepare_run_data
from swarm.data.token_store import MANIFEST, build_store, encoding_chunks, load_store

PARAGRAPHS = [f"Paragraph {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(40 + i % 30)) for i in range(400)]
ONE_FILE = "\n\n".join(PARAGRAPHS) + "\n"


class _Trickle(io.StringIO):
    """A stream that hands out at most `step` characters per read, to show cuts do not depend on reads."""

    def __init__(self, text: str, step: int) -> None:
        super().__init__(text)
        self.step = step

    def read(self, size: int = -1) -> str:
        return super().read(self.step if size < 0 else min(size, self.step))


@pytest.mark.parametrize("target", [50, 500, 4096])
def test_cut_pieces_rejoin_to_the_text_end_at_blank_lines_and_ignore_read_sizes(target):
    pieces = list(cut_pieces(io.StringIO(ONE_FILE), target))
    assert "".join(pieces) == ONE_FILE
    assert all(target <= len(piece) <= 2 * target for piece in pieces[:-1])
    if target >= 500:  # paragraphs are shorter than that: every piece ends at a blank line
        assert all(piece.endswith("\n\n") for piece in pieces[:-1])
    for step in (1, 7, 1000):
        assert list(cut_pieces(_Trickle(ONE_FILE, step), target)) == pieces


def test_text_without_blank_lines_is_cut_at_newlines_then_at_fixed_windows():
    lines = "".join(f"line {i}\n" for i in range(200))
    pieces = list(cut_pieces(io.StringIO(lines), 100))
    assert "".join(pieces) == lines and all(p.endswith("\n") and 100 <= len(p) <= 110 for p in pieces[:-1])
    solid = "x" * 1000
    assert list(cut_pieces(io.StringIO(solid), 100)) == [solid[i:i + 200] for i in range(0, 1000, 200)]
    assert piece_chars(10) == 4096 and piece_chars(40_000_000) == 156_250 and piece_chars(1 << 40) == 1 << 18


def test_one_big_text_file_is_a_corpus_with_a_held_out_part(tmp_path):
    (tmp_path / "book.txt").write_text(ONE_FILE * 4, encoding="utf-8")  # ~1.4 MB of text: ~256 pieces
    docs = load_corpus(str(tmp_path / "book.txt"))
    assert "".join(doc.text for doc in docs) == ONE_FILE * 4
    assert [doc.doc_id for doc in docs] == [f"book.txt#{k}" for k in range(len(docs))] and len(docs) > 100
    train, val = split_documents(docs, 0.05, seed=0)
    assert len(val) == round(0.05 * len(docs)) and train and val
    assert split_documents(load_corpus(str(tmp_path / "book.txt")), 0.05, seed=0) == (train, val)


def _parquet(path, texts, field="text"):
    pq.write_table(pa.table({field: texts, "id": list(range(len(texts)))}), path)


def _arrow_stream(path, texts, field="text"):  # the layout `datasets.save_to_disk` writes
    table = pa.table({field: texts})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def test_every_format_and_compression_reads_the_same_records(tmp_path):
    texts = ["first record", "second record", None, "  ", "fourth, after a null and a blank"]
    lines = "".join(json.dumps({"body": t}) + "\n" for t in texts if t is not None)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    _parquet(tmp_path / "c.parquet", texts, "body")
    _arrow_stream(tmp_path / "d.arrow", texts, "body")
    (tmp_path / "e.txt.zst").write_bytes(zstandard.ZstdCompressor().compress("plain text\n".encode()))
    (tmp_path / "f.md.gz").write_bytes(gzip.compress(b"# markdown\n"))
    (tmp_path / "notes.csv").write_text("not a corpus file")
    docs = load_corpus(str(tmp_path), text_field="body")
    kept = [t for t in texts if t and t.strip()]
    assert [doc.text for doc in docs] == kept * 4 + ["plain text\n", "# markdown\n"]
    assert [doc.doc_id for doc in docs][:6] == ["a.jsonl.gz:1", "a.jsonl.gz:2", "a.jsonl.gz:4",
                                                "b.jsonl.zst:1", "b.jsonl.zst:2", "b.jsonl.zst:4"]
    assert [doc.doc_id for doc in docs][6:12] == ["c.parquet:0", "c.parquet:1", "c.parquet:4",
                                                  "d.arrow:0", "d.arrow:1", "d.arrow:4"]


def test_unreadable_files_are_skipped_with_a_warning_and_counted(tmp_path, caplog):
    (tmp_path / "good.txt").write_text("good text\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "half.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')  # fails after one document
    (tmp_path / "torn.txt.gz").write_bytes(gzip.compress(b"x" * 1000)[:15])
    _parquet(tmp_path / "nofield.parquet", ["a", "b"], field="content")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    corpus = Corpus(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        keys, sizes = corpus.scan(seed=0)
    assert len(keys) == 1 and sizes.tolist() == [len("good text\n")]
    assert sorted(path.rsplit("/", 1)[1] for path in corpus.skipped) == [
        "broken.parquet", "half.jsonl", "latin1.txt", "nofield.parquet", "torn.txt.gz"]
    assert 'no column "text" (columns: content, id)' in corpus.skipped[str(tmp_path / "nofield.parquet")]
    assert sum("skipping a file that cannot be read" in r.message for r in caplog.records) == 5
    assert [doc.doc_id for doc in corpus] == ["good.txt"]  # later passes see the same files
    (tmp_path / "good.txt").unlink()
    with pytest.raises(CorpusError, match=r"no documents in .*; 5 unreadable file\(s\) skipped, the first: "):
        Corpus(str(tmp_path)).scan(seed=0)
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(CorpusError, match=r"notes\.csv' is not one of \.txt, \.md, \.jsonl"):
        Corpus(str(tmp_path / "notes.csv"))


def test_streaming_split_matches_the_list_split():
    docs = [Document(f"doc-{i}", "text") for i in range(1000)]
    for fraction, seed in ((0.05, 0), (0.3, 7), (0.001, 1)):
        _, val = split_documents(docs, fraction, seed)
        split = plan_split([doc.doc_id for doc in docs], fraction, seed)
        assert [doc.doc_id for doc in split.part(docs, True)] == [doc.doc_id for doc in val]
        assert (split.n_val, split.n_train) == (len(val), 1000 - len(val))
    with pytest.raises(CorpusError, match="need at least 2"):
        plan_split(["only"], 0.1, 0)


def test_shards_hold_the_same_windows_as_one_stream_and_are_content_addressed(tmp_path):
    texts = [f"text number {i} " * (i % 9 + 1) for i in range(300)]
    encode = lambda batch: [[ord(c) % 250 for c in text] for text in batch]  # noqa: E731
    expected = np.concatenate([np.array(ids + [255]) for ids in encode(texts)])
    in_memory, _ = build_store(texts, encode, 255, 256, None, shard_tokens=1000)
    on_disk, stats = build_store(texts, encode, 255, 256, tmp_path / "tokens", shard_tokens=1000)
    assert stats.tokens == len(expected) and stats.shards == -(-len(expected) // 1000)
    for store in (in_memory, on_disk):
        assert store.total == len(expected) and np.array_equal(store.read(0, store.total), expected)
        assert np.array_equal(store.read(990, 2013), expected[990:2013])  # across two shard boundaries
    manifest = json.loads((tmp_path / "tokens" / MANIFEST).read_text())
    assert manifest["dtype"] == "<u2" and manifest["tokens"] == len(expected)
    sizes = [entry["tokens"] for entry in manifest["shards"]]
    assert sizes == [1000] * (len(expected) // 1000) + [len(expected) % 1000]
    for entry in manifest["shards"]:
        raw = (tmp_path / "tokens" / entry["file"]).read_bytes()
        assert entry["file"] == f"{entry['sha256']}.bin" == f"{hashlib.sha256(raw).hexdigest()}.bin"
    assert isinstance(load_store(tmp_path / "tokens").shards[0], np.memmap)
    assert load_store(tmp_path / "tokens", verify=True) is not None
    first = tmp_path / "tokens" / manifest["shards"][0]["file"]
    first.write_bytes(first.read_bytes()[:-2] + b"\x01\x00")  # same size, one token changed
    assert load_store(tmp_path / "tokens", verify=True) is None and load_store(tmp_path / "nowhere") is None
    first.write_bytes(first.read_bytes()[:-2])  # a torn file
    assert load_store(tmp_path / "tokens") is None
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_one_file_corpus_prepares_with_a_cached_sharded_stream(tmp_path):
    (tmp_path / "book.txt").write_text(ONE_FILE * 3, encoding="utf-8")
    cache = tmp_path / "cache"
    run = prepare_run_data(str(tmp_path / "book.txt"), "bpe", 300, 0.05, 16, 4, 0, cache, show_progress=False)
    assert run.n_val_docs == round(0.05 * (run.n_train_docs + run.n_val_docs)) and run.skipped_files == 0
    assert run.train.stats is not None and run.train.stats.tokens == len(run.train)
    again = prepare_run_data(str(tmp_path / "book.txt"), "bpe", 300, 0.05, 16, 4, 0, cache, show_progress=False)
    assert again.train.stats is None  # read from the shards
    assert torch.equal(next(again.train.batches(1, 4, 4, 0)), next(run.train.batches(1, 4, 4, 0)))
    assert all(torch.equal(a, b) for a, b in zip(again.eval_batches, run.eval_batches, strict=True))
    # The same windows as an in-memory stream of the same documents.
    corpus = Corpus(str(tmp_path / "book.txt"))
    split = split_by_keys(corpus.scan(seed=0)[0], 0.05, 0)
    assert split == plan_split([doc.doc_id for doc in corpus], 0.05, 0)
    tokenizer = load_tokenizer("bpe", list(split.part(corpus, False)), 300, cache)
    plain = TokenDataset(list(split.part(corpus, False)), tokenizer, 16)
    assert torch.equal(plain.tokens, run.train.tokens)


def test_long_texts_are_encoded_in_chunks_with_the_ids_of_the_whole_text(tmp_path):
    tokenizer = load_tokenizer("bpe", [Document("d", ONE_FILE)], 300, tmp_path)
    backend = tokenizer.backend_tokenizer
    rng = np.random.default_rng(0)
    pieces = ["word", "Word", "'s", "42", "!?", " ", "  ", "\n", "\n\n", "\t", " \n", "\n ", "é", "\u2028"]
    for _ in range(20):  # whitespace of every kind, with a line break between two words every ~40 characters
        text = "".join("".join(rng.choice(pieces, size=12)) + "x\ny" for _ in range(40))
        chunks = encoding_chunks(text, limit=64)
        assert "".join(chunks) == text and len(chunks) > 3
        joined = [i for chunk in chunks for i in backend.encode(chunk, add_special_tokens=False).ids]
        assert joined == backend.encode(text, add_special_tokens=False).ids
    assert encoding_chunks("x" * 150, limit=64) == ["x" * 64, "x" * 64, "x" * 22]  # no newline: a hard cut


def test_the_bpe_trains_on_a_bounded_prefix_of_a_large_corpus(tmp_path, monkeypatch):
    import swarm.data.prepare as data_module
    from swarm.data.prepare import tokenizer_digest

    first = Document("a", ONE_FILE)
    other = Document("b", " ".join(f"zebra{i} quokka{i}" for i in range(3000)))
    whole = tokenizer_digest(load_tokenizer("bpe", [first, other], 300, tmp_path / "whole"))
    monkeypatch.setattr(data_module, "BPE_SAMPLE_CHARS", len(ONE_FILE))
    sampled = tokenizer_digest(load_tokenizer("bpe", [first, other], 300, tmp_path / "sampled"))
    assert sampled == tokenizer_digest(load_tokenizer("bpe", [first], 300, tmp_path / "first")) != whole


@pytest.mark.parametrize("text", ["", "\n", " \n", "a  \nb", "a \t \nb \n", "a \r\nb\t\n\n  ", "end  ", " \t",
                                  "x\n  y"])
def test_the_bundled_corpus_loses_the_blanks_before_each_newline_and_nothing_else(text):
    assert _without_hard_breaks(text) == re.sub(r"[ \t]+\n", "\n", text)


def test_every_bundled_document_reads_as_the_regular_expression_would_clean_it():
    expected = [re.sub(r"[ \t]+\n", "\n", text) for doc_id, path in _bundled_files()
                for _, text in read_documents(doc_id, path, "text", False)]
    assert [doc.text for doc in Corpus(BUNDLED_CORPUS)] == expected and len(expected) > 30
