"""The group all-reduce inside one process: the server's stream handler on hand-fed streams, and both shapes
(butterfly, ring) between GroupAllReduce servers on an in-memory network, clean and with client members, bad
weights and garbage. The multi-process runs are in test_allreduce.py and test_faults.py."""

from __future__ import annotations

import asyncio
from typing import Optional

import msgpack
import pytest
import torch

from swarm.averaging.allreduce import AllReduceError, GroupAllReduce
from swarm.averaging.deadlines import AdaptiveDeadlines
from swarm.averaging.faults import FaultPlan
from swarm.averaging.matchmaking import Group
from swarm.dht.node import FRAME_HEADER, recv_frame


class _Writer:
    """The handler's end of an in-memory stream: what it writes, the test reads from `reader`."""

    def __init__(self, reader: asyncio.StreamReader):
        self.reader = reader

    def write(self, data: bytes) -> None:
        self.reader.feed_data(data)

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.reader.feed_eof()


def _answer_to(allreduce: GroupAllReduce, header: dict) -> asyncio.Task:
    """Start the all-reduce's stream handler on a stream whose sender sent `header`; returns the task."""
    inbound, outbound = asyncio.StreamReader(), asyncio.StreamReader()
    frame = msgpack.packb(header)
    inbound.feed_data(FRAME_HEADER.pack(len(frame)) + frame)
    inbound.feed_eof()
    task = asyncio.ensure_future(allreduce._on_stream("sender", inbound, _Writer(outbound)))
    task.reply = outbound
    return task


async def _reply(task: asyncio.Task) -> bytes:
    return await recv_frame(task.reply, 16)


def test_streams_for_a_group_we_do_not_join_get_conflict_at_once():
    """A sender that put us in its group (a leader race) must learn that we joined another group, or none, as
    soon as our matchmaking is over: not wait out its deadline for parts we will never send."""

    async def scenario():
        allreduce = GroupAllReduce(node=None, run_id="t", codec_name="none", max_numel=1 << 20,
                                   deadlines=AdaptiveDeadlines(5.0, 30.0))
        header = {"phase": "part", "chunks": 0, "round": 4, "attempt": 0, "group_id": "theirs"}
        waiting = _answer_to(allreduce, header)
        await asyncio.sleep(0.2)
        assert not waiting.done(), "undecided: the handler waits for our matchmaking"
        await allreduce.decide(4, 0, "ours")
        assert await asyncio.wait_for(_reply(waiting), 2) == b"conflict"
        # A stream for the group we did join is accepted; one for an attempt we found no group in is refused.
        assert await asyncio.wait_for(_reply(_answer_to(allreduce, {**header, "group_id": "ours"})), 2) == b"ok"
        await allreduce.decide(4, 1, None)
        refused = _answer_to(allreduce, {**header, "attempt": 1, "group_id": "theirs"})
        assert await asyncio.wait_for(_reply(refused), 2) == b"conflict"
        # A peer that found nobody retries under the same attempt number and may join a group then: its new
        # decision counts (a stale "no group" answer made the first round of a peer that started alone fail).
        await allreduce.decide(4, 1, "theirs")
        joined = _answer_to(allreduce, {**header, "attempt": 1, "group_id": "theirs"})
        assert await asyncio.wait_for(_reply(joined), 2) == b"ok"

    asyncio.run(scenario())


GOOD_HEADER = {"group_id": "g", "round": 1, "attempt": 0, "phase": "part", "chunks": 2}


def test_a_malformed_header_fails_its_stream_naming_the_sender_and_the_field():
    async def scenario():
        allreduce = GroupAllReduce(node=None, run_id="t", codec_name="none", max_numel=1 << 20,
                                   deadlines=AdaptiveDeadlines(5.0, 30.0))
        task = _answer_to(allreduce, {**GOOD_HEADER, "round": -4})
        with pytest.raises(ValueError, match="malformed all-reduce header from sender: round must be an integer"):
            await asyncio.wait_for(task, 2)

    asyncio.run(scenario())


class _Node:
    """A node of an in-memory network (the parts of SwarmNode the all-reduce uses): a stream is two
    StreamReaders, and the handler runs guarded as SwarmNode runs it."""

    def __init__(self, peer_id: str, handlers: dict):
        self.peer_id, self.handlers = peer_id, handlers
        self.errors: list[Exception] = []  # what our handlers raised
        self._serving: set[asyncio.Task] = set()

    async def add_stream_handler(self, name: str, handler) -> None:
        self.handlers[(self.peer_id, name)] = handler

    async def open_stream(self, peer_id: str, name: str):
        handler = self.handlers.get((peer_id, name))
        if handler is None:
            raise ConnectionError(f"{peer_id} accepts no streams")
        to_them, to_us = asyncio.StreamReader(), asyncio.StreamReader()
        task = asyncio.ensure_future(self._serve(handler, to_them, _Writer(to_us)))
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)
        return to_us, _Writer(to_them)

    async def _serve(self, handler, reader: asyncio.StreamReader, writer: _Writer) -> None:
        try:
            await handler(self.peer_id, reader, writer)
        except Exception as e:  # noqa: BLE001 - as SwarmNode: a bad request never takes the peer down
            self.errors.append(e)
        finally:
            writer.close()


PEERS = ("peerA", "peerB", "peerC")
WEIGHTS = (1.0, 2.0, 4.0)


def _average(codec: str = "none", ring: str = "never", clients=(), fault: Optional[str] = None,
             weights=WEIGHTS, numel: int = 210_000, exact_from=None,
             max_weight: float = float("inf"), aggregator: str = "mean",
             vectors: Optional[list] = None, declared: Optional[tuple] = None,
             verify: bool = True) -> tuple[list, list, list[tuple[str, str]]]:
    """Every member of one group of PEERS averages its seeded vector (or its one of `vectors`); returns the
    vectors, each member's result (or AllReduceError), and the (peer, reason) bad-peer reports. PEERS[2] runs
    `fault` (FaultPlan). With `declared` (the weights the members' matchmaking entries declare), the group names
    them and every member's nonce commitment, so reducers are verified where the aggregator allows."""
    vectors = vectors or [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(len(PEERS))]
    reports: list[tuple[str, str]] = []

    async def scenario():
        handlers: dict = {}
        allreduces = [GroupAllReduce(_Node(peer, handlers), "t", codec, numel, AdaptiveDeadlines(5.0, 30.0),
                                     on_bad_peer=lambda peer, reason: reports.append((peer, reason)),
                                     faults=FaultPlan(fault if i == 2 else None), ring=ring,
                                     max_weight=max_weight, aggregator_name=aggregator, verify_reducers=verify)
                      for i, peer in enumerate(PEERS)]
        clients_of = clients or (False,) * len(PEERS)
        for allreduce, client in zip(allreduces, clients_of):
            if not client:
                await allreduce.start()
        servers = sum(not c for c in clients_of)
        group = Group.of(0, 0, PEERS, [0.0 if c else 1 / servers for c in clients_of], 5.0, clients_of,
                         weights=declared or (),
                         commitments=[a.commitment(0, 0) for a in allreduces] if declared else ())
        results = await asyncio.gather(*(a.run(group, v, w, exact_from) for a, v, w in zip(allreduces, vectors,
                                                                                           weights)),
                                       return_exceptions=True)
        if fault is None and all(0 <= w <= max_weight for w in weights):
            assert not [e for a in allreduces for e in a.node.errors], "a handler failed in a clean round"
        return results

    return vectors, asyncio.run(scenario()), reports


def _exact(vectors) -> torch.Tensor:
    return sum(v * w for v, w in zip(vectors, WEIGHTS)) / sum(WEIGHTS)


@pytest.mark.parametrize("ring", ["never", "always"])
def test_both_shapes_average_exactly_in_memory(ring):
    vectors, results, reports = _average(ring=ring)
    assert not reports and all(not isinstance(r, Exception) for r in results), results
    for result in results:
        torch.testing.assert_close(result.average, _exact(vectors), rtol=1e-6, atol=1e-6)
        assert torch.equal(result.average, results[0].average) and result.total_weight == sum(WEIGHTS)
        assert result.bytes_sent > 0 and result.bytes_received > 0
        assert (result.wire is None) == (ring == "always"), "only the butterfly's averages travel encoded"


def test_butterfly_with_a_lossy_codec_a_lossless_tail_and_a_client_member():
    vectors, results, reports = _average(codec="int8", clients=(False, False, True), exact_from=150_000)
    assert not reports and all(not isinstance(r, Exception) for r in results), results
    exact = _exact(vectors)
    for result in results:
        assert torch.equal(result.average, results[0].average), "every member holds the same bytes"
        torch.testing.assert_close(result.average[150_000:], exact[150_000:], rtol=1e-6, atol=1e-6)
        assert (result.average[:150_000] - exact[:150_000]).abs().max() < 0.1  # int8 on N(0, 1) values
    assert not torch.equal(results[2].delivered[:150_000], vectors[2][:150_000]), "the client's parts were encoded"


def test_a_bad_weight_costs_the_sender_its_contribution_not_its_stream():
    vectors, results, reports = _average(weights=(1.0, 2.0, -1.0))
    assert reports == [("peerC", "bad_weight")] * 2, "each other reducer refuses it once, then goes on without it"
    for result in results:
        assert isinstance(result, AllReduceError) and result.reason == "bad_data", result
    assert results[0].rejected == results[1].rejected == {"peerC"}


@pytest.mark.parametrize("ring", ["never", "always"])
def test_an_inflated_weight_is_refused_and_blamed_on_its_sender_in_both_shapes(ring):
    """A weight is declared by its sender: one of 1e18 tokens would make the average its own vector. Past the
    recipe's cap (Recipe.max_contribution_tokens) it is refused like a malformed one."""
    _, results, reports = _average(ring=ring, weights=(1.0, 2.0, 1e18), max_weight=10.0)
    assert reports and all(peer == "peerC" and reason in ("bad_weight", "bad_header") for peer, reason in reports), \
        reports
    for result in results[:2]:
        assert isinstance(result, AllReduceError) and result.reason == "bad_data", result
        assert result.rejected == {"peerC"}, (result, result.rejected)
    _, clean, reports = _average(ring=ring, max_weight=10.0)
    assert not reports and not any(isinstance(r, Exception) for r in clean), "weights under the cap average"


@pytest.mark.parametrize("ring, fault", [("never", "garbage@0"), ("always", "ring-garbage@0")])
def test_garbage_is_rejected_and_blamed_on_its_sender_in_both_shapes(ring, fault):
    _, results, reports = _average(ring=ring, fault=fault)
    assert reports and all(peer == "peerC" for peer, _ in reports), reports
    for result in results[:2]:  # the honest members, whether they saw the garbage or were told whom to blame
        assert isinstance(result, AllReduceError) and result.reason == "bad_data", result
        assert result.rejected == {"peerC"}, (result, result.rejected)
    assert isinstance(results[2], AllReduceError), "nothing is applied anywhere"


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_robust_aggregator_bounds_a_scaled_contribution_where_the_mean_takes_it(codec):
    """A member sends its pseudo-gradient x1000 with an honest weight: the butterfly's reducers, with
    centered_clip, keep every member's result near the honest members' mean (and all of them bit-identical),
    where the plain mean moves ~300x as far. Without an attacker, centered_clip is the mean exactly."""
    numel = 120_000
    common = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    honest = [common + 0.5 * torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    attacked, weights = [honest[0], honest[1], 1000 * honest[2]], (2.0, 3.0, 2.5)
    target = (honest[0] * weights[0] + honest[1] * weights[1]) / (weights[0] + weights[1])
    errors = {}
    for aggregator in ("mean", "centered_clip"):
        _, results, reports = _average(codec=codec, aggregator=aggregator, vectors=attacked, numel=numel,
                                       weights=weights, verify=False)  # (the aggregate alone, reducers trusted)
        assert not reports and all(not isinstance(r, Exception) for r in results), results
        assert all(torch.equal(r.average, results[0].average) for r in results), "members end bit-identical"
        errors[aggregator] = float((results[0].average - target).norm() / target.norm())
    assert errors["mean"] > 100 and errors["centered_clip"] < 0.6, errors
    _, clean, _ = _average(aggregator="centered_clip", vectors=honest, numel=numel, weights=weights, verify=False)
    _, plain, _ = _average(aggregator="mean", vectors=honest, numel=numel, weights=weights)
    assert all(torch.equal(c.average, p.average) for c, p in zip(clean, plain)), "no attacker: the mean, exactly"


@pytest.mark.parametrize("codec, clients", [("none", ()), ("int8", ()), ("fp16", ()), ("fp16", (False, False, True)),
                                           ("sparse", ()), ("sparse", (False, False, True))])
def test_verified_reducers_give_the_same_average_as_unverified_ones(codec, clients):
    """With every member's weight and nonce commitment in the group, members check each reducer's CenteredClip
    (verify.py) before applying: an honest group passes and ends with the very bits an unchecked one does."""
    vectors, checked, reports = _average(codec=codec, clients=clients, aggregator="centered_clip", declared=WEIGHTS,
                                         exact_from=150_000)
    assert not reports and all(not isinstance(r, Exception) for r in checked), checked
    _, unchecked, _ = _average(codec=codec, clients=clients, aggregator="centered_clip", exact_from=150_000,
                               verify=False)
    assert all(torch.equal(c.average, u.average) for c, u in zip(checked, unchecked))
    # What the reducers decoded of each member's parts is kept whole only where error feedback needs it; the checks
    # of a codec without (none, the default fp16) encode the member's chunks again (Run.delivered).
    assert all((r.delivered is None) == (codec in ("none", "fp16")) for r in checked + unchecked)
    # The check's own time, reported apart (the round's `verification` phase), by every member that checks.
    servers = [r for r, client in zip(checked, clients or (False,) * len(checked)) if not client]
    assert all(0 < r.verification_seconds < r.seconds for r in servers), [r.verification_seconds for r in checked]
    assert all(r.verification_seconds == 0 for r in unchecked)


@pytest.mark.parametrize("codec", ["int8", "fp16", "sparse"])
def test_a_lying_reducer_is_refused_by_every_honest_member_and_accused(codec):
    """peerC reduces its part x1000 and makes up its own verification term to cancel the rest as best it can: the
    honest members apply nothing and accuse it (their next attempt parts them from it). With the sparse codec too,
    whose averages travel back with every position they have (compression/sparse.py, the support codec)."""
    # (Weights where the liar holds less than half: a member with half the capped weight can pull CenteredClip
    # anywhere, as reducer or not; with WEIGHTS, peerC's 4 is capped to 3 of 6.)
    weights = (2.0, 3.0, 2.5)
    vectors, results, _ = _average(codec=codec, aggregator="centered_clip", declared=weights, weights=weights,
                                   fault="lying-reducer@0")
    for result in results[:2]:
        assert isinstance(result, AllReduceError) and result.reason == "unverified", result
        assert result.rejected == {"peerC"}, (result, result.rejected)
    # The same lie where nobody checks (averaging.verify_reducers: false): every member applies it.
    _, unchecked, _ = _average(codec=codec, aggregator="centered_clip", weights=weights, fault="lying-reducer@0",
                               verify=False)
    assert not any(isinstance(r, Exception) for r in unchecked)
    assert float(unchecked[0].average.abs().max()) > 100 * float(_exact(vectors).abs().max())
    # Where the run checks its reducers, a group that does not carry every member's commitment is not averaged at
    # all (a missing field used to switch the check off for the whole group, and the lie went through).
    _, omitted, _ = _average(codec=codec, aggregator="centered_clip", weights=weights, fault="lying-reducer@0")
    assert all(isinstance(r, AllReduceError) and r.reason == "unverified" for r in omitted), omitted


def test_a_member_declaring_another_weight_to_a_reducer_than_to_the_group_is_refused():
    """Weights come from the members' signed matchmaking entries: a part header that declares another weight
    (to outweigh the group at one reducer) costs its sender its contribution."""
    _, results, reports = _average(aggregator="centered_clip", declared=(1.0, 2.0, 1.0))
    assert set(reports) == {("peerC", "bad_weight")}, reports
    for result in results[:2]:
        assert isinstance(result, AllReduceError) and result.rejected == {"peerC"}, result


def test_a_reducer_naming_every_member_bans_nobody_but_itself():
    """peerC, as a reducer, says every other member sent it bad data. Its word is not a verdict: the round fails
    (its part was averaged without them: nothing applied), but the honest members ban nobody for it (they used to
    leave each other out for the rest of the round, and each one's next attempt was a pair with the accuser). peerC's
    own exclusions name them, so its next matchmaking entry parts it from them."""
    _, results, reports = _average(fault="reject-all@0")
    assert all(isinstance(r, AllReduceError) and r.reason == "bad_data" for r in results), results
    assert [r.rejected for r in results[:2]] == [set(), set()], "an honest member bans nobody on the accuser's word"
    assert results[2].rejected == {"peerA", "peerB"}, "the accuser keeps its own word: its exclusions part it from them"
