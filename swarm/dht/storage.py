"""What a DHT node keeps under one key, bounded. Anyone can make keys, so a crowd of them (Sybils) can write many
valid signed entries under a run's key; a node keeps at most MAX_SUBKEYS entries and MAX_KEY_BYTES there, so its
answer to a read still fits one DHT message (hivemind's unary limit, 2 MiB; past it nobody can read the key from
that node) and its memory stays flat. When a key is full, an entry stored by its own peer (first-hand) takes the
place of entries that reached us from another node, so one node writing for a thousand keys cannot keep out
peers that announce themselves. Updates of entries we hold are always taken, and our own node's entry always gets
in (a bootstrap keeps its recipe, a peer sees itself).

Installed in our DHT process (process.py) by making hivemind's DHTNode build BoundedProtocol."""

from __future__ import annotations

from typing import Any, Optional

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.p2p import P2PContext
from hivemind.proto import dht_pb2

from swarm.dht.validation import subkey_owner

MAX_KEY_BYTES = 3 << 19  # 1.5 MiB of entries (subkeys and signed values) per key: a read's answer fits 2 MiB
MAX_SUBKEYS = 2048  # entries per key (an honest announcement takes ~1.1 kB, so bytes bind first: ~1400 peers)


def entry_bytes(subkey: Any, value: bytes) -> int:
    return len(subkey) + len(value) if isinstance(subkey, (str, bytes)) else 64 + len(value)


class BoundedStorage(DHTLocalStorage):
    """hivemind's storage of a node, with every key's dictionary bounded (see the module docstring).
    `sender` is the peer id of the node whose store request is being served (None: our own node's write)."""

    def __init__(self, maxsize: Optional[int] = None):
        super().__init__(maxsize)
        self.sender: Optional[str] = None
        self._first_hand: dict[DHTID, set] = {}  # per key: subkeys whose own peer stored them with us
        self.refused = 0  # new entries refused at a full key
        self.evicted = 0  # second-hand entries dropped for first-hand ones

    def store_subkey(self, key: DHTID, subkey: Any, value: bytes, expiration_time: float) -> bool:
        current = self.get(key)
        entries = current.value if current is not None and isinstance(current.value, DictionaryDHTValue) else None
        first_hand = self.sender is None or subkey_owner(subkey) == self.sender
        if entries is not None and subkey not in entries and \
                not self._make_room(key, entries, entry_bytes(subkey, value), first_hand):
            self.refused += 1
            return False
        if entries is None:
            self._first_hand.pop(key, None)  # (what we knew of an expired dictionary under this key)
        stored = super().store_subkey(key, subkey, value, expiration_time)
        if stored and first_hand:
            self._first_hand.setdefault(key, set()).add(subkey)
            if len(self._first_hand) > 2 * len(self.data) + 64:  # forget keys that expired (rounds' keys do)
                self._first_hand = {k: subkeys for k, subkeys in self._first_hand.items() if k in self.data}
        return stored

    def _make_room(self, key: DHTID, entries: DictionaryDHTValue, size: int, first_hand: bool) -> bool:
        """Whether an entry of `size` bytes fits under `key`, after dropping second-hand entries (largest first)
        for a first-hand one; for our own node's entry, first-hand ones of others too, if need be (a node always
        holds its own record: a bootstrap's recipe, a peer's announcement)."""
        sizes = {subkey: entry_bytes(subkey, item.value) for subkey, item in entries.items()}
        count, total = len(sizes) + 1, sum(sizes.values()) + size
        if count <= MAX_SUBKEYS and total <= MAX_KEY_BYTES:
            return True
        if not first_hand:
            return False
        hands = self._first_hand.setdefault(key, set())
        hands.intersection_update(sizes)  # (forget entries that expired)
        by_size = sorted(sizes, key=sizes.__getitem__, reverse=True)
        dropped = []
        for subkey in [s for s in by_size if s not in hands] + ([s for s in by_size if s in hands]
                                                               if self.sender is None else []):
            if count <= MAX_SUBKEYS and total <= MAX_KEY_BYTES:
                break
            dropped.append(subkey)
            count, total = count - 1, total - sizes[subkey]
        if count > MAX_SUBKEYS or total > MAX_KEY_BYTES:
            return False  # first-hand entries alone fill the key: a newcomer waits for one to expire
        for subkey in dropped:
            del entries[subkey]
        self.evicted += len(dropped)
        return True


class BoundedProtocol(DHTProtocol):
    """hivemind's DHT protocol with BoundedStorage for its storage and cache, told who sends each store request."""

    @classmethod
    async def create(cls, *args: Any, **kwargs: Any) -> "BoundedProtocol":
        self = await super().create(*args, **kwargs)
        cache_size = self.cache.maxsize if self.cache.maxsize != float("inf") else None
        self.storage, self.cache = BoundedStorage(), BoundedStorage(cache_size)  # (nothing is stored yet)
        return self

    async def rpc_store(self, request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
        # hivemind's rpc_store stores everything without awaiting, so no other request runs in between.
        sender = context.remote_id.to_base58() if context.remote_id is not None else ""
        self.storage.sender = self.cache.sender = sender
        try:
            return await super().rpc_store(request, context)
        finally:
            self.storage.sender = self.cache.sender = None


# Its RPCs are named after the class (`DHTProtocol.rpc_store`): other nodes call them by that name.
BoundedProtocol.__name__ = BoundedProtocol.__qualname__ = "DHTProtocol"
