"""Multi-process: a bootstrap and peers through the real CLI on 127.0.0.1, read with `swarm-peer status --json`.
Peers appear with their fields, a SIGKILLed peer leaves within the record expiry, a SIGTERMed one is offline at
once, the bootstrap keeps its address across a restart, and hostile writes leave the original records intact."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import time
from pathlib import Path

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from conftest import MADDR
from swarm.config import Recipe, load_recipe
from swarm.dht.node import NetworkOptions, SwarmNode
from swarm.dht.records import ONLINE_STATES, RECIPE_KEY, peers_key, recipe_value
from swarm.dht.validation import Identity, owned_subkey
from swarm.peer.announcer import RECORD_TTL
from swarm.runtime import LoopThread

pytestmark = pytest.mark.slow
STATUS_RECIPE = Path(__file__).parent / "recipes" / "status.yaml"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def status(swarm, maddr: str) -> dict:
    result = swarm.run("status", "--initial-peers", maddr, "--json", timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def poll_status(swarm, maddr: str, condition, timeout: float, what: str) -> dict:
    """Read the swarm until `condition(view)` holds; fail with the last view after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        view = status(swarm, maddr)
        if condition(view):
            return view
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout} s: {what}; last status:\n{json.dumps(view, indent=1)}")


def by_id(view: dict) -> dict[str, dict]:
    return {p["peer_id"]: p for p in view["peers"]}


@contextlib.contextmanager
def honest_reader(maddr: str):
    """A read-only node with the swarm's validators, in this process: yields get(key) -> {subkey: value}."""
    loop = LoopThread()
    node = SwarmNode([maddr], NetworkOptions(client_mode=True))
    try:
        yield lambda key: loop.run(node.get(key), timeout=30)
    finally:
        node.shutdown()
        loop.close()


def test_hostile_writes_leave_records_and_recipe_intact(swarm):
    bootstrap, maddr = swarm.bootstrap()  # the tiny recipe
    victim_key = swarm.workdir / "victim.id"
    victim = swarm.peer(maddr, "--identity-path", str(victim_key), name="victim")
    victim_id = victim.wait_event("joined", 90)["peer_id"]
    before = poll_status(swarm, maddr, lambda v: by_id(v).get(victim_id, {}).get("state") in ONLINE_STATES, 60,
                         "the victim announced")
    genuine = by_id(before)[victim_id]
    victim_subkey = Identity.load_or_create(str(victim_key)).owned_subkey
    bootstrap_id = maddr.rsplit("/p2p/", 1)[1]
    attacker_identity = Identity.ephemeral()
    attacker = None
    with honest_reader(maddr) as read:
        [bootstrap_subkey] = read(RECIPE_KEY)
        assert bootstrap_subkey.startswith(bootstrap_id + "[owner:")
        try:
            # A raw hivemind node in the same DHT: it signs what names its own key and validates nothing else.
            attacker = hivemind.DHT(
                initial_peers=[maddr], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                identity_path=attacker_identity.path, check_if_identity_free=False, use_ipfs=False,
                nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False,
                record_validators=[RSASignatureValidator(attacker_identity.private_key)])
            key, later = peers_key("tiny-test"), get_dht_time() + 300
            fake = {**{k: v for k, v in genuine.items() if k not in ("peer_id", "last_seen_s")},
                    "state": "offline", "device_name": "HIJACKED", "round": 999}
            attacker_public = attacker_identity.public_key.decode()
            fake_recipe = recipe_value(Recipe(run_id="hijacked"))
            writes = [
                (key, fake, victim_subkey),  # the victim's own subkey, without its key
                (key, fake, owned_subkey(victim_id, attacker_public)),  # signed, but with the attacker's key
                (key, fake, victim_id),  # a plain subkey in the victim's name
                (key, "wipe", None),  # a plain value that would replace every announcement
                (RECIPE_KEY, fake_recipe, bootstrap_subkey),  # the owner's recipe entry
                (RECIPE_KEY, fake_recipe, None),  # a plain value over the whole recipe key
                (RECIPE_KEY, fake_recipe, owned_subkey(bootstrap_id, attacker_public)),
                # its own entry: allowed, not trusted; JSON nested deeper than Python's parser goes, which raised
                # RecursionError out of every peer's recipe fetch (join, status) before
                (RECIPE_KEY, {"json": "[" * 5000 + "]" * 5000, "digest": ""}, attacker_identity.owned_subkey),
            ]
            for write_key, value, subkey in writes:
                attacker.store(write_key, value, later, subkey=subkey)

            # Only the attacker's own recipe entry got in, beside the owner's; peers keep following the owner's.
            recipes = read(RECIPE_KEY)
            assert set(recipes) == {bootstrap_subkey, attacker_identity.owned_subkey}
            assert recipes[bootstrap_subkey]["digest"] == before["recipe_digest"]
            announcements = read(key)
            assert set(announcements) == {victim_subkey}, "no forged announcement got in"
            after = status(swarm, maddr)
            assert after["run_id"] == "tiny-test" and after["recipe_digest"] == before["recipe_digest"]
            assert [p["peer_id"] for p in after["peers"]] == [victim_id]
            record = by_id(after)[victim_id]
            assert record["state"] in ONLINE_STATES and record["device_name"] == genuine["device_name"] != "HIJACKED"
            assert record["round"] < 999
            late = swarm.peer(maddr, name="late")  # a peer that joins now follows the owner's recipe
            assert late.wait_for(r"run tiny-test \(recipe (\w+)\)", 90).group(1) == before["recipe_digest"][:12]
        finally:
            if attacker is not None:
                attacker.shutdown()
            attacker_identity.discard_file()


def test_status_kill_term_and_bootstrap_restart(swarm, cache_dir):
    started = time.monotonic()
    port = _free_port()
    boot_argv = ("--identity-path", str(swarm.workdir / "bootstrap.id"), "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}")
    bootstrap, maddr = swarm.bootstrap(*boot_argv, recipe=STATUS_RECIPE)
    assert maddr.startswith(f"/ip4/127.0.0.1/tcp/{port}/p2p/Qm")
    # The command it prints for its users names that address.
    assert bootstrap.wait_for(MADDR.pattern, 10).group(1) == maddr
    peers = [swarm.peer(maddr, name="peer0")]
    if not any(cache_dir.iterdir()):  # a cold cache: one peer fills it, rather than three training a tokenizer
        peers[0].wait_event("data_prepared", 90)
    peers += [swarm.peer(maddr, name=f"peer{i}") for i in (1, 2)]
    ids = [peer.wait_event("joined", 90)["peer_id"] for peer in peers]

    view = poll_status(swarm, maddr, lambda v: all(by_id(v).get(i, {}).get("state") == "training" for i in ids),
                       60, "three peers training")
    assert view["run_id"] == "status-test" and view["recipe_digest"] == load_recipe(STATUS_RECIPE).digest()
    assert view["peers_online"] == 3 and view["n_blocks"] == 2
    assert view["block_coverage"] == [3, 3] and view["uncovered_blocks"] == []
    assert view["digests_agree"] and view["majority_digest"]
    assert view["tokens_per_s"] == pytest.approx(sum(p["tokens_per_s"] for p in view["peers"]))
    for record in view["peers"]:
        assert record["run_id"] == "status-test" and record["version"]
        assert (record["block_start"], record["block_end"]) == (0, 2)
        assert record["device"] == "cpu" and record["device_name"] and record["device_memory"] > 1 << 20
        assert record["tokens_per_s"] > 0, "the start-up probe measures throughput before training does"
        assert record["bandwidth_up"] == record["bandwidth_down"] == 0.0  # nothing averaged yet
        assert record["round"] == 0 and record["digest"] == view["majority_digest"]
        assert 0 <= record["last_seen_s"] < 15

    # kill -9 (the whole process group, as a pulled cable would): its record stays until it expires.
    killed, stopped, survivor = ids
    peers[0].kill()
    killed_at = time.monotonic()

    # A clean stop announces offline at once, long before any expiry.
    peers[1].process.send_signal(signal.SIGTERM)
    assert peers[1].wait(30) == 0, peers[1].output()[-3000:]
    view = poll_status(swarm, maddr, lambda v: by_id(v).get(stopped, {}).get("state") == "offline", 10,
                       "the stopped peer offline")
    assert time.monotonic() - killed_at < RECORD_TTL
    assert by_id(view)[survivor]["state"] == "training"
    assert by_id(view)[killed]["state"] == "training", "a vanished peer stays listed until its record expires"

    # The bootstrap restarts with the same identity at the same address and finds the swarm again.
    bootstrap.process.send_signal(signal.SIGTERM)
    assert bootstrap.wait(30) == 0
    deadline = time.monotonic() + 15
    while bootstrap.session_alive() and time.monotonic() < deadline:  # its p2pd must free the port
        time.sleep(0.1)
    restarted, maddr_again = swarm.bootstrap(*boot_argv, recipe=STATUS_RECIPE, name="bootstrap-restarted")
    assert maddr_again == maddr

    view = poll_status(swarm, maddr, lambda v: killed not in by_id(v)
                       and by_id(v).get(survivor, {}).get("state") == "training",
                       RECORD_TTL + 20 - (time.monotonic() - killed_at),
                       "the killed peer gone and the survivor seen through the restarted bootstrap")
    gone_after = time.monotonic() - killed_at
    assert gone_after < RECORD_TTL + 20
    assert view["peers_online"] == 1 and view["block_coverage"] == [1, 1]
    print(f"killed peer gone after {gone_after:.1f} s; test took {time.monotonic() - started:.1f} s")
