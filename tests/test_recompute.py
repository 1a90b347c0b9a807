"""A first stage's activations computed again by its other peers (issue 37, class 9; swarm/peer/pipeline/recompute.py):
over real p2p streams on localhost, three first-stage peers (copies of one stage, each stepped on its own batches, so
they drift apart as in a round) serve recomputations, and a last stage right after them verifies its senders. Noise of
the honest activations' norm is outvoted on its sender's first microbatch, applied nowhere, and its sender left out
with one warning; a peer that lies in what it computes again is outvoted in turn while the honest sender's
microbatch is taken; two lone first-stage peers that disagree apply nothing and blame nobody; the verifying stage
takes only whole rows of token ids, and a first-stage peer computes again only for the next stage's peers it
knows, two microbatches each at a time."""

from __future__ import annotations

import copy
import functools
import itertools
import logging

import msgpack
import pytest
import torch
import torch.nn.functional as F

from swarm.dht.frames import recv_frame, send_frame
from swarm.model.stages import make_stages
from swarm.peer.pipeline import routing
from swarm.peer.pipeline.integrity import ACTIVATIONS, PROBATION, Answer, disagreement
from swarm.peer.pipeline.recompute import MAX_PER_ASKER, RecomputeServer, Recheck, ask_recompute, recompute_protocol
from swarm.peer.pipeline.routing import stage_protocol
from swarm.peer.pipeline.server import StageServer
from swarm.peer.pipeline.worker import PipelineError
from test_pipeline import BOUNDS, HIDDEN, RUN, VOCAB, _batch, _model, _worker

pytestmark = pytest.mark.timeout(120)


def _train(first, last, seeds) -> None:
    optimizer = torch.optim.AdamW([*first.parameters(), *last.parameters()], lr=1e-3)
    for seed in seeds:
        batch = _batch(seed)
        F.cross_entropy(last(first(batch[:, :-1])).reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _drifted_copies(n: int, steps: int = 20) -> list:
    """`n` copies of the first stage, trained together for 200 steps (the rounds before), then each with its own
    copy of the last stage for `steps` steps on batches of its own (peers of a stage within one round). From the
    recipe's init instead, copies of this tiny model trained on random tokens drift apart within 20 steps each (a
    cosine of about 0 between their activations: docs/security.md, known limits)."""
    stage0, stage1 = make_stages(_model(), BOUNDS)
    _train(stage0, stage1, range(5000, 5200))
    copies = []
    for k in range(n):
        first, last = copy.deepcopy(stage0), copy.deepcopy(stage1)
        _train(first, last, range(1000 * (k + 1), 1000 * (k + 1) + steps))
        copies.append(first)
    return copies


@functools.lru_cache(maxsize=None)
def _copies(n: int) -> tuple:
    return tuple(_drifted_copies(n))


@pytest.fixture(scope="module")
def shared(p2p_network_shared):
    """(loop, six real nodes on 127.0.0.1) for every test of this module: each test serves its protocols under a
    run id of its own (_Swarm), so that nodes, whose start costs a second or so each, are started once."""
    loop, add = p2p_network_shared
    return loop, [add() for _ in range(6)]


class _Swarm:
    """First-stage peers (nodes, their stage copies, their recompute servers; three by default) and a verifying last
    stage, on `shared`'s nodes, under a run id of their own."""

    runs = itertools.count()

    def __init__(self, shared, firsts: int = 3, share: float = 0.25):
        loop, nodes = shared
        self.loop, self.run = loop, f"{RUN}-{next(self.runs)}"
        self.stage1 = make_stages(_model(), BOUNDS)[1]
        self.last, self.stranger = nodes[0], nodes[5]
        self.server = StageServer(_worker(copy.deepcopy(self.stage1)), HIDDEN, max_tokens=64, vocab_size=VOCAB,
                                  loop=loop.loop)
        self.protocol = recompute_protocol(self.run, *BOUNDS[0])
        self.nodes = nodes[1:1 + firsts]
        self.stages = [copy.deepcopy(stage) for stage in _copies(firsts)]
        self.recomputes = []
        for peer, stage in zip(self.nodes, self.stages):
            recompute = RecomputeServer(_worker(stage), 64, VOCAB, lambda: {self.last.peer_id}, loop.loop)
            recompute.round = lambda: 0
            loop.run(peer.add_stream_handler(self.protocol, recompute.handle), timeout=30)
            self.recomputes.append(recompute)
        self.server.verify = Recheck(self.last, self.protocol, lambda: [(p.peer_id, False, 0) for p in self.nodes],
                                     self.server.check, share, codec="none", seed=5)
        loop.run(self.last.add_stream_handler(stage_protocol(self.run, *BOUNDS[1]), self.server.handle), timeout=30)

    def send(self, k: int, seed: int, garbage: bool = False, rows: bool = True, claim: int = 0) -> str:
        """First-stage peer `k` sends its activations for a batch (noise of their norm with `garbage`): "ok", or why
        it was refused. The last stage's params must be unchanged by a refusal."""
        batch = _batch(seed)
        with torch.no_grad():
            x = self.stages[k](batch[:, :-1])
        if garbage:
            noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
            x = noise * (x.norm() / noise.norm())
        before = [p.detach().clone() for p in self.server.worker.stage.parameters()]
        try:
            self.loop.run(routing.call_stage(self.nodes[k], self.last.peer_id, stage_protocol(self.run, *BOUNDS[1]), x,
                                             batch if rows else batch[:, 1:], "none", routing.WireMeter(), 30,
                                             our_round=claim), timeout=60)
            return "ok"
        except PipelineError as e:
            assert all(torch.equal(a, b) for a, b in zip(before, self.server.worker.stage.parameters())), \
                "a refused microbatch applied nothing"
            return str(e)


@pytest.mark.slow  # about 7-12 s on the 2-core machines: out of the quick subset
def test_honest_copies_of_a_first_stage_agree_and_noise_of_their_norm_does_not():
    copies = _drifted_copies(2, steps=40)
    batch = _batch(7)[:, :-1]
    with torch.no_grad():
        a, b = (stage(batch) for stage in copies)
    noise = torch.randn(a.shape, generator=torch.Generator().manual_seed(0))
    assert disagreement(Answer("a", a, 0.0), Answer("b", b, 0.0), ACTIVATIONS) is None
    why = disagreement(Answer("a", noise * a.norm() / noise.norm(), 0.0), Answer("b", b, 0.0), ACTIVATIONS)
    assert why is not None and why.startswith("activation norm") and "cosine" in why, why
    assert disagreement(Answer("a", torch.zeros_like(a), 0.0), Answer("b", b, 0.0), ACTIVATIONS) is not None, \
        "zeros are no computation"


@pytest.mark.slow  # about 7-12 s on the 2-core machines: out of the quick subset
def test_noise_from_a_first_stage_peer_is_outvoted_on_its_first_microbatch_and_applied_nowhere(shared, caplog):
    """Peer 2 sends noise of its activations' norm from its first microbatch: the last stage has peer 0 or 1
    compute it again, they disagree, the third agrees with the other, and peer 2 is left out (one warning naming it)
    with nothing of it applied; its later microbatches are refused as left out. The honest peers' microbatches, all
    computed again while on probation and a share after, are all taken: their drift is no disagreement."""
    loop, _ = shared
    swarm = _Swarm(shared)
    liar = swarm.nodes[2].peer_id
    outcomes = {k: [] for k in range(3)}
    with caplog.at_level(logging.WARNING, logger="swarm.peer.pipeline.recompute"):
        for step in range(6):
            for k in range(3):
                outcomes[k].append(swarm.send(k, 100 * step + k, garbage=k == 2))
    assert outcomes[0] == ["ok"] * 6 and outcomes[1] == ["ok"] * 6, outcomes
    assert "outvoted on microbatch" in outcomes[2][0] and "cosine" in outcomes[2][0], outcomes[2][0]
    assert all("you are left out" in why for why in outcomes[2][1:]), outcomes[2]
    assert swarm.server.check.is_excluded(liar) and swarm.server.verify.outvoted == 1
    assert not any(swarm.server.check.is_excluded(p.peer_id) for p in swarm.nodes[:2])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and liar in warnings[0], warnings
    assert swarm.server.worker.microbatches == 12
    assert swarm.server.verify.verified[swarm.nodes[0].peer_id] >= PROBATION
    print(f"asked {swarm.server.verify.asked}, compared {swarm.server.verify.compared}; served "
          f"{[r.served for r in swarm.recomputes]}")


@pytest.mark.slow  # about 13 s on the 2-core machines, with its setup: out of the quick subset
def test_a_peer_lying_in_what_it_computes_again_is_outvoted_and_the_honest_sender_is_taken(shared):
    """Peer 2 computes again honestly nothing: it answers noise of the true activations' norm. Whenever it is asked,
    the third peer agrees with the sender, so peer 2 is left out and the sender's microbatch is taken; it is asked no
    more once left out."""
    loop, _ = shared
    swarm = _Swarm(shared, share=1.0)
    liar = swarm.recomputes[2]
    honest_output = liar.worker.output

    def noise(inputs: torch.Tensor) -> torch.Tensor:
        out = honest_output(inputs)
        garbage = torch.randn(out.shape)
        return garbage * (out.norm() / garbage.norm())

    liar.worker.output = noise
    outcomes = [swarm.send(k, 100 * step + k) for step in range(6) for k in range(2)]
    assert outcomes == ["ok"] * 12, outcomes
    assert liar.served >= 1 and swarm.server.check.is_excluded(swarm.nodes[2].peer_id)
    assert swarm.server.verify.outvoted == 1 and swarm.server.verify.disputed == 0
    assert swarm.server.worker.microbatches == 12


@pytest.mark.slow  # about 7-12 s on the 2-core machines: out of the quick subset
def test_two_lone_first_stage_peers_that_disagree_apply_nothing_and_blame_nobody(shared):
    """Whatever round the noise sender claims (its own, the next, one far off): nothing of it is applied, and
    nobody is left out; the claim chooses nothing and compares nothing."""
    swarm = _Swarm(shared, firsts=2, share=1.0)
    for claim in (0, 1, 7):
        why = swarm.send(1, 3 + claim, garbage=True, claim=claim)
        assert "no two first-stage peers agree" in why, (claim, why)
    assert not swarm.server.check.excluded and swarm.server.verify.disputed == 3
    assert swarm.send(0, 4) == "ok" and swarm.send(1, 5) == "ok", "honest microbatches of both are taken"
    assert swarm.server.worker.microbatches == 2


def test_strangers_make_nobody_compute_and_a_peer_far_from_the_stages_round_is_not_asked(shared):
    """A sender the verifying stage does not know as a first-stage peer is told to come back (busy, so an honest
    one just joined is not held to it), and nobody computes anything for it. A first-stage peer announcing a round
    far from the stage's (one still at the recipe's init) is never asked to compute again."""
    loop, _ = shared
    swarm = _Swarm(shared, share=1.0)
    stranger = swarm.stranger
    with torch.no_grad():
        x = swarm.stages[0](_batch(9)[:, :-1])
    with pytest.raises(routing.StageBusy, match="do not know you as a peer of the first stage"):
        loop.run(routing.call_stage(stranger, swarm.last.peer_id, stage_protocol(swarm.run, *BOUNDS[1]), x, _batch(9),
                                    "none", routing.WireMeter(), 30), timeout=60)
    assert swarm.server.verify.asked == 0 and not swarm.server.worker.microbatches
    far = swarm.nodes[2].peer_id
    swarm.server.verify.peers = lambda: [(p.peer_id, False, 40 if p.peer_id == far else 3) for p in swarm.nodes]
    assert [swarm.send(k, 20 + step) for step in range(4) for k in range(2)] == ["ok"] * 8
    assert swarm.recomputes[2].served == 0 and swarm.recomputes[0].served + swarm.recomputes[1].served == 8


def test_the_verifying_stage_takes_whole_rows_only_and_recomputes_are_served_to_the_next_stage_only(shared):
    """A sender that leaves out the inputs of its rows (sending the targets alone, as to a later stage) is refused
    with one line saying what to do: without them nothing can be computed again, so leaving them out buys no escape.
    A first-stage peer computes again for the next stage's peers it knows only, of a bounded size, two at a time
    each."""
    loop, _ = shared
    swarm = _Swarm(shared)
    why = swarm.send(0, 1, rows=False)
    assert "whole rows of token ids" in why and "update swarm" in why, why
    swarm.server.max_seq = 4  # (attention costs the square of a row: rows past the run's seq_len are refused)
    assert "rows of 8 tokens, over the run's 4" in swarm.send(0, 1)
    swarm.server.max_seq = None
    stranger = swarm.stranger
    with pytest.raises(PipelineError, match="not a peer of the next stage"):
        loop.run(ask_recompute(stranger, swarm.nodes[0].peer_id, swarm.protocol, _batch(1)[:, :-1], HIDDEN),
                 timeout=30)
    swarm.recomputes[0].max_seq = 8
    with pytest.raises(PipelineError, match="rows of 9 tokens, over the run's 8"):
        loop.run(ask_recompute(swarm.last, swarm.nodes[0].peer_id, swarm.protocol,
                               torch.zeros((1, 9), dtype=torch.long), HIDDEN), timeout=30)
    with pytest.raises(PipelineError, match="over the 64 a microbatch may hold"):
        loop.run(ask_recompute(swarm.last, swarm.nodes[0].peer_id, swarm.protocol,
                               torch.zeros((9, 8), dtype=torch.long), HIDDEN), timeout=30)
    out, round_no = loop.run(ask_recompute(swarm.last, swarm.nodes[0].peer_id, swarm.protocol, _batch(1)[:, :-1],
                                           HIDDEN), timeout=30)
    with torch.no_grad():
        assert torch.allclose(out, swarm.stages[0](_batch(1)[:, :-1]), atol=1e-2) and round_no == 0

    async def malformed(header: dict, ids: bytes) -> dict:
        reader, writer = await swarm.last.open_stream(swarm.nodes[1].peer_id, swarm.protocol)
        try:
            await send_frame(writer, msgpack.packb(header))
            await send_frame(writer, ids)
            return msgpack.unpackb(await recv_frame(reader, 1024))
        finally:
            writer.close()

    ids = torch.full((2, 8), VOCAB, dtype=torch.int32).numpy().tobytes()
    assert "malformed" in loop.run(malformed({"shape": [2, 8], "codec": "none"}, ids), timeout=30)["error"]
    assert "codec" in loop.run(malformed({"shape": [2, 8], "codec": "zip"}, ids), timeout=30)["error"]
    assert "shape" in loop.run(malformed({"shape": [2, True], "codec": "none"}, ids), timeout=30)["error"]
    swarm.recomputes[1].running[swarm.last.peer_id] += MAX_PER_ASKER  # (as many of ours as it takes are running)
    assert loop.run(malformed({"shape": [2, 8], "codec": "none"}, ids), timeout=30)["error"].startswith("busy")
