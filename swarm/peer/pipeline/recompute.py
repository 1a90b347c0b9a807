"""A first stage's activations checked by computing them again (issue 37, class 9). A first-stage peer computes its
activations from token ids, which travel with them (the microbatch's whole rows: server.py), so another peer of the
first stage can compute them again. The stage right after the first holds a sampled share of each sender's training
activations, and all of them until PROBATION agreed with another peer's (`Recheck`, in its StageServer), to what
another first-stage peer computes for the same ids (`RecomputeServer`: a forward pass on its params as they stand,
no gradient, no step), and to a third's when those two do not agree (integrity.decide with ACTIVATIONS: two copies
of a stage drift apart within a round, so they are held to being the same computation, not the same bits).
Activations that are not the computation, such as noise of the honest ones' norm, which no statistic shows, are then
outvoted on their sender's first microbatch: nothing of it is applied, and the sender is left out with the evidence.
A first-stage peer outvoted on what it computed again is left out too. Two first-stage peers that disagree, with no
third, cannot be told apart (nothing applied, nobody left out); a lone first-stage peer is held only to its own
history and to the loss its activations give (server.py).

A first-stage peer computes again only for the next stage's peers it knows, MAX_PER_ASKER microbatches per asker at
a time and MAX_RECOMPUTING in all; the rest are refused at once ("busy").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import statistics
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Optional

import msgpack
import torch

from swarm.compression import decode, get_codec
from swarm.dht.frames import recv_frame, send_frame
from swarm.dht.node import SwarmNode
from swarm.peer.pipeline.integrity import (ACTIVATIONS, EXCLUDE_SECONDS, PROBATION, Answer, AnswerCheck, Verdict,
                                           decide, microbatch_id, tally)
from swarm.peer.pipeline.routing import (BUSY, DISPUTED, HEADER_BYTES, payload_bound, refused_with, round_number,
                                         size_problem, token_ids)
from swarm.peer.pipeline.worker import PipelineError, StageWorker
from swarm.words import shown

logger = logging.getLogger(__name__)

RECOMPUTE_SECONDS = 15.0  # the longest an asker waits for activations computed again (then the comparison is lost;
# two such, a second peer's and a third's, fit in the sender's hop: routing.HOP_SECONDS)
MAX_RECOMPUTING = 4  # microbatches a first-stage peer computes again at once
MAX_PER_ASKER = 2  # of them for one asker (a next-stage peer checks the microbatches of several senders at once)
CODECS = ("none", "fp16", "bf16")


def recompute_protocol(run_id: str, start: int, end: int) -> str:
    return f"swarm.{run_id}.recompute.{start}-{end}"


async def ask_recompute(node: SwarmNode, peer: str, protocol: str, inputs: torch.Tensor, hidden: int,
                        codec: str = "fp16", timeout: float = RECOMPUTE_SECONDS) -> tuple[torch.Tensor, Optional[int]]:
    """`peer`'s activations for the token ids `inputs` (b, t), shape (b, t, `hidden`), and the round of its stage it
    says it computed them in (None: it does not say). Raises on any failure or malformed answer."""
    b, t = inputs.shape
    async with asyncio.timeout(timeout):
        reader, writer = await node.open_stream(peer, protocol)
        try:
            await send_frame(writer, msgpack.packb({"shape": [b, t], "codec": codec}))
            await send_frame(writer, inputs.to("cpu", torch.int32).contiguous().numpy().tobytes())
            answer = msgpack.unpackb(await recv_frame(reader, HEADER_BYTES))
            refusal = refused_with(answer)
            if refusal is not None:
                raise PipelineError(f"first-stage peer {peer[-8:]} did not compute the microbatch again: {refusal}")
            round_no = answer.get("round")
            if round_no is not None and not round_number(round_no):
                raise PipelineError(f"first-stage peer {peer[-8:]} answered a round of {shown(round_no)}")
            out = decode(await recv_frame(reader, payload_bound(b * t * hidden)))
            if out.numel() != b * t * hidden or not torch.isfinite(out).all():
                raise PipelineError(f"first-stage peer {peer[-8:]} answered {out.numel()} activations, not "
                                    f"{b * t * hidden} finite ones")
            return out.reshape(b, t, hidden), round_no
        finally:
            writer.close()


class RecomputeServer:
    """A first-stage peer's side: computes its stage's output for token ids an asker sends (`worker.output`: the
    live params, eval mode, no gradient) and answers it with our stage's round (`round`, read on the event loop;
    left out when it changed meanwhile). Serves only the peers `allowed()` lists (the next stage's), `max_per_asker`
    microbatches per peer at a time and `max_running` in all, of at most `max_tokens` ids below `vocab_size`."""

    def __init__(self, worker: StageWorker, max_tokens: int, vocab_size: int, allowed: Callable[[], Collection[str]],
                 loop: asyncio.AbstractEventLoop, max_running: int = MAX_RECOMPUTING,
                 max_per_asker: int = MAX_PER_ASKER, max_seq: Optional[int] = None):
        self.worker, self.max_tokens, self.vocab_size, self.allowed = worker, max_tokens, vocab_size, allowed
        self.max_seq = max_seq  # the longest row (the recipe's seq_len: attention costs its square)
        self.loop, self.max_running, self.max_per_asker = loop, max_running, max_per_asker
        self.round: Optional[Callable[[], int]] = None
        self.running: Counter = Counter()
        self.refused: Counter = Counter()
        self.served = 0
        self._thread: Optional[concurrent.futures.ThreadPoolExecutor] = None

    async def handle(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held = False
        try:
            async with asyncio.timeout(RECOMPUTE_SECONDS):
                header = msgpack.unpackb(await recv_frame(reader, HEADER_BYTES))
                shape = header.get("shape") if isinstance(header, dict) else None
                codec = header.get("codec") if isinstance(header, dict) else None
                problem = self._check(remote, shape, codec) or self._busy(remote)
                if problem is not None:
                    return await self._refuse(writer, problem)
                b, t = shape
                ids = await recv_frame(reader, 4 * b * t)  # (before a slot is taken: an asker that stalls holds none)
                inputs = token_ids(ids, self.vocab_size) if len(ids) == 4 * b * t else None
                problem = "token ids malformed" if inputs is None else self._busy(remote)
                if problem is not None:
                    return await self._refuse(writer, problem)
                self.running[remote] += 1
                held = True
                if self._thread is None:
                    self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="recompute")
                round_before = self.round() if self.round is not None else None
                # (the copy to the CPU and the encoding in that thread too: on a GPU they wait for the forward)
                payload = await self.loop.run_in_executor(self._thread, lambda: get_codec(codec).encode(
                    self.worker.output(inputs.reshape(b, t)).detach().float().reshape(-1).cpu()))
                round_no = self.round() if self.round is not None else None
                if round_no != round_before:  # (an outer step moved our params meanwhile: no answer of one state)
                    return await self._refuse(writer, f"{BUSY}: our round ended while we computed")
                await send_frame(writer, msgpack.packb({} if round_no is None else {"round": round_no}))
                await send_frame(writer, payload)
                self.served += 1
        except asyncio.TimeoutError:
            logger.info("gave up computing a microbatch again for %s: it took over %.0f s", remote[-8:],
                        RECOMPUTE_SECONDS)
        except (asyncio.IncompleteReadError, ConnectionError):  # the asker went away, or sent less than it said
            return
        except asyncio.CancelledError:  # the peer is stopping
            return
        finally:
            if held:
                self.running[remote] -= 1
                if not self.running[remote]:
                    del self.running[remote]

    async def _refuse(self, writer: asyncio.StreamWriter, problem: str) -> None:
        """Answer `problem` (one line), counted by kind ("busy" or "request": never by the text, which quotes what
        the asker wrote)."""
        self.refused[BUSY if problem.startswith(BUSY) else "request"] += 1
        await send_frame(writer, msgpack.packb({"error": problem}))

    def _check(self, remote: str, shape: object, codec: object) -> Optional[str]:
        """Why a request from `remote` is refused before its ids are read (None: it is not)."""
        if remote not in self.allowed():
            return "you are not a peer of the next stage that we know of"
        if not isinstance(shape, list) or len(shape) != 2 or \
                not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
            return "shape is not (batch, tokens)"
        too_large = size_problem(shape[0], shape[1], self.max_tokens, self.max_seq)
        if too_large is not None:
            return too_large
        if not isinstance(codec, str) or codec not in CODECS:
            return f"codec {shown(codec)} is not one for activations ({', '.join(CODECS)})"
        return None

    def _busy(self, remote: str) -> Optional[str]:
        if self.running[remote] >= self.max_per_asker:
            return f"{BUSY}: {self.running[remote]} microbatches of yours are computed again already"
        if sum(self.running.values()) >= self.max_running:
            return f"{BUSY}: {self.max_running} microbatches are computed again already"
        return None


@dataclass
class Recheck:
    """The side of the stage right after the first: `judge` holds a sender's training activations to another
    first-stage peer's for the same token ids (see the module). `peers()` lists the first stage's training peers,
    each with whether it is a client (it accepts no streams, so it cannot compute again) and the round it announces;
    a sender it does not list is told to come back (busy), so that strangers make nobody compute. Those asked are
    drawn at random among the others that announce a round within one of the stage's median (a peer still at the
    recipe's init, which could not sync, computes nothing for anyone), whatever round the sender says it is in: the
    rule is loose enough for peers a round apart, and a sender's claim chooses nothing. The outvoted are left out in
    `check` (the server's check of its senders). `share` is the recipe's pipeline.duplicate_share (0: nothing is
    computed again)."""

    node: SwarmNode
    protocol: str
    peers: Callable[[], list[tuple[str, bool, int]]]
    check: AnswerCheck
    share: float
    codec: str = "fp16"
    timeout: float = RECOMPUTE_SECONDS
    seed: Optional[int] = None
    verified: Counter = field(default_factory=Counter)  # sender -> its activations that agreed with another's
    asked: int = 0  # microbatches we asked a first-stage peer to compute again
    compared: int = 0
    disputed: int = 0  # no two agreed: nothing applied
    outvoted: int = 0  # peers left out for disagreeing with two that agree

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def sampled(self, sender: str) -> bool:
        """Whether `sender`'s microbatch is computed again: while fewer than PROBATION of its microbatches agreed with
        another peer's, and then a `share` of them, drawn at random."""
        return self.share > 0 and (self.verified[sender] < PROBATION or self._random.random() < self.share)

    async def judge(self, sender: str, x: torch.Tensor, rows: torch.Tensor) -> Optional[str]:
        """None: `sender`'s activations `x` (b, t, h) for the whole rows of token ids `rows` (b, t + 1) may be trained
        on. Otherwise why not (one line, with the numbers): `sender` is no first-stage peer we know of (yet: busy),
        no two first-stage peers agree on them, or they disagree with two that agree (then `sender` is left out).
        With no other first-stage peer to ask, or when it does not answer, they stand."""
        if sender not in {peer for peer, _, _ in self.peers()}:
            return f"{BUSY}: we do not know you as a peer of the first stage (yet); try again in a moment"
        if not self.sampled(sender):
            return None
        inputs = rows[:, :-1]
        first = Answer(sender, x, 0.0)
        second = await self._another({sender}, inputs, x.shape[-1])
        if second is None:
            return None
        self.compared += 1
        verdict = decide(first, second, agreement=ACTIVATIONS)
        if verdict.use is None:
            third = await self._another({sender, second.peer}, inputs, x.shape[-1])
            verdict = decide(first, second, third, ACTIVATIONS) if third is not None else verdict
        return self._settle(sender, verdict, microbatch_id(x, rows))

    async def _another(self, exclude: set[str], inputs: torch.Tensor, hidden: int) -> Optional[Answer]:
        """The activations one more first-stage peer, not one of `exclude` and drawn at random, computes for
        `inputs`; None when there is none, or it fails (the comparison is lost). Its round is left out: activations
        are compared whatever round each was computed in."""
        servers = [(peer, round_no) for peer, client, round_no in self.peers() if not client]
        if not servers:
            return None
        middle = statistics.median_low(round_no for _, round_no in servers)
        pool = [peer for peer, round_no in servers if abs(round_no - middle) <= 1 and peer not in exclude
                and not self.check.is_excluded(peer)]
        if not pool:
            return None
        peer = self._random.choice(sorted(pool))
        self.asked += 1
        try:
            out, _ = await ask_recompute(self.node, peer, self.protocol, inputs, hidden, self.codec, self.timeout)
        except Exception as e:  # noqa: BLE001 - a peer that cannot compute it again compares nothing
            logger.info("first-stage peer %s did not compute a microbatch again (%s)", peer[-8:],
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            return None
        return Answer(peer, out, 0.0)

    def _settle(self, sender: str, verdict: Verdict, microbatch: str) -> Optional[str]:
        """What a comparison says (integrity.tally: probation, the outvoted left out), and why `sender`'s microbatch
        is refused (None: it agreed; with no rounds compared, a sender that did not agree was outvoted or disputed)."""
        if verdict.outvoted is not None and not self.check.is_excluded(verdict.outvoted):
            self.outvoted += 1
        tally(verdict, microbatch, self.verified, Counter(), self._leave_out)  # (no rounds compared: none odd)
        if sender in verdict.agreed:
            return None
        if verdict.use is None:
            self.disputed += 1
            logger.info("pipeline: no two first-stage peers agree on the activations of microbatch %s, nothing "
                        "applied: %s", microbatch, verdict.evidence)
            return f"{DISPUTED} on them ({verdict.evidence})"
        return f"activations refused: outvoted on microbatch {microbatch}: {verdict.evidence}"

    def _leave_out(self, peer: str, why: str) -> None:
        if self.check.is_excluded(peer):  # (settled on two microbatches at once: one warning is enough)
            return
        self.check.exclude(peer, why)
        self.verified.pop(peer, None)
        logger.warning("pipeline: left out first-stage peer %s for %.0f s: %s", peer, EXCLUDE_SECONDS, why)
