"""A node's storage keeps at most MAX_SUBKEYS entries and MAX_KEY_BYTES under one key (so its answer to a read fits
one DHT message), and at a full key an entry stored by its own peer takes the place of entries relayed by another
node: one node writing for many keys (Sybils) cannot keep a peer that announces itself out. Storage alone, no
network; tests/test_attacks.py runs the Sybil attack between real processes."""

from __future__ import annotations

from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time, timed_storage

from swarm.dht import storage as storage_module
from swarm.dht.storage import MAX_KEY_BYTES, MAX_SUBKEYS, BoundedStorage, entry_bytes
from swarm.dht.validation import Identity

KEY = DHTID.generate(source="swarm.run.peers")
VALUE = b"v" * (8 << 10)  # an announcement as large as nodes accept


def _entries(storage: BoundedStorage) -> dict:
    found = storage.get(KEY)
    return dict(found.value.items()) if found is not None else {}


def _filled_by_a_relay() -> BoundedStorage:
    """A key filled with 8 KiB entries that one node (`relay`) stored for other keys' peers, until refused."""
    storage, expiration = BoundedStorage(), get_dht_time() + 600
    storage.sender = "relay"
    stored = 0
    while storage.store_subkey(KEY, f"sybil{stored}", VALUE, expiration):
        stored += 1
    assert stored == len(_entries(storage)) and storage.refused == 1
    return storage


def test_a_key_holds_at_most_its_byte_cap_and_a_relayed_newcomer_is_refused():
    storage = _filled_by_a_relay()
    entries = _entries(storage)
    total = sum(entry_bytes(subkey, item.value) for subkey, item in entries.items())
    assert total <= MAX_KEY_BYTES < total + entry_bytes("sybil", VALUE) and len(entries) <= MAX_SUBKEYS
    assert not storage.store_subkey(KEY, "another", VALUE, get_dht_time() + 600), "a relayed newcomer waits"
    assert storage.store_subkey(KEY, "sybil0", VALUE, get_dht_time() + 700), "an entry we hold is updated"


def test_at_a_full_key_a_peer_storing_its_own_entry_displaces_relayed_ones():
    storage = _filled_by_a_relay()
    honest = Identity.ephemeral()
    honest.discard_file()
    storage.sender = honest.peer_id  # the peer itself asks us to store its announcement
    assert storage.store_subkey(KEY, honest.owned_subkey, VALUE, get_dht_time() + 600)
    assert honest.owned_subkey in _entries(storage) and storage.evicted == 1
    storage.sender = "relay"
    assert not storage.store_subkey(KEY, "sybil-new", VALUE, get_dht_time() + 600)
    assert storage.store_subkey(KEY, honest.owned_subkey, VALUE, get_dht_time() + 700), \
        "a relayed update of an entry we hold is taken"


def test_first_hand_entries_are_displaced_only_by_our_own_nodes_entry(monkeypatch):
    """Once entries stored by their own peers fill a key, another peer's newcomer waits for one to expire rather
    than push out an entry its peer keeps alive; our own node's entry (a bootstrap's recipe) still gets in."""
    peers = [Identity.ephemeral() for _ in range(6)]
    monkeypatch.setattr(storage_module, "MAX_KEY_BYTES", 5 * entry_bytes(peers[0].owned_subkey, VALUE))
    storage, expiration = BoundedStorage(), get_dht_time() + 600
    for peer in peers:
        peer.discard_file()
        storage.sender = peer.peer_id
        storage.store_subkey(KEY, peer.owned_subkey, VALUE, expiration)
    assert len(_entries(storage)) == 5 and storage.refused == 1 and storage.evicted == 0
    storage.sender = None
    assert storage.store_subkey(KEY, "our own", VALUE, expiration) and storage.evicted == 1
    assert len(_entries(storage)) == 5 and "our own" in _entries(storage)


def test_what_it_knows_of_keys_that_expired_is_forgotten(monkeypatch):
    clock = [get_dht_time()]
    monkeypatch.setattr(timed_storage, "get_dht_time", lambda: clock[0])
    storage = BoundedStorage()
    for round_no in range(500):  # a key per round, each expired by the time the next is written
        clock[0] += 1.0
        storage.store_subkey(DHTID.generate(source=f"swarm.run.group.{round_no}.0"), "peer", b"entry", clock[0] + 0.5)
    assert len(storage.data) == 1 and len(storage._first_hand) <= 2 * len(storage.data) + 65
