"""The group all-reduce end to end with every codec: three real peer processes (scripts/allreduce_bench.py)
average seeded random 1M-element vectors with unequal weights; every peer's result must be within the codec's
stated bound of the exact weighted mean computed here, and all peers' results must be bit-identical. Also the
bandwidth-weighted partition as pure functions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarm.averaging.matchmaking import Candidate, choose_members
from swarm.averaging.partition import optimal_shares, partition
from swarm.compression import get_codec

ROOT = Path(__file__).resolve().parent.parent
NUMEL = 1_000_000


CODECS = ["none", "fp16", "bf16", "int8", "int4", "topk"]


@pytest.fixture(scope="module")
def averaged(tmp_path_factory) -> Path:
    """One run of three peers, one round per codec (round r uses CODECS[r])."""
    out = tmp_path_factory.mktemp("allreduce")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "allreduce_bench.py"), "--peers", "3",
                             "--numel", str(NUMEL), "--codec", ",".join(CODECS), "--rounds", str(len(CODECS)),
                             "--save", str(out), "--timeout", "200"], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


@pytest.mark.slow
@pytest.mark.parametrize("round_no, codec_name", list(enumerate(CODECS)))
def test_three_peers_average_within_codec_bound(averaged, round_no, codec_name):
    saved = [torch.load(averaged / f"peer{i}-round{round_no}.pt") for i in range(3)]
    assert all(s["codec"] == codec_name for s in saved)
    codec = get_codec(codec_name)
    weights = torch.tensor([s["weight"] for s in saved])
    exact = sum(s["vector"] * s["weight"] for s in saved) / weights.sum()
    # Bound: each contribution is encoded per part (blocks restart at part boundaries), then each reducer
    # encodes its averaged part once more.
    bounds = partition(NUMEL, saved[0]["shares"])
    members = saved[0]["members"]
    bound = torch.zeros(NUMEL)
    for j, (start, end) in enumerate(bounds):
        reducer = next(i for i, s in enumerate(saved) if s["peer_id"] == members[j])
        contribution_bound = torch.zeros(end - start)
        for i, s in enumerate(saved):
            if i != reducer:  # a reducer's own contribution never crosses the wire
                contribution_bound += s["weight"] / weights.sum() * codec.error_bound(s["vector"][start:end])
        reencode_bound = torch.maximum(codec.error_bound(exact[start:end]),
                                       codec.error_bound(saved[0]["average"][start:end]))
        if codec_name == "topk":  # the reducer keeps the top-k of the average it computed, which is within
            reencode_bound = torch.maximum(reencode_bound, exact[start:end].abs() + contribution_bound)
        bound[start:end] = contribution_bound + reencode_bound
    for s in saved:
        assert s["members"] == members
        error = (s["average"] - exact).abs()
        slack = 1e-6 * exact.abs().max()  # fp32 rounding of the weighted sums themselves
        assert bool((error <= bound + slack).all()), f"{codec_name}: max excess {(error - bound).max():.3g}"
        assert torch.equal(s["average"], saved[0]["average"]), "all peers must hold bit-identical results"
    if codec_name == "none":
        torch.testing.assert_close(saved[0]["average"], exact, rtol=1e-6, atol=1e-6)
    else:  # the codec really was on the wire
        assert not torch.equal(saved[0]["average"], exact)


def test_shares_follow_bandwidth():
    # The mixed links: the 25 Mbit/s peer must reduce nothing; faster links reduce more.
    shares = optimal_shares([25, 50, 100, 200], [True] * 4)
    assert shares[0] == 0 and shares[3] > shares[2] >= shares[1] and sum(shares) == pytest.approx(1)
    times = [(1 + 2 * p) / b for p, b in zip(shares, [25, 50, 100, 200])]
    assert max(times) == pytest.approx(1 / 25)  # the optimum: the slow peer only uploads its vector once
    assert optimal_shares([100] * 4, [True] * 4) == pytest.approx([0.25] * 4)
    assert optimal_shares([100, 100, 100], [True, False, True]) == pytest.approx([0.5, 0, 0.5])
    assert optimal_shares([10, 30], [True, True]) == pytest.approx([0.25, 0.75])
    with pytest.raises(ValueError):
        optimal_shares([100, 100], [False, False])


def test_shares_beat_equal_split_on_mixed_links():
    bandwidths = [10, 1000, 1000, 1000, 1000]
    shares = optimal_shares(bandwidths, [True] * 5)
    n = len(bandwidths)

    def round_time(p):
        return max((1 + (n - 2) * share) / b for share, b in zip(p, bandwidths))

    assert round_time(shares) < round_time([1 / n] * n) / 1.5


def test_partition_by_shares_is_exact():
    assert partition(10, [0.5, 0.0, 0.5]) == [(0, 5), (5, 5), (5, 10)]
    bounds = partition(1_000_003, [0.1, 0.2, 0.3, 0.4])
    assert bounds[-1][1] == 1_000_003 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    with pytest.raises(ValueError):
        partition(10, [0.0, 0.0])


def test_choose_members_majority_digest_and_accusations():
    c = {"a": Candidate("d1", 1.0, False), "b": Candidate("d1", 1.0, False), "c": Candidate("d2", 1.0, False)}
    assert choose_members(c, 16) == ["a", "b"], "the majority digest wins; a stale peer waits for the next round"
    assert choose_members(c, 1) == ["a"]
    assert choose_members({"x": Candidate("d2", 1, False), "y": Candidate("d1", 1, False)}, 16) == ["y"]  # tie
    # An honest peer that caught "b" sending bad data is never grouped with it, whoever computes the group.
    accused = {**c, "a": Candidate("d1", 1.0, False, ("b",))}
    assert choose_members(accused, 16) == ["a"]
    assert choose_members({}, 16) == []
