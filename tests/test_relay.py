"""A middle stage relays microbatches (swarm/peer/pipeline/relay.py): three stages over real p2p streams, each in
its own node, the middle one's training thread taking the next microbatch while the ones it sent on travel. Its
microbatches are in flight together, each is trained once on every stage, and with the flush schedule the three
stages end where one process computing the whole batches ends."""

from __future__ import annotations

import concurrent.futures
import re
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from swarm.peer.pipeline.microbatches import MicrobatchStream
from swarm.peer.pipeline.relay import Relay
from swarm.peer.pipeline.routing import Router, stage_protocol
from swarm.peer.pipeline.server import Handoff, StageServer
from swarm.peer.pipeline.worker import PipelineError
from swarm.model.stages import make_stages
from test_pipeline import HIDDEN, VOCAB, _model, _worker  # (the same 4-block model and stage workers)

RUN = "relay-test"
BOUNDS = [(0, 1), (1, 3), (3, 4)]
ROWS = 4  # a batch's rows: each stage steps once per batch


def _batches(n: int) -> list[torch.Tensor]:
    return [torch.randint(0, VOCAB, (ROWS, 9), generator=torch.Generator().manual_seed(seed)) for seed in range(n)]


@pytest.fixture
def three_stages(p2p_network):
    """A first-stage worker, a middle-stage peer whose training thread relays (as Part runs it), and a last-stage
    peer that computes 50 times slower than it could, so that a microbatch's answer takes a while."""
    loop, node = p2p_network
    first_node, middle_node, last_node = node(), node(), node()
    workers = [_worker(stage) for stage in make_stages(_model(), BOUNDS)]
    for worker in workers[1:]:
        worker.step_rows = ROWS
    workers[2].slowdown = 50.0
    last = StageServer(workers[2], HIDDEN, max_tokens=64, vocab_size=VOCAB, loop=loop.loop)
    loop.run(last_node.add_stream_handler(stage_protocol(RUN, *BOUNDS[2]), last.handle), timeout=30)
    last_peers = [(last_node.peer_id, 1000.0)]
    to_last = Router(middle_node, stage_protocol(RUN, *BOUNDS[2]), lambda: list(last_peers), codec="none",
                     timeout=20, seed=3)
    handoff = Handoff(loop.loop)
    middle = StageServer(workers[1], HIDDEN, max_tokens=64, vocab_size=VOCAB, loop=loop.loop,
                         execute=handoff.hand_over, execute_eval=lambda x, t: handoff.hand_over(x, t, None))
    loop.run(middle_node.add_stream_handler(stage_protocol(RUN, *BOUNDS[1]), middle.handle), timeout=30)
    relay = Relay(workers[1], to_last.send(loop), to_last.send(loop, evaluate=True), handoff.answer, window=4)
    to_middle = Router(first_node, stage_protocol(RUN, *BOUNDS[1]), lambda: [(middle_node.peer_id, 1000.0)],
                       codec="none", timeout=20, seed=4)
    stop = threading.Event()

    def train():  # the middle peer's training thread
        while not stop.is_set():
            relay.serve(handoff.take, 0.2)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    yield loop, workers, relay, to_middle, to_last, last_peers
    stop.set()
    thread.join(10)
    assert not thread.is_alive()


@pytest.mark.slow  # about 7-12 s on the 2-core machines: out of the quick subset
def test_a_middle_stage_relays_microbatches_in_flight_together_and_trains_what_one_process_trains(three_stages):
    """pipeline.schedule flush: each batch as 2 microbatches in flight, the next batch once this one is stepped on.
    The middle stage has both in flight to the last stage at once (holding one from its forward to its gradient's
    return, it had one), steps once per batch, and after three batches the losses and all three stages' params are
    those of the whole batches through the three stages in one process."""
    loop, workers, relay, to_middle, to_last, _ = three_stages
    stream = MicrobatchStream(workers[0], to_middle.send(loop), parts=2, window=2, across=False)
    batches = _batches(3)
    feed = iter(batches)
    losses = [stream.step(lambda: next(feed))[0] for _ in batches]
    assert to_last.most_in_flight == 2, "the middle stage sent the second microbatch before the first came back"

    stages = make_stages(_model(), BOUNDS)
    optimizers = [torch.optim.AdamW(s.parameters(), lr=1e-3) for s in stages]
    for batch, loss in zip(batches, losses):
        hidden = batch[:, :-1]
        for stage in stages:
            hidden = stage(hidden)
        expected = F.cross_entropy(hidden.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        expected.backward()
        for stage, optimizer in zip(stages, optimizers):
            torch.nn.utils.clip_grad_norm_(stage.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        assert abs(loss - expected.item()) < 1e-5, (loss, expected.item())
    for worker, stage in zip(workers, stages):
        for ours, theirs in zip(worker.stage.parameters(), stage.parameters()):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
    assert [w.microbatches for w in workers] == [6, 6, 6] and not relay.pending


@pytest.mark.slow  # about 7-12 s on the 2-core machines: out of the quick subset
def test_a_streaming_middle_stage_trains_each_microbatch_once_and_settles_before_averaging(three_stages):
    """The first stage's default schedule (stream): microbatches of the next batch go before this one is stepped
    on, so the middle stage holds two generations of weights at times. Every microbatch is trained once on each
    stage, the middle one had several in flight, and settling (what a peer does before it averages) leaves nothing
    in flight and no gradient unapplied; a validation microbatch through the middle stage gets the pipeline's loss
    and trains nothing."""
    loop, workers, relay, to_middle, to_last, _ = three_stages
    stream = MicrobatchStream(workers[0], to_middle.send(loop), parts=2, window=2)
    feed = iter(_batches(5))
    losses = [stream.step(lambda: next(feed))[0] for _ in range(4)]
    losses += [loss for loss, _ in stream.settle()]
    assert stream.taken == stream.trained == 5 and all(torch.isfinite(torch.tensor(losses)))
    assert to_last.most_in_flight >= 2
    assert [w.microbatches for w in workers] == [10, 10, 10], "each microbatch trained once on each stage"
    assert not relay.pending, "the middle stage answered its last microbatch after stepping on it"

    before = [p.clone() for w in workers for p in w.stage.parameters()]
    batch = _batches(6)[5]
    loss = workers[0].evaluate(batch[:, :-1], batch[:, 1:], to_middle.evaluator(loop))
    with torch.no_grad():
        hidden = batch[:, :-1]
        for worker in workers:
            hidden = worker.stage(hidden)
        expected = F.cross_entropy(hidden.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    assert abs(loss - expected.item()) < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(before, [p for w in workers for p in w.stage.parameters()]))
    assert [w.microbatches for w in workers] == [10, 10, 10]


def test_a_middle_stage_that_knows_no_peer_of_the_next_stage_answers_busy_and_is_not_left_out(three_stages):
    """While the stage after the middle one has no peer it knows (not found yet at start, or all gone), its answer
    is "busy": the first stage keeps its microbatches and tries the middle peer again, rather than leaving it out
    for 30 s for what the stage after it lacks; once the last stage is back, the batches train, each microbatch
    once on every stage."""
    loop, workers, relay, to_middle, to_last, last_peers = three_stages
    stream = MicrobatchStream(workers[0], to_middle.send(loop), parts=2, window=2)
    feed = iter(_batches(3))
    gone = last_peers.pop()
    with pytest.raises(PipelineError, match="no peer of the next stage"):
        stream.step(lambda: next(feed))
    assert not to_middle.failed, "the middle peer is not left out"
    assert [w.microbatches for w in workers] == [0, 0, 0]
    last_peers.append(gone)
    for outage in range(2):  # (the other microbatch in flight may have failed too: each is sent again once)
        try:
            stream.step(lambda: next(feed))
            break
        except PipelineError:
            assert outage == 0, "a microbatch failed again with a last-stage peer there to take it"
    stream.settle()
    assert stream.pending == 0 and stream.taken == stream.trained
    assert [w.microbatches for w in workers] == [2 * stream.taken] * 3, "each microbatch trained once on each stage"


class _LateFuture(concurrent.futures.Future):
    """A hop's future whose answer is there already but which says so only from its second look on: as one that
    comes back while the relay reads its microbatches in flight."""

    def __init__(self, answer):
        super().__init__()
        self.set_result(answer)
        self.looks = 0

    def done(self) -> bool:
        self.looks += 1
        return self.looks > 1


def test_a_gradient_that_comes_back_while_the_relay_looks_is_not_lost():
    """A gradient that came back between two looks at the microbatches in flight was once dropped from both lists:
    never backpropagated nor answered, its generation never stepped on, and after two such generations the middle
    stage took no more microbatches. It is backpropagated and answered now."""
    worker = _worker(make_stages(_model(), BOUNDS)[1])
    worker.step_rows = 2
    answers = []
    relay = Relay(worker, lambda out, targets, scale: _LateFuture((torch.ones_like(out), 1.5)), None,
                  lambda done, result=None, error=None: answers.append((result, error)), window=4)
    before = [p.clone() for p in worker.stage.parameters()]
    sender = concurrent.futures.Future()  # (the sender's: not done, so it still waits for the answer)
    entry = (torch.randn(2, 8, HIDDEN), torch.randint(0, VOCAB, (2, 8)), 1.0, None, sender)
    taken = iter([entry])
    finished = relay.serve(lambda timeout: next(taken, None), 5.0)
    assert finished == [(1.5, 16)] and len(answers) == 1 and answers[0][1] is None
    assert answers[0][0][0].shape == (2, 8, HIDDEN) and not relay.pending
    assert not all(torch.equal(a, b) for a, b in zip(before, worker.stage.parameters())), "stepped on"


@pytest.mark.slow
def test_three_stage_peers_train_with_the_middle_one_relaying(swarm):
    """The pipeline as peers run it, three stages of one peer each (tests/recipes/stages3.yaml), the last one
    computing 4x slower (--inject-fault slow@0): the middle peer has several microbatches in flight to it at once,
    each stage averages three rounds, every peer stops cleanly, and the validation loss the first stage gets
    through all three falls. The recipe's bottleneck of 16 values a token in int8 (the hidden size is 64) is what
    crosses each boundary, with the whole rows of token ids that the stages after it embed again: the first stage's
    hops carry under a quarter of the bytes a token that 64 values in fp16 would (validation microbatches too)."""
    _, maddr = swarm.bootstrap(recipe=Path(__file__).parent / "recipes" / "stages3.yaml")
    peers = [swarm.peer(maddr, "--stage", str(k), "--until-round", "3", *(["--inject-fault", "slow@0"] if k == 2
                                                                          else []), name=f"stage{k}")
             for k in (2, 1, 0)][::-1]
    for peer in peers:
        peer.wait_event("averaged", 240, round=2)
    for peer in peers:
        assert peer.wait(120) == 0, peer.output()[-3000:]
    relayed = int(re.search(r"stage 1 trained \d+ microbatches .* at most (\d+) microbatches in flight",
                            peers[1].output()).group(1))
    assert relayed >= 2, "the middle stage sent one on before the one before it came back"
    trained = [peer.events("pipeline")[0]["microbatches"] for peer in peers]
    assert all(n > 0 for n in trained), trained
    first = peers[0].events("pipeline")[0]
    fp16 = 2 * 64 * 2  # (hidden states forward and their gradients back, fp16, per token)
    assert first["wire_bytes"] / first["tokens"] < fp16 / 4, first
    val = [e["val_loss"] for e in peers[0].events("averaged")][:3]
    assert len(val) == 3 and all(v is not None for v in val) and val[-1] < val[0], val
