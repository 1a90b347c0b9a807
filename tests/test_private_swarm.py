"""A private swarm with real processes: invited peers (one by token, one on the bootstrap's allowlist) train and
average together, while peers without an invite can take no part: `join` stops with one line saying what to do,
and an attacker that writes a peer record and matchmaking entries with its own key (and a forged invite) and opens
all-reduce streams is in nobody's view, in no group, and its streams are refused."""

from __future__ import annotations

import json
import time

import pytest

from conftest import kill_session
from swarm.dht.validation import Identity
from swarm.events import read_events
from test_attacks import start_attacker

pytestmark = pytest.mark.slow
ROUNDS = 4


def test_only_invited_peers_take_part_in_a_private_swarm(swarm, tmp_path, cache_dir):
    keys = {name: tmp_path / f"{name}.key" for name in ("owner", "alice", "bob", "stranger")}
    ids = {name: Identity.load_or_create(str(path)).peer_id for name, path in keys.items()}
    allowlist = tmp_path / "allowlist.txt"
    allowlist.write_text(f"# admitted without a token\n{ids['bob']}\n")
    _, maddr = swarm.bootstrap("--private", "--identity-path", str(keys["owner"]), "--allowlist", str(allowlist))
    invite = swarm.run("invite", ids["alice"], "--identity-path", str(keys["owner"]), "--run-id", "tiny-test")
    assert invite.returncode == 0, invite.stderr
    attacker, attacker_events = start_attacker(swarm, maddr, "uninvited", cache_dir)
    try:
        stranger = swarm.peer(maddr, "--identity-path", str(keys["stranger"]), name="stranger")
        honest = [swarm.peer(maddr, "--identity-path", str(keys["alice"]), "--invite", invite.stdout.strip(),
                             "--until-round", str(ROUNDS), name="alice"),
                  swarm.peer(maddr, "--identity-path", str(keys["bob"]), "--until-round", str(ROUNDS), name="bob")]

        assert stranger.wait(120) == 2, stranger.output()[-3000:]
        errors = [line for line in stranger.lines if "ERROR" in line]
        assert len(errors) == 1 and "this run is private: ask the run owner for an invite (swarm-peer invite " \
            f"{ids['stranger']})" in errors[0], stranger.output()[-3000:]
        assert not stranger.events("training")

        # The attacker enters once the honest peers announce a state, and opens a stream to each of them.
        deadline = time.monotonic() + 150
        while {e["peer_id"] for e in read_events(attacker_events) if e["event"] == "stream"} != \
                {ids["alice"], ids["bob"]}:
            assert time.monotonic() < deadline and all(p.process.poll() is None for p in honest), \
                "the attacker never opened streams to both honest peers"
            time.sleep(0.5)
        status = swarm.run("status", "--initial-peers", maddr, "--json")
        assert status.returncode == 0, status.stderr
        listed = {p["peer_id"] for p in json.loads(status.stdout)["peers"]}
        assert listed == {ids["alice"], ids["bob"]}, f"the swarm's view lists {listed}"

        for peer in honest:
            assert peer.wait(240) == 0, peer.output()[-3000:]
        attacker_id = next(e for e in read_events(attacker_events) if e["event"] == "ready")["peer_id"]
        lies = [e for e in read_events(attacker_events) if e["event"] == "attacking"]
    finally:
        kill_session(attacker)
    assert lies, "the attacker never wrote its record and entries: the test proves nothing"
    for peer in honest:
        averaged = peer.events("averaged")
        assert averaged and all(e["members"] == sorted([ids["alice"], ids["bob"]]) for e in averaged), averaged
        assert f"refused a swarm.tiny-test.allreduce stream from {attacker_id}" in peer.output(), \
            f"{peer.name} did not refuse the attacker's stream"
        assert not peer.events("bad_peer"), "the attacker's data never reached an all-reduce"
