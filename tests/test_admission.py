"""Private swarms without a network: invites (signing, parsing, each reason one is refused), the validator every
node of a private run runs on entries, the recipe field that makes a run private, and the CLI that makes ids and
invites."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from conftest import ask_echo, echo_handler
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

from swarm.cli import _identity_command, build_parser
from swarm.config import Recipe, recipe_from_json
from swarm.settings import BootstrapSettings
from swarm.dht.admission import (INVITE_FIELD, Admission, AdmissionError, AdmissionValidator, Invite, InviteError,
                                 allowlist_invites)
from swarm.dht.validation import Identity

RUN = "tiny-test"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Identity]:
    """An owner, an invited peer, another peer and another would-be owner (RSA keys take a moment each)."""
    directory = tmp_path_factory.mktemp("keys")
    return {name: Identity.load_or_create(str(directory / f"{name}.key"))
            for name in ("owner", "peer", "other", "rival")}


def problem(invite: Invite, keys: dict[str, Identity], peer: str = "peer", now: float | None = None) -> str | None:
    owner = keys["owner"]
    return invite.problem(owner.peer_id, owner.public_key.decode(), RUN, keys[peer].peer_id,
                          time.time() if now is None else now)


def test_an_invite_admits_its_peer_and_survives_its_token(keys):
    invite = Invite.sign(keys["owner"], RUN, keys["peer"].peer_id, days=2)
    token = invite.token()
    assert "\n" not in token and len(token) < 1000
    assert Invite.parse(token) == invite
    assert problem(invite, keys) is None
    assert time.time() + 2 * 86400 - 5 < invite.expires <= time.time() + 2 * 86400


def test_an_invite_for_another_peer_is_refused(keys):
    invite = Invite.sign(keys["owner"], RUN, keys["peer"].peer_id, days=1)
    assert "it is for peer" in problem(invite, keys, peer="other")


def test_an_invite_of_another_owner_is_refused(keys):
    invite = Invite.sign(keys["rival"], RUN, keys["peer"].peer_id, days=1)
    assert f"signed by {keys['rival'].peer_id}, not by this run's owner" in problem(invite, keys)


def test_a_forged_invite_is_refused(keys):
    """Signed by the peer itself in the owner's name, or the owner's invite with its peer id or expiry changed."""
    selfmade = replace(Invite.sign(keys["peer"], RUN, keys["peer"].peer_id, days=1), owner=keys["owner"].peer_id)
    genuine = Invite.sign(keys["owner"], RUN, keys["other"].peer_id, days=1)
    for forged in (selfmade, replace(genuine, peer_id=keys["peer"].peer_id),
                   replace(Invite.sign(keys["owner"], RUN, keys["peer"].peer_id, days=1), expires=2 ** 40)):
        assert "signature is not the run owner's" in problem(Invite.parse(forged.token()), keys)


def test_an_expired_invite_is_refused(keys):
    invite = Invite.sign(keys["owner"], RUN, keys["peer"].peer_id, days=1, now=time.time() - 3 * 86400)
    assert "it expired on" in problem(invite, keys)
    assert problem(invite, keys, now=time.time() - 2.5 * 86400) is None


@pytest.mark.parametrize("token", ["", "not base64 !", "aGVsbG8", "x" * 5000, None])
def test_what_is_not_a_token_is_one_clear_error(token):
    with pytest.raises(InviteError, match="not an invite token"):
        Invite.parse(token)


def test_signing_refuses_what_is_not_a_peer_id_or_a_lifetime(keys):
    with pytest.raises(InviteError, match="is not a peer id"):
        Invite.sign(keys["owner"], RUN, "bob", days=1)
    with pytest.raises(InviteError, match="between 0 and 3650 days"):
        Invite.sign(keys["owner"], RUN, keys["peer"].peer_id, days=0)


def test_admission_remembers_peers_whose_invite_it_saw(keys):
    owner, peer, other = keys["owner"], keys["peer"].peer_id, keys["other"].peer_id
    admission = Admission(owner.peer_id, owner.public_key.decode(), RUN)
    token = Invite.sign(owner, RUN, peer, days=1).token()
    assert admission.admits(owner.peer_id)
    assert not admission.admits(peer)
    assert not admission.admits(other, token), "another peer's token admits nobody else"
    assert admission.admits(peer, token) and admission.admits(peer), "seen once, admitted on streams after"
    assert admission.entry_admitted(peer, {"state": "training", INVITE_FIELD: token})
    assert not admission.entry_admitted(other, {"state": "training", INVITE_FIELD: token})
    assert not admission.entry_admitted(other, "a plain value") and admission.entry_admitted(owner.peer_id, 3)


def test_joining_says_what_to_do(keys):
    owner, peer = keys["owner"], keys["peer"]
    admission = Admission(owner.peer_id, owner.public_key.decode(), RUN)
    with pytest.raises(AdmissionError, match=rf"^this run is private: ask the run owner for an invite \(swarm-peer "
                                             rf"invite {peer.peer_id}\)"):
        admission.join_with(peer, None)
    with pytest.raises(AdmissionError, match="your invite does not admit you: it is for peer"):
        admission.join_with(peer, Invite.sign(owner, RUN, keys["other"].peer_id, days=1).token())
    admission.offered = {peer.peer_id: Invite.sign(owner, RUN, peer.peer_id, days=1).token()}  # --allowlist
    admission.join_with(peer, None)
    assert admission.token == admission.offered[peer.peer_id]
    admission.join_with(owner, None)  # the owner needs none


def _record(writer: Identity, value, key: str = "swarm.tiny-test.group.3.0") -> DHTRecord:
    """An entry as hivemind's validators see it after the signature check: serialized subkey and value."""
    return DHTRecord(key=DHTID.generate(source=key).to_bytes(),
                     subkey=DHTProtocol.serializer.dumps(writer.owned_subkey),
                     value=DHTProtocol.serializer.dumps(value), expiration_time=time.time() + 60)


def test_every_node_refuses_entries_of_peers_not_admitted(keys):
    owner, peer, other = keys["owner"], keys["peer"], keys["other"]
    validator = AdmissionValidator(owner.peer_id, owner.public_key.decode(), RUN)
    token = Invite.sign(owner, RUN, peer.peer_id, days=1).token()
    entry = {"digest": "d", "bandwidth": 1.0}
    assert validator.validate(_record(peer, {**entry, INVITE_FIELD: token}))
    assert validator.validate(_record(owner, entry)), "the owner writes without an invite"
    assert not validator.validate(_record(peer, entry)), "no invite"
    assert not validator.validate(_record(other, {**entry, INVITE_FIELD: token})), "someone else's invite"
    forged = replace(Invite.sign(other, RUN, other.peer_id, days=1), owner=owner.peer_id).token()
    assert not validator.validate(_record(other, {**entry, INVITE_FIELD: forged})), "a forged invite"
    assert not validator.validate(_record(peer, b"not a mapping"))
    unowned = DHTRecord(key=DHTID.generate(source="k").to_bytes(), subkey=DHTProtocol.serializer.dumps("free"),
                        value=DHTProtocol.serializer.dumps(1), expiration_time=time.time() + 60)
    assert validator.validate(unowned), "unowned entries are SwarmValidator's business, and readers ignore them"


def test_an_open_recipe_keeps_its_digest_and_a_private_one_says_so():
    open_run = Recipe()
    assert "admission" not in open_run.canonical_json(), "open runs hash as before the field existed"
    assert recipe_from_json(open_run.canonical_json()).admission == "open"
    private = open_run.model_copy(update={"admission": "invite"})
    assert recipe_from_json(private.canonical_json()) == private
    assert private.digest() != open_run.digest()


def test_a_private_bootstrap_needs_a_lasting_key():
    with pytest.raises(ValueError, match="--private needs --identity-path"):
        BootstrapSettings(private=True)
    with pytest.raises(ValueError, match="add --private"):
        BootstrapSettings(allowlist="ids.txt", network={"identity_path": "k"})


def test_an_allowlist_becomes_invites_and_a_bad_line_is_named(keys, tmp_path):
    listed = tmp_path / "allow.txt"
    listed.write_text(f"# volunteers\n{keys['peer'].peer_id}\n\n{keys['other'].peer_id}  # bob\n")
    invites = allowlist_invites(keys["owner"], RUN, str(listed), days=1)
    assert sorted(invites) == sorted([keys["peer"].peer_id, keys["other"].peer_id])
    assert problem(Invite.parse(invites[keys["other"].peer_id]), keys, peer="other") is None
    listed.write_text(f"{keys['peer'].peer_id}\nbob\n")
    with pytest.raises(InviteError, match="line 2: 'bob' is not a peer id"):
        allowlist_invites(keys["owner"], RUN, str(listed), days=1)


@pytest.mark.slow  # starts real nodes or CLI processes (the quick subset runs none)
def test_id_and_invite_commands(keys, tmp_path, caplog):
    volunteer = tmp_path / "volunteer.key"
    made = subprocess.run([sys.executable, "-m", "swarm", "id", "--identity-path", str(volunteer)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and volunteer.exists(), made.stderr
    peer_id = made.stdout.strip()
    assert peer_id == Identity.load_or_create(str(volunteer)).peer_id
    invited = subprocess.run([sys.executable, "-m", "swarm", "invite", peer_id, "--identity", keys["owner"].path,
                              "--run-id", RUN,
                              "--days", "3"], capture_output=True, text=True, timeout=60)
    assert invited.returncode == 0, invited.stderr
    assert problem(Invite.parse(invited.stdout.strip()), {**keys, "peer": Identity.load_or_create(str(volunteer))}) \
        is None
    args = build_parser().parse_args(["invite", peer_id, "--identity-path", str(tmp_path / "nope.key"),
                                      "--run-id", RUN])
    with caplog.at_level(logging.ERROR, logger="swarm"):
        assert _identity_command(args) == 2
    assert "no identity file" in caplog.text
    assert not (tmp_path / "nope.key").exists(), "an invite never makes a new owner key"


STREAM = "test.admitted"


@pytest.mark.slow  # starts real nodes or CLI processes (the quick subset runs none)
def test_nodes_of_a_private_run_refuse_entries_and_streams_of_peers_not_admitted(tmp_path):
    """Real nodes on 127.0.0.1: the owner's node, an invited peer (direct streams) and a stranger (libp2p only):
    the stranger's entry is in nobody's read and its streams, with no invite or a forged one, never reach the
    handler; the invited peer's do."""
    from swarm.dht.node import NetworkOptions, SwarmNode
    from swarm.runtime import LoopThread

    loop, served = LoopThread(), []

    handler = echo_handler(served)

    def ask(node: SwarmNode, peer: str):
        return ask_echo(node, peer, STREAM)

    owner = SwarmNode([], NetworkOptions(identity_path=str(tmp_path / "owner.key")))
    nodes = [owner] + [SwarmNode(owner.visible_maddrs(), NetworkOptions(identity_path=str(tmp_path / f"{n}.key"),
                                                                        direct_streams=n == "invited"))
                       for n in ("invited", "stranger")]
    try:
        owner_key = owner.identity.public_key.decode()
        admissions = [node.private_run(owner.peer_id, owner_key, RUN) for node in nodes]
        invited, stranger = nodes[1:]
        admissions[1].join_with(invited.identity, Invite.sign(owner.identity, RUN, invited.peer_id, days=1).token())
        for node in nodes:
            loop.run(node.add_stream_handler(STREAM, handler), timeout=30)
        for node in nodes[1:]:
            loop.run(node.store("swarm.test.entries", {"who": node.peer_id}, ttl=60, subkey=node.owned_subkey),
                     timeout=30)
        for node in nodes:
            read = loop.run(node.get("swarm.test.entries"), timeout=30)
            assert sorted(value["who"] for value in read.values()) == [invited.peer_id], node.peer_id
        assert loop.run(ask(invited, owner.peer_id), timeout=30) == b"hello"
        assert invited.direct.opened["direct"] >= 1, "the invite travels on direct streams too"
        assert loop.run(ask(owner, invited.peer_id), timeout=30) == b"hello", "the owner needs no invite"
        assert served == [invited.peer_id, owner.peer_id]
        assert loop.run(ask(stranger, owner.peer_id), timeout=30) is None
        stranger.admission.token = replace(Invite.sign(stranger.identity, RUN, stranger.peer_id, days=1),
                                           owner=owner.peer_id).token()
        assert loop.run(ask(stranger, invited.peer_id), timeout=30) is None
        assert served == [invited.peer_id, owner.peer_id] and owner.refused_streams == invited.refused_streams == 1
    finally:
        for node in nodes:
            node.shutdown()
        loop.close()
