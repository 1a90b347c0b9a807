"""What a stage peer may not claim (issue 37, class 9; swarm/peer/pipeline/integrity.py): an announced rate buys no
more than a bounded share of the microbatches (the router weighs peers by what it measured), and an answer far
outside the other peers' or the peer's own earlier ones (gradients x1000, a loss made up) is refused, retried on
another peer, and its peer left out with one log line that names it and the numbers. The router is driven in one
process with a fake hop; then real stage servers on localhost, one of them lying, and a stage server refusing a
sender's activations x1000."""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter

import pytest
import torch

from swarm.peer.pipeline import routing
from swarm.peer.pipeline.integrity import (ANSWER_RULES, PRIOR_CAP, STRIKES, WEIGHT_CAP, AnswerCheck,
                                           routing_weights)
from swarm.peer.pipeline.routing import Router, stage_protocol
from swarm.peer.pipeline.worker import PipelineError

pytestmark = pytest.mark.timeout(90)
SHAPE = (2, 8, 16)


def _activations(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


class _FakeHops:
    """call_stage for a router in one process: each peer answers after `latency` s a gradient of about the same
    norm every time and a loss near 3, times `lies[peer]` (gradient) or / (loss) from its `after`-th answer on."""

    def __init__(self, latency: float = 0.002):
        self.latency = latency
        self.lies: dict[str, tuple[str, float, int]] = {}  # peer -> (what, factor, from which answer)
        self.answers: Counter = Counter()
        self.calls = 0

    async def __call__(self, node, peer, protocol, x, targets, codec, meter, timeout, scale=1.0, evaluate=False):
        await asyncio.sleep(self.latency)
        self.calls += 1
        self.answers[peer] += 1
        noise = torch.Generator().manual_seed(self.calls)
        grad = None if evaluate else torch.randn(x.shape, generator=noise) * 1e-3 * scale
        loss = 3.0 + 0.2 * float(torch.rand(1, generator=noise))
        what, factor, after = self.lies.get(peer, ("", 1.0, 0))
        if self.answers[peer] > after:
            if what == "scale-grad" and grad is not None:
                grad = grad * factor
            if what == "low-loss":
                loss = loss / factor
        return grad, loss


def _router(peers: list[tuple[str, float]], hops: _FakeHops, monkeypatch) -> Router:
    monkeypatch.setattr(routing, "call_stage", hops)
    return Router(node=None, protocol="test", peers=lambda: peers, seed=1)


def _send(router: Router, n: int, evaluate: bool = False, first: int = 0) -> list:
    async def run():
        return [await router.forward(_activations(first + k), torch.zeros(SHAPE[:2], dtype=torch.long), 0.5,
                                     evaluate) for k in range(n)]
    return asyncio.run(run())


def test_routing_weights_bound_what_an_announced_or_measured_rate_buys():
    """While nobody is measured, an announced rate counts for at most PRIOR_CAP times the median announced; once
    peers are measured, an unmeasured one starts at their median, and no weight passes WEIGHT_CAP times the median
    (nor falls below 1 / WEIGHT_CAP of it)."""
    peers = [("a", 100.0), ("b", 100.0), ("c", 100.0), ("liar", 1e12)]
    assert routing_weights(peers, {}) == [100.0, 100.0, 100.0, PRIOR_CAP * 100.0]
    assert routing_weights(peers, {"a": 50.0, "b": 70.0}) == [50.0, 70.0, 60.0, 60.0]
    fast = routing_weights(peers, {"a": 50.0, "b": 50.0, "c": 50.0, "liar": 1e9})
    assert fast[-1] == WEIGHT_CAP * 50.0
    slow = routing_weights(peers, {"a": 0.001, "b": 50.0, "c": 50.0, "liar": 50.0})
    assert slow[0] == 50.0 / WEIGHT_CAP


def test_a_peer_announcing_a_thousand_times_the_others_rate_gets_no_more_than_twice_a_fair_share(monkeypatch):
    """Four next-stage peers that answer equally fast; one announces x1000 the others' tokens/s (the router used to
    give it 1000/1003 of the microbatches). Of the first 200 it gets at most twice a fair share."""
    peers = [("a", 100.0), ("b", 100.0), ("c", 100.0), ("liar", 1e5)]
    router = _router(peers, _FakeHops(), monkeypatch)
    _send(router, 200)
    assert sum(router.sent_to.values()) == 200
    assert router.sent_to["liar"] <= 2 * 200 / 4, router.sent_to
    assert min(router.sent_to.values()) > 0.5 * 200 / 4, router.sent_to


def test_x1000_gradients_from_one_of_three_peers_are_refused_and_it_is_left_out(monkeypatch, caplog):
    """Three next-stage peers; from its 4th answer on one returns its gradients x1000. Each such answer is refused
    (never returned to the sender: the microbatch goes to another peer), and after STRIKES in a row it is left out
    with one warning that names it and the numbers; every microbatch is answered once, honestly."""
    hops = _FakeHops()
    hops.lies["liar"] = ("scale-grad", 1000.0, 3)
    router = _router([("a", 100.0), ("b", 100.0), ("liar", 100.0)], hops, monkeypatch)
    with caplog.at_level(logging.INFO, logger="swarm.peer.pipeline.routing"):
        answers = _send(router, 60)
    assert len(answers) == 60
    assert max(float(grad.norm()) for grad, _ in answers) < 0.1, "no x1000 gradient reached the sender"
    assert router.check.is_excluded("liar") and router.refused == STRIKES
    assert hops.answers["liar"] == 3 + STRIKES, "left out after STRIKES refusals in a row"
    assert router.sent_to["liar"] == 3 and router.sent_to["a"] + router.sent_to["b"] == 57
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "stage peer liar" in warnings[0] and "left it out" in warnings[0], warnings
    assert "sensitivity" in warnings[0] and "x the median" in warnings[0], warnings


def test_a_liar_from_its_first_answer_is_refused_once_two_honest_peers_have_answered(monkeypatch):
    hops = _FakeHops()
    hops.lies["liar"] = ("scale-grad", 1000.0, 0)
    router = _router([("a", 100.0), ("b", 100.0), ("liar", 100.0)], hops, monkeypatch)
    answers = _send(router, 60)
    assert router.check.is_excluded("liar") and not router.check.is_excluded("a") \
        and not router.check.is_excluded("b")
    # (its answers before the honest peers had MIN_EVIDENCE each set nothing to compare against: at most a few pass)
    assert sum(float(grad.norm()) > 0.1 for grad, _ in answers) <= 3


def test_a_lone_next_stage_peer_is_held_to_its_own_first_answers(monkeypatch):
    """With one next-stage peer there is nobody to compare with: its first answers set the scale, and from its 6th
    answer on its gradients jump x1000, which is refused; at STRIKES refusals it is left out, and the sender learns
    that no peer took the microbatch (PipelineError) rather than train on the jump."""
    hops = _FakeHops()
    hops.lies["lone"] = ("scale-grad", 1000.0, 5)
    router = _router([("lone", 100.0)], hops, monkeypatch)
    assert len(_send(router, 5)) == 5
    with pytest.raises(PipelineError, match="refused"):
        _send(router, 1, first=5)
    with pytest.raises(PipelineError, match="refused"):
        _send(router, 1, first=6)
    assert router.check.is_excluded("lone")
    with pytest.raises(PipelineError, match="no peer of the next stage took the microbatch \\(tried 0"):
        _send(router, 1, first=7)


def test_a_made_up_validation_loss_is_refused(monkeypatch):
    """The validation loss of a pipelined run goes through the next stage's peers: one that answers the loss / 1000
    is refused (the honest peers' losses are about 3), and the losses the sender gets are all honest."""
    hops = _FakeHops()
    hops.lies["liar"] = ("low-loss", 1000.0, 3)
    router = _router([("a", 100.0), ("b", 100.0), ("liar", 100.0)], hops, monkeypatch)
    losses = [loss for _, loss in _send(router, 40, evaluate=True)]
    assert min(losses) >= 3.0 and router.check.is_excluded("liar")


def test_two_lone_peers_that_disagree_are_a_dispute_and_nobody_is_left_out():
    """Two peers, one answering x1000 the other's from the start: nobody can tell which lies; both are accepted and
    the dispute is counted (the limit: an honest majority of at least two is what the comparison needs)."""
    check = AnswerCheck(ANSWER_RULES)
    for k in range(5):
        assert check.judge("a", {"sensitivity": 1.0, "loss": 3.0}, now=k) is None
        assert check.judge("b", {"sensitivity": 1000.0, "loss": 3.0}, now=k) is None
    assert check.disputes > 0 and not check.excluded


def test_an_honest_spike_costs_one_retry_not_the_peer():
    """One answer 20x the others' (an honest peer's gradients did reach that in a tiny model memorising its data)
    is refused, but the next honest answer clears the strike: the peer is not left out."""
    check = AnswerCheck(ANSWER_RULES)
    for k in range(4):
        for peer in "abc":
            assert check.judge(peer, {"sensitivity": 1.0, "loss": 3.0}, now=k) is None
    assert check.judge("c", {"sensitivity": 20.0, "loss": 3.0}, now=5) is not None
    assert check.judge("c", {"sensitivity": 1.2, "loss": 3.0}, now=6) is None
    assert check.judge("c", {"sensitivity": 20.0, "loss": 3.0}, now=7) is not None and not check.excluded


# -- real stage servers on localhost ------------------------------------------------------------------------------

def test_a_lying_stage_server_is_caught_over_the_network_and_training_goes_on(p2p_network, caplog):
    """A first-stage worker and three last-stage servers over real p2p streams; one server answers with its
    gradients x1000 (StageServer lie="scale-grad"). Within 40 microbatches it is refused and left out, every
    microbatch is trained (on the honest servers' answers), and the first stage's losses stay finite and close to
    those of the same batches through one honest copy of the pipeline in one process."""
    from swarm.compression import get_codec
    from swarm.model.stages import WireStats, make_stages, run_pipeline
    from test_pipeline import BOUNDS, HIDDEN, RUN, VOCAB, _batch, _model, _worker
    from swarm.peer.pipeline.server import StageServer

    loop, node = p2p_network
    first = node()
    servers = {}
    for lie in (None, None, "scale-grad"):
        peer = node()
        server = StageServer(_worker(make_stages(_model(), BOUNDS)[1]), HIDDEN, max_tokens=64, vocab_size=VOCAB,
                             loop=loop.loop, lie=lie)
        loop.run(peer.add_stream_handler(stage_protocol(RUN, *BOUNDS[1]), server.handle), timeout=30)
        servers[peer.peer_id] = server
    liar = next(p for p, s in servers.items() if s.lie)
    router = Router(first, stage_protocol(RUN, *BOUNDS[1]), lambda: [(p, 1000.0) for p in sorted(servers)],
                    codec="none", timeout=20, seed=3)
    worker = _worker(make_stages(_model(), BOUNDS)[0])
    stages = make_stages(_model(), BOUNDS)
    optimizers = [torch.optim.AdamW(s.parameters(), lr=1e-3) for s in stages]
    losses, clean = [], []
    with caplog.at_level(logging.WARNING, logger="swarm.peer.pipeline.routing"):
        for seed in range(40):
            batch = _batch(seed)
            clean.append(float(run_pipeline(stages, batch, get_codec("none"), WireStats())))
            for stage, optimizer in zip(stages, optimizers):
                torch.nn.utils.clip_grad_norm_(stage.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(worker.step(batch[:, :-1], batch[:, 1:], router.hop(loop.loop))[1])
    assert router.check.is_excluded(liar), (liar[-6:], router.sent_to, router.refused, router.check.strikes,
                                            {p[-6:]: len(h["loss"]) for p, h in router.check.history.items()})
    assert any(liar in r.getMessage() and "sensitivity" in r.getMessage() for r in caplog.records)
    assert worker.microbatches == 40 and all(math.isfinite(x) for x in losses)
    # (the honest servers each trained on a share of the batches, so their params, and the losses, differ a little)
    gaps = [abs(a - b) for a, b in zip(losses, clean)]
    print(f"liar's answers {servers[liar].worker.microbatches}, refused {router.refused}; loss gap to one honest "
          f"process: mean {sum(gaps) / len(gaps):.4f}, max {max(gaps):.4f}")
    assert sum(gaps) / len(gaps) < 0.05 and max(gaps) < 0.2, list(zip(losses, clean))


def test_a_stage_server_refuses_a_senders_activations_x1000(p2p_network):
    """Three first-stage peers send to one server; one sends its activations x1000 from its 4th microbatch on. The
    server refuses them against its own earlier ones (the sender gets the reason), leaves it out at STRIKES refusals,
    and the others' go on."""
    from test_pipeline import BOUNDS, HIDDEN, RUN, VOCAB, _batch, _model, _worker
    from swarm.model.stages import make_stages
    from swarm.peer.pipeline.server import StageServer

    loop, node = p2p_network
    peer = node()
    server = StageServer(_worker(make_stages(_model(), BOUNDS)[1]), HIDDEN, max_tokens=64, vocab_size=VOCAB,
                         loop=loop.loop)
    loop.run(peer.add_stream_handler(stage_protocol(RUN, *BOUNDS[1]), server.handle), timeout=30)
    senders = [node() for _ in range(3)]
    stage0 = make_stages(_model(), BOUNDS)[0]
    outcomes = Counter()
    for k in range(6):
        for i, sender in enumerate(senders):
            batch = _batch(10 * k + i)
            with torch.no_grad():
                x = stage0(batch[:, :-1])
            if i == 2 and k >= 3:
                x = x * 1000
            try:
                loop.run(routing.call_stage(sender, peer.peer_id, stage_protocol(RUN, *BOUNDS[1]), x, batch[:, 1:],
                                            "none", routing.WireMeter(), 20), timeout=30)
                outcomes[i, "ok"] += 1
            except PipelineError as e:
                assert "activations refused" in str(e)
                outcomes[i, "refused"] += 1
    assert outcomes[0, "ok"] == outcomes[1, "ok"] == 6 and outcomes[2, "ok"] == 3 and outcomes[2, "refused"] == 3
    assert server.check.is_excluded(senders[2].peer_id) and server.refused["activations"] == 3


def test_a_validation_microbatch_is_not_judged_against_the_senders_training_activations(p2p_network):
    """A validation microbatch trains nothing on the server, so its activations are held to nothing but the sender's
    standing (a left-out sender is refused): one x1000 its training ones is answered with its loss, twice in a row,
    and leaves no strike (on the old server, a first stage's validation activations taken from the round's new
    params came 160x its training ones, were refused, and the round had no validation loss)."""
    from test_pipeline import BOUNDS, HIDDEN, RUN, VOCAB, _batch, _model, _worker
    from swarm.model.stages import make_stages
    from swarm.peer.pipeline.server import StageServer

    loop, node = p2p_network
    peer, sender = node(), node()
    server = StageServer(_worker(make_stages(_model(), BOUNDS)[1]), HIDDEN, max_tokens=64, vocab_size=VOCAB,
                         loop=loop.loop)
    loop.run(peer.add_stream_handler(stage_protocol(RUN, *BOUNDS[1]), server.handle), timeout=30)
    stage0 = make_stages(_model(), BOUNDS)[0]

    def hop(k: int, factor: float, evaluate: bool):
        batch = _batch(k)
        with torch.no_grad():
            x = stage0(batch[:, :-1]) * factor
        return loop.run(routing.call_stage(sender, peer.peer_id, stage_protocol(RUN, *BOUNDS[1]), x, batch[:, 1:],
                                           "none", routing.WireMeter(), 20, evaluate=evaluate), timeout=30)

    for k in range(4):
        hop(k, 1.0, evaluate=False)
    for k in range(2):
        grad, loss = hop(10 + k, 1000.0, evaluate=True)[:2]
        assert grad is None and math.isfinite(loss)
    hop(20, 1.0, evaluate=False)
    assert not server.check.is_excluded(sender.peer_id) and server.refused["activations"] == 0
    assert server.worker.microbatches == 5


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_stage_peer_process_sending_back_x1000_gradients_is_left_out_and_the_swarm_trains_on(swarm):
    """Real peer processes: two first-stage peers, three last-stage peers of which one answers every microbatch with
    its input-gradients x1000 (--inject-fault scale-grad@0). The first stage refuses its answers and leaves it out
    within the first round (one warning naming it), every batch it took is trained once, and the swarm ends round 2
    with finite losses."""
    from pathlib import Path
    rounds = 2
    _, maddr = swarm.bootstrap(recipe=Path(__file__).parent / "recipes" / "stages.yaml")
    # The last stage first: once its three peers train, the first stage's microbatches reach them from its first
    # batch on (started together, the first stage once found no next-stage peer, and its rounds came due from the
    # other first-stage peer's tokens before a microbatch reached the liar).
    liar = swarm.peer(maddr, "--stage", "1", "--until-round", str(rounds), "--inject-fault", "scale-grad@0",
                      name="liar")
    honest = [swarm.peer(maddr, "--stage", "1", "--until-round", str(rounds), name=f"last{i}") for i in range(2)]
    for peer in (liar, *honest):
        peer.wait_event("training", 120)
    liar_id = liar.events("joined")[0]["peer_id"]
    first, other_first = (swarm.peer(maddr, "--stage", "0", "--until-round", str(rounds), name=name)
                          for name in ("first", "first2"))
    first.wait_for("left it out", 180)  # (within round 0: it runs until round 2)
    assert first.wait(300) == 0, first.output()[-3000:]
    for peer in (other_first, *honest):
        assert peer.wait(300) == 0, peer.output()[-3000:]
    refusals = [line for line in first.output().splitlines() if "left it out" in line]
    assert refusals and all(liar_id in line for line in refusals), refusals
    assert [e["round"] for e in first.events("averaged")][:1] == [0]
    account = first.events("pipeline")[-1]
    assert account["taken"] == account["trained"] + account["pending"] and account["trained"] > 0, account
    losses = [e["loss"] for e in first.events("averaged") if e.get("loss") is not None]
    assert losses and all(math.isfinite(loss) and loss < 10 for loss in losses), first.events("averaged")
