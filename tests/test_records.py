"""Unit tests, no network: announcement schemas and their validation, malformed and hostile records (through
hivemind's own validator pipeline), the run owner's recipe, identities, block selection, the swarm summary and
the start-up probe."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time

from swarm.config import MAX_RECIPE_JSON, Recipe, RecipeError, load_recipe
from swarm.dht.records import (PEER_RECORD_RULE, RECIPE_KEY, RECIPE_RULE, PeerRecord, InvalidRecord,
                               choose_recipe, parse_peer_records, parse_recipes, peers_key, protected_keys,
                               recipe_value)
from swarm.dht.validation import (Identity, IdentityError, SwarmValidator, make_validators, owned_subkey,
                                  peer_id_of, subkey_owner)
from swarm.dht.view import block_throughputs, summarize, summarize_stages
from swarm.monitoring.swarm_status import SwarmExporter, coverage_runs, render_status
from swarm.peer.pipeline.placement import MOVE_GAIN, stage_to_move_to, weakest_stage
from swarm.model.build import build_model
from swarm.model.probe import describe_device, measure_tokens_per_s

RUN = "unit-run"
TINY_RECIPE = Path(__file__).parent / "recipes" / "tiny.yaml"


@pytest.fixture(scope="module")
def identities(tmp_path_factory) -> list[Identity]:
    """Three RSA identities (a victim, an attacker, a bystander), made once: key generation takes a while."""
    directory = tmp_path_factory.mktemp("identities")
    return [Identity.load_or_create(str(directory / f"id{i}.key")) for i in range(3)]


def record(peer_id: str = "", **changes) -> PeerRecord:
    base = PeerRecord(peer_id=peer_id, state="training", version="0.1.0", run_id=RUN, round=3, tokens_in_round=512,
                      block_start=0, block_end=2, digest="ab" * 8, device="cuda", device_name="NVIDIA A100",
                      device_memory=80 << 30, tokens_per_s=1234.5, bandwidth_up=1e8, bandwidth_down=2e8,
                      loss=4.2, val_loss=4.3, attempt=0, data_shard=17, data_start=12,
                      updated=1000.0)
    return dataclasses.replace(base, **changes)


# ---- schema ---------------------------------------------------------------------------------------------------
def test_record_round_trips_and_ignores_unknown_fields():
    original = record("QmPeer")
    wire = original.to_wire()
    assert "peer_id" not in wire  # the subkey carries it
    assert PeerRecord.from_wire("QmPeer", {**wire, "from_a_newer_version": [1, 2]}, n_blocks=2) == original


def test_old_records_without_new_fields_still_parse():
    wire = record("QmPeer").to_wire()
    for name in ("device_name", "device_memory", "bandwidth_up", "bandwidth_down", "in_flight_tokens", "data_shard",
                 "data_start", "client"):
        del wire[name]
    parsed = PeerRecord.from_wire("QmPeer", wire)
    assert (parsed.device_name, parsed.device_memory, parsed.bandwidth_up, parsed.bandwidth_down) == ("", 0, 0, 0)
    assert parsed.data_shard is None and parsed.data_start is None and parsed.client is False
    assert parsed.counting_round == parsed.round


@pytest.mark.parametrize("field, value", [
    ("state", "hacking"), ("state", 3), ("round", -1), ("round", 1.5), ("round", True), ("round", "3"),
    ("tokens_in_round", 1 << 63), ("block_start", 2), ("block_end", 3), ("block_end", 0),
    ("tokens_per_s", -1.0), ("tokens_per_s", math.nan), ("tokens_per_s", math.inf), ("tokens_per_s", 1e15),
    ("tokens_per_s", False), ("bandwidth_up", -5.0), ("bandwidth_down", 1e20), ("device_memory", -1),
    ("device_memory", 1 << 60), ("device_memory", 1.0), ("loss", math.nan), ("loss", "low"), ("updated", -1.0),
    ("digest", "x" * 10_000), ("device_name", ["a"]), ("run_id", None), ("in_flight_tokens", -1),
    ("in_flight_tokens", "4"), ("data_shard", -3), ("data_shard", 2.0), ("data_shard", True),
    ("data_start", -1), ("data_start", "0"), ("client", 1), ("client", "yes"),
    # Terminal escapes and line breaks would let a record rewrite what `status` shows an operator.
    ("device_name", "RTX\x1b[2J\x1b[Hall peers agree"), ("device", "cuda\nfake line"), ("version", "0.2\r9.9"),
])
def test_malformed_fields_are_rejected(field, value):
    wire = {**record().to_wire(), field: value}
    with pytest.raises(InvalidRecord, match=field.split("_")[0]):
        PeerRecord.from_wire("QmPeer", wire, n_blocks=2)


@pytest.mark.parametrize("value", [None, [], "record", 5, {"state": "training"},
                                   {**record().to_wire(), **{f"pad{i}": 0 for i in range(100)}}])
def test_malformed_records_are_rejected(value):
    with pytest.raises(InvalidRecord):
        PeerRecord.from_wire("QmPeer", value, n_blocks=2)


def test_parse_counts_rejects_and_keeps_only_owned_subkeys(identities):
    victim, attacker, bystander = identities
    raw = {
        victim.owned_subkey: record().to_wire(),
        bystander.owned_subkey: record(block_end=9).to_wire(),  # outside a 2-block model
        victim.peer_id: record(state="offline").to_wire(),  # plain subkey: anyone could have written it
        owned_subkey(victim.peer_id, attacker.public_key.decode()): record(state="offline").to_wire(),
        attacker.owned_subkey: "not a record",
        ("not", "a", "string"): record().to_wire(),
    }
    records, rejected = parse_peer_records(raw, n_blocks=2)
    assert [r.peer_id for r in records] == [victim.peer_id]
    assert records[0] == record(victim.peer_id)
    assert rejected == 5


def test_parse_sorts_by_peer_id(identities):
    raw = {identity.owned_subkey: record().to_wire() for identity in reversed(identities)}
    records, rejected = parse_peer_records(raw)
    assert [r.peer_id for r in records] == sorted(i.peer_id for i in identities) and rejected == 0


# ---- identities and owned subkeys -----------------------------------------------------------------------------
def test_identity_is_stable_and_gives_p2pd_peer_id(tmp_path, identities):
    path = tmp_path / "bootstrap.id"
    first = Identity.load_or_create(str(path))
    assert path.exists() and Identity.load_or_create(str(path)).peer_id == first.peer_id
    # p2pd derives its peer id from the same file: hivemind's own derivation must agree with ours.
    assert PeerID.from_identity(path.read_bytes()).to_base58() == first.peer_id
    assert len({i.peer_id for i in identities}) == 3


def test_identity_file_errors(tmp_path):
    garbage = tmp_path / "garbage.id"
    garbage.write_bytes(b"\x00not a key")
    with pytest.raises(IdentityError, match="not a hivemind/libp2p private key"):
        Identity.load_or_create(str(garbage))
    ed25519 = tmp_path / "ed25519.id"
    ed25519.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=b"k" * 64)
                        .SerializeToString())
    with pytest.raises(IdentityError, match="RSA"):
        Identity.load_or_create(str(ed25519))
    with pytest.raises(IdentityError, match="cannot create"):
        Identity.load_or_create(str(tmp_path / "missing-dir" / "id.key"))


def test_ephemeral_identity_file_is_removed():
    identity = Identity.ephemeral()
    assert PeerID.from_identity(open(identity.path, "rb").read()).to_base58() == identity.peer_id
    identity.discard_file()
    with pytest.raises(FileNotFoundError):
        open(identity.path, "rb")


def test_subkey_owner(identities):
    victim, attacker, _ = identities
    assert subkey_owner(victim.owned_subkey) == victim.peer_id == peer_id_of(victim.public_key.decode())
    assert subkey_owner(owned_subkey(victim.peer_id, attacker.public_key.decode())) is None
    assert subkey_owner(victim.peer_id) is None
    assert subkey_owner(victim.owned_subkey + "x") is None
    assert subkey_owner(f"{victim.peer_id}[owner:ssh-rsa AAAAnotakey]") is None
    assert subkey_owner(None) is None and subkey_owner(42) is None


# ---- hostile writes, through hivemind's validator pipeline -----------------------------------------------------
def dht_record(key: str, subkey, value, ttl: float = 30.0, signer: Identity | None = None) -> DHTRecord:
    """A record as a node with `signer`'s validators sends it: serialized, and signed if the subkey names the
    signer as owner (hivemind signs only then)."""
    raw = DHTRecord(DHTID.generate(source=key).to_bytes(),
                    DHTProtocol.IS_REGULAR_VALUE if subkey is None else DHTProtocol.serializer.dumps(subkey),
                    DHTProtocol.serializer.dumps(value), get_dht_time() + ttl)
    if signer is None:
        return raw
    return dataclasses.replace(raw, value=CompositeValidator(make_validators(signer, {})).sign_value(raw))


@pytest.fixture(scope="module")
def honest(identities) -> CompositeValidator:
    """What every honest node runs once it knows the run (the bystander's node; any key validates alike)."""
    rules = {RECIPE_KEY: RECIPE_RULE, **protected_keys(Recipe(run_id=RUN))}
    return CompositeValidator(make_validators(identities[2], rules))


def test_own_signed_records_validate(identities, honest):
    victim = identities[0]
    assert honest.validate(dht_record(peers_key(RUN), victim.owned_subkey, record().to_wire(), signer=victim))
    assert honest.validate(dht_record(RECIPE_KEY, victim.owned_subkey, recipe_value(Recipe()), signer=victim))


def test_nobody_can_write_another_peers_subkey(identities, honest):
    victim, attacker, _ = identities
    key, fake = peers_key(RUN), record(state="offline", device_name="HIJACKED").to_wire()
    unsigned = dht_record(key, victim.owned_subkey, fake, signer=attacker)  # attacker's key is not in the subkey
    assert DHTProtocol.serializer.loads(unsigned.value) == fake, "hivemind signs only the owner's subkeys"
    assert not honest.validate(unsigned)
    genuine = dht_record(key, victim.owned_subkey, record().to_wire(), signer=victim)
    signature = genuine.value[len(DHTProtocol.serializer.dumps(record().to_wire())):]
    replayed = dataclasses.replace(unsigned, value=unsigned.value + signature)  # the victim's signature, new value
    assert not honest.validate(replayed)
    extended = dataclasses.replace(genuine, expiration_time=genuine.expiration_time + 100)  # signed lifetime
    assert not honest.validate(extended)
    # Signed with the attacker's own key, but naming the victim's peer id: our rule rejects it.
    impostor = dht_record(key, owned_subkey(victim.peer_id, attacker.public_key.decode()), fake, signer=attacker)
    assert RSASignatureValidator(attacker.private_key).validate(impostor), "the signature itself is valid"
    assert not honest.validate(impostor)


def test_protected_keys_refuse_plain_values_unsigned_subkeys_oversize_and_long_lifetimes(identities, honest):
    victim = identities[0]
    key = peers_key(RUN)
    # A plain value with a later expiration would replace the whole dictionary of announcements.
    assert not honest.validate(dht_record(key, None, "wipe", ttl=10 ** 7))
    assert not honest.validate(dht_record(RECIPE_KEY, None, recipe_value(Recipe())))
    assert not honest.validate(dht_record(key, victim.peer_id, record().to_wire()))
    huge = {**record().to_wire(), "pad": "x" * PEER_RECORD_RULE.max_bytes}
    assert not honest.validate(dht_record(key, victim.owned_subkey, huge, signer=victim))
    assert not honest.validate(dht_record(key, victim.owned_subkey, record().to_wire(), ttl=10 ** 6,
                                          signer=victim))


def test_every_key_refuses_plain_values_and_unsigned_subkeys(identities, honest):
    """Our nodes write only owned entries. A plain value under a round's matchmaking key, with a later expiration,
    would replace its entries and keep new ones out for as long as it lives: nobody could form that round's group."""
    victim = identities[0]
    assert not honest.validate(dht_record("swarm.some-run.group.0.0", None, "wipe", ttl=10 ** 4))
    assert not honest.validate(dht_record("swarm.some-run.group.0.0", victim.peer_id, {"digest": "ab"}))
    assert not honest.validate(dht_record("anything", None, b"plain value"))
    entry = dht_record("swarm.some-run.group.0.0", victim.owned_subkey, {"digest": "ab"}, ttl=3 * 3600,
                       signer=victim)
    assert honest.validate(entry), "matchmaking's own entries, for its longest timeout"
    assert not honest.validate(dht_record("swarm.some-run.group.0.0", victim.owned_subkey, {"digest": "ab"},
                                          ttl=10 ** 6, signer=victim)), "but not for days"
    assert not honest.validate(dht_record("anything", owned_subkey(victim.peer_id, identities[1].public_key.decode()),
                                          1, signer=identities[1])), "an owned subkey must be genuine"


def test_run_keys_get_their_tighter_rules_from_when_a_node_learns_the_run(identities):
    victim = identities[0]
    validators = CompositeValidator(make_validators(identities[2], {RECIPE_KEY: RECIPE_RULE}))
    long_lived = dht_record(peers_key(RUN), victim.owned_subkey, record().to_wire(), ttl=3600, signer=victim)
    assert validators.validate(long_lived)
    # what SwarmNode.protect does in the DHT process
    validators.extend([SwarmValidator(protected_keys(Recipe(run_id=RUN)))])
    assert not validators.validate(long_lived), "a peer record lives 10 minutes at most"
    assert not validators.validate(dht_record(RECIPE_KEY, None, recipe_value(Recipe()))), "earlier rules kept"
    assert len(validators._validators) == 2, "our rules merge into one validator"


# ---- the run owner's recipe -----------------------------------------------------------------------------------
def test_choose_recipe(identities):
    owner, other, _ = identities
    recipe, fake = load_recipe(TINY_RECIPE), Recipe(run_id="fake-run")
    raw = {owner.owned_subkey: recipe_value(recipe), other.owned_subkey: recipe_value(fake),
           owner.peer_id: recipe_value(fake)}  # unowned: ignored
    recipes, problems = parse_recipes(raw)
    assert set(recipes) == {owner.peer_id, other.peer_id} and not problems
    assert choose_recipe(recipes, problems, [owner.peer_id]) == (owner.peer_id, recipe)
    assert choose_recipe(recipes, problems, [other.peer_id]) == (other.peer_id, fake)
    with pytest.raises(RecipeError, match="pass the bootstrap's multiaddr"):
        choose_recipe(recipes, problems, ["QmSomeOtherPeer"])
    with pytest.raises(RecipeError, match="different recipes"):
        choose_recipe(recipes, problems, [owner.peer_id, other.peer_id])
    only = {owner.peer_id: recipe}
    assert choose_recipe(only, {}, ["QmSomeOtherPeer"]) == (owner.peer_id, recipe), "the only one is followed"
    assert choose_recipe(only, {}, ["QmSomeOtherPeer"], accept_untrusted=False) is None, \
        "...but only once the trusted owner had time to publish its own: anyone can publish a lone recipe"
    assert choose_recipe(recipes, problems, ["QmSomeOtherPeer"], accept_untrusted=False) is None
    assert choose_recipe(recipes, problems, [owner.peer_id], accept_untrusted=False) == (owner.peer_id, recipe)
    assert choose_recipe({}, {}, [owner.peer_id]) is None


def test_broken_recipes(identities):
    owner, other, _ = identities
    raw = {owner.owned_subkey: {**recipe_value(Recipe()), "digest": "0" * 64},
           other.owned_subkey: {"json": "{not json", "digest": ""}}
    recipes, problems = parse_recipes(raw)
    assert not recipes and set(problems) == {owner.peer_id, other.peer_id}
    with pytest.raises(RecipeError, match="does not match its published hash"):
        choose_recipe(recipes, problems, [owner.peer_id])
    assert choose_recipe(recipes, problems, ["QmSomeOtherPeer"]) is None


def test_a_strangers_recipe_record_that_no_parser_takes_is_a_problem_not_a_crash(identities):
    """Anyone may publish under RECIPE_KEY. A record whose JSON is nested deeper than Python's parser goes, holds a
    number of more digits than int() converts, or is over a record's size raised out of parse_recipes before (a
    RecursionError, a ValueError), so one stranger's record stopped every peer from joining. Now each is that
    stranger's problem, in one line, and the owner's recipe is followed."""
    owner, stranger, _ = identities
    recipe = load_recipe(TINY_RECIPE)
    canonical = recipe.canonical_json()
    for text in ("[" * 5000 + "]" * 5000, '{"a":' * 5000 + "1" + "}" * 5000,
                 canonical.replace('"seed":0', '"seed":' + "9" * 5000, 1), " " * (MAX_RECIPE_JSON + 1)):
        assert text != canonical
        raw = {owner.owned_subkey: recipe_value(recipe), stranger.owned_subkey: {"json": text, "digest": ""}}
        recipes, problems = parse_recipes(raw)
        assert set(recipes) == {owner.peer_id} and set(problems) == {stranger.peer_id}
        assert len(problems[stranger.peer_id].splitlines()) == 1 and len(problems[stranger.peer_id]) < 300
        assert choose_recipe(recipes, problems, [owner.peer_id]) == (owner.peer_id, recipe)
        with pytest.raises(RecipeError, match="unusable"):  # (the owner's own record of it: refused, one line)
            choose_recipe(*parse_recipes({owner.owned_subkey: {"json": text, "digest": ""}}), [owner.peer_id])


# ---- block selection ------------------------------------------------------------------------------------------
def hosting(peer_id: str, start: int, end: int, tokens_per_s: float, state: str = "training") -> PeerRecord:
    return record(peer_id, block_start=start, block_end=end, tokens_per_s=tokens_per_s, state=state)


def test_a_joining_stage_peer_takes_the_stage_with_the_fewest_live_peers():
    assert weakest_stage({0: 2, 1: 0, 2: 1}, peer_hash=7) == 1
    assert weakest_stage({0: 3}, peer_hash=5) == 0, "the one stage that fits"
    # Ties go to the tied stage the peer's hash picks, so peers that join together spread over them.
    assert [weakest_stage({0: 1, 1: 1, 2: 4}, peer_hash=h) for h in range(4)] == [0, 1, 0, 1]
    assert weakest_stage({2: 0, 0: 0}, peer_hash=1) == 2, "the order of the readings does not matter"
    with pytest.raises(ValueError):
        weakest_stage({}, peer_hash=0)


def test_block_throughputs_count_live_hosts_of_each_block():
    view = [hosting("QmA", 0, 3, 100.0), hosting("QmB", 3, 6, 50.0), hosting("QmC", 0, 6, 10.0)]
    assert block_throughputs(view, 6) == [110.0] * 3 + [60.0] * 3
    view = [hosting("QmA", 1, 3, 100.0), hosting("QmB", 3, 6, 10.0)]
    assert block_throughputs(view, 6) == [0.0, 100.0, 100.0, 10.0, 10.0, 10.0]
    view = [hosting("QmA", 0, 2, 5.0), hosting("QmB", 2, 4, 50.0, state="offline")]
    assert block_throughputs(view, 4) == [5.0, 5.0, 0.0, 0.0], "an offline peer hosts nothing"


def test_a_stage_peer_moves_to_a_stage_with_two_fewer_peers_or_to_the_throughput_bottleneck():
    """stage_to_move_to: peers first (a stage with two fewer live peers than ours), then throughput: the pipelines
    run at the pace of the stage computing the fewest tokens/s, and a move that lifts that pace by MOVE_GAIN or more
    is worth its cost. Our capacity in another stage scales with the two stages' work per token."""
    even = [1.0, 1.0]
    assert stage_to_move_to([3, 1], [300.0, 100.0], 0, 100.0, even, [0, 1]) == (1, "peers")
    assert stage_to_move_to([2, 1], [200.0, 100.0], 0, 100.0, even, [0, 1]) == (None, ""), "100 -> 100: no gain"
    # Stage 1's one peer computes 50 tokens/s, each of stage 0's two 200: the pipelines run at 50. With us on
    # stage 1, stage 0 keeps 200 and stage 1 computes 250: pace 200.
    assert stage_to_move_to([2, 1], [400.0, 50.0], 0, 200.0, even, [0, 1]) == (1, "throughput")
    assert stage_to_move_to([2, 1], [400.0, 50.0], 0, 200.0, even, [0]) == (None, ""), "stage 1 does not fit us"
    # Stage 1 costs 4x per token: we would compute 50 there, lifting the pace from 50 to 100; at 16x only to 62.5,
    # not above 1.25 x 50.
    assert stage_to_move_to([2, 1], [400.0, 50.0], 0, 200.0, [1.0, 4.0], [0, 1]) == (1, "throughput")
    assert stage_to_move_to([2, 1], [400.0, 50.0], 0, 200.0, [1.0, 16.0], [0, 1]) == (None, "")
    assert stage_to_move_to([2, 1], [400.0, 100.0], 0, 200.0, even, [0, 1]) == (1, "throughput")
    assert stage_to_move_to([2, 1], [400.0, 100.0 * MOVE_GAIN / 1.2], 0, 200.0, even, [0, 1])[0] == 1
    assert stage_to_move_to([2, 2], [220.0, 200.0], 0, 110.0, even, [0, 1]) == (None, ""), "balanced: stay"
    # Nobody leaves a stage it is alone in, nor moves while some peer's capacity is unmeasured (None, or 0).
    assert stage_to_move_to([1, 1], [400.0, 50.0], 0, 400.0, even, [0, 1]) == (None, "")
    assert stage_to_move_to([2, 1], [None, 50.0], 0, 200.0, even, [0, 1]) == (None, "")
    assert stage_to_move_to([2, 1], [400.0, 0.0], 0, 200.0, even, [0, 1]) == (None, "")
    assert stage_to_move_to([2, 1], [400.0, 50.0], 0, 0.0, even, [0, 1]) == (None, "")
    # Three stages: to the one that lifts the pace most.
    assert stage_to_move_to([3, 2, 2], [600.0, 150.0, 60.0], 0, 200.0, [1.0] * 3, [0, 1, 2]) == (2, "throughput")


def test_block_throughputs_are_deterministic_for_any_view_order():
    # Float sums depend on order ((0.1 + 0.2) + 0.3 != (0.3 + 0.2) + 0.1): peers are summed in peer-id order.
    view = [hosting(f"Qm{i}", 0, 3, tps) for i, tps in enumerate((0.1, 0.2, 0.3))] + [hosting("QmZ", 3, 6, 0.6)]
    expected_blocks = block_throughputs(view, 6)
    rng = random.Random(0)
    for _ in range(20):
        shuffled = rng.sample(view, len(view))
        assert block_throughputs(shuffled, 6) == expected_blocks


# ---- summary and status ---------------------------------------------------------------------------------------
def test_summary_coverage_agreement_and_json():
    peers = [hosting("QmA", 0, 2, 10.0), hosting("QmB", 1, 3, 20.0), hosting("QmC", 3, 4, 5.0, state="offline"),
             dataclasses.replace(hosting("QmD", 0, 1, 1.0), digest="ff" * 8, round=2)]
    summary = summarize(peers, invalid=2, n_blocks=5, read_at=1010.0)
    assert summary.peers_online == 3 and summary.by_state["offline"] == 1 and summary.invalid_records == 2
    assert summary.tokens_per_s == 31.0
    assert summary.block_coverage == [2, 2, 1, 0, 0] and summary.uncovered_blocks == [3, 4]
    assert summary.round == 3 and summary.digests_agree and summary.majority_digest == "ab" * 8
    disagree = summarize(peers + [dataclasses.replace(hosting("QmE", 0, 1, 1.0), digest="cd" * 8)], 0, 5)
    assert not disagree.digests_agree
    as_json = summary.to_json()
    assert as_json["peers"][0]["peer_id"] == "QmA" and as_json["peers"][0]["last_seen_s"] == 10.0
    assert coverage_runs(summary.block_coverage) == [(0, 2, 2), (2, 3, 1), (3, 5, 0)]
    text = render_status(summary, "unit-run", "f" * 64)
    assert "3 peers online" in text and "1 offline" in text and "hosted by nobody: 3, 4" in text
    assert "2 invalid records" in text and "agree (" in text and "DIFFER" in render_status(disagree, "r", "f")
    header, first = text.splitlines()[3:5]
    assert header.split()[-5:] == ["round", "shard", "files", "loss", "seen"]
    assert first.split()[-5:-2] == ["3", "17", "-"]  # the run shares no dataset
    unknown = render_status(summarize([dataclasses.replace(peers[0], data_shard=None, data_files=9)], 0, 5), "r", "f")
    assert unknown.splitlines()[4].split()[-4:-2] == ["-", "9"], "a peer that announces no shard, and 9 files"
    assert summarize([], 0).n_blocks == 0


def test_a_pipelined_runs_summary_judges_each_stage_by_itself():
    """Each stage averages under its own run id, so its round and digest are its own: stage 1 behind stage 0 and
    holding other params is no disagreement, a peer differing from its own stage's majority is. The stage with
    the fewest peers is the bottleneck; the run's round is the lowest stage's, its tokens/s the first stage's."""
    stage0 = [dataclasses.replace(hosting(f"QmA{i}", 0, 2, 100.0), round=5, digest="aa" * 8) for i in range(3)]
    stage1 = [dataclasses.replace(hosting("QmB0", 2, 4, 90.0), round=4, digest="bb" * 8),
              dataclasses.replace(hosting("QmB1", 2, 4, 80.0), round=4, digest="cc" * 8),
              dataclasses.replace(hosting("QmB2", 2, 4, 80.0, state="offline"), round=4, digest="cc" * 8)]
    summary = summarize_stages([stage0, stage1], [(0, 2), (2, 4)], invalid=1, n_blocks=4, read_at=1010.0)
    first, second = summary.stages
    assert (first.round, first.peers_online, first.tokens_per_s, first.digests_agree) == (5, 3, 300.0, True)
    assert (second.round, second.peers_online, second.tokens_per_s, second.digests_agree) == (4, 2, 170.0, False)
    assert second.divergent_peers == 1 and first.divergent_peers == 0
    assert second.bottleneck and not first.bottleneck
    assert (summary.round, summary.tokens_per_s, summary.digests_agree, summary.peers_online) == (4, 300.0, False, 5)
    assert summary.block_coverage == [3, 3, 2, 2] and summary.invalid_records == 1
    assert summary.to_json()["stages"][1]["bottleneck"] is True
    text = render_status(summary, "r", "f" * 64)
    assert "through 2 pipeline stages" in text and "DIFFER within a stage" in text
    assert "stage 0 blocks [0, 2): 3 peers, round 5, 300 tokens/s, digests agree (" in text
    assert "stage 1 blocks [2, 4): 2 peers, round 4, 170 tokens/s, digests DIFFER" in text
    assert text.count("<- bottleneck") == 1 and "bottleneck" in next(l for l in text.splitlines() if "stage 1" in l)
    # A stage nobody hosts is the bottleneck, whatever the others' numbers.
    empty = summarize_stages([stage0, []], [(0, 2), (2, 4)], 0, 4)
    assert empty.stages[1].bottleneck and empty.uncovered_blocks == [2, 3] and empty.round == 0
    registry = CollectorRegistry()
    SwarmExporter(registry).update(summary)
    value = registry.get_sample_value
    assert value("swarm_stage_peers", {"stage": "1"}) == 2 and value("swarm_stage_round", {"stage": "0"}) == 5
    assert value("swarm_stage_tokens_per_second", {"stage": "0"}) == 300
    assert value("swarm_stage_divergent_peers", {"stage": "1"}) == 1
    assert value("swarm_stage_bottleneck") == 1 and value("swarm_swarm_divergent_peers") == 1
    assert value("swarm_stage_capacity_tokens_per_second", {"stage": "0"}) is None, "nobody measured it yet"
    # Once every stage's training peers announce their capacity, the stage that computes least is the bottleneck,
    # though it has more peers: here stage 0's three slow peers (3 x 50) against stage 1's two (2 x 120).
    slow = [dataclasses.replace(p, capacity=50.0) for p in stage0]
    fast = [dataclasses.replace(p, capacity=120.0) for p in stage1]
    measured = summarize_stages([slow, fast], [(0, 2), (2, 4)], 0, 4)
    assert [t.capacity for t in measured.stages] == [150.0, 240.0] and measured.stages[0].bottleneck
    assert not measured.stages[1].bottleneck
    assert "300 tokens/s (could compute 150)" in render_status(measured, "r", "f" * 64)
    half = summarize_stages([slow, stage1], [(0, 2), (2, 4)], 0, 4)
    assert half.stages[1].capacity is None and half.stages[1].bottleneck, "until every stage measured: by peers"
    registry = CollectorRegistry()
    SwarmExporter(registry).update(measured)
    assert registry.get_sample_value("swarm_stage_capacity_tokens_per_second", {"stage": "1"}) == 240
    assert registry.get_sample_value("swarm_stage_bottleneck") == 0


# ---- start-up probe -------------------------------------------------------------------------------------------
def test_probe_measures_without_changing_the_model():
    recipe = load_recipe(TINY_RECIPE)
    model = build_model(recipe.model, recipe.data.vocab_size)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5  # dropout draws from the RNG, which training must find unmoved
    before = [p.detach().clone() for p in model.parameters()]
    rng_before = torch.random.get_rng_state()
    tokens_per_s = measure_tokens_per_s(model, recipe.data.batch_size, recipe.data.seq_len, torch.device("cpu"),
                                        steps=2)
    assert 0 < tokens_per_s < 1e9
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng_before, torch.random.get_rng_state())
    info = describe_device(torch.device("cpu"))
    assert info.kind == "cpu" and info.memory_bytes > 0 and len(info.name) <= 128


def test_matchmaking_counts_only_signed_entries(identities, honest):
    """Group entries and a leader's final list are written under owned (signed) subkeys: an attacker can neither
    enter, accuse nor lead in another peer's name."""
    from swarm.averaging.matchmaking import signed_entries
    from swarm.dht.records import final_key

    victim, attacker, _ = identities
    key = final_key(RUN, 3, 0)
    fake_final = {"members": [victim.peer_id, attacker.peer_id], "shares": [0.5, 0.5]}
    # Under the victim's plain peer id (the way entries were keyed before): unsigned, so not counted.
    assert signed_entries({victim.peer_id: fake_final, victim.owned_subkey: {"digest": "d"}}) == \
        {victim.peer_id: {"digest": "d"}}
    # Under the victim's owned subkey but signed by the attacker, or naming the victim with the attacker's key:
    # every honest node refuses to store it.
    assert not honest.validate(dht_record(key, victim.owned_subkey, fake_final, signer=attacker))
    assert not honest.validate(dht_record(key, owned_subkey(victim.peer_id, attacker.public_key.decode()),
                                          fake_final, signer=attacker))
    assert honest.validate(dht_record(key, victim.owned_subkey, fake_final, signer=victim))
