"""Fuzz the messages a participant can send: every field of every message type, mutated one at a time.

Two levels. **Schema**: each message type's parser gets a valid message with one field omitted, of a wrong type,
NaN, infinite, negative, zero, huge, overlong, or inconsistent with the rest of the message, or a replay of
another round's; what it must do is written here from the protocol's documentation (docs/design.md, "Entries are
one schema"), not read from the parser: accept exactly the messages whose every field is within its bounds, and
refuse the others with its own error (None or its typed exception), never another exception. **Matchmaking**, end
to end in one process (the real `form_group` over an in-memory DHT, four real identities): an attacker's entry,
then the group it publishes as leader, mutated the same way; afterwards the honest members must have formed their
group (an entry cannot stall them) with the terms their own entries give (weights, shares, deadline, commitments,
no mixing of a state nobody else holds, no swarm size over the entries), or, where the attacker led, have refused
its group.

A violation is any other outcome. Prints a table per message type and mutation class, then one JSON line with at
least `mutations` and `violations`; exit status 1 if any violation was found.

    python scripts/fuzz_protocol.py                     # every message type, both levels
    python scripts/fuzz_protocol.py --only entry,final  # some types (see --help)
    python scripts/fuzz_protocol.py --no-matchmaking    # the schema level alone (a second or two)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.averaging.group_push import parse_final, leader_of  # noqa: E402
from swarm.averaging.matchmaking import Candidate, form_group, group_terms, parse_candidate  # noqa: E402
from swarm.averaging.messages import (Averaged, Blame, Contribution, Header, MessageError, PartialSum,  # noqa: E402
                                      Reveal)
from swarm.averaging.verify import SKETCH_BUCKETS, Term  # noqa: E402
from swarm.dht.records import InvalidRecord, PeerRecord, final_key, group_key  # noqa: E402

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
            "data_shard": 1, "data_start": 1, "data_files": None, "data_fetched": None, "client": False,
            "updated": 1.7e9}


RECORD_RULES = {**{name: printable(256) for name in ("version", "run_id", "digest", "device", "device_name")},
                "state": lambda x: x in ("joining", "training", "averaging", "syncing", "offline", "stopping"),
                **{name: integer(0, 1 << 62) for name in ("round", "tokens_in_round", "attempt")},
                "block_start": integer(0, 2), "block_end": integer(1, 3),
                "device_memory": integer(0, 1 << 50),
                **{name: within(0, 1e12) for name in ("tokens_per_s", "capacity")},
                **{name: within(0, 1e13) for name in ("bandwidth_up", "bandwidth_down")},
                "loss": optional(number), "val_loss": optional(number),
                **{name: optional(integer(0, 1 << 62)) for name in ("in_flight_tokens", "data_shard", "data_start",
                                                                    "data_files", "data_fetched")},
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
        _invite_parts.update(owner=owner, peer=peer.peer_id,
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
TERM_TYPE = "verify_term"  # a list, not a mapping: mutated position by position below
ALL_TYPES = [t.name for t in MESSAGE_TYPES] + [TERM_TYPE, "matchmaking_entry", "matchmaking_final"]


# ---- mutations -------------------------------------------------------------------------------------------------
def mutations_of(value: Any) -> Iterator[tuple[str, Any]]:
    """(class, mutated value) for one field's value."""
    yield "none", None
    for wrong in ("x", b"\x00", [], {}, True, 3):
        yield "wrong type", wrong
    for special in (math.nan, math.inf, -math.inf):
        yield "nan/inf", special
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


def _judge(kind: MessageType, mutation: str, name: str, value: Any) -> Outcome:
    expected = _expected(kind, value) if isinstance(value, dict) else False
    try:
        accepted = kind.parse(value)
    except Exception as e:  # noqa: BLE001 - what the fuzzer looks for
        return Outcome(kind.name, mutation, name, f"{type(e).__name__}: {str(e)[:120]}")
    if accepted and not expected:
        return Outcome(kind.name, mutation, name, f"accepted {name}={_short(value.get(name, '<omitted>'))}")
    if expected and not accepted:
        return Outcome(kind.name, mutation, name, f"refused a valid {name}={_short(value.get(name, '<omitted>'))}")
    return Outcome(kind.name, mutation, name, None)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def schema_level(only: set[str]) -> list[Outcome]:
    _peer_states()
    outcomes = []
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
        for wrong in ([], "x", None, 3, [seed]):
            outcomes.append(_judge(kind, "wrong type", "<message>", wrong))
    if TERM_TYPE in only:
        outcomes.extend(_term_level())
    return outcomes


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
    print(json.dumps({"mutations": len(outcomes), "violations": len(violations),
                      "message_types": sorted({o.message for o in outcomes}),
                      "seconds": round(time.monotonic() - started, 1)}))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
