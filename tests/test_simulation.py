"""The distributed system computes exactly the algorithm we benchmark: a real 2-peer swarm (fixed seeds, data
shards 0 and 1, 5 inner steps per round) ends 3 rounds with the same global params as the in-process simulation."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from swarm.config import load_recipe
from swarm.peer.data import prepare_run_data
from swarm.peer.simulation import simulate_diloco, simulate_groups

RECIPE = Path(__file__).parent / "recipes" / "fixed_steps.yaml"
ROUNDS = 3


@pytest.mark.slow
def test_real_swarm_matches_simulation(swarm, cache_dir):
    _, maddr = swarm.bootstrap(recipe=RECIPE)
    peers = [swarm.peer(maddr, "--data-shard", str(shard), "--max-rounds", str(ROUNDS),
                        "--trace-dir", str(swarm.workdir / f"trace{shard}"), name=f"peer{shard}")
             for shard in (0, 1)]
    for peer in peers:
        assert peer.wait(240) == 0, peer.output()[-3000:]

    recipe = load_recipe(RECIPE)
    data = prepare_run_data(recipe.data.source, recipe.data.tokenizer, recipe.data.vocab_size,
                            recipe.data.val_fraction, recipe.data.seq_len, recipe.data.batch_size, recipe.data.seed,
                            cache_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the peers ran with one thread: same kernels, same rounding
    try:
        simulated = simulate_diloco(recipe, data, shards=[0, 1], rounds=ROUNDS,
                                    inner_steps=recipe.inner_steps_per_round)
    finally:
        torch.set_num_threads(threads)
    expected = torch.cat([p.view(-1) for p in simulated.global_params])
    for shard in (0, 1):
        last = swarm.workdir / f"trace{shard}" / f"round-{ROUNDS - 1:06d}"
        meta = json.loads(last.with_suffix(".json").read_text())
        assert len(meta["members"]) == 2
        real = load_file(str(last.with_suffix(".safetensors")))["global_after"]
        torch.testing.assert_close(real, expected, rtol=1e-4, atol=1e-6)
    # ...and training changed the params: the comparison is not between two untouched initialisations.
    first = load_file(str(swarm.workdir / "trace0" / "round-000000.safetensors"))["global_before"]
    assert (expected - first).abs().max() > 1e-3


def test_simulated_overlap_keeps_local_progress_on_the_new_global_params(cache_dir):
    """The overlap bookkeeping of the simulation (the benchmark's config f): an average that arrives before the
    first inner step of the next round (delay 0) re-bases every worker exactly onto the new global params, so the
    run equals plain DiLoCo; one that arrives later gives a different (delayed) run that still learns."""
    recipe = load_recipe(RECIPE)
    data = prepare_run_data(recipe.data.source, recipe.data.tokenizer, recipe.data.vocab_size,
                            recipe.data.val_fraction, recipe.data.seq_len, recipe.data.batch_size, recipe.data.seed,
                            cache_dir)
    runs = {delay: simulate_diloco(recipe, data, shards=[0, 1], rounds=3, inner_steps=4, overlap_delay=delay)
            for delay in (None, 0, 2)}
    flat = {delay: torch.cat([p.view(-1) for p in run.global_params]) for delay, run in runs.items()}
    torch.testing.assert_close(flat[0], flat[None], rtol=1e-4, atol=1e-5)
    assert (flat[2] - flat[None]).abs().max() > 1e-4, "a late average must change the run"
    assert runs[2].val_losses[-1] < runs[2].val_losses[0]


def test_simulated_groups_are_diloco_when_one_group_holds_everyone_and_mix_otherwise(cache_dir):
    """The benchmark's config g: workers split into groups as peers split themselves. A group as large as the
    swarm is plain DiLoCo; groups of 2 out of 4 leave round 0 with two lineages, which round 1 merges (every
    group averages params across them), and the run still learns."""
    recipe = load_recipe(RECIPE)
    data = prepare_run_data(recipe.data.source, recipe.data.tokenizer, recipe.data.vocab_size,
                            recipe.data.val_fraction, recipe.data.seq_len, recipe.data.batch_size, recipe.data.seed,
                            cache_dir)
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
