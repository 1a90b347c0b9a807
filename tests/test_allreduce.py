"""The group all-reduce end to end with every codec: three real peer processes (scripts/allreduce_bench.py)
average seeded random 1M-element vectors with unequal weights; every peer's result must be within the codec's
stated bound of the exact weighted mean computed here, and all peers' results must be bit-identical. Also the
bandwidth-weighted partition as pure functions, and the typed phase messages (see also test_allreduce_in_memory.py).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarm.averaging.allreduce import GroupAllReduce
from swarm.averaging.deadlines import AdaptiveDeadlines
from swarm.averaging.grouping import Candidate, choose_members, group_timeout, plan_groups
from swarm.averaging.matchmaking import Group, leader_of
from swarm.averaging.messages import Averaged, Blame, Contribution, Header, MessageError, PartialSum
from swarm.averaging.partition import optimal_shares, partition
from swarm.compression import get_codec

ROOT = Path(__file__).resolve().parent.parent
NUMEL = 1_000_000


CODECS = ["none", "fp16", "bf16", "int8", "int4", "topk", "sparse"]


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
    bounds = partition(NUMEL, saved[0]["shares"], codec.alignment())
    members = saved[0]["members"]
    bound = torch.zeros(NUMEL)
    for j, (start, end) in enumerate(bounds):
        reducer = next(i for i, s in enumerate(saved) if s["peer_id"] == members[j])
        contribution_bound = torch.zeros(end - start)
        for i, s in enumerate(saved):
            if i != reducer or codec.own_part_encoded:  # (else a reducer's own part never crosses the wire)
                contribution_bound += s["weight"] / weights.sum() * codec.error_bound(s["vector"][start:end])
        back = codec.average_codec(3)  # (sparse: the support codec, the average as it is, so of the decoded parts)
        decoded = [codec.decode(codec.encode(s["vector"][start:end])) * s["weight"] for s in saved]
        averaged = exact[start:end] if back is codec else sum(decoded) / weights.sum()
        reencode_bound = torch.maximum(back.error_bound(averaged), back.error_bound(saved[0]["average"][start:end]))
        if codec_name == "topk":  # the reducer keeps the top-k of the average it computed, which is within
            reencode_bound = torch.maximum(reencode_bound, exact[start:end].abs() + contribution_bound)
        bound[start:end] = contribution_bound + reencode_bound
    for s in saved:
        assert s["members"] == members
        error = (s["average"] - exact).abs()
        slack = 1e-6 * exact.abs().max()  # fp32 rounding of the weighted sums themselves
        assert bool((error <= bound + slack).all()), f"{codec_name}: max excess {(error - bound).max():.3g}"
        assert torch.equal(s["average"], saved[0]["average"]), "all peers must hold bit-identical results"
    # Equal links (every bench peer announces the same bandwidth) and a lossless codec: averaged along the ring.
    assert all(s["ring"] == (codec_name == "none") for s in saved)
    if codec_name == "none":
        torch.testing.assert_close(saved[0]["average"], exact, rtol=1e-6, atol=1e-6)
    else:  # the codec really was on the wire
        assert not torch.equal(saved[0]["average"], exact)


def test_ring_only_for_lossless_first_attempts_of_three_or_more_with_even_links():
    def group(shares, attempt=0, clients=()):
        members = [f"peer{i}" for i in range(len(shares))]
        return Group.of(3, attempt, members, shares, clients=clients)

    def uses_ring(mode, codec="none"):
        return GroupAllReduce(node=None, run_id="t", codec_name=codec, max_numel=1 << 20,
                              deadlines=AdaptiveDeadlines(5.0, 30.0), ring=mode).uses_ring
    even = optimal_shares([100.0] * 4, [True] * 4)
    auto = uses_ring("auto")
    assert auto(group(even))
    assert auto(group(optimal_shares([100, 100, 100, 105], [True] * 4)))  # within RING_SPREAD
    assert not auto(group(optimal_shares([100, 100, 100, 130], [True] * 4)))  # one much faster link
    assert not auto(group(optimal_shares([25, 50, 100, 200], [True] * 4)))  # the mixed links: a butterfly
    assert not auto(group(even, attempt=1)), "a retry runs the butterfly"
    assert not auto(group([0.5, 0.5, 0.0], clients=(False, False, True))), "a client cannot be in a ring"
    assert not auto(group([0.5, 0.5])), "two members: a butterfly is already one flow each way"
    assert not uses_ring("auto", "int8")(group(even)), "partial sums would be re-quantized at every hop"
    assert not uses_ring("never")(group(even))
    assert uses_ring("always")(group(optimal_shares([25, 50, 100, 200], [True] * 4)))


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
    assert partition(10_000, 3, align=4096) == [(0, 4096), (4096, 8192), (8192, 10_000)]  # (the last unit short)
    assert partition(5000, [0.3, 0.3, 0.4], align=4096) == [(0, 4096), (4096, 4096), (4096, 5000)]
    bounds = partition(1_000_003, [0.1, 0.2, 0.3, 0.4])
    assert bounds[-1][1] == 1_000_003 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    with pytest.raises(ValueError):
        partition(10, [0.0, 0.0])


def test_choose_members_takes_every_lineage_and_leaves_out_the_accused():
    c = {"a": Candidate("d1", 1.0, False), "b": Candidate("d1", 1.0, False), "c": Candidate("d2", 1.0, False)}
    assert choose_members(c, 16) == ["a", "b", "c"], "other state digests are mixed in, not left to re-sync"
    assert choose_members(c, 1) == ["a"]
    # An honest peer that caught "b" sending bad data is never grouped with it, whoever computes the group.
    accused = {**c, "a": Candidate("d1", 1.0, False, ("b",))}
    assert choose_members(accused, 16) in (["a", "c"], ["b", "c"])
    assert choose_members({}, 16) == []


def test_an_accusation_parts_two_peers_and_never_costs_the_others_more():
    honest = {peer: Candidate("d", 1.0, False) for peer in "abcd"}
    # A liar that accuses every honest peer is the one left out, not the four it accused.
    liar = {**honest, "0": Candidate("d", 1.0, False, tuple("abcd"))}
    assert choose_members(liar, 16) == list("abcd")
    assert sorted(p for g in plan_groups(liar, 2, 2, 0) for p in g) == list("abcd"), "in several groups too"
    # Caught by the two others of its group (who each accuse it), a peer that accuses them back is still out.
    caught = {**honest, "a": Candidate("d", 1.0, False, ("z",)), "b": Candidate("d", 1.0, False, ("z",)),
              "z": Candidate("d", 1.0, False, ("a", "b"))}
    assert choose_members(caught, 16) == list("abcd")
    # Unknown or self accusations count for nothing.
    assert choose_members({**honest, "e": Candidate("d", 1.0, False, ("e", "nobody"))}, 16) == list("abcde")


def test_an_accusation_tie_is_not_won_by_the_peer_id():
    """Issue 37, class 5: ties went to the smaller peer id, so an accuser that chose a key sorting below its victim's
    (two tries) left the victim out of every attempt. Now a lone accusation costs its writer the attempt, and two
    that accuse each other are each out of about half the attempts, whatever their ids."""
    honest = {f"h{i}": Candidate("d", 1.0, False) for i in range(5)}
    accuser = {**honest, "a": Candidate("d", 1.0, False, ("h4",))}  # "a" sorts below "h4": it won every tie
    outs = [plan_groups(accuser, 8, 2, round_no, attempt) for round_no in range(10) for attempt in range(4)]
    assert all(groups == [sorted(honest)] for groups in outs), "the accuser leaves, its victim stays"
    mutual = {**accuser, "h4": Candidate("d", 1.0, False, ("a",))}
    outs = [plan_groups(mutual, 8, 2, round_no, attempt) for round_no in range(10) for attempt in range(4)]
    victim_out = sum("h4" not in groups[0] for groups in outs)
    assert all(("h4" in groups[0]) != ("a" in groups[0]) for groups in outs), "exactly one of the two leaves"
    assert 8 <= victim_out <= 32, f"the victim was out of {victim_out} attempts of {len(outs)}"
    # Two colluders each accusing one honest peer of six no longer take two honest places.
    pair = {**{f"h{i}": Candidate("d", 1.0, False) for i in range(6)},
            "a0": Candidate("d", 1.0, False, ("h0",)), "a1": Candidate("d", 1.0, False, ("h1",))}
    assert all({"h0", "h1"} <= set(plan_groups(pair, 8, 2, r, 0)[0]) for r in range(40))


def test_a_state_digest_nobody_else_holds_is_not_mixed_in():
    """Issue 37, class 3: any member declaring a digest of its own made its group average params and momentum with
    it. A digest must be declared by MIX_QUORUM candidates before a group mixes it in; alone, its holder is left
    out (and re-syncs). Lineages that several peers hold still mix, and two peers that differ still average."""
    from swarm.averaging.grouping import lineages
    honest = {p: Candidate("aaaa", 1.0, False) for p in "abcd"}
    stranger = {**honest, "z": Candidate("ffff", 1.0, False)}
    assert sorted(lineages(stranger)) == list("abcd")
    two = {**{p: Candidate("aaaa", 1.0, False) for p in "ab"}, **{p: Candidate("bbbb", 1.0, False) for p in "cd"}}
    assert lineages({**two, "z": Candidate("ffff", 1.0, False)}) == two
    pair = {"a": Candidate("aaaa", 1.0, False), "b": Candidate("bbbb", 1.0, False)}
    assert lineages(pair) == pair


def test_plan_groups_up_to_target_is_one_group():
    c = {"a": Candidate("d1", 1e6, False), "b": Candidate("d1", 1e6, False), "c": Candidate("d2", 1e6, False)}
    assert plan_groups(c, 4, 1, 0) == [["a", "b", "c"]], "up to target size: one group of every lineage"
    assert plan_groups({}, 4, 1, 0) == []
    # Five candidates, groups of 4 but at least 3: two groups cannot both reach 3, and leaving one peer out would
    # drop its work, so one group of five.
    five = {p: Candidate("d", 1e6, False) for p in "abcde"}
    assert plan_groups(five, 4, 3, 0) == [["a", "b", "c", "d", "e"]]
    assert plan_groups(five, 4, 2, 0) == [["a", "b", "c"], ["d", "e"]]


def test_plan_groups_similar_bandwidth_on_even_rounds_and_across_groups_on_odd_rounds():
    mbit = 125_000.0
    links = {"a": 25, "b": 1000, "c": 50, "d": 900, "e": 100, "f": 200, "g": 1000, "h": 30}
    c = {p: Candidate("same", bw * mbit, False) for p, bw in links.items()}
    even = plan_groups(c, 4, 2, 0)
    assert even == [["b", "d", "f", "g"], ["a", "c", "e", "h"]], "fast links together, slow links together"
    # After that round the two groups hold different params: the next round takes one from each in every pair.
    after = {p: Candidate("fast" if p in even[0] else "slow", cand.bandwidth, False) for p, cand in c.items()}
    odd = plan_groups(after, 4, 2, 1)
    assert sorted(map(len, odd)) == [4, 4]
    for group in odd:
        digests = [after[p].digest for p in group]
        assert digests.count("fast") == digests.count("slow") == 2, f"{group} does not mix the two lineages"
    # A k x g grid: with 9 peers in groups of 3, every odd group has one member of every even group.
    nine = {f"p{i}": Candidate(f"d{i // 3}", (i + 1) * mbit, False) for i in range(9)}
    rows = plan_groups(nine, 3, 1, 2)
    assert len(rows) == 3
    columns = plan_groups({p: Candidate(next(f"r{j}" for j, row in enumerate(rows) if p in row), cand.bandwidth,
                                        False) for p, cand in nine.items()}, 3, 1, 3)
    for column in columns:
        assert all(len(set(column) & set(row)) == 1 for row in rows), (rows, columns)


def test_plan_groups_is_the_same_for_every_viewer_and_gives_every_group_a_reducer():
    mbit = 125_000.0
    c = {f"p{i}": Candidate(f"d{i % 2}", (10 + i) * mbit, client=i >= 3) for i in range(6)}  # p3..p5: clients
    for round_no in range(4):
        groups = plan_groups(c, 3, 1, round_no)
        assert plan_groups(dict(reversed(list(c.items()))), 3, 1, round_no) == groups, "order of the view matters"
        assert sorted(p for g in groups for p in g) == sorted(c), "every candidate is in exactly one group"
        assert all(any(not c[p].client for p in g) for g in groups), f"a group of clients only: {groups}"
    # An accuser and the peer it accuses are in no group together, whoever computes it.
    accused = {**c, "p0": Candidate("d0", 10 * mbit, False, ("p1",))}
    assert all({"p0", "p1"} - set(g) for g in plan_groups(accused, 3, 1, 0))


def test_plan_groups_gives_every_group_two_servers_where_the_run_checks_its_groups():
    """With min_servers 2 (averaging.checked_groups), a group holding one server among clients takes a second from a
    group that can spare one, and where the servers are too few for every group, there are fewer groups."""
    mbit = 125_000.0
    c = {f"p{i}": Candidate("d0", (100 - i) * mbit, client=i >= 4) for i in range(8)}  # p0..p3 servers, the fastest
    plain = plan_groups(c, 4, 3, 0)  # (even rounds: runs of the bandwidth order, so the servers land together)
    assert sorted(sum(not c[p].client for p in g) for g in plain) == [1, 3], plain
    checked = plan_groups(c, 4, 3, 0, min_servers=2)
    assert all(sum(not c[p].client for p in g) == 2 for g in checked), checked
    assert sorted(p for g in checked for p in g) == sorted(c)
    # Three servers and six clients, groups of 4: three groups of one server each would leave nobody averaging;
    # there are two groups instead, or one, whatever the round's layout, each with two servers or more.
    few = {f"p{i}": Candidate(f"d{i % 2}", (100 - i) * mbit, client=i >= 3) for i in range(9)}
    for round_no in range(4):
        groups = plan_groups(few, 4, 3, round_no, min_servers=2)
        assert all(sum(not few[p].client for p in g) >= 2 for g in groups), (round_no, groups)
        assert sorted(p for g in groups for p in g) == sorted(few)


def test_deadlines_follow_measured_rounds_and_grow_after_timeouts():
    deadlines = AdaptiveDeadlines(floor=5.0, ceiling=60.0)
    assert deadlines.measured() is None and deadlines.phase_timeout() == 60.0, "nothing measured: the ceiling"
    assert deadlines.phase_timeout(group_timeout=7.0) == 7.0, "a new peer adopts its group's measured deadline"
    assert deadlines.phase_timeout(group_timeout=1e5) == 60.0, "a leader cannot make us wait past our ceiling"
    deadlines.record(0.5)
    assert deadlines.phase_timeout() == 5.0, "fast rounds: the floor"
    deadlines.record(4.0)
    assert deadlines.phase_timeout() == 12.0
    # Links got slower than anything measured: each timed-out attempt doubles the deadline, up to the ceiling,
    # so the swarm does not fail every round from then on.
    deadlines.record_timeout(12.0)
    assert deadlines.phase_timeout() == 24.0
    deadlines.record_timeout(24.0)
    deadlines.record_timeout(48.0)
    assert deadlines.phase_timeout() == 60.0


def test_group_agrees_on_the_slowest_measured_deadline():
    assert group_timeout([Candidate("d", 1, False), Candidate("d", 1, False)]) is None
    assert group_timeout([Candidate("d", 1, False, phase_timeout=6.0), Candidate("d", 1, False),
                          Candidate("d", 1, False, phase_timeout=9.0)]) == 9.0
    one, other = Group.of(3, 0, ["a", "b"], [0.5, 0.5], 9.0), Group.of(3, 0, ["a", "b"], [0.5, 0.5], None)
    assert one.phase_timeout == 9.0 and one.group_id != other.group_id


def test_headers_keep_their_wire_form():
    """The typed header writes the fields peers have always sent, in the same order (msgpack keeps it)."""
    part = Header("part", "g1", 3, 1, 5, Contribution(2.0)).to_wire()
    assert list(part.items()) == [("group_id", "g1"), ("round", 3), ("attempt", 1), ("phase", "part"),
                                  ("weight", 2.0), ("chunks", 5)]
    abort = Header("abort", "g1", 3, 1, body=Blame(("b", "a"), ("c",))).to_wire()
    assert list(abort.items()) == [("group_id", "g1"), ("round", 3), ("attempt", 1), ("phase", "abort"),
                                   ("chunks", 0), ("suspects", ["a", "b"]), ("rejected", ["c"])]
    assert Header("commit", "g1", 3, 1).to_wire() == {"group_id": "g1", "round": 3, "attempt": 1, "phase": "commit",
                                                       "chunks": 0}
    averaged = Averaged(("b", "a"), (), 3.0).to_wire()
    assert averaged == {"contributors": ["a", "b"], "rejected": [], "total_weight": 3.0}
    assert PartialSum(("b", "a"), 2.0).to_wire() == {"contributors": ["b", "a"], "weight": 2.0}
    # Read back: the same records; unknown fields (a newer peer's) are ignored.
    assert Header.from_wire({**part, "new_field": 1}, 10) == Header("part", "g1", 3, 1, 5)
    assert Contribution.from_wire(part) == Contribution(2.0) and Blame.from_wire(abort) == Blame(("a", "b"), ("c",))
    assert Averaged.from_wire(averaged) == Averaged(("a", "b"), (), 3.0)
    assert Averaged.from_wire({"contributors": ["a"], "total_weight": 1.0}).rejected == ()


GOOD_HEADER = {"group_id": "g", "round": 1, "attempt": 0, "phase": "part", "chunks": 2}


@pytest.mark.parametrize("change, field", [
    ({"phase": "gossip"}, "phase"), ({"group_id": 7}, "group_id"), ({"chunks": -1}, "chunks"),
    ({"chunks": 11}, "chunks"), ({"chunks": True}, "chunks"), ({"round": None}, "round"),
    ({"round": "1"}, "round"), ({"attempt": 1 << 40}, "attempt"), ({"attempt": False}, "attempt")])
def test_header_from_wire_names_the_bad_field(change, field):
    with pytest.raises(MessageError, match=field):
        Header.from_wire({**GOOD_HEADER, **change}, max_chunks=10)


def test_messages_from_wire_refuse_bad_fields_with_a_clear_error():
    with pytest.raises(MessageError, match="header is a list, not a mapping"):
        Header.from_wire([1, 2], max_chunks=10)
    for weight in (None, True, -1.0, 1e18, math.nan, "2"):
        with pytest.raises(MessageError, match="weight must be a number"):
            Contribution.from_wire({**GOOD_HEADER, "weight": weight})
    with pytest.raises(MessageError, match="suspects must be a list of peer ids"):
        Blame.from_wire({"suspects": "a"})
    with pytest.raises(MessageError, match="rejected must be a list of peer ids"):
        Blame.from_wire({"rejected": ["a", 3]})
    assert Blame.from_wire({}) == Blame()
    with pytest.raises(MessageError, match="names a member twice"):
        PartialSum.from_wire({"contributors": ["a", "a"], "weight": 1.0})
    with pytest.raises(MessageError, match="weight"):
        PartialSum.from_wire({"contributors": ["a"], "weight": -2})
    with pytest.raises(MessageError, match="partial sum is a str"):
        PartialSum.from_wire("sum")
    for total_weight in (3, math.nan, -1.0, None):
        with pytest.raises(MessageError, match="total_weight must be a finite float"):
            Averaged.from_wire({"contributors": ["a"], "rejected": [], "total_weight": total_weight})
    with pytest.raises(MessageError, match="contributors must be a list of peer ids"):
        Averaged.from_wire({"contributors": [["a"]], "total_weight": 1.0})


def test_no_peer_id_leads_every_round():
    """The smallest id led every group, so one key ground for a small id set every group's shares and members.
    The leader now changes with the round and attempt, and every member computes the same one."""
    members = sorted(f"Qm{i:04d}" for i in range(8))
    leaders = [leader_of(members, round_no, attempt) for round_no in range(64) for attempt in range(2)]
    assert len(set(leaders)) == 8 and max(leaders.count(m) for m in members) < 40
    assert leader_of(members, 5, 1) == leader_of(list(reversed(members)), 5, 1), "the order does not matter"
