"""Stage backups (swarm/peer/pipeline/keeper.py): each stage's peers keep the next stage's state, and a stage whose
every host died goes on from it. The rule a joiner follows to the keepers' state (two keepers that agree, where two
or more announce one), a state-only DiLoCo that replays and loads as a peer's does, the record fields' validation,
and four real stage peers one of which is SIGKILLed and replaced."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from swarm.config import OuterRecipe
from swarm.dht.records import InvalidRecord, PeerRecord
from swarm.peer.diloco import DiLoCo
from swarm.dht.view import FRESH_SECONDS, kept_reference
from swarm.peer.pipeline.keeper import keepers_of, kept_stage


def _record(peer: str, kept_round, kept_digest: str, updated: float = 100.0, client: bool = False,
            state: str = "training") -> PeerRecord:
    return PeerRecord(peer_id=peer, state=state, version="t", run_id="r.stage1", round=9, tokens_in_round=0,
                      block_start=1, block_end=2, digest="own-stage-digest", kept_round=kept_round,
                      kept_digest=kept_digest, client=client, updated=updated)


def test_the_peers_of_each_stage_keep_the_next_one_and_the_last_the_first():
    assert [kept_stage(k, 4) for k in range(4)] == [1, 2, 3, 0]
    assert [keepers_of(kept_stage(k, 4), 4) for k in range(4)] == [0, 1, 2, 3]
    assert [kept_stage(k, 2) for k in range(2)] == [1, 0]


def test_a_joiner_follows_the_state_two_keepers_agree_on_and_no_lone_liar():
    now = 100.0
    agree = [_record("a", 4, "d4"), _record("b", 4, "d4"), _record("c", 9, "forged")]
    ref = kept_reference(agree, now)
    assert (ref.round, ref.digest, sorted(ref.holders)) == (4, "d4", ["a", "b"])
    # Two keepers that disagree: neither is followed (one of them lies, and nobody can tell which).
    assert kept_reference([_record("a", 4, "d4"), _record("c", 9, "forged")], now).holders == []
    # A lone keeper is followed as a lone peer is (view.quorum).
    assert kept_reference([_record("a", 4, "d4")], now)[:2] == (4, "d4")
    # What does not count: keepers that keep nothing yet, client peers (they serve nothing), stale or future
    # records, peers not training, and the records' own stage digest.
    ignored = [_record("n", None, ""), _record("e", 4, ""), _record("k", 7, "d7", client=True),
               _record("s", 7, "d7", updated=now - 60), _record("f", 7, "d7", updated=now + 60),
               _record("j", 7, "d7", state="joining")]
    assert kept_reference(ignored, now).holders == []
    assert kept_reference(ignored + [_record("a", 4, "d4")], now)[:2] == (4, "d4")


def test_kept_fields_are_validated_like_any_other():
    base = _record("a", 3, "d").to_wire()
    assert PeerRecord.from_wire("a", base).kept_round == 3
    old = {k: v for k, v in base.items() if k not in ("kept_round", "kept_digest")}  # a peer of an older version
    assert PeerRecord.from_wire("a", old).kept_round is None
    for field, value in (("kept_round", -1), ("kept_round", "3"), ("kept_round", True), ("kept_round", 1 << 70),
                         ("kept_digest", 5), ("kept_digest", "x" * 300), ("kept_digest", "d\x1b[2J")):
        with pytest.raises(InvalidRecord, match=field):
            PeerRecord.from_wire("a", {**base, field: value})


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_a_state_only_diloco_replays_and_loads_the_stage_s_steps_as_its_peers_do():
    """A keeper holds global params and momentum alone (no model, no replay log): it replays a peer's logged outer
    steps to the peer's exact state digest, loads a downloaded state, and drops the module it was built from."""
    outer = OuterRecipe()
    peer, kept = DiLoCo(_module(0), outer, log_bytes=1 << 20), DiLoCo.state_only(_module(0), outer)
    assert kept.digest() == peer.digest() and kept.local_params == [] and kept.model is None
    for step in range(3):
        for p in peer.local_params:
            p.data.add_(0.01 * (step + 1))
        peer.outer_step(peer.pseudo_gradient(), tokens=100)
    peer.digest()  # (the log holds a step once it is hashed)
    steps = peer.steps_since(0, kept.digest())
    assert len(steps) == 3
    kept.replay(steps)
    assert (kept.round, kept.tokens_seen, kept.digest()) == (3, 300, peer.digest())
    assert len(kept.replay_log) == 0, "a keeper logs no steps"
    other = DiLoCo.state_only(_module(1), outer)
    other.load_state_tensors(peer.state_tensors(), peer.round, peer.tokens_seen)
    assert other.digest() == peer.digest()


@pytest.mark.slow
def test_a_stage_whose_only_peer_is_sigkilled_goes_on_from_its_keepers_backup(swarm):
    """Four stage peers (tests/recipes/stages4.yaml: 4 blocks, 4 stages, backups every round), each limited by
    --max-memory to 6.5 MB, about 0.38 of the 17.3 MB the whole model needs to train (its stages need 4.1-5.8 MB,
    and the backup it keeps 0.4-0.7 MB more), train; stage 1's peer keeps stage 2's state. Stage 2's only peer is
    SIGKILLed after round 2, and a new peer started without --stage takes the stage nobody hosts, takes the state
    stage 1's peer keeps (its round and digest, not the recipe's init), and the four stages average on from there."""
    _, maddr = swarm.bootstrap(recipe=Path(__file__).parent / "recipes" / "stages4.yaml")

    def join(name: str, *extra: str):
        return swarm.peer(maddr, "--max-memory", "6.5", *extra, name=name)

    peers = [join(f"stage{k}", "--stage", str(k)) for k in range(4)]
    for k, peer in enumerate(peers):
        peer.wait_for(rf"pipeline: keeping a backup of stage {(k + 1) % 4}'s state", 120)
    for peer in peers:
        peer.wait_event("averaged", 240, where=lambda e: e["round"] >= 2)
    keeper, victim = peers[1], peers[2]
    keeper.wait_for(r"pipeline: backup of stage 2: synced state of round ([2-9]|\d\d+), digest", 60)
    victim_id = victim.events("joined")[0]["peer_id"]
    victim.process.kill()
    victim.wait(30)
    deadline = time.monotonic() + 60
    while True:  # (its last record looks alive for FRESH_SECONDS: a peer placed meanwhile would count stage 2 hosted)
        result = swarm.run("status", "--initial-peers", maddr, "--json", timeout=60)
        seen = [p["last_seen_s"] for p in json.loads(result.stdout)["peers"] if p["peer_id"] == victim_id]
        if all(age > FRESH_SECONDS for age in seen):
            break
        assert time.monotonic() < deadline, seen  # (each status call takes a second or more: no pause between)
    last = {e["round"] + 1: e["digest"] for e in victim.events("averaged")}  # (its state after averaging round r)
    replacement = join("replacement")
    replacement.wait_for(r"pipeline: hosting stage 2 of 4", 120)
    synced = replacement.wait_event("synced", 120, reason="the stage's backup")
    kept = {int(r): d for r, d in re.findall(r"pipeline: backup of stage 2: synced state of round (\d+), digest (\w+)",
                                             keeper.output())}
    assert synced["round"] >= 2 and synced["digest"] == kept[synced["round"]], (synced, kept)
    assert last.get(synced["round"]) == synced["digest"], "the backup is the state the killed peer had at that round"
    replacement.wait_event("averaged", 240, where=lambda e: e["round"] > synced["round"])
    for peer in (peers[0], peers[1], peers[3]):
        assert peer.process.poll() is None, peer.output()[-3000:]
    for peer in (peers[0], peers[1], peers[3], replacement):
        peer.process.send_signal(signal.SIGTERM)
    for peer in (peers[0], peers[1], peers[3], replacement):
        assert peer.wait(90) == 0, peer.output()[-3000:]


def test_operators_see_each_stage_s_backup_round_until_its_keepers_leave():
    """`swarm-peer status` and the bootstrap's gauge show the round of each stage's state its keepers (the stage
    before's peers, the first's the last's) vouch for; none where they keep nothing or disagree, and the gauge's
    series goes when the backup does."""
    from prometheus_client import CollectorRegistry

    from swarm.dht.view import summarize_stages
    from swarm.monitoring.swarm_status import SwarmExporter, render_status

    now = 100.0
    stage0 = [_record("a", 6, "d6"), _record("b", 6, "d6")]  # (they keep stage 1)
    stage1 = [_record("c", 5, "e5"), _record("d", 9, "lie")]  # (they keep stage 0, and disagree)
    summary = summarize_stages([stage0, stage1], [(0, 1), (1, 2)], 0, 2, read_at=now)
    assert [t.backup_round for t in summary.stages] == [None, 6]
    text = render_status(summary, "r", "f" * 64)
    assert "backup of round 6" in next(line for line in text.splitlines() if "stage 1 blocks" in line)
    assert "backup" not in next(line for line in text.splitlines() if "stage 0 blocks" in line)
    registry = CollectorRegistry()
    exporter = SwarmExporter(registry)
    exporter.update(summary)
    assert registry.get_sample_value("swarm_stage_backup_round", {"stage": "1"}) == 6
    assert registry.get_sample_value("swarm_stage_backup_round", {"stage": "0"}) is None
    exporter.update(summarize_stages([[], stage1], [(0, 1), (1, 2)], 0, 2, read_at=now))
    assert registry.get_sample_value("swarm_stage_backup_round", {"stage": "1"}) is None, "its keepers left"


class _Joiner:
    """What CatchUp.join reads of a peer: the swarm's reference and live peers (its announcer), its state's round,
    the keepers' reference; `resync` is recorded and answers `works`."""

    def __init__(self, reference=(0, "", []), live=(), kept=(0, "", []), works=True, round_no=0):
        from swarm.dht.view import Reference
        from swarm.peer.state.catch_up import CatchUp

        announcer = type("A", (), {"swarm_reference": lambda _: Reference(*reference), "live": lambda _: list(live)})()
        diloco = type("D", (), {"round": round_no, "digest": lambda _: "ours"})()
        self.calls = []
        self.catch_up = CatchUp(loop=None, node=None, run_id="r", diloco=diloco, rounds=None, announcer=announcer,
                                metrics=None, events=None, on_synced=lambda: None,
                                kept=lambda: Reference(*kept))
        self.catch_up.resync = lambda holders, digest, reason: self.calls.append((holders, digest, reason)) or works


@pytest.mark.parametrize("case, expected", [
    # Every host of the stage gone: the keepers' newer state is taken, an older or equal one is not.
    (dict(kept=(4, "k4", ["a"])), [(["a"], "k4", "the stage's backup")]),
    (dict(kept=(4, "k4", ["a"]), round_no=4), []),
    (dict(kept=(0, "", [])), []),
    # The stage's peers are there: their state, and the keepers' only if it could not be taken from them.
    (dict(reference=(6, "s6", ["p"]), live=["p"], kept=(4, "k4", ["a"])), [(["p"], "s6", "joining")]),
    (dict(reference=(6, "s6", ["p"]), live=["p"], kept=(4, "k4", ["a"]), works=False),
     [(["p"], "s6", "joining"), (["a"], "k4", "the stage's backup")]),
    # Peers train but vouch for no state we follow (no quorum yet): not the keepers' over theirs.
    (dict(live=["p", "q"], kept=(4, "k4", ["a"])), []),
    # We hold the stage's state already.
    (dict(reference=(6, "ours", ["p"]), live=["p"], kept=(9, "k9", ["a"]), round_no=6), []),
])
def test_a_joiner_takes_the_keepers_state_only_when_its_stage_has_none_to_give(case, expected):
    joiner = _Joiner(**case)
    joiner.catch_up.join()
    assert joiner.calls == expected
