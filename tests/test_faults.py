"""Fault tolerance with real peers: one of three peers is SIGKILLed at a named phase of an averaging round, or
sends bad data; the survivors must finish that round without it, hold bit-identical params equal to the exact
weighted mean of their own contributions, and go on to the next round."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


def _trace(directory: Path, round_no: int) -> tuple[dict, dict]:
    meta = json.loads((directory / f"round-{round_no:06d}.json").read_text())
    return meta, load_file(str(directory / f"round-{round_no:06d}.safetensors"))


def _written_trace(directory: Path, round_no: int, timeout: float = 30) -> tuple[dict, dict]:
    """A round's trace from a peer that is still running: it writes it just after logging the round."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _trace(directory, round_no)
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _seconds_between(earlier: dict, later: dict) -> int:
    """Whole seconds from one event to a later one, as a log's HH:MM:SS clock counts them."""
    return int(later["time"]) - int(earlier["time"])


def _start_three(swarm, fault: str, rounds: int, recipe: Path | None = None):
    """The faulty peer starts first, so it is surely in the swarm when its fault round comes."""
    _, maddr = swarm.bootstrap(**({"recipe": recipe} if recipe else {}))
    faulty = swarm.peer(maddr, "--until-round", str(rounds), "--inject-fault", fault, name="faulty")
    faulty.wait_event("training", 120, round=0)
    survivors = [swarm.peer(maddr, "--until-round", str(rounds), "--trace-dir", str(swarm.workdir / f"trace{i}"),
                            name=f"survivor{i}") for i in range(2)]
    return faulty, survivors


def _check_round_redone_without(swarm, survivors, round_no: int, read=_trace) -> None:
    """Both survivors' trace of `round_no`: averaged by the two of them alone, to the exact weighted mean of their
    pseudo-gradients, with bit-identical results."""
    ids = sorted(p.wait_event("joined", 5)["peer_id"] for p in survivors)
    (meta_a, ta), (meta_b, tb) = (read(swarm.workdir / f"trace{i}", round_no) for i in range(2))
    assert meta_a["members"] == meta_b["members"] == ids, "the round must be redone with the survivors only"
    total = meta_a["weight"] + meta_b["weight"]
    expected = (ta["pseudo_gradient"] * meta_a["weight"] + tb["pseudo_gradient"] * meta_b["weight"]) / total
    torch.testing.assert_close(ta["average"], expected, rtol=1e-5, atol=1e-7)
    assert torch.equal(ta["average"], tb["average"]) and torch.equal(ta["global_after"], tb["global_after"])


def _check_survivors_averaged_without(swarm, survivors, fault_round: int, rounds: int) -> None:
    for peer in survivors:
        assert peer.wait(180) == 0, peer.output()[-3000:]
    _check_round_redone_without(swarm, survivors, fault_round)
    # ...and the swarm went on: both survivors averaged the following rounds together.
    last_a, last_b = _trace(swarm.workdir / "trace0", rounds - 1), _trace(swarm.workdir / "trace1", rounds - 1)
    assert torch.equal(last_a[1]["global_after"], last_b[1]["global_after"])


@pytest.mark.parametrize("phase", ["matchmaking", "send", "reduce", "commit"])
def test_sigkill_during_round_survivors_finish_without_it(swarm, phase):
    rounds = 4
    faulty, survivors = _start_three(swarm, f"{phase}@1", rounds)
    # Round 1, or the first round after it the faulty peer averages in (if a slow start left it out of one).
    fired = faulty.wait_event("fault", 150, kind="sigkill", phase=phase)
    killed_at = time.monotonic()
    fault_round = fired["round"]
    assert fault_round <= rounds - 2, "the fault must fire early enough for the swarm to go on after it"
    assert faulty.wait(10) == -9, "the fault must really have fired"
    for peer in survivors:
        peer.wait_event("averaged", 60, round=fault_round, group_size=2)
    # Within the configured timeout + 5 s: the tiny recipe's all-reduce phase ceiling is 30 s (a group whose
    # members have not measured a round yet waits that long; otherwise the group waits 3x its slowest member's
    # recent rounds, at least 5 s) and its matchmaking timeout 10 s.
    assert time.monotonic() - killed_at < 30 + 5
    _check_survivors_averaged_without(swarm, survivors, fault_round, rounds)


@pytest.mark.parametrize("bad", ["nan", "garbage", "short"])
def test_bad_data_is_excluded_and_reported(swarm, bad):
    fault_round, rounds = 1, 3
    faulty, survivors = _start_three(swarm, f"{bad}@{fault_round}", rounds)
    faulty_id = faulty.wait_event("joined", 5)["peer_id"]
    for peer in survivors:
        peer.wait_event("averaged", 150, round=fault_round, group_size=2)
    _check_survivors_averaged_without(swarm, survivors, fault_round, rounds)
    assert any(p.events("bad_peer", peer_id=faulty_id) for p in survivors), "the bad peer is reported by id"


RING_RECIPE = Path(__file__).parent / "recipes" / "ring.yaml"


def test_sigkill_while_sending_along_the_ring_survivors_redo_the_round_without_it(swarm):
    """The ring breaks when a member dies mid-stream: nobody applies anything, the member that noticed tells the
    others whom it blames, and the survivors redo the round (attempt 1, a butterfly of two) without it."""
    rounds = 5
    # "ring@1": killed while streaming along a ring, in the first round from 1 on that it averages in one (a slow
    # start can leave a peer out of the first rounds, and a group of two averages in a butterfly).
    faulty, survivors = _start_three(swarm, "ring@1", rounds, RING_RECIPE)
    fired = faulty.wait_event("fault", 150, kind="sigkill", phase="ring")
    killed_at, fault_round = time.monotonic(), fired["round"]
    assert fault_round <= rounds - 2 and faulty.wait(10) == -9
    for peer in survivors:
        peer.wait_event("averaged", 60, round=fault_round, group_size=2)
    assert time.monotonic() - killed_at < 30 + 5
    _check_survivors_averaged_without(swarm, survivors, fault_round, rounds)
    outputs = [peer.output() for peer in survivors]  # (the ring's break is a log line of the all-reduce only)
    assert all(re.search(rf"round {fault_round}: the ring broke", out) for out in outputs), \
        "both survivors were in the ring when it broke"


def test_bad_data_along_the_ring_is_excluded_and_reported(swarm):
    """Only the bad peer's successor sees its partial sums: it rejects them and tells the third member, so both
    survivors leave the bad peer out of the redone round."""
    rounds = 8
    # "ring-garbage@1": garbage from round 1 on, but only along a ring (in a butterfly of two it sends good data).
    faulty, survivors = _start_three(swarm, "ring-garbage@1", rounds, RING_RECIPE)
    faulty_id = faulty.wait_event("joined", 5)["peer_id"]
    first_bad = faulty.wait_event("averaging_failed", 150, where=lambda e: e["round"] >= 1)["round"]
    for peer in survivors:
        peer.wait_event("averaged", 150, round=first_bad, group_size=2)
    # The redone round, as both survivors traced it (the bad peer keeps sending garbage in later rounds, so the
    # swarm's later rounds are not this test's business).
    _check_round_redone_without(swarm, survivors, first_bad, read=_written_trace)
    assert any(p.events("bad_peer", peer_id=faulty_id) for p in survivors), "the bad peer is reported by id"
    reported = "".join(p.output() for p in survivors)  # (the ring's break is a log line of the all-reduce only)
    assert re.search(rf"round {first_bad}: the ring broke", reported), "the garbage was sent along the ring"
    # The survivor that did not see the garbage blames whom its successor blamed, not the successor (which closed
    # its stream to it before its abort arrived).
    blamed = set(re.findall(rf"round {first_bad}: the ring broke \(([^)]*)\)", reported))
    assert blamed == {faulty_id[-8:]}, f"the ring's break was blamed on {blamed}, not on {faulty_id[-8:]}"


def test_diverged_peers_never_send_and_rejoin_the_next_average(swarm):
    """A peer whose params turn NaN mid-round, and one whose pseudo-gradient norm is absurd, send neither: each
    drops its round's local progress, restarts from the global params and contributes again; every average the
    swarm applies stays finite and exact."""
    _, maddr = swarm.bootstrap()
    rounds = 4
    peers = [swarm.peer(maddr, "--until-round", str(rounds), "--inject-fault", fault,
                        "--trace-dir", str(swarm.workdir / f"trace{i}"), name=f"peer{i}")
             for i, fault in enumerate(["diverge@1", "explode@2"])]
    for peer in peers:
        assert peer.wait(240) == 0, peer.output()[-3000:]
    assert peers[0].events("fault", kind="diverge") and peers[1].events("fault", kind="explode")
    assert peers[0].events("recovered", reason="non-finite loss")
    assert peers[1].events("recovered", where=lambda e: re.fullmatch(r"pseudo-gradient norm \S+ over the recipe's "
                                                                     r"bound", e["reason"]))
    for round_no in range(rounds):
        (meta_a, ta), (meta_b, tb) = (_trace(swarm.workdir / f"trace{i}", round_no) for i in range(2))
        assert len(meta_a["members"]) == 2, "both peers are back in every round's average"
        assert torch.isfinite(ta["pseudo_gradient"]).all() and torch.isfinite(tb["pseudo_gradient"]).all()
        assert ta["pseudo_gradient"].norm() < 1e3 and tb["pseudo_gradient"].norm() < 1e3
        total = meta_a["weight"] + meta_b["weight"]
        expected = (ta["pseudo_gradient"] * meta_a["weight"] + tb["pseudo_gradient"] * meta_b["weight"]) / total
        torch.testing.assert_close(ta["average"], expected, rtol=1e-5, atol=1e-7)
        assert torch.equal(ta["global_after"], tb["global_after"]) and torch.isfinite(ta["global_after"]).all()


def test_a_peer_that_diverges_while_its_average_is_in_flight_applies_it_and_restarts_from_it(swarm):
    """With overlap, a peer's params turn NaN while its round-1 average is still in flight (the fault fires in
    the first step after it handed round 1 in). It concludes that average first, then restarts from the new global
    params: the average is neither lost nor later applied on top of a local model that no longer descends from
    the snapshot it was taken against; every round stays exact, finite and identical on both peers."""
    _, maddr = swarm.bootstrap(recipe=Path(__file__).parent / "recipes" / "overlap.yaml")
    rounds = 4
    peers = [swarm.peer(maddr, "--until-round", str(rounds), "--trace-dir", str(swarm.workdir / f"trace{i}"),
                        *(["--inject-fault", "diverge@2"] if i == 0 else []), name=f"peer{i}") for i in range(2)]
    for peer in peers:
        assert peer.wait(240) == 0, peer.output()[-3000:]
    assert peers[0].events("fault", kind="diverge", round=2)
    assert peers[0].events("recovered", reason="non-finite loss")
    # Applied on top of the restarted model, the average's "progress since the snapshot" would be minus the whole
    # round-1 progress, and round 2's pseudo-gradient would point back against round 1's: cosine -0.36 when this
    # was broken, +0.11 to +0.32 over five runs that work. (Round 1, not 0: a peer that starts a moment after the
    # other may hand round 0 in after a step or two, with almost no progress.)
    pseudo_gradients = [_trace(swarm.workdir / "trace0", r)[1]["pseudo_gradient"] for r in (1, 2)]
    assert torch.nn.functional.cosine_similarity(*pseudo_gradients, dim=0) > -0.1, "round 1's progress was undone"
    for round_no in range(rounds):
        (meta_a, ta), (meta_b, tb) = (_trace(swarm.workdir / f"trace{i}", round_no) for i in range(2))
        assert len(meta_a["members"]) == 2
        total = meta_a["weight"] + meta_b["weight"]
        expected = (ta["pseudo_gradient"] * meta_a["weight"] + tb["pseudo_gradient"] * meta_b["weight"]) / total
        torch.testing.assert_close(ta["average"], expected, rtol=1e-5, atol=1e-7)
        assert torch.equal(ta["global_after"], tb["global_after"]) and torch.isfinite(ta["global_after"]).all()


def test_sigkill_in_one_of_two_groups_leaves_no_survivor_behind(swarm):
    """Four peers in groups of two (Moshpit-style); one is SIGKILLed while reducing. Its partner cannot finish
    that round (it has nobody left to average with, and all-or-nothing forbids applying a part), so it re-syncs
    from the group that did; from then on the three survivors average as one group and end bit-identical."""
    rounds = 3  # the fault in round 1; the partner back for round 2, about 2 s after it
    # Its rounds (about 10 s) are longer than a matchmaking timeout and a re-sync (real rounds take minutes): the
    # partner must be back before the others finish their last round and stop serving state.
    _, maddr = swarm.bootstrap(recipe=Path(__file__).parent / "recipes" / "moshpit.yaml")
    faulty = swarm.peer(maddr, "--until-round", str(rounds), "--inject-fault", "reduce@1", name="faulty")
    faulty.wait_event("training", 120, round=0)
    survivors = [swarm.peer(maddr, "--until-round", str(rounds), "--trace-dir", str(swarm.workdir / f"trace{i}"),
                            name=f"survivor{i}") for i in range(3)]
    fired = faulty.wait_event("fault", 150, kind="sigkill", phase="reduce")
    assert faulty.wait(10) == -9, "the fault must really have fired"
    fault_round = fired["round"]
    assert fault_round <= rounds - 2, "the fault must fire early enough for the swarm to go on after it"
    for peer in survivors:
        assert peer.wait(180) == 0, peer.output()[-3000:]
    last = [_trace(swarm.workdir / f"trace{i}", rounds - 1) for i in range(3)]
    assert all(meta["members"] == last[0][0]["members"] and len(meta["members"]) == 3 for meta, _ in last), \
        "the three survivors average the last round as one group"
    assert all(torch.equal(t["global_after"], last[0][1]["global_after"]) for _, t in last)
    # A peer that found itself behind the swarm tried to re-sync: it synced, or failed to (and tried again later).
    partner = next((p for p in survivors if p.events("synced", reason="behind the swarm") or p.events("sync_failed")),
                   None)
    assert partner is not None, "the dead peer's partner re-synced from the others"
    # Within the bound the issue sets for survivors (the phase's timeout + 5 s): it does not wait out matchmaking
    # for peers whose announcements show they finished the round elsewhere.
    failed, synced = partner.events("averaging_failed"), partner.events("synced")
    assert failed and synced, partner.output()[-3000:]
    assert _seconds_between(failed[0], synced[0]) <= 5 + 5, partner.output()[-3000:]
