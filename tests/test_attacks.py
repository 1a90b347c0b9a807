"""Attacks by a participating peer, with real processes (scripts/attackers.py is the attacker; one key, one
process, lying where it can). What honest peers end with is checked, not what the attacker was told."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import kill_session
from swarm.averaging.aggregate import capped_weights, centered_clip_radius
from swarm.averaging.faults import SCALE
from swarm.averaging.partition import partition
from swarm.events import read_events
from test_swarm import _traces

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def start_attacker(swarm, maddr: str, scenario: str, cache_dir: Path, name: str = "") -> tuple[subprocess.Popen, Path]:
    """The attacker, once it is ready to attack (it prepares the run's data first, and with it the tokenizer
    cache the honest peers then share)."""
    events = swarm.workdir / f"attacker-{scenario}{name}.events.jsonl"
    log_path = swarm.workdir / f"attacker-{scenario}{name}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "attackers.py"), "--initial-peers", maddr,
                                    "--scenario", scenario, "--cache-dir", str(cache_dir), "--events-file",
                                    str(events), "--seconds", "600"], stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 180
    while not any(e["event"] == "ready" for e in read_events(events)):
        if process.poll() is not None or time.monotonic() > deadline:
            kill_session(process)
            raise AssertionError(f"the attacker did not get ready:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    return process, events


def test_a_forged_reference_moves_no_honest_peer(swarm, cache_dir):
    """Two colluding attackers announce the swarm's round + 1 with the same random params of their own, and serve
    them to whoever asks. Without a quorum every peer re-synced to that state at once; with the quorum of live peers
    alone (two, after a group of three), these two still led all three honest peers away (the attack bench measured
    15 forged syncs and +16% loss); held to a majority of the group each averaged in, no honest peer takes it, and
    the honest swarm trains on to bit-identical params."""
    rounds = 8
    _, maddr = swarm.bootstrap()
    # The attackers are ready first, and lie from the moment two honest peers vouch for a state (alone with one
    # honest peer they would be followed: a swarm of two follows its other peer).
    attackers = [start_attacker(swarm, maddr, "forged-reference", cache_dir, name=str(i)) for i in range(2)]
    try:
        honest = [swarm.peer(maddr, "--until-round", str(rounds), name=f"honest{i}") for i in range(3)]
        for peer in honest:
            assert peer.wait(300) == 0, peer.output()[-3000:]
        lies = [[e for e in read_events(events) if e["event"] == "attacking"] for _, events in attackers]
    finally:
        for attacker, _ in attackers:
            kill_session(attacker)
    assert all(lies), "an attacker never got to lie: the test proves nothing"
    forged = {e["digest"] for told in lies for e in told}
    assert {e["digest"] for e in lies[0]} & {e["digest"] for e in lies[1]}, "the two colluded on one state"
    lies = lies[0]
    assert len({e["round"] for e in lies}) >= 2, "it kept a round ahead of the swarm as the swarm moved on"
    for peer in honest:
        taken = [e for e in peer.events("synced") if e["digest"] in forged]
        assert not taken, f"{peer.name} took the attacker's state: {taken}"
    finals = [peer.events("averaged", round=rounds - 1) for peer in honest]
    assert all(finals) and len({f[0]["digest"] for f in finals}) == 1, "the honest peers end bit-identical"


def test_a_scaled_pseudo_gradient_moves_the_average_a_bounded_way(swarm):
    """One of four members sends its pseudo-gradient x1000 (well-formed, finite, an honest weight) every round.
    With the default aggregator (centered_clip) the average every member applies moves from the honest members'
    own mean, part by part, by at most the attacker's weight times the part's radius, plus the honest members'
    weighted excess over the radius, over the honest weight (CenteredClip's fixed point). The plain mean would move
    over 20 times as far; the honest members end bit-identical and nobody's contribution is dropped."""
    rounds = 3
    _, maddr = swarm.bootstrap(recipe=ROOT / "tests" / "recipes" / "four.yaml")  # every round waits for all four
    names = ["honest0", "honest1", "honest2", "attacker"]
    peers = [swarm.peer(maddr, "--until-round", str(rounds), "--trace-dir", str(swarm.workdir / name),
                        *(["--inject-fault", "scaled@0"] if name == "attacker" else []), name=name)
             for name in names]
    for peer in peers:
        assert peer.wait(300) == 0, peer.output()[-3000:]
    traces = {name: _traces(swarm.workdir / name) for name in names}
    attacker_id = peers[3].events("joined")[0]["peer_id"]
    attacked, lies = 0, []
    for round_no in range(rounds):
        entries = {name: traces[name][round_no] for name in names if round_no in traces[name]}
        honest = [entries[n] for n in names[:3] if n in entries]
        assert len(honest) == 3, f"round {round_no}: every honest peer averaged"
        metas, tensors = zip(*honest)
        assert all(torch.equal(t["global_after"], tensors[0]["global_after"]) for t in tensors)
        if attacker_id not in metas[0]["members"]:
            continue  # (a round it missed: nothing to measure)
        attacked += 1
        lie_meta, lie = entries["attacker"]
        # The weights as every reducer counts them (capped at 1.5x the lower median of the group's).
        *weights, lie_weight = capped_weights([m["weight"] for m in metas] + [lie_meta["weight"]])
        honest_mean = sum(t["pseudo_gradient"] * w for t, w in zip(tensors, weights)) / sum(weights)
        spread = max(float((t["pseudo_gradient"] - honest_mean).norm()) for t in tensors)
        pairs = sum(float((a["pseudo_gradient"] - b["pseudo_gradient"]).norm()) ** 2
                    for i, a in enumerate(tensors) for b in tensors[i + 1:])
        norms = sum(float(t["pseudo_gradient"].norm()) ** 2 for t in tensors)
        # At CenteredClip's fixed point v, W_h (honest mean - v) = sum_h w_i excess_i - w_a clip_tau(lie - v), part
        # by part: the lie pulls by at most its weight times the part's radius tau, and an honest member that the
        # pulled centre leaves more than tau away is clipped too and pulls further, by its excess over tau. Each
        # part's tau is the one its reducer computed (centered_clip_radius of the four parts as sent; the lie is
        # first cut to the group's norm cap, so it can land nearer the medoid than an honest member, and a bound
        # from the honest distances alone, used before, was exceeded once: moved 0.632 against 0.587).
        pulled = excess = 0.0
        for start, end in partition(tensors[0]["average"].numel(), metas[0]["shares"]):
            parts = [t["pseudo_gradient"][start:end] for t in tensors] + [SCALE * lie["pseudo_gradient"][start:end]]
            tau = centered_clip_radius(parts, [m["weight"] for m in metas] + [lie_meta["weight"]])[2]
            centre = tensors[0]["average"][start:end]
            pulled += (lie_weight * tau) ** 2
            excess += sum(w * max(float((x - centre).norm()) - tau, 0.0) for x, w in zip(parts, weights)) ** 2
        bound = (math.sqrt(pulled) + math.sqrt(excess)) / sum(weights)
        with_lie = (honest_mean * sum(weights) + SCALE * lie["pseudo_gradient"] * lie_weight) \
            / (sum(weights) + lie_weight)
        moved = float((tensors[0]["average"] - honest_mean).norm())
        assert moved <= 1.01 * bound, f"round {round_no}: moved {moved:.4g}, bound {bound:.4g} (honest spread " \
            f"{spread:.4g}, squared distances {pairs:.4g}, squared norms {norms:.4g})"
        lies.append(float((with_lie - honest_mean).norm()) / max(bound, 1e-12))
    assert attacked >= 2, "the attacker took part in too few rounds to show anything"
    # (A round in which the attacker had trained little lies little: its pseudo-gradient and weight are small.)
    assert max(lies) > 20, f"the lie was never big enough to matter: {lies}"


def test_a_lying_reducer_is_caught_and_no_honest_peer_applies_its_part(swarm):
    """One of four peers reduces its part of every average x1000 and makes up its own verification term to hide it
    as best it can (fault lying-reducer). Every honest member refuses such an average and accuses it; the retry
    without it averages the honest three. No average an honest peer applied ever had it as a member, and the
    honest peers end bit-identical."""
    rounds = 3
    _, maddr = swarm.bootstrap(recipe=ROOT / "tests" / "recipes" / "liar.yaml")
    names = ["honest0", "honest1", "honest2"]
    # The liar is training before the others start, so the honest peers' rounds wait for it (as test_faults does).
    liar = swarm.peer(maddr, "--until-round", str(rounds), "--inject-fault", "lying-reducer@0", name="liar")
    liar.wait_event("training", 120, round=0)
    peers = [swarm.peer(maddr, "--until-round", str(rounds), "--trace-dir", str(swarm.workdir / name), name=name)
             for name in names]
    for peer in peers:
        assert peer.wait(300) == 0, peer.output()[-3000:]
    liar.process.kill()
    liar_id = liar.events("joined")[0]["peer_id"]
    caught = [e for peer in peers for e in peer.events("averaging_failed", reason="unverified")
              if liar_id in e["rejected"]]
    assert caught, "no honest peer caught the lie: the liar never reduced in a group with them"
    for name in names:
        traces = _traces(swarm.workdir / name)
        assert traces, f"{name} averaged nothing"
        for round_no, (meta, _) in traces.items():
            assert liar_id not in meta["members"], f"{name} applied round {round_no}'s average with the liar"
    finals = [peer.events("averaged", round=rounds - 1) for peer in peers]
    assert all(finals) and len({f[0]["digest"] for f in finals}) == 1, "the honest peers end bit-identical"


def test_a_plain_value_under_a_rounds_key_does_not_stop_its_group_forming():
    """An attacker's node without our validators stores a plain value, living an hour, under round 1's
    matchmaking key: on nodes that accepted it, it would replace the entries and keep new ones out until it
    expires. Every honest node refuses it, on store and in answers, and two honest nodes form their group."""
    import asyncio

    import hivemind
    from hivemind.utils import get_dht_time

    from swarm.averaging.matchmaking import Candidate, form_group
    from swarm.dht.node import NetworkOptions, SwarmNode
    from swarm.dht.records import group_key
    from swarm.runtime import LoopThread

    loop, nodes, attacker = LoopThread(), [], None
    try:
        nodes.append(SwarmNode([], NetworkOptions()))
        attacker = hivemind.DHT(initial_peers=nodes[0].visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                use_ipfs=False, use_relay=False, use_auto_relay=False, auto_nat=False,
                                nat_port_map=False, start=True)
        nodes.append(SwarmNode(nodes[0].visible_maddrs(), NetworkOptions()))
        key = group_key("wipe-run", 1, 0)
        attacker.store(key, "wiped", get_dht_time() + 3600)
        assert attacker.get(key, latest=True).value == "wiped", "the attacker's own node holds it"
        assert loop.run(nodes[1].get(key)) == {}, "no honest node stores or takes it"
        ids = {node.peer_id for node in nodes}

        async def match(node):
            return await form_group(node, "wipe-run", 1, 0, Candidate("digest", 1.0, False), ids - {node.peer_id},
                                    2, 4, 20.0)

        async def both():
            return await asyncio.gather(*(match(node) for node in nodes))

        results = loop.run(both(), timeout=60)
        assert all(group is not None and set(group.members) == ids for group, _ in results), results
    finally:
        if attacker is not None:
            attacker.shutdown()
        for node in nodes:
            node.shutdown()
        loop.close()


def test_a_thousand_sybil_records_leave_honest_peers_seeing_each_other_and_averaging(swarm, cache_dir):
    """One attacker process makes 1000 keys and, before any honest peer joins, writes a valid signed ~7 kB record
    for each under the run's peers key (7 MB: past hivemind's 2 MiB message limit, so a node that kept them all
    could answer no read of the key, and a node joining later saw nobody). Nodes keep at most 1.5 MiB under a key,
    and a peer's own record pushes out relayed ones: two honest peers find each other and average a round, and a
    node joining afterwards reads both of them within seconds."""
    from swarm.dht.node import NetworkOptions, SwarmNode
    from swarm.dht.records import parse_peer_records, peers_key
    from swarm.runtime import LoopThread

    _, maddr = swarm.bootstrap()
    attacker, attacker_events = start_attacker(swarm, maddr, "sybils", cache_dir)
    try:
        deadline = time.monotonic() + 120
        while not (written := [e for e in read_events(attacker_events) if e["event"] == "attacking"]):
            assert attacker.poll() is None and time.monotonic() < deadline, "the attacker wrote no records"
            time.sleep(0.2)
        assert written[0]["written"] == 1000, written
        honest = [swarm.peer(maddr, "--until-round", "1", name=f"honest{i}") for i in range(2)]
        for peer in honest:
            assert peer.wait(300) == 0, peer.output()[-3000:]
        ids = {peer.events("joined")[0]["peer_id"] for peer in honest}
        for peer in honest:
            assert ids <= set(peer.events("averaged", round=0)[0]["members"]), "the two averaged together"
        loop, reader = LoopThread(), SwarmNode([maddr], NetworkOptions())
        try:
            started = time.monotonic()
            raw = loop.run(reader.get(peers_key("tiny-test")), timeout=60)
            took = time.monotonic() - started
        finally:
            reader.shutdown()
            loop.close()
    finally:
        kill_session(attacker)
    records, _ = parse_peer_records(raw)
    assert ids <= {r.peer_id for r in records}, f"a later node reads the honest peers ({len(records)} records)"
    assert took < 10, f"the read took {took:.1f} s"
    print(f"nodes accepted {written[0]['accepted']} of 1000 Sybil records; a later node read {len(records)} records "
          f"({len(records) - len(ids)} Sybils) in {took:.2f} s")
