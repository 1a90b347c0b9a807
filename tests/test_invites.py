"""Invites bound to one run, and the owner's signed revocation list: an invite for one run admits to no other, an
older token that names no run is refused with one line, a revoked peer is refused once a node has seen the owner's
list (and admitted again by an invite signed after it), a list not signed by the owner changes nothing, and an older
list never replaces a newer one. In memory, then with a real private bootstrap that publishes what `swarm-peer
revoke` wrote."""

from __future__ import annotations

import base64
import time
from dataclasses import replace

import msgpack
import pytest
from conftest import ask_echo, echo_handler, wait_until
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

from swarm.cli import main
from swarm.dht import admission as admission_module
from swarm.dht.admission import (INVITE_FIELD, REVOCATION_FIELD, Admission, AdmissionError, AdmissionValidator,
                                 Invite, InviteError, Revocation, load_revocation, revocation_file)
from swarm.dht.validation import Identity

RUN_A, RUN_B = "run-a", "run-b"
ENTRY = {"digest": "d", "bandwidth": 1.0}


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Identity]:
    """An owner, two invited peers and a rival who would like to be the owner (RSA keys take a moment each)."""
    directory = tmp_path_factory.mktemp("keys")
    return {name: Identity.load_or_create(str(directory / f"{name}.key"))
            for name in ("owner", "alice", "bob", "rival")}


def admission(keys, run_id: str = RUN_A) -> Admission:
    return Admission(keys["owner"].peer_id, keys["owner"].public_key.decode(), run_id)


def token(keys, peer: str, run_id: str = RUN_A, now: float | None = None) -> str:
    return Invite.sign(keys["owner"], run_id, keys[peer].peer_id, days=1, now=now).token()


def record(writer: Identity, value, key: str = "swarm.run-a.group.3.0") -> DHTRecord:
    """An entry as hivemind's validators see it after the signature check: serialized subkey and value."""
    return DHTRecord(key=DHTID.generate(source=key).to_bytes(),
                     subkey=DHTProtocol.serializer.dumps(writer.owned_subkey), value=DHTProtocol.serializer.dumps(value), expiration_time=time.time() + 60)


def owner_entry(revocation: Revocation) -> dict:
    return {REVOCATION_FIELD: revocation.pack()}


def test_an_invite_for_one_run_is_refused_in_another(keys):
    alice = keys["alice"]
    invite = token(keys, "alice", RUN_A)
    assert admission(keys, RUN_A).admits(alice.peer_id, invite)
    other_run = admission(keys, RUN_B)
    assert not other_run.admits(alice.peer_id, invite) and not other_run.admits(alice.peer_id)
    assert not other_run.entry_admitted(alice.peer_id, {**ENTRY, INVITE_FIELD: invite})
    validator = AdmissionValidator(keys["owner"].peer_id, keys["owner"].public_key.decode(), RUN_B)
    assert not validator.validate(record(alice, {**ENTRY, INVITE_FIELD: invite}))
    with pytest.raises(AdmissionError) as refused:
        other_run.join_with(alice, invite)
    assert "\n" not in str(refused.value)
    assert f"it was made for run {RUN_A}, not for this run {RUN_B}" in str(refused.value)
    forged = replace(Invite.parse(invite), run_id=RUN_B).token()  # the run id is under the owner's signature
    assert not other_run.admits(alice.peer_id, forged)


def test_a_token_of_the_older_form_is_refused_with_one_line_saying_what_to_do(keys):
    """Tokens of before invites named their run: (owner, peer id, expiry, signature), valid for any run."""
    owner, alice = keys["owner"], keys["alice"]
    expires = int(time.time() + 86400)
    message = b"swarm invite v1\x00" + msgpack.packb([owner.peer_id, alice.peer_id, expires])
    signature = base64.b64decode(owner.private_key.sign(message))
    old = base64.urlsafe_b64encode(msgpack.packb([owner.peer_id, alice.peer_id, expires, signature]))
    old = old.rstrip(b"=").decode()
    with pytest.raises(InviteError, match="an invite of an older swarm-peer"):
        Invite.parse(old)
    run = admission(keys)
    assert not run.admits(alice.peer_id, old)
    with pytest.raises(AdmissionError) as refused:
        run.join_with(alice, old)
    assert "\n" not in str(refused.value) and "older swarm-peer" in str(refused.value)
    assert f"ask the run owner for a new invite (swarm-peer invite {alice.peer_id} --run-id {RUN_A})" in \
        str(refused.value)


def test_a_revoked_peer_is_refused_once_the_list_is_seen(keys):
    owner, alice, bob = keys["owner"], keys["alice"], keys["bob"]
    run = admission(keys)
    validator = AdmissionValidator(owner.peer_id, owner.public_key.decode(), RUN_A)
    invites = {peer: token(keys, peer, now=time.time() - 60) for peer in ("alice", "bob")}
    assert run.admits(alice.peer_id, invites["alice"]) and run.admits(alice.peer_id)
    revocation = Revocation.sign(owner, RUN_A, [alice.peer_id])
    assert run.admits(alice.peer_id, invites["alice"]), "not before the list is seen"

    assert run.follow_entries({owner.owned_subkey: owner_entry(revocation)})
    assert validator.validate(record(owner, owner_entry(revocation))), "the owner's entry itself is fine"
    for check in (run, validator.admission):
        assert not check.admits(alice.peer_id, invites["alice"]) and not check.admits(alice.peer_id)
        assert not check.entry_admitted(alice.peer_id, {**ENTRY, INVITE_FIELD: invites["alice"]})
        assert check.admits(bob.peer_id, invites["bob"]), "only the peers it names"
    assert not validator.validate(record(alice, {**ENTRY, INVITE_FIELD: invites["alice"]}))
    with pytest.raises(AdmissionError, match="your invite does not admit you: the owner revoked it on"):
        run.join_with(alice, invites["alice"])

    again = token(keys, "alice", now=time.time() + 2)  # signed after the revocation: the owner invites it again
    assert run.admits(alice.peer_id, again) and run.entry_admitted(alice.peer_id, {**ENTRY, INVITE_FIELD: again})
    assert not run.admits(alice.peer_id, invites["alice"]), "its earlier invites stay void"


def test_a_list_not_signed_by_the_owner_is_ignored(keys):
    owner, alice, rival = keys["owner"], keys["alice"], keys["rival"]
    run = admission(keys)
    invite = token(keys, "alice", now=time.time() - 60)
    rivals = Revocation.sign(rival, RUN_A, [alice.peer_id])
    in_owners_name = replace(rivals, owner=owner.peer_id)  # signed by the rival, claiming to be the owner's
    other_run = Revocation.sign(owner, RUN_B, [alice.peer_id])  # the owner's, but for another of its runs
    for forged in (rivals, in_owners_name, other_run):
        assert not run.follow(forged.pack())
    assert not run.follow_entries({rival.owned_subkey: owner_entry(in_owners_name)}), "under the rival's subkey"
    assert not run.entry_admitted(rival.peer_id, owner_entry(in_owners_name))
    validator = AdmissionValidator(owner.peer_id, owner.public_key.decode(), RUN_A)
    assert not validator.validate(record(rival, owner_entry(in_owners_name)))
    assert validator.validate(record(owner, owner_entry(in_owners_name))), "the owner's entry, a bad list in it"
    for check in (run, validator.admission):
        assert check.revocation is None and check.admits(alice.peer_id, invite)
    with pytest.raises(InviteError, match="not a revocation list"):
        Revocation.unpack(b"\x93garbage")


def test_an_older_list_does_not_undo_a_newer_one(keys):
    owner, alice, bob = keys["owner"], keys["alice"], keys["bob"]
    invites = {peer: token(keys, peer, now=time.time() - 60) for peer in ("alice", "bob")}
    first = Revocation.sign(owner, RUN_A, [alice.peer_id])
    second = Revocation.sign(owner, RUN_A, [bob.peer_id], previous=first)
    behind = Revocation.sign(owner, RUN_A, [], previous=second, now=time.time() - 3600)
    assert second.issued > first.issued and behind.issued > second.issued, "the owner's clock going back or not"
    assert set(second.revoked) == {alice.peer_id, bob.peer_id}
    unrelated_older = Revocation.sign(owner, RUN_A, [], now=time.time() - 7200)  # an empty list, issued earlier

    run = admission(keys)
    assert run.follow(second.pack())
    assert not run.follow(first.pack()) and not run.follow(unrelated_older.pack())
    assert run.revocation == second
    assert not run.admits(bob.peer_id, invites["bob"]) and not run.admits(alice.peer_id, invites["alice"])

    in_order = admission(keys)
    assert in_order.follow(first.pack()) and in_order.follow(second.pack())
    assert in_order.revocation == second and not in_order.admits(bob.peer_id, invites["bob"])


def test_revoke_command_keeps_one_growing_list_beside_the_key(keys, tmp_path, capsys):
    owner_key = tmp_path / "owner.key"
    owner_key.write_bytes(open(keys["owner"].path, "rb").read())
    owner = Identity.load_or_create(str(owner_key))
    alice, bob = keys["alice"].peer_id, keys["bob"].peer_id
    revoke = ["revoke", "--identity-path", str(owner_key), "--run-id", RUN_A]
    assert main([*revoke, alice]) == 0
    first = load_revocation(revocation_file(str(owner_key), RUN_A), owner, RUN_A)
    assert main([*revoke, bob]) == 0
    second = load_revocation(revocation_file(str(owner_key), RUN_A), owner, RUN_A)
    assert set(first.revoked) == {alice} and set(second.revoked) == {alice, bob}
    assert second.issued > first.issued and second.revoked[alice] == first.revoked[alice]
    assert "revoked the invites of 1 peer to run run-a (2 in all" in capsys.readouterr().out
    with pytest.raises(InviteError, match="it is for run run-a, not for this run run-b"):
        load_revocation(revocation_file(str(owner_key), RUN_A), owner, RUN_B)
    assert main([*revoke, "bob"]) == 2, "not a peer id"
    assert main(["revoke", "--identity-path", str(tmp_path / "nope.key"), "--run-id", RUN_A, alice]) == 2
    assert not (tmp_path / "nope.key").exists(), "revoking never makes a new owner key"
    assert main(["invite", bob, "--identity-path", str(owner_key), "--run-id", RUN_B]) == 0
    made = Invite.parse(capsys.readouterr().out.strip().splitlines()[-1])  # after the log lines above
    assert (made.run_id, made.peer_id) == (RUN_B, bob)


STREAM = "test.revoked"


@pytest.mark.slow  # starts a bootstrap process and real nodes
def test_a_bootstrap_publishes_the_revocation_and_nodes_refuse_the_peer(swarm, tmp_path, monkeypatch):
    """A private bootstrap (a real process) of run tiny-test, two invited nodes: `swarm-peer revoke` writes the list
    beside the owner key, the bootstrap publishes it, and the other node then leaves the revoked node's entry out of
    its reads and refuses its streams; an invite made for another run never admitted it in the first place."""
    from swarm.dht.node import NetworkOptions, SwarmNode
    from swarm.dht.recipes import fetch_run
    from swarm.runtime import LoopThread

    monkeypatch.setattr(admission_module, "REVOCATION_SECONDS", 1.0)  # our nodes re-read the list every second
    owner_key = tmp_path / "owner.key"
    owner = Identity.load_or_create(str(owner_key))
    _, maddr = swarm.bootstrap("--private", "--identity-path", str(owner_key))
    loop, served = LoopThread(), []

    handler = echo_handler(served)

    def ask(node: SwarmNode, peer: str):
        return ask_echo(node, peer, STREAM)

    nodes = [SwarmNode([maddr], NetworkOptions(identity_path=str(tmp_path / f"{name}.key")))
             for name in ("alice", "bob")]
    try:
        alice, bob = nodes
        for node in nodes:
            recipe, _ = loop.run(fetch_run(node, timeout=30), timeout=60)
            assert recipe.admission == "invite" and node.admission.run_id == recipe.run_id == "tiny-test"
        with pytest.raises(AdmissionError, match="it was made for run run-a, not for this run tiny-test"):
            alice.admission.join_with(alice.identity, Invite.sign(owner, RUN_A, alice.peer_id, 1).token())
        for node in nodes:
            node.admission.join_with(node.identity, Invite.sign(owner, "tiny-test", node.peer_id, 1).token())
            loop.run(node.add_stream_handler(STREAM, handler), timeout=30)
            loop.run(node.store("swarm.test.entries", {"who": node.peer_id}, ttl=60, subkey=node.owned_subkey),
                     timeout=30)
        read = loop.run(bob.get("swarm.test.entries"), timeout=30)
        assert sorted(value["who"] for value in read.values()) == sorted([alice.peer_id, bob.peer_id])
        assert loop.run(ask(alice, bob.peer_id), timeout=30) == b"hello"

        assert main(["revoke", alice.peer_id, "--identity-path", str(owner_key), "--run-id", "tiny-test"]) == 0

        def bob_saw_it() -> bool:  # (a read re-reads the list once it is due)
            loop.run(bob.get("swarm.test.entries"), timeout=30)
            return bob.admission.revocation is not None

        # The bootstrap checks the file every 5 s; bob re-reads every second.
        assert wait_until(bob_saw_it, 25, step=0.5), "bob never saw the owner's revocation list"
        read = loop.run(bob.get("swarm.test.entries"), timeout=30)
        assert [value["who"] for value in read.values()] == [bob.peer_id], "alice's entry is left out"
        assert loop.run(ask(alice, bob.peer_id), timeout=30) is None, "alice's stream is refused"
        assert served == [alice.peer_id] and bob.refused_streams == 1, "served before the list only"
    finally:
        for node in nodes:
            node.shutdown()
        loop.close()
