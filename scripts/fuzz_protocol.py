"""Fuzz the messages a participant can send: every field of every message type, mutated one at a time.

Two levels. **Schema**: each message type's parser gets a valid message with one field omitted, of a wrong type,
NaN, infinite, negative, zero, huge, overlong, or inconsistent with the rest of the message, or a replay of
another round's; what it must do is written here from the protocol's documentation (docs/design.md, "Entries are
one schema"), not read from the parser: accept exactly the messages whose every field is within its bounds, and
refuse the others with its own error (None or its typed exception), never another exception. Messages sent on
streams (the direct-stream handshake, state and replay requests, data requests, group pushes, a stage server's
microbatches, token ids a first-stage peer computes again) go over a socket on 127.0.0.1 to the real server, which
must answer each as its protocol says (its refusal a reason or a closed stream) and, once all went through, still
serve an honest request and hold nothing it was sent; the answers a client reads (a holder's state header, a data
holder's, a stage peer's, a first-stage peer's activations computed again) go to the real client. **Matchmaking**,
end to end in one process (the real `form_group` over an in-memory DHT, four real identities): an attacker's entry,
then the group it publishes as leader, mutated the same way; afterwards the honest members must have formed their
group (an entry cannot stall them) with the terms their own entries give (weights, shares, deadline, commitments, no
mixing of a state nobody else holds, no swarm size over the entries), or, where the attacker led, have refused its
group.

A violation is any other outcome. Prints a table per message type and mutation class, then one JSON line with at
least `mutations` and `violations`; exit status 1 if any violation was found.

    python scripts/fuzz_protocol.py                     # every message type, both levels
    python scripts/fuzz_protocol.py --only entry,final  # some types (see --help)
    python scripts/fuzz_protocol.py --no-matchmaking    # the schema level alone (a few seconds)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import math
import shutil
import ssl
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import msgpack
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.averaging.group_push import MAX_PUSH_BYTES, GroupPush, parse_final, leader_of  # noqa: E402
from swarm.averaging.matchmaking import Candidate, form_group, group_terms, parse_candidate  # noqa: E402
from swarm.averaging.messages import (Averaged, Blame, Contribution, Header, MessageError, PartialSum,  # noqa: E402
                                      Reveal)
from swarm.averaging.verify import SKETCH_BUCKETS, Term  # noqa: E402
from swarm.compression import decode, get_codec  # noqa: E402
from swarm.data.share import RANGE_BYTES as DATA_RANGE_BYTES  # noqa: E402
from swarm.dht.direct import MAX_AUTH_BYTES  # noqa: E402
from swarm.dht.frames import FRAME_HEADER  # noqa: E402
from swarm.dht.records import InvalidRecord, PeerRecord, final_key, group_key  # noqa: E402
from swarm.peer.pipeline.recompute import RecomputeServer, Recheck, ask_recompute  # noqa: E402
from swarm.peer.pipeline.routing import HEADER_BYTES as PIPE_HEADER_BYTES, payload_bound  # noqa: E402
from swarm.peer.pipeline.worker import PipelineError  # noqa: E402
from swarm.words import shown  # noqa: E402

DIGEST, OTHER_DIGEST, COMMITMENT = "d" * 16, "e" * 16, "c" * 32
HUGE_LIST = 100_000


# ---- what each field may hold (from the protocol's documentation) ------------------------------------------------
def number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def within(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Callable[[Any], bool]:
    return lambda x: number(x) and (low < x if low_open else low <= x) and (x < high if high_open else x <= high)


def hex_of(length: int) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, str) and len(x) == length and all(c in "0123456789abcdef" for c in x)


def integer(low: int, high: int) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, int) and not isinstance(x, bool) and low <= x < high


def list_of(item: Callable[[Any], bool], most: int = 1 << 30, length: Optional[int] = None) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, list) and len(x) <= most and (length is None or len(x) == length) and \
        all(item(i) for i in x)


def peer_string(x: Any) -> bool:
    return isinstance(x, str) and len(x) <= 128


def is_bool(x: Any) -> bool:
    return isinstance(x, bool)


def optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda x: x is None or check(x)


def printable(most: int) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, str) and len(x) <= most and x.isprintable()


@dataclass
class MessageType:
    """A message a participant sends: a valid instance, its parser (True: accepted, False: refused with the
    parser's own error), each field's rule, the fields whose absence is allowed (and means the conservative
    default), and rules that tie fields together (`whole`: the message as a whole is valid)."""

    name: str
    sender: str  # who sends it: member, leader, reducer, stranger
    seed: Callable[[], Any]
    parse: Callable[[Any], bool]
    fields: dict[str, Callable[[Any], bool]]
    may_omit: frozenset = frozenset()
    whole: Callable[[Any], bool] = lambda value: True
    inconsistent: Callable[[Any], Iterator[tuple[str, Any]]] = lambda value: iter(())
    # Sent as msgpack, so judged as its receiver decodes it (a tuple arrives a list; what msgpack cannot carry, such
    # as an integer of 2^64, is never sent), and refused over `max_bytes` whatever it holds.
    wire: bool = False
    max_bytes: Optional[int] = None
    # Whole messages beyond one field's mutations: (class, field, message, whether it is valid).
    others: Callable[[Any], Iterator[tuple[str, str, Any, bool]]] = lambda value: iter(())
    # A real server's state once every mutation went through it: what is wrong with it (None: nothing).
    afterwards: Optional[Callable[[], Optional[str]]] = None


def _refusing(parse: Callable[[Any], Any], *errors: type) -> Callable[[Any], bool]:
    def run(value: Any) -> bool:
        try:
            return parse(value) is not None
        except errors:
            return False
    return run


# ---- the message types -----------------------------------------------------------------------------------------
ENTRY_RULES = {"digest": hex_of(16), "bandwidth": within(0, 1e11), "client": is_bool,
               "excluded": list_of(peer_string, most=1024), "phase_timeout": optional(within(0, 1e6, True, True)),
               "weight": within(0, 1e18, high_open=True), "commitment": hex_of(32)}


def entry_seed() -> dict:
    return {"digest": DIGEST, "bandwidth": 1e6, "client": False, "excluded": [], "phase_timeout": 5.0,
            "weight": 8192.0, "commitment": COMMITMENT}


MEMBERS = sorted(["QmAlpha", "QmBravo", "QmCharlie"])
ROUND, ATTEMPT = 3, 1
LEADER = leader_of(MEMBERS, ROUND, ATTEMPT)


def final_seed() -> dict:
    return {"members": list(MEMBERS), "shares": [0.5, 0.25, 0.25], "phase_timeout": 5.0,
            "clients": [False, False, False], "mix": False, "swarm_size": 3, "weights": [1.0, 2.0, 3.0],
            "commitments": [COMMITMENT] * 3}


def final_whole(value: dict) -> bool:
    members, n = value["members"], len(value["members"])
    return (members == sorted(set(members)) and n > 0 and leader_of(members, ROUND, ATTEMPT) == LEADER
            and len(value["shares"]) == n and abs(sum(value["shares"]) - 1) < 1e-6 and len(value["clients"]) == n
            and not all(value["clients"]) and not any(c and s > 0 for c, s in zip(value["clients"], value["shares"]))
            and n <= value["swarm_size"] and len(value["weights"]) == n and len(value["commitments"]) == n)


def final_inconsistent(value: dict) -> Iterator[tuple[str, Any]]:
    yield "members", list(reversed(value["members"]))  # unsorted
    yield "members", value["members"] + [value["members"][0]]  # a member twice
    yield "members", [m for m in value["members"] if m != LEADER] + ["QmZulu"]  # not this writer's group to lead
    yield "shares", [1.0, 0.5, 0.25]  # not a distribution
    yield "shares", [0.5, 0.5]  # one short
    yield "clients", [True, True, True]  # nobody reduces
    yield "clients", [True, False, False]  # a client given a share
    yield "swarm_size", 2  # fewer than its own members
    yield "weights", [1.0, 2.0]
    yield "commitments", [COMMITMENT] * 2


def header_seed() -> dict:
    return {"group_id": "g" * 32, "round": 3, "attempt": 0, "phase": "part", "chunks": 2, "weight": 8.0}


def record_seed() -> dict:
    return {"state": "training", "version": "0.1", "run_id": "run", "round": 3, "tokens_in_round": 100,
            "block_start": 0, "block_end": 2, "digest": DIGEST, "device": "cpu", "device_name": "cpu",
            "device_memory": 1 << 30, "tokens_per_s": 10.0, "capacity": 10.0, "bandwidth_up": 1e6,
            "bandwidth_down": 1e6, "loss": 5.0, "val_loss": None, "attempt": 0, "in_flight_tokens": None,
            "data_shard": 1, "data_start": 1, "data_files": None, "data_fetched": None, "kept_round": 2,
            "kept_digest": DIGEST, "client": False, "updated": 1.7e9}


RECORD_RULES = {**{name: printable(256) for name in ("version", "run_id", "digest", "device", "device_name",
                                                     "kept_digest")},
                "state": lambda x: x in ("joining", "training", "averaging", "syncing", "offline", "stopping"),
                **{name: integer(0, 1 << 62) for name in ("round", "tokens_in_round", "attempt")},
                "block_start": integer(0, 2), "block_end": integer(1, 3),
                "device_memory": integer(0, 1 << 50),
                **{name: within(0, 1e12) for name in ("tokens_per_s", "capacity")},
                **{name: within(0, 1e13) for name in ("bandwidth_up", "bandwidth_down")},
                "loss": optional(number), "val_loss": optional(number),
                **{name: optional(integer(0, 1 << 62)) for name in ("in_flight_tokens", "data_shard", "data_start",
                                                                    "data_files", "data_fetched", "kept_round")},
                "client": is_bool, "updated": within(0, math.inf)}


def term_seed() -> list:
    return [[0.0] * SKETCH_BUCKETS, [1.0, 2.0], [0.5, 0.5]]


def _record_parse(value: Any) -> bool:
    try:
        PeerRecord.from_wire("QmAlpha", value, n_blocks=2)
        return True
    except InvalidRecord:
        return False


def _peer_states() -> None:  # (the record rule above spells out the states the docs list; check they agree)
    from swarm.dht.records import PEER_STATES
    assert set(PEER_STATES) <= {"joining", "training", "averaging", "syncing", "offline", "stopping"}, PEER_STATES


INVITE_FIELDS = ("owner", "run_id", "peer_id", "issued", "expires", "signature")
_invite_parts: dict = {}


def _invite_seed() -> dict:
    """A valid invite of a fresh owner key (made once), as its fields."""
    if not _invite_parts:
        from swarm.dht.admission import Invite
        from swarm.dht.validation import Identity
        from hivemind.utils.crypto import RSAPrivateKey
        owner, peer = (Identity(RSAPrivateKey(), path="", ephemeral=False) for _ in range(2))
        invite = Invite.sign(owner, "run", peer.peer_id, days=1.0)
        _invite_parts.update(owner=owner, peer=peer.peer_id, peer_identity=peer, invite=invite,
                             fields={name: getattr(invite, name) for name in INVITE_FIELDS})
    return dict(_invite_parts["fields"])


def _invite_parse(value: Any) -> bool:
    """Whether a token made of these fields admits its peer to run "run" of the seed's owner (it must be the owner's
    word, as signed: any field changed breaks the signature; the order on the wire is INVITE_FIELDS)."""
    import base64

    import msgpack

    from swarm.dht.admission import Invite, InviteError
    if not isinstance(value, dict):
        return False
    packed = msgpack.packb([value[name] for name in INVITE_FIELDS if name in value], default=repr)
    token = base64.urlsafe_b64encode(packed).rstrip(b"=").decode()
    try:
        invite = Invite.parse(token)
    except InviteError:
        return False
    owner = _invite_parts["owner"]
    return invite.problem(owner.peer_id, owner.public_key.decode(), "run", _invite_parts["peer"], time.time()) is None


def _as_signed(name: str) -> Callable[[Any], bool]:
    return lambda x: type(x) is type(_invite_parts["fields"][name]) and x == _invite_parts["fields"][name]


MESSAGE_TYPES = [
    MessageType("entry", "member", entry_seed, lambda v: parse_candidate(v, verified=True) is not None,
                ENTRY_RULES),
    MessageType("final", "leader", final_seed,
                lambda v: parse_final(LEADER, v, set(), ROUND, ATTEMPT, verified=True) is not None,
                {"members": list_of(lambda m: isinstance(m, str)), "shares": list_of(within(0, math.inf)),
                 "phase_timeout": optional(within(0, 1e6, True, True)), "clients": list_of(is_bool), "mix": is_bool,
                 "swarm_size": integer(1, (1 << 20) + 1), "weights": list_of(within(0, 1e18, high_open=True)),
                 "commitments": list_of(hex_of(32))}, whole=final_whole, inconsistent=final_inconsistent),
    MessageType("record", "member", record_seed, _record_parse, RECORD_RULES,
                may_omit=frozenset(RECORD_RULES) - {"state", "version", "run_id", "round", "tokens_in_round",
                                                    "block_start", "block_end"},
                whole=lambda v: v["block_start"] < v["block_end"]),
    MessageType("header", "member", header_seed, _refusing(lambda v: Header.from_wire(v, max_chunks=64), MessageError),
                {"group_id": lambda x: isinstance(x, str), "round": integer(0, 1 << 40),
                 "attempt": integer(0, 1 << 40), "phase": lambda x: x in ("part", "avg", "commit", "pull", "decision",
                                                                           "abort", "ping", "ring", "verify"),
                 "chunks": integer(0, 65)}, may_omit=frozenset({"chunks", "weight"})),
    MessageType("contribution", "member", lambda: {"weight": 8.0},
                _refusing(Contribution.from_wire, MessageError), {"weight": within(0, 1e18, high_open=True)}),
    MessageType("blame", "member", lambda: {"suspects": ["QmAlpha"], "rejected": []},
                _refusing(Blame.from_wire, MessageError),
                {"suspects": list_of(lambda x: isinstance(x, str)), "rejected": list_of(lambda x: isinstance(x, str))},
                may_omit=frozenset({"suspects", "rejected"})),  # (no blame: the conservative default)
    MessageType("reveal", "member", lambda: {"nonce": "ab" * 16, "hashes": ["f" * 64] * 3},
                _refusing(lambda v: Reveal.from_wire(v, parts=3), MessageError),
                {"nonce": lambda x: isinstance(x, str) and len(x) <= 128 and len(x) % 2 == 0 and
                 all(c in "0123456789abcdefABCDEF" for c in x),
                 "hashes": list_of(lambda h: isinstance(h, str) and len(h) <= 64, length=3)}),
    MessageType("partial_sum", "member", lambda: {"contributors": ["QmAlpha", "QmBravo"], "weight": 3.0},
                _refusing(PartialSum.from_wire, MessageError),
                {"contributors": list_of(lambda x: isinstance(x, str)), "weight": within(0, 1e18, high_open=True)},
                whole=lambda v: len(set(v["contributors"])) == len(v["contributors"])),
    MessageType("accounts", "reducer", lambda: {"contributors": ["QmAlpha"], "rejected": [], "total_weight": 3.0,
                                                "radius": 0.5, "cap": 2.0},
                _refusing(Averaged.from_wire, MessageError),
                {"contributors": list_of(lambda x: isinstance(x, str)), "rejected": list_of(lambda x: isinstance(x, str)),
                 "total_weight": lambda x: isinstance(x, float) and math.isfinite(x) and x >= 0,
                 # (inf: a group of two's radius, or no cap; a verified member refuses a chunk without either)
                 "radius": lambda x: x is None or (isinstance(x, float) and x >= 0),
                 "cap": lambda x: x is None or (isinstance(x, float) and x >= 0)},
                may_omit=frozenset({"rejected", "radius", "cap"})),
]
MESSAGE_TYPES.append(MessageType("invite", "owner", _invite_seed, _invite_parse,
                                 {name: _as_signed(name) for name in INVITE_FIELDS}))
# ---- stream messages, sent to the real servers (and read by the real clients) in this process -----------------
# Each server below is the real one (DirectStreams, StateServer, DataServer, GroupPush, StageServer), listening on
# 127.0.0.1 and served as SwarmNode serves a stream: every message goes over a socket, the answer is read to its end,
# and once every mutation went through, the server must still answer an honest request and hold nothing it was sent.
# A client (a joiner reading a holder's header, a data fetcher, a stage hop) reads a scripted answer instead. They
# are made on first use in a run, and stopped at its end (_shutdown).
STALL = 5.0  # s a server or client may take over one message here before it counts as stalled
PUSHED_BOUND = 16  # (round, attempt) keys whose pushed groups a peer keeps (group_push.PUSHED_KEYS)
REASONS_BOUND = 16  # reasons a server counts its refusals by: more means it counts what the senders wrote
_live: dict = {}


class Misbehaved(Exception):
    """A server or client did with a message what its protocol does not say (answered other bytes, kept what it
    refused, gave no answer in time): a violation whatever the message."""


@dataclass(frozen=True)
class Variant:
    """A message sent otherwise than the seed: by another peer than its sender (`by`), after another one the
    receiver took first (`after`), as bytes that are no msgpack (`raw`: the frame's body), or followed by other
    frames (`frames`)."""

    message: Any = None
    by: Optional[str] = None
    after: Any = None
    raw: Optional[bytes] = None
    frames: Optional[tuple[bytes, ...]] = None


def _variant(value: Any) -> Variant:
    return value if isinstance(value, Variant) else Variant(message=value)


def _on_the_wire(value: Any) -> Any:
    """`value` as its receiver decodes it; TypeError, ValueError or OverflowError if msgpack cannot carry it."""
    if isinstance(value, Variant):
        return replace(value, message=None if value.raw is not None else _on_the_wire(value.message),
                       after=None if value.after is None else _on_the_wire(value.after))
    return msgpack.unpackb(msgpack.packb(value))


def _body(variant: Variant) -> bytes:
    return variant.raw if variant.raw is not None else msgpack.packb(variant.message)


def _frame(data: bytes) -> bytes:
    return FRAME_HEADER.pack(len(data)) + data


def _frames_of(data: bytes) -> list[bytes]:
    """The frames an answer is made of."""
    frames, at = [], 0
    while at < len(data):
        start = at + FRAME_HEADER.size
        end = start + FRAME_HEADER.unpack_from(data, at)[0] if start <= len(data) else start
        if end > len(data):
            raise Misbehaved("answered a frame cut short")
        frames.append(data[start:end])
        at = end
    return frames


def _raw_frames(max_bytes: int) -> Iterator[tuple[str, str, Any, bool]]:
    """Frames that hold no message: empty, not msgpack, msgpack cut short, a list nested as deep as the frame allows
    (msgpack refuses past 1,024 levels; below that, Python's repr of it recurses too deep), or longer than the
    receiver reads."""
    for raw in (b"", b"\xc1", b"\x93\x01", b"\xa5abc"):
        yield "wrong type", "<frame>", Variant(raw=raw), False
    for depth in (min(max_bytes - 1, 1000), min(max_bytes - 1, 5000)):
        yield "nested", "<frame>", Variant(raw=b"\x91" * depth + b"\xc0"), False
    yield "overlong", "<frame>", Variant(raw=b"\xc0" * (max_bytes + 1)), False


def _loop() -> asyncio.AbstractEventLoop:
    if "loop" not in _live:
        _live.update(loop=asyncio.new_event_loop(), closers=[])
    return _live["loop"]


def _run(coroutine: Any) -> Any:
    """`coroutine` run on this run's loop; Misbehaved if it takes over STALL s."""
    async def bounded() -> Any:
        try:
            return await asyncio.wait_for(coroutine, STALL)
        except asyncio.TimeoutError:
            raise Misbehaved(f"no answer within {STALL:g} s") from None
    return _loop().run_until_complete(bounded())


def _shutdown() -> None:
    """Stop this run's servers, their loop and threads, and remove their files."""
    loop = _live.get("loop")
    if loop is not None:
        for close in reversed(_live["closers"]):
            close()

        async def settle() -> None:
            pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await asyncio.sleep(0)

        loop.run_until_complete(settle())
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
    _live.clear()


class LocalServer:
    """`handle(remote, reader, writer)` served on 127.0.0.1 as SwarmNode serves a stream: the remote is the peer id
    the caller names (authenticated, on a real node), the stream is closed once the handler returns, and what the
    handler raises closes it too. `errors`: what it raises to refuse a request; another exception is a violation."""

    def __init__(self, handle: Callable, errors: tuple[type, ...]):
        self.handle, self.errors = handle, errors
        self.listener: Optional[asyncio.base_events.Server] = None
        self.remote, self.raised, self.done = "", None, asyncio.Event()
        self.serving: set[asyncio.Task] = set()  # (held: asyncio holds a stalled handler's task only weakly)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.serving.add(task)
        try:
            await self.handle(self.remote, reader, writer)
        except Exception as e:  # noqa: BLE001 - judged by ask()
            self.raised = e
        except asyncio.CancelledError:  # (the run ends: a handler that stalled is stopped)
            return
        finally:
            try:  # (read what the handler left, so that closing sends no reset that loses its answer)
                await asyncio.wait_for(reader.read(), 1.0)
            except (asyncio.TimeoutError, ConnectionError):
                pass
            writer.close()
            self.done.set()
            self.serving.discard(task)

    async def ask(self, remote: str, request: bytes) -> tuple[bytes, Optional[Exception]]:
        """`request` sent by `remote`, then its answer to the end: (answer, the handler's refusal or None)."""
        if self.listener is None:
            self.listener = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            _live["closers"].append(self.listener.close)
        self.remote, self.raised, self.done = remote, None, asyncio.Event()
        reader, writer = await asyncio.open_connection(*self.listener.sockets[0].getsockname()[:2])
        try:
            writer.write(request)
            writer.write_eof()
            answer = await reader.read()
        finally:
            writer.close()
        await self.done.wait()
        if self.raised is not None and not isinstance(self.raised, self.errors):
            raise self.raised
        if self.raised is not None and answer:
            raise Misbehaved(f"answered, then refused ({type(self.raised).__name__}: {self.raised})")
        return answer, self.raised


class _Sink:
    """The request side of a scripted stream: what the client writes goes nowhere."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class Scripted:
    """What a client needs of a SwarmNode: every stream it opens answers `answer`, then ends."""

    peer_id = "QmClient"

    def __init__(self, answer: bytes):
        self.answer = answer

    async def open_stream(self, peer_id: str, protocol: str, *args: Any) -> tuple[asyncio.StreamReader, _Sink]:
        reader = asyncio.StreamReader()
        reader.feed_data(self.answer)
        reader.feed_eof()
        return reader, _Sink()


_keys: list = []


def _key(index: int):
    """This process's identity number `index` (made once: an RSA key takes a moment)."""
    while len(_keys) <= index:
        _keys.extend(_identities(1))
    return _keys[index]


def _equal_to(expected: Callable[[], Any]) -> Callable[[Any], bool]:
    return lambda x: type(x) is type(expected()) and x == expected()


# The direct-stream handshake (dht/direct.py): the frame an opener sends over TLS, before the receiver's ACCEPTED.
DIRECT_PROTOCOL = "swarm.run.fuzz"


def _direct() -> dict:
    if "direct" not in _live:
        from swarm.dht.direct import DirectStreams, _signed_message
        receiver, served, raised = DirectStreams(_key(0), ["127.0.0.1"], [], 0, listen=True), [], []
        _run(receiver.start())
        _live["closers"].append(receiver.close)

        async def handler(remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            served.append(remote)
            writer.write(b"served")
            await writer.drain()
            writer.close()

        authenticate = receiver._authenticate

        async def recorded(reader: asyncio.StreamReader) -> Any:  # (the receiver only logs why it refused)
            try:
                return await authenticate(reader)
            except Exception as e:
                raised.append(e)
                raise

        receiver.handlers[DIRECT_PROTOCOL], receiver._authenticate = handler, recorded

        def sign(fingerprint: bytes, protocol: str, ack: bool) -> bytes:
            return _key(0).private_key.sign(_signed_message(fingerprint, protocol, ack))

        signatures = {ack: sign(receiver.fingerprint, DIRECT_PROTOCOL, ack) for ack in (True, False)}
        _live["direct"] = {"receiver": receiver, "served": served, "raised": raised, "sign": sign,
                           "signatures": signatures}
    return _live["direct"]


def handshake_seed() -> dict:
    return {"peer": _key(0).peer_id, "key": _key(0).public_key.decode(), "protocol": DIRECT_PROTOCOL, "ack": True,
            "signature": _direct()["signatures"][True]}


def _gives_opener(key: Any) -> bool:
    """An RSA public key (OpenSSH form) whose peer id is the opener's: its key, however written."""
    from swarm.dht.validation import peer_id_of
    try:
        return isinstance(key, str) and peer_id_of(key) == _key(0).peer_id
    except Exception:  # noqa: BLE001 - no key at all
        return False


HANDSHAKE_RULES = {"peer": _equal_to(lambda: _key(0).peer_id), "key": _gives_opener,
                   "protocol": _equal_to(lambda: DIRECT_PROTOCOL), "signature": lambda x: isinstance(x, bytes),
                   "ack": lambda x: True}


def handshake_whole(value: dict) -> bool:
    """The signature is the opener's over this receiver's certificate and the protocol, under the domain of an
    opener that waits for ACCEPTED if it says "ack": True, of one before ACCEPTED otherwise."""
    return value["signature"] == _direct()["signatures"][value.get("ack") is True]


def handshake_others(seed: dict) -> Iterator[tuple[str, str, Any, bool]]:
    direct, other = _direct(), _key(1)
    before_ack = {name: value for name, value in seed.items() if name != "ack"}
    yield "valid", "ack", {**before_ack, "signature": direct["signatures"][False]}, True  # an opener of before ACCEPTED
    yield "inconsistent", "ack", {**seed, "signature": direct["signatures"][False]}, False
    yield "inconsistent", "key", {**seed, "peer": other.peer_id, "key": other.public_key.decode()}, False
    yield "inconsistent", "peer", {**seed, "peer": other.peer_id}, False
    yield "replayed", "signature", {**seed, "signature": direct["sign"](b"\x00" * 32, DIRECT_PROTOCOL, True)}, False
    yield "inconsistent", "protocol", {**seed, "protocol": "swarm.run.other", "signature": direct["sign"](
        direct["receiver"].fingerprint, "swarm.run.other", True)}, False  # signed, but not a protocol it serves
    yield from _raw_frames(MAX_AUTH_BYTES)


async def _open_direct(port: int, data: bytes) -> bytes:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname="")
    try:
        writer.write(data)
        return await reader.read()
    except (ConnectionError, ssl.SSLError):  # cut: refused
        return b""
    finally:
        writer.close()


def _handshake_parse(value: Any) -> bool:
    """Whether the receiver handed the stream to its handler as the opener's (ACCEPTED first if it asked)."""
    from swarm.dht.direct import ACCEPTED, DirectError
    direct, variant = _direct(), _variant(value)
    receiver, served = direct["receiver"], len(direct["served"])
    direct["raised"].clear()
    answer = _run(_open_direct(receiver.port, _frame(_body(variant))))
    for e in direct["raised"]:
        if not isinstance(e, (DirectError, ValueError)):
            raise e
    if receiver.slots.count:
        raise Misbehaved(f"{receiver.slots.count} handshake slots held after the handshake")
    if len(direct["served"]) == served:
        if answer:
            raise Misbehaved(f"refused the stream after answering {answer[:16]!r}")
        return False
    ack = isinstance(variant.message, dict) and variant.message.get("ack") is True
    if direct["served"][-1] != _key(0).peer_id or answer != (ACCEPTED if ack else b"") + b"served":
        raise Misbehaved(f"served the stream as {direct['served'][-1]}, answering {answer[:16]!r} first")
    return True


def _handshake_afterwards() -> Optional[str]:
    from swarm.dht.direct import DirectStreams
    direct = _direct()
    receiver, opener = direct["receiver"], DirectStreams(_key(1), [], [], 0, listen=False)

    async def hello(peer_id: str) -> tuple[dict, list[str]]:
        return receiver.hello(), ["127.0.0.1"]

    async def honest() -> bytes:
        await opener.start()
        opened = await opener.open(_key(0).peer_id, DIRECT_PROTOCOL, hello)
        if opened is None:
            return b"<no direct stream>"
        reader, writer = opened
        try:
            return await reader.read()
        finally:
            writer.close()

    answer = _run(honest())
    if answer != b"served" or direct["served"][-1] != _key(1).peer_id:
        return f"an honest opener got {answer!r} afterwards"
    return f"{receiver.slots.count} handshake slots held" if receiver.slots.count or receiver.slots.pending else None


# State requests and answers (peer/state): a joiner asks a holder for a byte range of its state, or for the outer
# steps it logged; the holder answers a header (then the bytes).
def _state() -> dict:
    if "state" not in _live:
        from swarm.config import OuterRecipe
        from swarm.peer.diloco import DiLoCo
        from swarm.peer.outer import OuterStep
        from swarm.peer.state.serve import StateServer
        diloco = DiLoCo(torch.nn.Linear(4, 4), OuterRecipe())
        step = OuterStep(0, diloco.digest(), "a" * 16, tokens=8, average=torch.ones(diloco.numel))
        diloco.replay_log.append(step)
        server = StateServer(diloco)
        _live["state"] = {"server": server, "step": step, "snapshot": _run(server.current()),
                          "local": LocalServer(server.handle, (ValueError,))}
    return _live["state"]


def state_request_seed() -> dict:
    return {"offset": 0, "length": 64, "sha256": _state()["snapshot"].header["sha256"]}


def state_request_whole(value: dict) -> bool:
    """A range of another state than the holder's (a sha256 it does not hold) is not served; an empty one is."""
    snapshot = _state()["snapshot"]
    return value.get("sha256") in (None, snapshot.header["sha256"]) or value.get("length", 0) == 0 or \
        value.get("offset", 0) >= len(snapshot.payload)


def _state_request_parse(value: Any) -> bool:
    """Whether the holder answered its header and the bytes asked for (its header alone: it does not serve them)."""
    state, variant = _state(), _variant(value)
    answer, refused = _run(state["local"].ask("QmJoiner", _frame(_body(variant))))
    if refused is not None:
        return False
    frames, snapshot = _frames_of(answer), state["snapshot"]
    if not frames or msgpack.unpackb(frames[0]) != snapshot.header:
        raise Misbehaved("answered no header, or another state's")
    if len(state["server"]._kept) > 2:
        raise Misbehaved(f"keeps {len(state['server']._kept)} past snapshots")
    offset, length = variant.message.get("offset", 0), variant.message.get("length", 0)
    asked, sent = snapshot.payload[offset:offset + length], b"".join(frames[1:])
    if sent and sent != asked:
        raise Misbehaved("answered other bytes than those asked for")
    return sent == asked


def state_request_others(seed: dict) -> Iterator[tuple[str, str, Any, bool]]:
    yield "valid", "sha256", {**seed, "sha256": None}, True  # whatever state it holds
    yield "inconsistent", "sha256", {**seed, "sha256": "0" * 64}, False  # a state it no longer holds
    yield from _raw_frames(1024)


def _state_afterwards() -> Optional[str]:
    size = len(_state()["snapshot"].payload)
    return None if _state_request_parse({"offset": 0, "length": size, "sha256": None}) else \
        "refused an honest joiner the whole state afterwards"


def replay_request_seed() -> dict:
    step = _state()["step"]
    return {"replay_from": step.round, "digest": step.digest, "to": step.after, "bodies": True}


def _replay_parse(value: Any) -> bool:
    """Whether the holder listed the step it logged, then sent its bytes unless asked for the listing only (an
    empty listing: it logged no step from that state to that one)."""
    state, variant = _state(), _variant(value)
    answer, refused = _run(state["local"].ask("QmJoiner", _frame(_body(variant))))
    if refused is not None:
        return False
    frames, step = _frames_of(answer), state["step"]
    listing = msgpack.unpackb(frames[0]) if frames else None
    if listing in ({"steps": []}, state["snapshot"].header) and len(frames) == 1:
        return False  # (no step from there; or, without replay_from, no replay asked: the header of an empty range)
    body = step.average.numpy().tobytes() if variant.message.get("bodies", True) else b""
    if listing != {"steps": [{"round": step.round, "digest": step.digest, "after": step.after, "tokens": step.tokens,
                              "chunks": None}]} or b"".join(frames[1:]) != body:
        raise Misbehaved(f"listed or sent other steps than its log holds: {_short(listing)}")
    return True


def replay_request_others(seed: dict) -> Iterator[tuple[str, str, Any, bool]]:
    yield "valid", "bodies", {**seed, "bodies": False}, True  # the listing only
    yield "inconsistent", "to", {**seed, "to": "b" * 16}, False  # params its log does not reach
    yield from _raw_frames(1024)


def _replay_afterwards() -> Optional[str]:
    return None if _replay_parse(replay_request_seed()) else "refused an honest replay afterwards"


def _state_answer_parse(value: Any) -> bool:
    """Whether a joiner takes a holder's answer as its header (download._request, as a download first asks)."""
    from swarm.peer.state.download import _request
    try:
        _run(_request(Scripted(_frame(_body(_variant(value)))), "QmHolder", "run", 0, 0, None, STALL))
    except (ValueError, asyncio.IncompleteReadError):
        return False
    return True


# Data requests and answers (data/share.py): a fetcher asks a holder for a range of a dataset file.
class _Manifest:
    """What DataServer reads of a manifest: its files, id and bytes."""

    def __init__(self, entry):
        self.files, self.id = [entry], hashlib.sha256(b"manifest").hexdigest()

    def to_bytes(self) -> bytes:
        return b"manifest"


def _data() -> dict:
    if "data" not in _live:
        from swarm.data.dataset import FileStore
        from swarm.data.share import DataServer
        directory = Path(tempfile.mkdtemp(prefix="fuzz-protocol-"))
        _loop()
        _live["closers"].append(lambda: shutil.rmtree(directory, ignore_errors=True))
        store, content = FileStore(directory / "held"), bytes(range(256)) * 5
        entry = store.add(content)
        server = DataServer(_Manifest(entry), store)
        _live["data"] = {"server": server, "entry": entry, "content": content, "fetched": FileStore(directory / "got"),
                         "local": LocalServer(server.handle, (ValueError,))}
    return _live["data"]


def data_request_seed() -> dict:
    return {"sha256": _data()["entry"].sha256, "offset": 0}


def _data_request_parse(value: Any) -> bool:
    """Whether the holder answered the file's size and its range from `offset` ({"size": None}: not served)."""
    data, variant = _data(), _variant(value)
    answer, refused = _run(data["local"].ask("QmFetcher", _frame(_body(variant))))
    if data["server"].answering:
        raise Misbehaved("still counts a request it answered")
    if refused is not None:
        return False
    frames = _frames_of(answer)
    header = msgpack.unpackb(frames[0]) if frames else None
    if header == {"size": None} and len(frames) == 1:
        return False
    offset = variant.message["offset"]
    if header != {"size": data["entry"].size} or \
            b"".join(frames[1:]) != data["content"][offset:offset + DATA_RANGE_BYTES]:
        raise Misbehaved(f"answered {_short(header)} and other bytes than the range asked for")
    return True


def data_request_others(seed: dict) -> Iterator[tuple[str, str, Any, bool]]:
    yield "inconsistent", "sha256", {**seed, "sha256": _Manifest(None).id}, False  # listed, but not held
    yield "inconsistent", "sha256", {**seed, "sha256": "0" * 64}, False
    yield from _raw_frames(1024)


def _data_afterwards() -> Optional[str]:
    server = _data()["server"]
    if not _data_request_parse(data_request_seed()):
        return "refused an honest fetcher afterwards"
    return f"counts refusals by {len(server.refused)} reasons" if len(server.refused) > REASONS_BOUND else None


def _data_answer_parse(value: Any) -> bool:
    """Whether a fetcher takes a holder's answer to its request and reads the file's bytes after it (DataFetcher:
    whether the bytes are the file's it checks once all are in)."""
    from swarm.data.share import DataFetcher
    data, variant = _data(), _variant(value)
    frames = variant.frames if variant.frames is not None else (data["content"],)
    fetcher = DataFetcher(Scripted(_frame(_body(variant)) + b"".join(map(_frame, frames))), "run", "dataset",
                          data["fetched"], stall=STALL)
    incoming = data["fetched"].incoming(data["entry"].sha256)
    try:
        held = _run(fetcher._from("QmHolder", data["entry"], incoming))
    except (ValueError, asyncio.IncompleteReadError):
        return False
    finally:
        incoming.discard()
    if held and incoming.size != data["entry"].size:
        raise Misbehaved(f"took {incoming.size} bytes of a {data['entry'].size}-byte file as the whole")
    return held


def data_answer_others(seed: dict) -> Iterator[tuple[str, str, Any, bool]]:
    content = _data()["content"]
    yield "inconsistent", "size", {"size": None, "busy": "64 requests are being answered"}, False
    yield "inconsistent", "<bytes>", Variant(message=seed, frames=(content[:-1],)), False
    yield "overlong", "<bytes>", Variant(message=seed, frames=(content + b"x",)), False
    yield from _raw_frames(1024)


# Group pushes (averaging/group_push.py): a leader sends its group straight to the members.
def _push() -> dict:
    if "push" not in _live:
        push = GroupPush(None, "run", verified=True)
        _live["push"] = {"push": push, "local": LocalServer(push._on_stream, (ValueError,))}
    return _live["push"]


def push_seed() -> dict:
    return {"round": ROUND, "attempt": ATTEMPT, "final": final_seed()}


def _rounds_led(by_leader: bool, count: int, start: int = ROUND + 1) -> list[int]:
    """`count` rounds from `start` on whose group of MEMBERS LEADER leads (`by_leader`), or another member does."""
    rounds = range(start, start + 64 * count)
    return [r for r in rounds if (leader_of(MEMBERS, r, ATTEMPT) == LEADER) == by_leader][:count]


def _push_parse(value: Any) -> bool:
    """Whether the member took the group as its sender's for that round and attempt (it answers "ok")."""
    pushed, variant = _push(), _variant(value)
    push, sender = pushed["push"], variant.by or LEADER
    before = {key: dict(finals) for key, finals in push._finals.items()}
    answer, refused = _run(pushed["local"].ask(sender, _frame(_body(variant))))
    if len(push._arrived) > PUSHED_BOUND or len(push._finals) > PUSHED_BOUND:
        raise Misbehaved(f"keeps pushed groups of {len(push._finals)} (round, attempt) keys")
    if refused is not None:
        if {key: dict(finals) for key, finals in push._finals.items()} != before:
            raise Misbehaved("a refused push changed the groups it holds")
        return False
    if _frames_of(answer) != [b"ok"] or \
            sender not in push.finals(variant.message["round"], variant.message["attempt"], set()):
        raise Misbehaved(f"answered {answer[:16]!r} without holding the group")
    return True


def push_others(seed: dict) -> Iterator[tuple[str, str, Any, bool]]:
    yield "inconsistent", "<sender>", Variant(message=seed, by=next(m for m in MEMBERS if m != LEADER)), False
    yield "replayed", "round", {**seed, "round": _rounds_led(True, 1)[0]}, True  # (its members check it again)
    yield "replayed", "round", {**seed, "round": _rounds_led(False, 1)[0]}, False  # another member leads it
    yield from _raw_frames(MAX_PUSH_BYTES)


def _push_afterwards() -> Optional[str]:
    """Groups pushed for 3x the keys a member keeps, all of them the sender's to lead: it keeps the newest."""
    push = _push()["push"]
    for round_no in _rounds_led(True, 3 * PUSHED_BOUND, start=1000):
        if not _push_parse({**push_seed(), "round": round_no}):
            return f"refused an honest push of round {round_no} afterwards"
    return f"keeps pushed groups of {len(push._finals)} keys" if len(push._finals) > PUSHED_BOUND else None


# The owner's revocation list (dht/admission.py), as node.read_revocations reads it under the run's revocations key.
REVOCATION_FIELDS = ("owner", "run_id", "issued", "revoked", "signature")


def _revocations() -> dict:
    _invite_seed()
    if "revocations" not in _invite_parts:
        from swarm.dht.admission import MAX_REVOKED, Revocation, _sign
        owner, peer, now = _invite_parts["owner"], _invite_parts["peer"], time.time()
        older = Revocation.sign(owner, "run", ["QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"], now=now - 60)
        newer = Revocation.sign(owner, "run", [peer], previous=older, now=now)
        unsigned = Revocation(owner.peer_id, "run", newer.issued + 1,
                              {f"QmFuzz{i:040d}": int(now) for i in range(MAX_REVOKED + 1)})
        lists = {"older": older, "newer": newer,
                 "too_many": replace(unsigned, signature=_sign(owner, unsigned.message())),
                 "other_run": Revocation.sign(owner, "other", [peer], now=now),
                 "other_owner": Revocation.sign(_invite_parts["peer_identity"], "run", [peer], now=now)}
        _invite_parts["revocations"] = {name: {"owner": r.owner, "run_id": r.run_id, "issued": r.issued, "revoked": [
            list(item) for item in sorted(r.revoked.items())], "signature": r.signature} for name, r in lists.items()}
    return _invite_parts["revocations"]


def revocation_seed() -> dict:
    return dict(_revocations()["newer"])


def _revoked_rule(x: Any) -> bool:
    """The owner signs the set of (peer id, time) pairs: listed in any order, or twice, it is the same word."""
    from swarm.dht.admission import MAX_REVOKED
    return isinstance(x, list) and len(x) <= MAX_REVOKED and all(
        isinstance(e, list) and len(e) == 2 and type(e[0]) is str and type(e[1]) is int for e in x) and \
        dict(map(tuple, x)) == dict(map(tuple, _revocations()["newer"]["revoked"]))


REVOCATION_RULES = {**{name: _equal_to(lambda name=name: _revocations()["newer"][name])
                       for name in REVOCATION_FIELDS}, "revoked": _revoked_rule}


def _packed_list(fields: Any) -> bytes:
    return msgpack.packb([fields[name] for name in REVOCATION_FIELDS if name in fields]
                         if isinstance(fields, dict) else fields)


def _revocation_parse(value: Any) -> bool:
    """Whether a node of the owner's private run follows the list (Admission.follow_entries, as node.read_revocations
    calls it): then, and only then, it refuses the peer the list revokes."""
    from swarm.dht.admission import REVOCATION_FIELD, Admission
    variant, owner, peer, invite = (_variant(value), *(_invite_parts[k] for k in ("owner", "peer", "invite")))
    admission, token = Admission(owner.peer_id, owner.public_key.decode(), "run"), invite.token()
    if not admission.admits(peer, token):
        raise Misbehaved("refuses an invite before any list")
    if variant.after is not None:
        admission.follow_entries({owner.owned_subkey: {REVOCATION_FIELD: _packed_list(variant.after)}})
    held = admission.revocation
    packed = variant.raw if variant.raw is not None else _packed_list(variant.message)
    changed = admission.follow_entries({variant.by or owner.owned_subkey: {REVOCATION_FIELD: packed}})
    revoked = admission.revocation is not None and admission.revocation.voids(invite) is not None
    if admission.admits(peer, token) == revoked or admission.admits(peer) == revoked:
        raise Misbehaved("admits a peer its list revokes, or refuses one no list revokes")
    if changed == (admission.revocation is held):
        raise Misbehaved("says it followed a list and holds the one before, or the other way round")
    return changed


def revocation_others(seed: dict) -> Iterator[tuple[str, str, Any, bool]]:
    lists = _revocations()
    yield "valid", "issued", Variant(message=seed, after=lists["older"]), True  # newer than the list held
    yield "replayed", "issued", Variant(message=lists["older"], after=seed), False  # older than the list held
    yield "replayed", "-", Variant(message=seed, after=seed), False  # the list held, again
    yield "inconsistent", "run_id", lists["other_run"], False  # the owner's, for another of its runs
    yield "inconsistent", "owner", lists["other_owner"], False  # another key's
    yield "huge", "revoked", lists["too_many"], False  # the owner's, over MAX_REVOKED peers
    yield "inconsistent", "<writer>", Variant(message=seed, by=_invite_parts["peer_identity"].owned_subkey), False
    for raw in (b"", b"\xc1", msgpack.packb([1, 2, 3, 4, 5])):
        yield "wrong type", "<list>", Variant(raw=raw), False


# Pipeline frames (peer/pipeline): a microbatch's header, activations and token ids to a stage server, and its answer;
# token ids to a first-stage peer that computes its activations again (recompute.py), and its answer.
PIPE_HIDDEN, PIPE_VOCAB, PIPE_TOKENS = 4, 10, 64
NEXT_STAGE = "QmNextStage"  # the one peer a first-stage peer here computes activations again for


class _OneLayer(torch.nn.Module):
    """A stage of one layer (what StageWorker needs: `first`, `last` and a module): a first stage's embedding, or a
    last stage's linear layer."""

    def __init__(self, first: bool):
        super().__init__()
        self.first, self.last = first, not first
        self.embed = None  # (no bottleneck before it: swarm.model.stages.Stage)
        self.layer = torch.nn.Embedding(PIPE_VOCAB, PIPE_HIDDEN) if first else torch.nn.Linear(PIPE_HIDDEN, PIPE_VOCAB)

    def forward(self, x: torch.Tensor, ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.layer(x)


def _worker(first: bool) -> Any:
    from swarm.peer.pipeline.worker import StageWorker
    stage = _OneLayer(first)
    return StageWorker(stage, torch.optim.SGD(stage.parameters(), lr=0.0), lambda: 0.0, grad_clip=1.0)


def _stage() -> dict:
    if "stage" not in _live:
        from swarm.peer.pipeline.server import StageServer
        server = StageServer(_worker(first=False), PIPE_HIDDEN, PIPE_TOKENS, PIPE_VOCAB, _loop())
        # (the stage right after the first: it takes whole rows, and would have a share of the activations computed
        # again by the first stage's other peers; the sender, a client, is the only one here: its activations stand)
        server.verify = Recheck(None, "swarm.run.recompute.0-1", lambda: [("QmUpstream", True, 0)], server.check,
                                share=1.0)
        _live["closers"].append(lambda: server._thread is not None and server._thread.shutdown())
        _live["stage"] = {"server": server, "activations": get_codec("none").encode(torch.ones(2 * PIPE_HIDDEN)),
                          "targets": np.zeros(3, np.int32).tobytes(),  # (a row of 2 inputs and 2 targets)
                          "local": LocalServer(server.handle, (ValueError,))}
    return _live["stage"]


def stage_request_seed() -> dict:
    return {"shape": [1, 2, PIPE_HIDDEN], "codec": "none", "scale": 1.0, "eval": False, "round": 0}


STAGE_REQUEST_RULES = {
    "shape": lambda x: list_of(integer(1, 1 << 64), length=3)(x) and x[2] == PIPE_HIDDEN and x[0] * x[1] <= PIPE_TOKENS,
    "codec": lambda x: isinstance(x, str) and x in ("none", "fp16", "bf16", "int8"),
    "scale": lambda x: isinstance(x, float) and 0 < x <= 1, "eval": is_bool,
    "round": lambda x: x is None or isinstance(x, int) and not isinstance(x, bool) and x >= 0}


def _stage_request_parse(value: Any) -> bool:
    """Whether the stage server computed the microbatch: a loss, then (unless it is a validation microbatch) the
    gradient of its activations; {"error": reason} is a refusal."""
    stage, variant = _stage(), _variant(value)
    served = _served(stage, variant, (stage["activations"], stage["targets"]), "QmUpstream", stage["server"].waiting)
    if served is None:
        return False
    header, answered = served
    evaluate = variant.message.get("eval") is True
    if not (isinstance(header, dict) and isinstance(header.get("loss"), float) and math.isfinite(header["loss"])
            and len(answered) == (1 if evaluate else 2)
            and (evaluate or decode(answered[1]).numel() == 2 * PIPE_HIDDEN)):
        raise Misbehaved(f"answered {_short(header)} in {len(answered)} frames")
    return True


def _served(live: dict, variant: Variant, frames: tuple[bytes, ...], sender: str,
            held: Counter) -> Optional[tuple[Any, list[bytes]]]:
    """`variant` sent to a pipeline server (`live["local"]`), by `sender` unless it says otherwise, after its header
    `frames` unless it gives its own: None when refused (a raised refusal, a closed stream, or {"error": reason}
    alone), else (the answer's header, its frames). Misbehaved if the server still holds (`held`) what it answered."""
    frames = variant.frames if variant.frames is not None else frames
    answer, refused = _run(live["local"].ask(variant.by or sender,
                                             _frame(_body(variant)) + b"".join(map(_frame, frames))))
    if held:
        raise Misbehaved(f"holds {sum(held.values())} requests it answered")
    if refused is not None or not answer:  # (a stream closed with no answer: one that sent less than it said)
        return None
    answered = _frames_of(answer)
    header = msgpack.unpackb(answered[0]) if answered else None
    if isinstance(header, dict) and set(header) == {"error"} and isinstance(header["error"], str) and \
            len(answered) == 1:
        return None
    return header, answered


def _non_finite(payload: bytes, value: float) -> bytes:
    """A raw fp32 payload whose last value is `value` (no codec encodes NaN or inf)."""
    return payload[:-4] + np.float32(value).tobytes()


def stage_request_others(seed: dict) -> Iterator[tuple[str, str, Any, bool]]:
    stage, none = _stage(), get_codec("none")

    def sent(activations: bytes, targets: bytes = stage["targets"]) -> Variant:
        return Variant(message=seed, frames=(activations, targets))

    yield "valid", "<activations>", sent(get_codec("fp16").encode(torch.ones(2 * PIPE_HIDDEN))), True
    for special in (math.nan, math.inf):
        yield "nan/inf", "<activations>", sent(_non_finite(stage["activations"], special)), False
    yield "inconsistent", "<activations>", sent(none.encode(torch.ones(2 * PIPE_HIDDEN - 1))), False
    yield "inconsistent", "<activations>", sent(none.encode(torch.ones(2 * PIPE_HIDDEN + 1))), False
    yield "wrong type", "<activations>", sent(b"\x00" * 40), False
    yield "overlong", "<activations>", sent(b"\x00" * (payload_bound(2 * PIPE_HIDDEN) + 1)), False
    yield "huge", "<targets>", sent(stage["activations"], np.full(2, PIPE_VOCAB, np.int32).tobytes()), False
    yield "negative", "<targets>", sent(stage["activations"], np.full(2, -1, np.int32).tobytes()), False
    yield "inconsistent", "<targets>", sent(stage["activations"], np.zeros(1, np.int32).tobytes()), False
    yield "omit", "<inputs>", sent(stage["activations"], np.zeros(2, np.int32).tobytes()), False  # (targets alone)
    yield "inconsistent", "<sender>", Variant(message=seed, by="QmStranger"), False  # (no first-stage peer it knows)
    yield "overlong", "<targets>", sent(stage["activations"], np.zeros(4, np.int32).tobytes()), False
    yield from _raw_frames(PIPE_HEADER_BYTES)


def _served_afterwards(live: str, parse: Callable[[Any], bool], seed: Callable[[], dict],
                       what: str) -> Callable[[], Optional[str]]:
    """A pipeline server's check once every mutation went through it (`_live[live]`): it still serves an honest
    `what`, and counts its refusals by a bounded set of reasons."""
    def afterwards() -> Optional[str]:
        if not parse(seed()):
            return f"refused an honest {what} afterwards"
        refused = _live[live]["server"].refused
        if len(refused) > REASONS_BOUND:
            return f"counts its refusals by {len(refused)} reasons, as the senders wrote them (memory without bound)"
        return None
    return afterwards


def _stage_answer_parse(value: Any) -> bool:
    """Whether a stage hop (routing.call_stage) takes a stage peer's answer: its loss, then the gradient of the
    activations it was sent."""
    from swarm.peer.pipeline.routing import WireMeter, call_stage
    variant, x = _variant(value), torch.ones(1, 2, PIPE_HIDDEN)
    frames = variant.frames if variant.frames is not None else \
        (get_codec("none").encode(torch.full((2 * PIPE_HIDDEN,), 0.5)),)
    node = Scripted(_frame(_body(variant)) + b"".join(map(_frame, frames)))
    try:
        grad, loss = _run(call_stage(node, "QmStage", "swarm.run.stage.1-2", x, torch.zeros(1, 2, dtype=torch.long),
                                     "none", WireMeter(), STALL))[:2]
    except (PipelineError, ValueError, asyncio.IncompleteReadError):
        return False
    if grad is None or grad.shape != x.shape or loss != variant.message["loss"]:
        raise Misbehaved(f"took a loss of {loss!r} and a gradient of {None if grad is None else tuple(grad.shape)}")
    return True


def stage_answer_others(seed: dict, tensor: str = "<gradient>") -> Iterator[tuple[str, str, Any, bool]]:
    """A stage peer's answer with other tensors after its header (the gradient; or a first-stage peer's activations
    computed again), and other errors."""
    none, values = get_codec("none"), torch.full((2 * PIPE_HIDDEN,), 0.5)

    def gradient(*frames: bytes) -> Variant:
        return Variant(message=seed, frames=frames)

    yield "valid", tensor, gradient(get_codec("fp16").encode(values)), True
    for special in (math.nan, math.inf):
        yield "nan/inf", tensor, gradient(_non_finite(none.encode(values), special)), False
    yield "inconsistent", tensor, gradient(none.encode(values[:-1])), False
    yield "wrong type", tensor, gradient(b"\x00" * 40), False
    yield "overlong", tensor, gradient(b"\x00" * (payload_bound(2 * PIPE_HIDDEN) + 1)), False
    yield "omit", tensor, gradient(), False
    yield "inconsistent", "error", {"error": "busy: 8 microbatches are here already; try another peer"}, False
    yield "inconsistent", "error", {**seed, "error": "x"}, False
    yield "inconsistent", "error", {**seed, "error": None}, False
    # an error that is a list nested 1,000 deep (msgpack a peer writes by hand: packb stops at 511 levels)
    yield "nested", "error", Variant(raw=b"\x81\xa5error" + b"\x91" * 1000 + b"\xc0"), False
    yield from _raw_frames(PIPE_HEADER_BYTES)


def _recompute() -> dict:
    if "recompute" not in _live:
        server = RecomputeServer(_worker(first=True), PIPE_TOKENS, PIPE_VOCAB, lambda: {NEXT_STAGE}, _loop())
        server.round = lambda: 0
        _live["closers"].append(lambda: server._thread is not None and server._thread.shutdown())
        _live["recompute"] = {"server": server, "ids": np.zeros(2, np.int32).tobytes(),
                              "local": LocalServer(server.handle, (ValueError,))}
    return _live["recompute"]


def recompute_request_seed() -> dict:
    return {"shape": [1, 2], "codec": "none"}


def _recompute_request_parse(value: Any) -> bool:
    """Whether the first-stage peer computed the activations again: a header with its round, then the activations;
    {"error": reason} is a refusal."""
    recompute, variant = _recompute(), _variant(value)
    served = _served(recompute, variant, (recompute["ids"],), NEXT_STAGE, recompute["server"].running)
    if served is None:
        return False
    header, answered = served
    if not (isinstance(header, dict) and header.get("round") == 0 and len(answered) == 2
            and decode(answered[1]).numel() == 2 * PIPE_HIDDEN):
        raise Misbehaved(f"answered {_short(header)} in {len(answered)} frames")
    return True


def recompute_request_others(seed: dict) -> Iterator[tuple[str, str, Any, bool]]:
    def sent(*frames: bytes) -> Variant:
        return Variant(message=seed, frames=frames)

    yield "huge", "<ids>", sent(np.full(2, PIPE_VOCAB, np.int32).tobytes()), False
    yield "negative", "<ids>", sent(np.full(2, -1, np.int32).tobytes()), False
    yield "inconsistent", "<ids>", sent(np.zeros(1, np.int32).tobytes()), False
    yield "overlong", "<ids>", sent(np.zeros(3, np.int32).tobytes()), False
    yield "omit", "<ids>", sent(), False
    yield "inconsistent", "<asker>", Variant(message=seed, by="QmStranger"), False  # (not of the next stage)
    yield from _raw_frames(PIPE_HEADER_BYTES)


def _recompute_answer_parse(value: Any) -> bool:
    """Whether the stage after the first (recompute.ask_recompute) takes a first-stage peer's activations computed
    again: a header with its round, then activations of the shape asked for."""
    variant = _variant(value)
    frames = variant.frames if variant.frames is not None else \
        (get_codec("none").encode(torch.full((2 * PIPE_HIDDEN,), 0.5)),)
    node = Scripted(_frame(_body(variant)) + b"".join(map(_frame, frames)))
    try:
        out, round_no = _run(ask_recompute(node, "QmFirst", "swarm.run.recompute.0-1",
                                           torch.zeros(1, 2, dtype=torch.long), PIPE_HIDDEN, "none", STALL))
    except (PipelineError, ValueError, asyncio.IncompleteReadError):
        return False
    if out.shape != (1, 2, PIPE_HIDDEN) or round_no != variant.message.get("round"):
        raise Misbehaved(f"took activations of shape {tuple(out.shape)} of round {round_no!r}")
    return True


# The run recipe's record (records.recipe_value), under RECIPE_KEY in an owned subkey: anyone may publish one in
# their own, so a peer must follow its trusted owner's (--initial-peers) whatever the others hold, and the owner's
# only as signed: "json" its canonical JSON and "digest" that recipe's hash, "dataset" a dataset id or anything
# (then it names none), "invites" read in an invite-only run alone. A record that no parser takes (nested deeper
# than Python's JSON parser goes, a number too long for int(), over a record's size) is refused with one line.
_recipe_parts: dict = {}


def _recipe_keys() -> dict:
    if not _recipe_parts:
        from swarm.config import Recipe
        from swarm.dht.records import recipe_value
        from swarm.dht.validation import Identity
        from hivemind.utils.crypto import RSAPrivateKey
        owner, stranger = (Identity(RSAPrivateKey(), path="", ephemeral=False) for _ in range(2))
        recipe = Recipe(run_id="fuzz")
        _recipe_parts.update(owner=owner, stranger=stranger, recipe=recipe,
                             seed=recipe_value(recipe, dataset="ab" * 32))
    return _recipe_parts


def recipe_seed() -> dict:
    return dict(_recipe_keys()["seed"])


def _recipe_parse(value: Any) -> bool:
    """Whether a peer that trusts the owner follows the owner's record `value` (records.parse_recipes, then
    choose_recipe as fetch_run calls them); and the same `value` in a stranger's subkey beside the owner's seed
    record must leave the owner's recipe followed. Every refusal is one line."""
    from swarm.config import RecipeError
    from swarm.dht.records import choose_recipe, parse_recipes
    keys = _recipe_keys()
    owner, stranger = keys["owner"], keys["stranger"]
    recipes, problems = parse_recipes({owner.owned_subkey: keys["seed"], stranger.owned_subkey: value})
    if choose_recipe(recipes, problems, [owner.peer_id]) != (owner.peer_id, keys["recipe"]):
        raise Misbehaved("a stranger's recipe record changed which recipe the owner's peers follow")
    recipes, problems = parse_recipes({owner.owned_subkey: value})
    if any(len(problem.splitlines()) != 1 or len(problem) > 400 for problem in problems.values()):
        raise Misbehaved(f"refused a recipe record with more than one short line: {list(problems.values())!r:.120}")
    try:
        return choose_recipe(recipes, problems, [owner.peer_id]) is not None
    except RecipeError as e:
        if len(str(e).splitlines()) != 1:
            raise Misbehaved(f"refused a recipe record with more than one line: {str(e)!r:.120}") from None
        return False


def _same_recipe_text(x: Any) -> bool:
    """Text that means the seed's recipe: the same fields (whitespace aside), which is what its digest hashes."""
    try:
        return isinstance(x, str) and json.loads(x) == json.loads(_recipe_keys()["seed"]["json"])
    except (ValueError, RecursionError):
        return False


RECIPE_NESTED = json.loads("[" * 900 + "]" * 900)  # (as deep as JSON text the parser takes goes)


def recipe_others(seed: dict) -> Iterator[tuple[str, str, Any, bool]]:
    """Texts no parser takes, and the recipe's own fields mutated under the seed's digest: the hash is of the recipe
    the text means, so a field left out, or null where its default is null, means the seed's own recipe (the seed
    is all defaults but run_id) and is followed; any other change breaks the hash and is refused. Another run's
    recipe with its own digest is the owner's word."""
    from swarm.config import MAX_RECIPE_JSON, Recipe
    from swarm.dht.records import recipe_value
    text = seed["json"]
    for name, bad in (("nested", "[" * 5000 + "]" * 5000), ("nested", '{"a":' * 5000 + "1" + "}" * 5000),
                      ("huge", text.replace('"seed":0', '"seed":' + "9" * 5000, 1)),
                      ("overlong", text + " " * MAX_RECIPE_JSON), ("wrong type", "[]"), ("nan/inf", "NaN"),
                      ("wrong type", '"' + text.replace('"', "'") + '"'), ("none", "null")):
        yield name, "json", {**seed, "json": bad}, False
    fields = json.loads(text)
    for section, body in fields.items():
        for name in (list(body) if isinstance(body, dict) else [None]):
            for mutation, bad in (("none", None), ("wrong type", "x"), ("negative", -1), ("huge", 10 ** 30),
                                  ("nan/inf", math.nan), ("omit", "<omit>"), ("nested", RECIPE_NESTED)):
                changed = json.loads(text)
                where, key = (changed, section) if name is None else (changed[section], name)
                if bad == "<omit>":
                    where.pop(key)
                else:
                    where[key] = bad
                default = body if name is None else body[name]
                same = (bad == "<omit>" and key != "run_id") or (bad is None and default is None)
                yield mutation, f"json.{section}" + (f".{name}" if name else ""), \
                    {**seed, "json": json.dumps(changed, separators=(",", ":"))}, same
    other = recipe_value(Recipe(run_id="fuzz-other"), dataset=seed.get("dataset"))
    yield "valid", "json", other, True


MESSAGE_TYPES.append(MessageType("recipe", "owner", recipe_seed, _recipe_parse,
                                 {"json": _same_recipe_text,
                                  "digest": _equal_to(lambda: _recipe_keys()["seed"]["digest"]),
                                  "dataset": lambda x: True, "invites": lambda x: True},
                                 may_omit=frozenset({"dataset", "invites"}), wire=True, others=recipe_others))


MESSAGE_TYPES += [
    MessageType("handshake", "stranger", handshake_seed, _handshake_parse, HANDSHAKE_RULES,
                may_omit=frozenset({"ack"}), whole=handshake_whole, wire=True, max_bytes=MAX_AUTH_BYTES,
                others=handshake_others, afterwards=_handshake_afterwards),
    MessageType("state_request", "stranger", state_request_seed, _state_request_parse,
                {"offset": integer(0, 1 << 64), "length": integer(0, 1 << 64), "sha256": lambda x: True},
                # (no range given: none sent; no sha256: the state it holds now)
                may_omit=frozenset({"offset", "length", "sha256"}), whole=state_request_whole, wire=True,
                max_bytes=1024, others=state_request_others, afterwards=_state_afterwards),
    MessageType("replay_request", "stranger", replay_request_seed, _replay_parse,
                {"replay_from": _equal_to(lambda: _state()["step"].round),
                 "digest": _equal_to(lambda: _state()["step"].digest), "to": _equal_to(lambda: _state()["step"].after),
                 "bodies": lambda x: True},  # (bytes follow unless it is false: the listing only)
                may_omit=frozenset({"bodies"}), wire=True, max_bytes=1024, others=replay_request_others,
                afterwards=_replay_afterwards),
    MessageType("state_answer", "holder", lambda: dict(_state()["snapshot"].header), _state_answer_parse,
                {**{name: integer(0, 1 << 64) for name in ("round", "tokens_seen", "size")},
                 "sha256": lambda x: isinstance(x, str), "digest": lambda x: isinstance(x, str)},
                wire=True, max_bytes=64 << 10, others=lambda seed: _raw_frames(64 << 10)),
    MessageType("data_request", "stranger", data_request_seed, _data_request_parse,
                {"sha256": _equal_to(lambda: _data()["entry"].sha256), "offset": integer(0, 1 << 64)},
                wire=True, max_bytes=1024, others=data_request_others, afterwards=_data_afterwards),
    MessageType("data_answer", "holder", lambda: {"size": _data()["entry"].size}, _data_answer_parse,
                {"size": _equal_to(lambda: _data()["entry"].size)}, wire=True, max_bytes=1024,
                others=data_answer_others),
    MessageType("group_push", "leader", push_seed, _push_parse,
                {"round": integer(0, 1 << 40), "attempt": integer(0, 1 << 40),
                 "final": lambda x: isinstance(x, dict) and _expected(MESSAGE_TYPES[1], x)},
                whole=lambda v: leader_of(v["final"]["members"], v["round"], v["attempt"]) == LEADER, wire=True,
                max_bytes=MAX_PUSH_BYTES, others=push_others, afterwards=_push_afterwards),
    MessageType("revocation", "owner", revocation_seed, _revocation_parse, REVOCATION_RULES, wire=True,
                others=revocation_others),
    MessageType("stage_request", "stage peer", stage_request_seed, _stage_request_parse, STAGE_REQUEST_RULES,
                may_omit=frozenset({"scale", "eval", "round"}),  # (a whole batch's microbatch; one to train on; a
                # sender's round only restarts the history its activations are held to)
                whole=lambda v: v["shape"][0] * v["shape"][1] == 2,  # (the frames after it hold 2 tokens)
                wire=True, max_bytes=PIPE_HEADER_BYTES, others=stage_request_others,
                afterwards=_served_afterwards("stage", _stage_request_parse, stage_request_seed, "microbatch")),
    MessageType("stage_answer", "stage peer", lambda: {"loss": 2.5, "round": 3}, _stage_answer_parse,
                {"loss": lambda x: isinstance(x, float) and math.isfinite(x) and x >= 0,  # (a cross-entropy)
                 "round": lambda x: x is None or isinstance(x, int) and not isinstance(x, bool) and x >= 0},
                may_omit=frozenset({"round"}),  # (an answer whose round ended while it ran says none)
                whole=lambda v: "error" not in v, wire=True, max_bytes=PIPE_HEADER_BYTES, others=stage_answer_others),
    MessageType("recompute_request", "stage peer", recompute_request_seed, _recompute_request_parse,
                {"shape": lambda x: list_of(integer(1, 1 << 64), length=2)(x) and x[0] * x[1] <= PIPE_TOKENS,
                 "codec": lambda x: isinstance(x, str) and x in ("none", "fp16", "bf16")},
                whole=lambda v: v["shape"][0] * v["shape"][1] == 2,  # (the frame after it holds 2 ids)
                wire=True, max_bytes=PIPE_HEADER_BYTES, others=recompute_request_others,
                afterwards=_served_afterwards("recompute", _recompute_request_parse, recompute_request_seed,
                                              "request")),
    MessageType("recompute_answer", "stage peer", lambda: {"round": 3}, _recompute_answer_parse,
                {"round": lambda x: x is None or isinstance(x, int) and not isinstance(x, bool) and x >= 0},
                may_omit=frozenset({"round"}),  # (an answer whose round ended while it ran says none)
                whole=lambda v: "error" not in v, wire=True, max_bytes=PIPE_HEADER_BYTES,
                others=lambda seed: stage_answer_others(seed, "<activations>")),
]


AFTERWARDS = "afterwards"  # (not a mutation: a server's state once every mutation went through it)
TERM_TYPE = "verify_term"  # a list, not a mapping: mutated position by position below
ALL_TYPES = [t.name for t in MESSAGE_TYPES] + [TERM_TYPE, "matchmaking_entry", "matchmaking_final"]


# ---- mutations -------------------------------------------------------------------------------------------------
NESTED = msgpack.unpackb(b"\x91" * 1000 + b"\xc0")  # a list of a list ... 1,000 deep: repr() of it recurses too deep


def mutations_of(value: Any) -> Iterator[tuple[str, Any]]:
    """(class, mutated value) for one field's value."""
    yield "none", None
    for wrong in ("x", b"\x00", [], {}, True, 3):
        yield "wrong type", wrong
    for special in (math.nan, math.inf, -math.inf):
        yield "nan/inf", special
    yield "nested", NESTED  # (a value msgpack carries: a peer's record or entry could hold it)
    yield "negative", -1
    yield "negative", -1e-9
    yield "zero", 0
    yield "zero", 0.0
    for huge in (1e300, 2 ** 64, 10 ** 30, 1 << 20, (1 << 20) + 1, 1e11 + 1, 1e18):
        yield "huge", huge
    if isinstance(value, str):
        yield "overlong", value * 200
        yield "overlong", "a" * 100_000
        yield "wrong type", value.upper()
        yield "wrong type", value + "\n"
        yield "wrong type", value[:-1]
    if isinstance(value, list):
        yield "overlong", value * 5000 if value else ["QmAlpha"] * HUGE_LIST
        yield "wrong type", tuple(value)
        yield "wrong type", [None] * len(value)
        yield "wrong type", [str(v) for v in value]
        if value:
            yield "duplicate", value + value[-1:]
            yield "nan/inf", [math.nan] * len(value)
            yield "negative", [-1.0] * len(value)
    if isinstance(value, bool):
        yield "wrong type", int(value)
    if isinstance(value, float):
        yield "wrong type", str(value)
        yield "zero", 5e-324


@dataclass
class Outcome:
    message: str
    mutation: str
    field: str
    violation: Optional[str]


def _expected(kind: MessageType, value: dict) -> bool:
    if kind.max_bytes is not None and len(msgpack.packb(value)) > kind.max_bytes:
        return False
    for name, rule in kind.fields.items():
        if name not in value:
            if name not in kind.may_omit:
                return False
            continue
        try:
            if not rule(value[name]):
                return False
        except Exception:  # noqa: BLE001 - a rule that cannot judge a value says no
            return False
    try:
        return bool(kind.whole(value))
    except Exception:  # noqa: BLE001
        return False


def _judge(kind: MessageType, mutation: str, name: str, value: Any,
           expected: Optional[bool] = None) -> Optional[Outcome]:
    """The outcome of one message (`expected`: whether it is valid, if its rules cannot tell); None for one that no
    peer can send (msgpack cannot carry it)."""
    if kind.wire:
        try:
            value = _on_the_wire(value)
        except (TypeError, ValueError, OverflowError):
            return None
    if expected is None:
        expected = _expected(kind, value) if isinstance(value, dict) else False
    try:
        accepted = kind.parse(value)
    except Exception as e:  # noqa: BLE001 - what the fuzzer looks for
        return Outcome(kind.name, mutation, name, f"{type(e).__name__}: {str(e)[:120]}")
    shown = _short(value.get(name, "<omitted>") if isinstance(value, dict) else value)
    if accepted and not expected:
        return Outcome(kind.name, mutation, name, f"accepted {name}={shown}")
    if expected and not accepted:
        return Outcome(kind.name, mutation, name, f"refused a valid {name}={shown}")
    return Outcome(kind.name, mutation, name, None)


def _afterwards(kind: MessageType) -> Outcome:
    try:
        violation = kind.afterwards()
    except Exception as e:  # noqa: BLE001
        violation = f"{type(e).__name__}: {str(e)[:120]}"
    return Outcome(kind.name, AFTERWARDS, "<server>", violation)


@contextmanager
def _quiet(names: tuple[str, ...]):
    """These loggers say only errors meanwhile (each refusal is a line: thousands of them)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _short(value: Any) -> str:
    return shown(value, 60)  # (repr() of a NESTED value recurses too deep)


def schema_level(only: set[str]) -> list[Outcome]:
    """Every mutation of every message type in `only`; the servers of stream messages are started for it and
    stopped at its end."""
    _peer_states()
    outcomes: list[Optional[Outcome]] = []
    with _quiet(("swarm.dht.direct", "swarm.peer.state", "swarm.data.share", "swarm.averaging.group_push",
                 "swarm.peer.pipeline")):
        try:
            for kind in MESSAGE_TYPES:
                if kind.name not in only:
                    continue
                seed = kind.seed()
                outcomes.append(_judge(kind, "valid", "-", seed))
                for name in list(seed) + ["unknown_field"]:
                    if name in seed:
                        outcomes.append(_judge(kind, "omit", name, {k: v for k, v in seed.items() if k != name}))
                    for mutation, value in mutations_of(seed.get(name, "x")):
                        outcomes.append(_judge(kind, mutation, name, {**seed, name: value}))
                for name, value in kind.inconsistent(seed):
                    outcomes.append(_judge(kind, "inconsistent", name, {**seed, name: value}))
                for mutation, name, value, valid in kind.others(seed):
                    outcomes.append(_judge(kind, mutation, name, value, expected=valid))
                for wrong in ([], "x", None, 3, [seed]):
                    outcomes.append(_judge(kind, "wrong type", "<message>", wrong))
                if kind.afterwards is not None:
                    outcomes.append(_afterwards(kind))
        finally:
            _shutdown()
    if TERM_TYPE in only:
        outcomes.extend(_term_level())
    return [o for o in outcomes if o is not None]


def _term_level() -> list[Outcome]:
    """A member's sketched term (verify.Term): three lists of floats, of SKETCH_BUCKETS and the part's chunks."""
    outcomes = []
    seed = term_seed()
    valid = lambda v: (isinstance(v, list) and len(v) == 3 and all(isinstance(x, list) for x in v)  # noqa: E731
                       and len(v[0]) == SKETCH_BUCKETS and len(v[1]) == 2 and len(v[2]) == 2
                       and all(isinstance(x, float) and math.isfinite(x) for x in v[0] + v[1] + v[2])
                       and min(v[1] + v[2]) >= 0)
    cases = [("valid", "-", seed), ("omit", "distances", seed[:2]), ("overlong", "sketch", [seed[0] * 2, *seed[1:]])]
    for position, name in enumerate(("sketch", "norms", "distances")):
        for mutation, value in mutations_of(seed[position]):
            cases.append((mutation, name, [*seed[:position], value, *seed[position + 1:]]))
        for mutation, element in (("nan/inf", math.nan), ("nan/inf", math.inf), ("negative", -1.0),
                                  ("wrong type", 1), ("wrong type", True), ("huge", 1e308)):
            items = list(seed[position])
            items[0] = element
            cases.append((mutation, f"{name}[0]", [*seed[:position], items, *seed[position + 1:]]))
    for mutation, name, value in cases:
        try:
            accepted = Term.from_wire(value, chunks=2) is not None
        except Exception as e:  # noqa: BLE001
            outcomes.append(Outcome(TERM_TYPE, mutation, name, f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        violation = None if accepted == valid(value) else f"{'accepted' if accepted else 'refused'} {name}"
        outcomes.append(Outcome(TERM_TYPE, mutation, name, violation))
    return outcomes


# ---- matchmaking, end to end -------------------------------------------------------------------------------------
class Board:
    def __init__(self) -> None:
        self.entries: dict[str, dict[str, object]] = {}


class Node:
    """A peer as form_group sees its DHT: real identities, entries under owned subkeys, an in-memory board."""

    def __init__(self, identity, board: Board) -> None:
        self.board, self.peer_id, self.owned_subkey = board, identity.peer_id, identity.owned_subkey

    async def store(self, key: str, value: object, ttl: float, subkey: Optional[str] = None) -> bool:
        self.board.entries.setdefault(key, {})[subkey or ""] = value
        return True

    async def get(self, key: str) -> dict[str, object]:
        return dict(self.board.entries.get(key, {}))


def _identities(n: int) -> list:
    from hivemind.utils.crypto import RSAPrivateKey
    from swarm.dht.validation import Identity
    return [Identity(RSAPrivateKey(), path="", ephemeral=False) for _ in range(n)]


HONEST_ENTRY = Candidate(DIGEST, 1e6, False, weight=8192.0, commitment=COMMITMENT, phase_timeout=5.0)


async def _round(identities: list, attacker_index: int, entry: Any, final: Any, timeout: float):
    board = Board()
    nodes = [Node(identity, board) for identity in identities]
    attacker = nodes[attacker_index]
    honest = [n for i, n in enumerate(nodes) if i != attacker_index]
    ids = {n.peer_id for n in honest}
    if entry is not None:
        await attacker.store(group_key("run", ROUND, ATTEMPT), entry, ttl=60, subkey=attacker.owned_subkey)
    if final is not None:
        await attacker.store(final_key("run", ROUND, ATTEMPT), final, ttl=60, subkey=attacker.owned_subkey)
    return honest, await asyncio.gather(*(form_group(
        n, "run", ROUND, ATTEMPT, HONEST_ENTRY, ids - {n.peer_id}, 2, 8, timeout, verified=True) for n in honest))


def _check_group(honest_ids: set[str], results: list, candidates: dict[str, Candidate],
                 must_form: bool) -> Optional[str]:
    groups = [group for group, _ in results]
    if any(group is None for group in groups):
        return "an honest member formed no group" if must_form else None
    if len({group.group_id for group in groups}) != 1:
        return "honest members hold different groups"
    group = groups[0]
    if not honest_ids <= set(group.members):
        return "an honest member was left out of the honest group"
    if not set(group.members) <= set(candidates):
        return "the group names a peer without an entry"
    terms = group_terms(list(group.members), candidates, verified=True)
    if list(group.weights) != terms["weights"] or list(group.commitments) != terms["commitments"] or \
            group.mix != terms["mix"] or group.phase_timeout != terms["phase_timeout"] or \
            any(abs(a - b) > 1e-9 for a, b in zip(group.shares, terms["shares"])):
        return "the group's terms are not the ones its members' entries give"
    if group.mix:
        return "the group mixes params with a state only the attacker declares"
    if group.swarm_size > len(candidates):
        return f"swarm size {group.swarm_size} over the {len(candidates)} entries"
    return None


def matchmaking_level(only: set[str], timeout: float = 1.0, at_once: int = 64) -> list[Outcome]:
    """Every scenario is its own round on its own board; up to `at_once` of them run concurrently (they only wait)."""
    identities = _identities(4)
    ids = sorted(i.peer_id for i in identities)
    leader_id = leader_of(ids, ROUND, ATTEMPT)
    leader_index = next(i for i, identity in enumerate(identities) if identity.peer_id == leader_id)
    member_index = next(i for i in range(4) if i != leader_index)
    scenarios: list[tuple[str, str, str, Any, Any, int]] = []
    if "matchmaking_entry" in only:
        seed = entry_seed()
        scenarios.append(("matchmaking_entry", "valid", "-", seed, None, member_index))
        for name in seed:
            scenarios.append(("matchmaking_entry", "omit", name, {k: v for k, v in seed.items() if k != name}, None,
                              member_index))
            for mutation, value in mutations_of(seed[name]):
                scenarios.append(("matchmaking_entry", mutation, name, {**seed, name: value}, None, member_index))
        for mutation, value in (("inconsistent", OTHER_DIGEST), ("huge", "f" * 16)):
            scenarios.append(("matchmaking_entry", mutation, "digest", {**seed, "digest": value}, None, member_index))
        scenarios.append(("matchmaking_entry", "inconsistent", "excluded", {**seed, "excluded": ids}, None,
                          member_index))
    if "matchmaking_final" in only:
        entry = entry_seed()
        everyone = {p: HONEST_ENTRY for p in ids}
        seed = {"members": ids, **group_terms(ids, everyone, verified=True), "swarm_size": 4}
        scenarios.append(("matchmaking_final", "valid", "-", entry, seed, leader_index))
        for name in seed:
            scenarios.append(("matchmaking_final", "omit", name, entry, {k: v for k, v in seed.items() if k != name},
                              leader_index))
            for mutation, value in mutations_of(seed[name]):
                scenarios.append(("matchmaking_final", mutation, name, entry, {**seed, name: value}, leader_index))
        for name, value in (("shares", [1.0 if p == leader_id else 0.0 for p in ids]), ("weights", [1e17] * 4),
                            ("mix", True), ("phase_timeout", 1e5), ("members", ids[:3] if leader_id in ids[:3]
                                                                    else ids[1:])):
            scenarios.append(("matchmaking_final", "inconsistent", name, entry, {**seed, name: value}, leader_index))
        scenarios.append(("matchmaking_final", "inconsistent", "digest", {**entry, "digest": OTHER_DIGEST},
                          {**seed, "mix": True}, leader_index))  # (mixing in a state only the leader holds)

    async def one(kind: str, mutation: str, name: str, entry: Any, final: Any, attacker: int) -> Outcome:
        honest_ids = {identities[i].peer_id for i in range(4) if i != attacker}
        started = time.monotonic()
        try:
            _, results = await _round(identities, attacker, entry, final, timeout)
        except Exception as e:  # noqa: BLE001
            return Outcome(kind, mutation, name, f"{type(e).__name__}: {str(e)[:120]}")
        candidates = {p: HONEST_ENTRY for p in honest_ids}
        parsed = parse_candidate(entry, verified=True) if entry is not None else None
        if parsed is not None:
            candidates[identities[attacker].peer_id] = parsed
        # An entry never stalls the honest; a leader that lies may cost an attempt (the next has another leader).
        violation = _check_group(honest_ids, results, candidates, must_form=final is None or mutation == "valid")
        waited = time.monotonic() - started
        if violation is None and final is None and waited > timeout + 1.0:
            violation = f"the honest waited {waited:.1f} s, past the matchmaking timeout"
        return Outcome(kind, mutation, name, violation)

    async def all_of() -> list[Outcome]:
        done: list[Outcome] = []
        for i in range(0, len(scenarios), at_once):
            done += await asyncio.gather(*(one(*scenario) for scenario in scenarios[i:i + at_once]))
        return done

    logging.getLogger("swarm.averaging.matchmaking").setLevel(logging.ERROR)  # (each refusal says so: 100s of lines)
    return asyncio.run(all_of())


# ---- report ----------------------------------------------------------------------------------------------------
def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(ALL_TYPES),
                        help=f"message types, comma-separated (default: all: {', '.join(ALL_TYPES)})")
    parser.add_argument("--no-matchmaking", action="store_true", help="the schema level only")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    unknown = only - set(ALL_TYPES)
    if unknown:
        parser.error(f"unknown message type(s) {', '.join(sorted(unknown))}: choose from {', '.join(ALL_TYPES)}")
    started = time.monotonic()
    outcomes = schema_level(only)
    if not args.no_matchmaking:
        outcomes += matchmaking_level(only)
    checks = [o for o in outcomes if o.mutation == AFTERWARDS]
    table: dict[tuple[str, str], Counter] = {}
    for o in outcomes:
        table.setdefault((o.message, o.mutation), Counter())["tried"] += 1
        table[(o.message, o.mutation)]["violations"] += o.violation is not None
    print(f"{'message':<20} {'mutation':<14} {'tried':>6} {'violations':>10}")
    for (message, mutation), counts in sorted(table.items()):
        print(f"{message:<20} {mutation:<14} {counts['tried']:>6} {counts['violations']:>10}")
    violations = [o for o in outcomes if o.violation]
    for o in violations[:40]:
        print(f"VIOLATION {o.message} {o.mutation} {o.field}: {o.violation}")
    print(json.dumps({"mutations": len(outcomes) - len(checks), "server_checks": len(checks),
                      "violations": len(violations),
                      "message_types": sorted({o.message for o in outcomes}),
                      "seconds": round(time.monotonic() - started, 1)}))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
