"""The distributed system computes exactly the algorithm we benchmark: a real 2-peer swarm (fixed seeds, data
shards 0 and 1, 5 inner steps per round) ends 3 rounds with the same global params as the in-process simulation,
and so does one of Streaming DiLoCo (4 fragments)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from swarm.config import load_recipe
from swarm.data.prepare import prepare_run_data
from swarm.simulation import simulate_diloco, simulate_groups, simulate_pipeline

RECIPE = Path(__file__).parent / "recipes" / "fixed_steps.yaml"


def _data(recipe, cache_dir):
    """The recipe's run data, as a peer prepares it (tokenizer and token files cached in `cache_dir`)."""
    d = recipe.data
    return prepare_run_data(d.source, d.tokenizer, d.vocab_size, d.val_fraction, d.seq_len, d.batch_size, d.seed,
                            cache_dir)
ROUNDS = 3


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["adamw", "muon", "fragments", "sparse"])
def test_real_swarm_matches_simulation(swarm, cache_dir, variant):
    """`fragments`: Streaming DiLoCo, 4 fragments each averaged every 8 inner steps, one every 2; the peers'
    8 outer steps are the simulation's 2 rounds. `sparse`: SparseLoCo, the sparse codec with its decayed error
    feedback and no outer momentum (each reducer's own part through the codec too, averages back as `support`)."""
    recipe_path, syncs, fields = RECIPE, ROUNDS, yaml.safe_load(RECIPE.read_text())
    if variant == "muon":  # (the recipe's inner optimizer: the peers and the simulation build the same)
        fields["inner"]["optimizer"] = "muon"
    if variant == "fragments":
        fields["outer"], fields["inner_steps_per_round"], syncs = {"fragments": 4}, 8, 8
    if variant == "sparse":
        fields["averaging"]["codec"], fields["outer"] = "sparse", {"lr": 1.0, "momentum": 0.0}
    if variant != "adamw":
        recipe_path = swarm.workdir / f"{variant}.yaml"
        recipe_path.write_text(yaml.safe_dump(fields))
    _, maddr = swarm.bootstrap(recipe=recipe_path)
    peers = [swarm.peer(maddr, "--data-shard", str(shard), "--max-rounds", str(syncs),
                        "--trace-dir", str(swarm.workdir / f"trace{shard}"), name=f"peer{shard}")
             for shard in (0, 1)]
    for peer in peers:
        assert peer.wait(240) == 0, peer.output()[-3000:]

    recipe = load_recipe(recipe_path)
    assert recipe.inner.optimizer == ("muon" if variant == "muon" else "adamw")
    assert recipe.outer.fragments == (4 if variant == "fragments" else 1)
    assert recipe.averaging.codec == ("sparse" if variant == "sparse" else "none")
    data = _data(recipe, cache_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the peers ran with one thread: same kernels, same rounding
    try:
        simulated = simulate_diloco(recipe, data, shards=[0, 1], rounds=syncs // recipe.outer.fragments,
                                    inner_steps=recipe.inner_steps_per_round)
    finally:
        torch.set_num_threads(threads)
    expected = torch.cat([p.view(-1) for p in simulated.global_params])
    for shard in (0, 1):
        last = swarm.workdir / f"trace{shard}" / f"round-{syncs - 1:06d}"
        meta = json.loads(last.with_suffix(".json").read_text())
        assert len(meta["members"]) == 2
        real = load_file(str(last.with_suffix(".safetensors")))["global_after"]
        torch.testing.assert_close(real, expected, rtol=1e-4, atol=1e-6)
    # ...and training changed the params: the comparison is not between two untouched initialisations.
    first = load_file(str(swarm.workdir / "trace0" / "round-000000.safetensors"))["global_before"]
    assert (expected - first).abs().max() > 1e-3
    if variant == "sparse":  # 3 rounds of 2 peers' 1/64 of every chunk: at most 6/64 of the params moved
        assert 0 < float((expected != first).float().mean()) <= 6 / 64 + 0.01


@pytest.mark.slow  # about 7-12 s on the 2-core machines: out of the quick subset
def test_simulated_overlap_keeps_local_progress_on_the_new_global_params(cache_dir):
    """The overlap bookkeeping of the simulation (the benchmark's config f): an average that arrives before the
    first inner step of the next round (delay 0) re-bases every worker exactly onto the new global params, so the
    run equals plain DiLoCo; one that arrives later gives a different (delayed) run that still learns."""
    recipe = load_recipe(RECIPE)
    data = _data(recipe, cache_dir)
    runs = {delay: simulate_diloco(recipe, data, shards=[0, 1], rounds=3, inner_steps=4, overlap_delay=delay)
            for delay in (None, 0, 2)}
    flat = {delay: torch.cat([p.view(-1) for p in run.global_params]) for delay, run in runs.items()}
    torch.testing.assert_close(flat[0], flat[None], rtol=1e-4, atol=1e-5)
    assert (flat[2] - flat[None]).abs().max() > 1e-4, "a late average must change the run"
    assert runs[2].val_losses[-1] < runs[2].val_losses[0]


@pytest.mark.slow  # about 13 s on the 2-core machines: out of the quick subset
def test_simulated_groups_are_diloco_when_one_group_holds_everyone_and_mix_otherwise(cache_dir):
    """The benchmark's config g: workers split into groups as peers split themselves. A group as large as the
    swarm is plain DiLoCo; groups of 2 out of 4 leave round 0 with two lineages, which round 1 merges (every
    group averages params across them), and the run still learns."""
    recipe = load_recipe(RECIPE)
    data = _data(recipe, cache_dir)
    plain = simulate_diloco(recipe, data, shards=[0, 1], rounds=2, inner_steps=3)
    one_group = simulate_groups(recipe, data, shards=[0, 1], rounds=2, inner_steps=3, group_size=2)
    torch.testing.assert_close(torch.cat([p.view(-1) for p in one_group.global_params]),
                               torch.cat([p.view(-1) for p in plain.global_params]), rtol=1e-4, atol=1e-6)
    grouped = simulate_groups(recipe, data, shards=[0, 1, 2, 3], rounds=3, inner_steps=3, group_size=2)
    assert grouped.val_losses[-1] < grouped.val_losses[0]
    mixing = simulate_groups(recipe, data, shards=[0, 1, 2, 3], rounds=2, inner_steps=3, group_size=2)
    alone = simulate_groups(recipe, data, shards=[0, 1, 2, 3], rounds=2, inner_steps=3, group_size=1)
    assert mixing.bytes_per_worker > 8 * sum(p.numel() for p in mixing.global_params) / 2, \
        "round 1 sends params and momentum (fp32) besides the pseudo-gradients"
    assert alone.bytes_per_worker == 0, "groups of one send nothing"


@pytest.mark.slow  # (a whole script run: the full suite runs it; the quick subset stays under 5 min)
def test_bench_diloco_runs_on_the_corpus_it_is_given(tmp_path, cache_dir):
    """scripts/bench_diloco.py --data-source trains and evaluates on that corpus, not the bundled one; a path that
    does not exist is a one-line usage error."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "the peer trains a model and averages its pseudo gradient with others every round".split()
    for doc in range(12):
        lines = (" ".join(words[(doc + line + k) % len(words)] for k in range(12)) for line in range(300))
        (corpus / f"doc{doc}.txt").write_text("\n".join(lines))
    script = [sys.executable, str(Path(__file__).parent.parent / "scripts" / "bench_diloco.py"), "--threads", "1",
              "--cache-dir", str(cache_dir), "--rounds", "1", "--inner-steps", "2", "--hidden", "32", "--layers", "1"]
    run = subprocess.run([*script, "--data-source", str(corpus), "--only", "a,b"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"corpus {corpus}: 11 training documents" in run.stdout
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert [row["config"] for row in rows] == ["a", "b"]
    # A tokenizer trained on these 14 words has a few hundred entries, so an untrained model's loss is near
    # ln(vocab) ~ 6, far below the ln(4096) ~ 8.3 of the bundled corpus's tokenizer.
    assert all(math.isfinite(row["val_loss"]) and row["val_loss"] < 7 for row in rows)

    missing = subprocess.run([*script, "--data-source", str(tmp_path / "nowhere")], capture_output=True, text=True,
                             timeout=300)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1].endswith(f"corpus path '{tmp_path / 'nowhere'}' does not exist")


@pytest.mark.slow  # about 11 s on the 2-core machines: out of the quick subset
def test_a_one_stage_pipeline_is_diloco_and_two_stages_learn_with_every_replica_fed(cache_dir):
    """simulate_pipeline (bench_pipeline.py's DiLoCo-SWARM): with one stage it is plain DiLoCo (same params); cut
    into 2 stages x 2 replicas with an fp16 wire, microbatches reach both second-stage replicas, the boundary
    carries hidden_size x 2 bytes forward and back per token, and the validation loss falls."""
    recipe = load_recipe(RECIPE)
    recipe = recipe.model_copy(update={"averaging": recipe.averaging.model_copy(update={"codec": "int8"})})
    data = _data(recipe, cache_dir)
    plain = simulate_diloco(recipe, data, shards=[0, 1], rounds=2, inner_steps=3)
    one = simulate_pipeline(recipe, data, shards=[0, 1], stages=1, rounds=2, inner_steps=3)
    torch.testing.assert_close(torch.cat([p.view(-1) for p in one.global_params]),
                               torch.cat([p.view(-1) for p in plain.global_params]), rtol=1e-4, atol=1e-5)
    assert one.activation_bytes == 0 and one.tokens == plain.tokens
    two = simulate_pipeline(recipe, data, shards=[0, 1], stages=2, rounds=3, inner_steps=4, wire_codec="fp16")
    assert two.val_losses[-1] < two.val_losses[0]
    assert all(r[0] == [4, 4] for r in two.stage_microbatches)  # each first-stage replica: its own data
    assert all(sum(r[1]) == 8 for r in two.stage_microbatches)  # all of it through the second stage
    assert min(sum(r[1][k] for r in two.stage_microbatches) for k in (0, 1)) > 0, "random wiring feeds both"
    per_token = two.activation_bytes / two.tokens
    assert abs(per_token - 2 * 2 * recipe.model.hidden_size) < 1, per_token


def test_bench_diloco_exact_sparse_ablation_keeps_the_codecs_positions_and_bytes(cache_dir):
    """bench_diloco.py --sparse-values exact (an ablation) sends exactly the entries the sparse codec keeps, with
    their own values, in the codec's own payloads; and simulate_diloco given a codec runs it as it runs the named one
    (the same params as codec_name with the same codec)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    try:
        from bench_diloco import ExactSparse, sparse_codec
    finally:
        sys.path.pop(0)
    codec = sparse_codec(16, "exact")
    assert isinstance(codec, ExactSparse) and isinstance(sparse_codec(16, "2bit"), type(codec.codec))
    x = torch.randn(3 * 4096 + 100, generator=torch.Generator().manual_seed(1))
    payload = codec.encode(x)
    assert payload == codec.codec.encode(x)
    kept = codec.codec.select(x)
    sent = codec.decode(payload)
    assert torch.equal(sent[kept], x[kept]) and int((sent != 0).sum()) == kept.numel() == codec.kept_count(x.numel())

    recipe = load_recipe(RECIPE)
    data = _data(recipe, cache_dir)
    named = simulate_diloco(recipe, data, shards=[0, 1], rounds=1, inner_steps=2, codec_name="sparse")
    given = simulate_diloco(recipe, data, shards=[0, 1], rounds=1, inner_steps=2, codec=sparse_codec(64, "2bit"))
    assert all(torch.equal(a, b) for a, b in zip(named.global_params, given.global_params))
    exact = simulate_diloco(recipe, data, shards=[0, 1], rounds=1, inner_steps=2, codec=sparse_codec(64, "exact"))
    assert exact.bytes_per_worker == given.bytes_per_worker
    assert not all(torch.equal(a, b) for a, b in zip(exact.global_params, given.global_params))
