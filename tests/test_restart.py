"""Checkpoints end to end: a swarm that stops completely and restarts resumes from the newest checkpoint any peer
has; Ctrl-C (SIGINT) stops a peer cleanly with a loadable checkpoint."""

from __future__ import annotations

import signal
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarm.dht.validation import Identity
from swarm.peer.state.checkpoint import load_latest
from swarm.peer.stream import peer_id_hash

pytestmark = pytest.mark.slow


def test_whole_swarm_restarts_from_newest_checkpoint(swarm):
    _, maddr = swarm.bootstrap(name="bootstrap1")
    ckpt = [swarm.workdir / f"ckpt{i}" for i in range(2)]
    first = [swarm.peer(maddr, "--until-round", "2", "--checkpoint-dir", str(ckpt[i]), name=f"first{i}")
             for i in range(2)]
    for peer in first:
        assert peer.wait(180) == 0, peer.output()[-3000:]
    saved = [load_latest(c) for c in ckpt]
    assert [c.round for c in saved] == [2, 2] and saved[0].meta["digest"] == saved[1].meta["digest"]

    # Everything stops (the bootstrap too), then the swarm comes back: a new bootstrap, the same checkpoint dirs.
    swarm_bootstrap = swarm.bootstrap(name="bootstrap2")
    maddr = swarm_bootstrap[1]
    second = [swarm.peer(maddr, "--until-round", "3", "--checkpoint-dir", str(ckpt[i]), name=f"second{i}")
              for i in range(2)]
    for peer in second:
        assert peer.wait(180) == 0, peer.output()[-3000:]
        resumed = peer.events("resumed", round=2, where=lambda e: "round-00000002" in e["path"])
        assert resumed or peer.events("synced", round=2), peer.output()[-2000:]
        assert peer.events("averaged", round=2, group_size=2), "training went on from round 2, losing nothing"
    assert [load_latest(c).round for c in ckpt] == [3, 3]


def test_a_peer_back_a_few_rounds_behind_replays_them_instead_of_downloading_the_state(swarm):
    """A peer leaves at round 2 (its checkpoint holds that state); the other two go on; restarted, it asks them
    for the outer steps they took since its state and replays them (int8 averages: a byte a param, against the
    eight of params and momentum), checking the state digest after each, and then averages with them again."""
    _, maddr = swarm.bootstrap(recipe=Path(__file__).parent / "recipes" / "replay.yaml")
    rounds, checkpoints = 6, swarm.workdir / "ckpt"  # back in round 3 or 4: two or three rounds together
    others = [swarm.peer(maddr, "--until-round", str(rounds), name=f"stays{i}") for i in range(2)]
    leaving = swarm.peer(maddr, "--until-round", "2", "--checkpoint-dir", str(checkpoints), name="leaving")
    assert leaving.wait(180) == 0, leaving.output()[-3000:]
    assert load_latest(checkpoints).round == 2
    others[0].wait_event("averaged", 120, round=2, group_size=2)  # the swarm went on without it
    back = swarm.peer(maddr, "--until-round", str(rounds), "--checkpoint-dir", str(checkpoints), "--metrics-port",
                      "0", "--replay-log-mb", "0.5", name="back")
    assert back.wait_event("model", 60)["replay_log_bytes"] == 500_000, "--replay-log-mb reached the peer"
    port = back.wait_event("metrics", 60)["port"]
    back.wait_event("resumed", 120, round=2)
    synced = back.wait_event("synced", 120, how="replay")
    assert synced["round"] >= 3 and synced["replayed"] == synced["round"] - 2, synced
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        metrics = {(s.name, s.labels.get("how")): s.value for family in
                   text_string_to_metric_families(response.read().decode()) for s in family.samples}
    assert metrics[("swarm_resyncs_total", "replay")] == 1 and metrics[("swarm_resyncs_total", "download")] == 0
    assert 0 < metrics[("swarm_resync_bytes_total", "replay")] < 1.3e6, "a fraction of the 1.3 MB state"
    for peer in [*others, back]:
        assert peer.wait(180) == 0, peer.output()[-3000:]
    assert not back.events("synced", how="download")
    last = [p.events("averaged", round=rounds - 1, group_size=3) for p in [*others, back]]
    assert all(last) and len({events[0]["digest"] for events in last}) == 1, "the three end with the same params"


def test_ctrl_c_stops_cleanly_with_a_checkpoint(swarm):
    _, maddr = swarm.bootstrap()
    peers = [swarm.peer(maddr, "--checkpoint-dir", str(swarm.workdir / f"ckpt{i}"), name=f"peer{i}")
             for i in range(2)]
    for peer in peers:
        peer.wait_event("averaged", 180, round=1, group_size=2)
    peers[0].process.send_signal(signal.SIGINT)
    assert peers[0].wait(60) == 0, peers[0].output()[-2000:]
    assert peers[0].events("stopping", signal=2) and "Traceback" not in peers[0].output()
    assert not peers[0].session_alive(), "p2pd and the DHT process must exit with the peer"
    checkpoint = load_latest(swarm.workdir / "ckpt0")
    assert checkpoint is not None and checkpoint.round >= 2


def test_a_joiner_reads_where_no_peer_does_and_a_restart_keeps_its_place(swarm):
    """A new peer starts its data stream inside the widest run of shards that no live peer reads (peers hashed
    their ids to a shard, and two of ten then shared one about half the time, training on identical batches). A
    restarted peer goes on where its checkpoint left its stream."""
    _, maddr = swarm.bootstrap()
    # Without a checkpoint of this run or --data-shard, a peer's start is chosen inside the widest unread run.
    first = swarm.peer(maddr, "--until-round", "3", name="first")
    assert first.wait_event("data", 120, step=0, resumed=False)["others_reading"] == [], \
        "the first peer sees nobody reading"
    first.wait_event("training", 60, round=0)
    checkpoints = swarm.workdir / "ckpt"
    joiner = swarm.peer(maddr, "--until-round", "3", "--checkpoint-dir", str(checkpoints), name="joiner")
    chose = joiner.wait_event("data", 120, step=0, resumed=False)
    [reading] = chose["others_reading"]  # exactly one shard: the one the first peer announced
    start = chose["shard"]
    assert min((start - reading) % 64, (reading - start) % 64) >= 16, (start, reading)
    for peer in (first, joiner):
        assert peer.wait(180) == 0, peer.output()[-3000:]
    saved = load_latest(checkpoints)
    steps = saved.meta["data_step"]
    assert saved.round == 3 and saved.meta["data_shard"] == start and steps > 0, saved.meta

    again = swarm.peer(maddr, "--until-round", "3", "--checkpoint-dir", str(checkpoints), name="again")
    again.wait_event("data", 120, shard=start, step=steps, resumed=True)  # where our checkpoint says
    assert again.wait(60) == 0, again.output()[-3000:]


def _move(data_moved: dict) -> tuple[str, int, int]:
    """(the peer we moved away from, the shard we both started at, our new start) of a `data_moved` event."""
    return data_moved["rival"], data_moved["from_shard"], data_moved["shard"]


def test_peers_whose_streams_start_at_one_shard_part(swarm):
    """Two peers whose ids hash to one shard join at the same moment. If each chose before the other announced a
    shard, both start there and read identical batches: the one whose id hashes higher moves to a new stream. If
    one saw the other's shard, it started elsewhere. Either way they end on different streams."""
    keys: dict[int, Identity] = {}
    for i in range(400):  # about 10 keys until two share a shard (64 of them): the birthday bound
        identity = Identity.load_or_create(str(swarm.workdir / f"id{i}.key"))
        shard = peer_id_hash(identity.peer_id) % 64
        if shard in keys:
            twins = sorted([keys[shard], identity], key=lambda k: peer_id_hash(k.peer_id))
            break
        keys[shard] = identity
    _, maddr = swarm.bootstrap()
    peers = [swarm.peer(maddr, "--until-round", "8", "--identity-path", twin.path, "--checkpoint-dir",
                        str(swarm.workdir / f"ckpt{i}"), name=f"twin{i}") for i, twin in enumerate(twins)]
    for peer in peers:
        assert peer.wait(180) == 0, peer.output()[-3000:]
    # (fresh checkpoint dirs and no --data-shard: each start is chosen inside the widest unread run)
    chose = [peer.events("data", step=0, resumed=False)[0] for peer in peers]
    chose = [(e["shard"], e["others_reading"]) for e in chose]
    moved = [[_move(e) for e in peer.events("data_moved")] for peer in peers]
    blind = [reading == [] for _, reading in chose]
    print("choices", chose, "moves", moved)
    if all(blind):  # both took the shard their ids hash to: the same one
        assert chose[0][0] == chose[1][0] == shard
        assert moved[0] == [] and len(moved[1]) == 1, "exactly one moves: the one whose id hashes higher"
        assert moved[1][0][:2] == (twins[0].peer_id, shard) and moved[1][0][2] != shard
    else:
        assert moved == [[], []], "a peer that saw the other's shard started elsewhere: nobody needs to move"
    starts = [load_latest(swarm.workdir / f"ckpt{i}").meta["data_shard"] for i in range(2)]
    assert starts[0] != starts[1], starts
