"""Which part of the model a peer trains, and how its inner steps run. A run of one stage (`pipeline.stages: 1`,
the default) trains the whole model on the peer's own batches, as always. In a run of S stages the peer hosts one
stage (swarm/model/stages.py), chosen with `--stage K` or where the fewest live peers are, and every round-related
service (announcements, groups, state, replay) runs under that stage's run id, so the peers of a stage are a
DiLoCo swarm of their own. A first-stage peer reads batches and sends each through the pipeline (a Router to the
next stage's peers, routing.py); the others serve microbatches from the stage before, which their training thread
runs (so a microbatch never races an outer step).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

import torch

from swarm.config import ModelRecipe, Recipe, RecipeError
from swarm.settings import PeerSettings
from swarm.dht import view
from swarm.dht.node import SwarmNode
from swarm.dht.records import ONLINE_STATES, TRAINING_STATES, parse_peer_records, peers_key
from swarm.model.build import build_model, n_blocks as count_blocks
from swarm.model.memory import fmt_bytes, part_params, stage_costs, stage_needs
from swarm.model.stages import Stage, even_bounds, materialize
from swarm.peer.pipeline.keeper import Keeper, backup_reference
from swarm.peer.pipeline.microbatches import MicrobatchStream, together
from swarm.peer.pipeline.placement import memory_limits, move_decision, upstream_finished, weakest_stage
from swarm.peer.pipeline.recompute import RecomputeServer, Recheck, recompute_protocol
from swarm.peer.pipeline.relay import Relay
from swarm.peer.pipeline.routing import Router, stage_protocol
from swarm.peer.pipeline.server import LIES, MAX_WAITING_PER_PEER, Handoff, StageServer, unless_dropped
from swarm.peer.pipeline.worker import PipelineError, StageWorker
from swarm.peer.stream import peer_id_hash
from swarm.peer.training import inner_step, validation_loss
from swarm.runtime import LoopThread

logger = logging.getLogger(__name__)
PEERS_SECONDS = 2.0  # how often the next stage's peers are read
WAIT_SECONDS = 0.2  # a serving stage's training thread waits this long for a microbatch before it looks around
DRAIN_SECONDS = 600.0  # the longest a serving stage answers the stage before after its own last round


class Part:
    """The model or the stage this peer trains (`module`), the recipe its round services run under (`run`: the
    recipe with the stage's run id), and its inner step (`step`)."""

    def __init__(self, recipe: Recipe, settings: PeerSettings, model: torch.nn.Module, node: SwarmNode,
                 loop: LoopThread, n_blocks: int, prefer: Optional[int] = None, device: torch.device | str = "cpu"):
        """`model` is the whole model, or in a run of stages best built on the meta device (build_model(meta=True)):
        our stage alone is then allocated and initialised (stages.materialize), so a peer never holds weights of
        the stages it does not host, even at start."""
        self.recipe, self.model, self.node, self.loop, self.settings = recipe, model, node, loop, settings
        self.n_blocks = n_blocks
        self.pinned = settings.stage is not None  # --stage: we stay there; otherwise we may move (rebalancing)
        self.move_to: Optional[int] = None  # the weaker stage we leave ours for, once decided (see _watch)
        self._upstream_rounds: list[int] = []  # the rounds the stage before's peers announce (see behind)
        self.stages, self.index, self.bounds = recipe.pipeline.stages, 0, (0, n_blocks)
        self.module, self.run = model, recipe  # (a stage's own, and the recipe under its run id, once chosen below)
        self.stream: Optional[MicrobatchStream] = None  # a first stage's microbatches, a stream across batches
        self.work: Optional[Handoff] = None  # a serving stage's: microbatches the stage before sent, for us to run
        self.relay: Optional[Relay] = None  # a middle stage's microbatches in flight to the next stage
        self.router: Optional[Router] = None
        self.server: Optional[StageServer] = None  # a serving stage's, once started
        self.recompute: Optional[RecomputeServer] = None  # a first stage's: our activations for the next stage's check
        self._first_peers: list[tuple[str, bool, int]] = []  # (the stage after the first: the first stage's peers)
        self._next_live: set[str] = set()  # the next stage's live peers, averaging or not (who may ask us to recompute)
        self.keeper: Optional[Keeper] = None  # our backup of the next stage's state (keeper.py), where we keep one
        limit, capacity = memory_limits(settings)
        parts = part_params(recipe, model)
        needs = stage_needs(recipe, parts=parts)  # (as doctor estimates)
        self.costs = stage_costs(recipe, model, parts)
        if self.stages == 1:
            need = needs[0]
            if limit is not None and need > limit:
                raise RecipeError(f"training the whole model needs about {fmt_bytes(need)} but --max-memory allows "
                                  f"{fmt_bytes(limit)}: join a run cut into pipeline stages (recipe pipeline: "
                                  "{stages: N}), or raise --max-memory")
        if self.stages > 1:
            self.all_bounds = even_bounds(n_blocks, self.stages)
            self.needs = needs
            fits = [k for k, need in enumerate(self.needs) if capacity is None or need <= capacity]
            if limit is not None and not fits:
                raise RecipeError(f"no stage of this run fits in --max-memory {fmt_bytes(limit)}: the smallest needs "
                                  f"about {fmt_bytes(min(self.needs))}; raise --max-memory, or ask the run's owner "
                                  "for more stages")
            client = settings.network.client_mode  # it cannot serve a stage: it reads data and sends
            self.fits = fits or list(range(self.stages))
            self.index = settings.stage if self.pinned else 0 if client else prefer if prefer is not None else \
                self._weakest(node, fits or list(range(self.stages)))
            if self.index >= self.stages:
                raise RecipeError(f"--stage {self.index}: the run has {self.stages} stages (0 to {self.stages - 1})")
            if client and self.index > 0:
                raise RecipeError("a --client-mode peer accepts no streams, so it can host only stage 0 "
                                  "(--stage 0)")
            if limit is not None and self.index not in fits:
                raise RecipeError(f"stage {self.index} needs about {fmt_bytes(self.needs[self.index])} to train but "
                                  f"--max-memory allows {fmt_bytes(limit)}: host a stage that fits "
                                  f"({', '.join(map(str, fits))}), or raise --max-memory")
            self.bounds = self.all_bounds[self.index]
            self.module = Stage(model, *self.bounds, recipe.pipeline.bottleneck)
            materialize(model, self.module, recipe.model.seed, device)
            hosted = {id(param) for param in self.module.parameters()}
            for param in model.parameters():  # the other stages' weights, where the model was built whole: freed
                if id(param) not in hosted and not param.is_meta:
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            self.run = recipe.model_copy(update={"run_id": recipe.stage_run_id(self.index)})
            if settings.checkpoints.dir is not None:  # each stage's checkpoints apart: a peer may host several
                directory = str(Path(settings.checkpoints.dir) / f"stage{self.index}")
                self.settings = settings.model_copy(
                    update={"checkpoints": settings.checkpoints.model_copy(update={"dir": directory})})
            logger.info("pipeline: hosting stage %d of %d (blocks [%d, %d)), about %s to train%s", self.index,
                        self.stages, *self.bounds, fmt_bytes(self.needs[self.index]),
                        "" if capacity is None else f" of {fmt_bytes(capacity)}")

    @classmethod
    def build(cls, recipe: Recipe, settings: PeerSettings, model_recipe: ModelRecipe, vocab_size: int,
              node: SwarmNode, loop: LoopThread, device: torch.device, prefer: Optional[int] = None) -> "Part":
        """The model as this peer needs it and the part of it we train: the whole model on `device`, or in a run of
        stages the model on the meta device with our stage alone allocated on `device` (and the kept one, keeper.py)."""
        staged, meta = recipe.pipeline.stages > 1, lambda: build_model(model_recipe, vocab_size, meta=True)
        model = build_model(model_recipe, vocab_size, meta=staged, recompute=settings.recompute_activations)
        part = cls(recipe, settings, model if staged else model.to(device), node, loop, count_blocks(model), prefer,
                   device)
        part.keeper = Keeper.build(node, settings, part, meta, device)
        return part

    @property
    def whole(self) -> bool:
        return self.stages == 1

    @property
    def first(self) -> bool:
        return self.index == 0

    def _weakest(self, node: SwarmNode, candidates: list[int]) -> int:
        """Of the `candidates` (the stages we can hold), the one with the fewest live peers now; ties go to a stage
        drawn from our peer id, so peers that join together spread over the tied stages."""
        if len(candidates) == 1:
            return candidates[0]
        counts = {}
        for k in candidates:
            records, _ = parse_peer_records(self.loop.run(node.get(peers_key(self.recipe.stage_run_id(k))), 30))
            counts[k] = len(view.live(records, node.now()))
        logger.info("pipeline: live peers per stage we can hold %s", counts)
        return weakest_stage(counts, peer_id_hash(node.peer_id))

    def start(self, metrics=None) -> None:
        """Serve our stage to the one before (unless first), and follow the next stage's peers (unless last);
        `metrics` (PeerMetrics) then reads our hops' bytes on every scrape."""
        if self.whole:
            return
        if metrics is not None:
            metrics.watch_pipeline(self.wire_bytes)
        self.worker = StageWorker(self.module, None, lambda: 0.0, 0.0)  # optimizer, lr and clip: set each step
        if not self.first:  # one step per batch's worth of rows, however the stage before cut its batches
            self.worker.step_rows = self.recipe.data.batch_size
        self._next_peers: list[tuple[str, float]] = []
        config, data, pipeline = self.model.config, self.recipe.data, self.recipe.pipeline
        if self.index + 1 < self.stages:
            self.router = Router(self.node, stage_protocol(self.recipe.run_id, *self.all_bounds[self.index + 1]),
                                 lambda: self._next_peers, pipeline.activations,
                                 duplicate_share=pipeline.duplicate_share)
        if self.first:  # the next stage's peers may ask us to compute activations again (recompute.py)
            self.recompute = RecomputeServer(self.worker, data.batch_size * data.seq_len, config.vocab_size,
                                             lambda: self._next_live, self.loop.loop, max_seq=data.seq_len)
            self.loop.run(self.node.add_stream_handler(recompute_protocol(self.recipe.run_id, *self.bounds),
                                                       self.recompute.handle), timeout=30)
            # Each batch cut into k, and a microbatch in flight for every stage at all times, so that none waits for
            # work: k, or the number of stages where that is more (a batch's then travel with the next batch's).
            k = self.settings.microbatches
            self.stream = MicrobatchStream(self.worker, self.router.send(self.loop), parts=k,
                                           window=max(k, self.stages), across=pipeline.schedule == "stream")
        self.started, self.server = time.monotonic(), None
        self.loop.submit(self._watch())
        if self.keeper is not None:
            self.loop.run(self.keeper.start(), timeout=30)
        if not self.first:
            self.work = Handoff(self.loop.loop)
            self.server = server = StageServer(
                self.worker, pipeline.bottleneck or config.hidden_size, data.batch_size * data.seq_len,
                config.vocab_size, self.loop.loop, execute=self.work.hand_over,
                execute_eval=lambda x, ids: self.work.hand_over(x, ids, None))
            if self.router is not None:  # a middle stage: it takes more microbatches while those it sent on travel
                self.relay = Relay(self.worker, self.router.send(self.loop), self.router.send(self.loop, evaluate=True),
                                   self.work.answer, window=2 * max(self.settings.microbatches, 1))
            # Senders are judged by their microbatches' losses only where the loss is ours (the last stage) and they
            # computed from tokens (the first): a last stage after a middle one would blame an honest middle peer.
            server.judge_losses, server.max_seq = self.index == 1 and self.stages == 2, data.seq_len
            if self.index == 1:  # the first stage's activations, a share of them computed again by its other peers
                server.verify = Recheck(self.node, recompute_protocol(self.recipe.run_id, *self.all_bounds[0]),
                                        lambda: self._first_peers, server.check, pipeline.duplicate_share,
                                        pipeline.activations)
            self.loop.run(self.node.add_stream_handler(stage_protocol(self.recipe.run_id, *self.bounds), server.handle),
                          timeout=30)

    def follow(self, round_no: Callable[[], int]) -> None:
        """Give our server, router, recompute server and stream our stage's round: our answers and training
        microbatches say it (the next stage holds them to that round), and the stream recomputes one kept across it."""
        for part in (self.server, self.router, self.recompute, self.stream):
            if part is not None:
                part.round = round_no

    def drill(self, lie: Optional[str]) -> None:
        """Make this peer's stage lie (a drill, faults.PIPELINE_LIES): in its answers as a server (server.LIES), or,
        garbage-act, in the training activations it sends (noise of their norm)."""
        if self.server is not None and lie in LIES:
            self.server.lie = lie
        if self.router is not None:
            self.router.garbage = lie == "garbage-act"

    def check(self, checkpoint) -> None:
        """Refuse a checkpoint of another run, or of another stage (its params would load: equal stages have equal
        shapes), with one line."""
        if checkpoint is None:
            return
        if checkpoint.meta.get("recipe") != self.recipe.digest():
            raise RecipeError(f"checkpoint {checkpoint.path} is of another run (recipe {checkpoint.meta.get('recipe')},"
                              f" not {self.recipe.digest()}): pass another --checkpoint-dir, or move it away")
        stage = checkpoint.meta.get("stage", 0)
        if stage != self.index:
            raise RecipeError(f"checkpoint {checkpoint.path} is of stage {stage}, and this peer hosts stage "
                              f"{self.index}: pass --stage {stage}")

    async def _watch(self) -> None:
        """Read every stage's peers every PEERS_SECONDS: keep `_next_peers` the live, non-client peers of the next
        stage with their tokens/s, hand our keeper its stage's, and decide whether to move (see _weaker)."""
        weaker_since: Optional[tuple[int, float]] = None
        while self.move_to is None:
            try:
                hosts = []
                for k in range(self.stages):
                    records, _ = parse_peer_records(await self.node.get(peers_key(self.recipe.stage_run_id(k))))
                    hosts.append(view.live(records, self.node.now(), ONLINE_STATES))
                    if k == self.index - 1:  # (peers that stopped announce their last round as they go offline)
                        self._upstream_rounds = [p.round for p in records if p.state not in ("joining", "syncing")]
                    if self.keeper is not None and k == self.keeper.stage:  # (the stage we keep a backup of)
                        self.keeper.offer(records)
                    if k == 0 and self.index == 1:  # (those that can compute our senders' activations again)
                        self._first_peers = [(p.peer_id, p.client, p.round) for p in hosts[0]
                                             if p.state in TRAINING_STATES and p.peer_id != self.node.peer_id]
                if self.index + 1 < self.stages:
                    live = [p for p in hosts[self.index + 1] if p.state in TRAINING_STATES and not p.client
                            and p.peer_id != self.node.peer_id]
                    # A peer that is averaging runs no microbatch until it is done: while others train, wire to them.
                    training = [p for p in live if p.state == "training"] or live
                    self._next_live = {p.peer_id for p in live}
                    self._next_peers = [(p.peer_id, max(p.tokens_per_s, 1.0)) for p in training]
                target, why, delay = self._weaker(hosts)
                if target is None or weaker_since is None or weaker_since[0] != target:
                    weaker_since = None if target is None else (target, time.monotonic())
                elif time.monotonic() - weaker_since[1] >= delay:
                    self.move_to = target
                    logger.warning("pipeline: %s: moving to stage %d after this step", why, target)
            except Exception as e:  # noqa: BLE001 - the DHT hiccups; the next read comes anyway
                logger.debug("could not read the stages' peers: %r", e)
            await asyncio.sleep(PEERS_SECONDS)

    def behind(self, round_no: int) -> bool:
        """Whether the stage before has just finished `round_no` (its peers announce the next round): then ours is
        due too, with the tokens it has. Every microbatch passes every stage, so a stage's rounds would end
        together, but one whose peer died mid-round lost the tokens that peer counted, and waited for tokens the
        stage before, done with the round (or with training, at --until-round), would never send."""
        return not self.whole and not self.first and upstream_finished(self._upstream_rounds, round_no)

    def _weaker(self, hosts: list[list]) -> tuple[Optional[int], str, float]:
        """The stage we should move to, why, and how long it must stay so first (placement.move_decision); only an
        unpinned peer moves, for throughput only once it has hosted its stage for pipeline.settle_seconds (its
        capacity, and the others', measured: a peer that just moved does not move on at once)."""
        if self.pinned or self.settings.network.client_mode:
            return None, "", 0.0
        settled = time.monotonic() - self.started >= self.recipe.pipeline.settle_seconds
        return move_decision(hosts, self.index, self.node.peer_id, self.capacity(), self.costs, self.fits, settled,
                             self.recipe.pipeline.rebalance_seconds)

    def validation_loss(self, batches: list[torch.Tensor], device: torch.device) -> Optional[float]:
        """The whole model's validation loss, or a first stage's of the pipeline as its stages' params stand (ours
        just averaged, each other's at its own round; forward only); None on other stages or if a batch went nowhere."""
        if self.whole:
            return validation_loss(self.model, batches, device)
        if not self.first:
            return None
        # (in flight together, as many as a stage server holds of one sender: the pipeline's stages each compute
        # while the others do, where one at a time took four trips through the whole pipeline in a row)
        send, flight, losses = self.router.send(self.loop, evaluate=True), deque(), []
        try:
            for batch in batches:
                if len(flight) >= MAX_WAITING_PER_PEER:
                    losses.append(flight.popleft().result()[1])
                batch = batch.to(device)
                flight.append(send(self.worker.output(batch[:, :-1]), batch.cpu(), 1.0))  # (its whole rows: server.py)
            losses += [future.result()[1] for future in flight]
        except Exception as e:  # noqa: BLE001 - no validation loss this round; training goes on
            logger.info("pipeline: no validation loss this round (%s)", str(e).splitlines()[0] if str(e) else e)
            return None
        return sum(losses) / max(len(losses), 1)

    def kept(self) -> view.Reference:
        """Our stage's state that its keepers vouch for now (keeper.py); none for a whole model."""
        return view.Reference(0, "", []) if self.whole else \
            self.loop.run(backup_reference(self.node, self.recipe, self.index), 30)

    def slow_down(self, factor: float) -> None:
        """Compute `factor` times slower from now on (a fault drill: a weaker device); a whole model ignores it."""
        if not self.whole:
            self.worker.slowdown = factor
            logger.warning("pipeline: computing %.0fx slower from now on (injected fault)", factor)

    def capacity(self) -> float:
        """Tokens/s our stage computes when it never waits for another (our tokens over our busy seconds); 0 until
        it trained a microbatch."""
        if self.whole or self.worker.busy <= 0:
            return 0.0
        return self.worker.tokens / self.worker.busy

    @property
    def in_flight(self) -> bool:
        """Whether a first stage has batches in flight, or a middle stage microbatches or a gradient not stepped on
        (see step's `settle`)."""
        return self.stream is not None and self.stream.pending > 0 or self.relay is not None and self.relay.pending

    def step(self, batches: Iterator[torch.Tensor], device: torch.device, optimizer: torch.optim.Optimizer,
             lr: float, grad_clip: float, settle: bool = False) -> tuple[Optional[float], int, int]:
        """One inner step: (its loss, or None if no microbatch was trained; tokens trained; batches it took from our
        data stream). A first stage streams its batches' microbatches (swarm/peer/pipeline/microbatches.py) and returns
        each batch as it is stepped on; with `settle`, it finishes the batches in flight instead, taking none, and
        returns them together (before its weights are averaged). A middle stage does the same with the microbatches
        it relays (relay.py)."""
        if self.whole:
            try:
                batch = next(batches)
            except concurrent.futures.CancelledError:  # a shard file's fetch, cancelled by a stop: the loop ends
                return None, 0, 0
            return inner_step(self.model, optimizer, batch, device, lr, grad_clip), batch[:, 1:].numel(), 1
        # A stage sees only its own gradient: each clips to its share of the whole model's bound.
        self.worker.optimizer, self.worker.lr = optimizer, lambda: lr
        self.worker.grad_clip = grad_clip / self.stages ** 0.5
        if self.first:
            taken = self.stream.taken
            if settle:
                return together(self.stream.settle())
            try:
                loss, tokens = self.stream.step(lambda: next(batches))
            except PipelineError:  # not lost: sent again once a next-stage peer takes it (the stream logs the wait)
                time.sleep(1.0)
                return None, 0, self.stream.taken - taken
            except concurrent.futures.CancelledError:  # a stop signal cancelled the hops in flight: the loop ends
                return None, 0, self.stream.taken - taken
            return loss, tokens, self.stream.taken - taken
        if settle and self.relay is not None:
            return together(self.relay.settle(self.router.timeout))
        return self._serve_one()

    def _serve_one(self) -> tuple[Optional[float], int, int]:
        """Run the next microbatch from the stage before, if one comes within WAIT_SECONDS (a middle stage: take
        microbatches and finish those whose gradient came back, for at most that long)."""
        if self.relay is not None:
            return together(self.relay.serve(self.work.take, WAIT_SECONDS))
        entry = self.work.take(WAIT_SECONDS)
        if entry is None:
            return None, 0, 0
        x, ids, scale, accept, done = entry
        try:
            if scale is None:  # a validation microbatch: its loss, nothing trained
                loss = self.worker.evaluate(x, ids, None if self.router is None else
                                            self.router.evaluator(self.loop))
                self.work.answer(done, loss)
                return None, 0, 0
            # (a microbatch whose sender gave up on it meanwhile is not trained on: it is sent elsewhere)
            grad, loss = self.worker.step(x, ids, None if self.router is None else
                                          unless_dropped(self.router.hop(self.loop), done.done), scale, accept)
        except Exception as e:  # noqa: BLE001 - the stage before learns of it and retries elsewhere
            if isinstance(e, concurrent.futures.CancelledError):  # (our next hop, cancelled by a stop signal)
                e = PipelineError("the stage peer is stopping")
            self.work.answer(done, error=e)
            return None, 0, 0
        self.work.answer(done, (grad, loss))
        return loss, x.shape[0] * x.shape[1], 0

    def finish(self, stop: threading.Event, events) -> None:
        """At the end of training: finish the batches in flight (a first stage: a few tries) or drain (a serving
        stage), then account for the microbatches: a first stage took `taken` batches from its stream and trained
        each once (`trained`), but for those still pending."""
        if self.whole:
            return
        for attempt in range(10):  # a microbatch no next-stage peer takes is tried again a second later
            if self.stream is None or not self.stream.pending or stop.wait(1.0 if attempt else 0.0):
                break
            self.stream.settle()
        if self.move_to is None:
            self.drain(stop)
        if self.relay is not None:  # (its senders get their answers before the refusals)
            self.relay.settle(self.router.timeout)
        if self.work is not None:
            self.work.close()
        taken, trained, pending, refreshed = (self.stream.taken, self.stream.trained, self.stream.pending,
                                              self.stream.refreshed) if self.stream else (0, 0, 0, 0)
        retries = self.router.retries if self.router is not None else 0
        wall = time.monotonic() - self.started
        wire = sum(self.wire_bytes())  # (both directions of our hops in and out)
        # (the span from its first microbatch to its last leaves out start-up and the wait for other stages' peers,
        # not its rounds' averaging)
        span = self.worker.last_at - self.worker.first_at if self.worker.first_at is not None else 0.0
        logger.info("pipeline: stage %d busy %.1f%% of %.0f s (computing, not waiting for other stages), %.1f%% of "
                    "the %.0f s from its first microbatch to its last; %.0f bytes of activations and gradients per "
                    "token", self.index, 100 * self.worker.busy / max(wall, 1e-9), wall,
                    100 * self.worker.busy / max(span, 1e-9), span, wire / max(self.worker.tokens, 1))
        logger.info("pipeline: stage %d trained %d microbatches (%d batches of %d taken from our data, %d pending), "
                    "%d hops retried (%d computed again after a round), at most %d microbatches in flight",
                    self.index, self.worker.microbatches, trained, taken, pending, retries, refreshed,
                    self.router.most_in_flight if self.router is not None else 0)
        events.emit("pipeline", stage=self.index, microbatches=self.worker.microbatches, taken=taken,
                    trained=trained, pending=pending, retries=retries, refreshed=refreshed,
                    busy=self.worker.busy, wall=wall, span=span, wire_bytes=wire, tokens=self.worker.tokens)

    def wire_bytes(self) -> tuple[int, int]:
        """(bytes sent, bytes received) on our hops: to the next stage's peers and from the stage before's."""
        meters = [part.meter for part in (self.router, self.server) if part is not None]
        return sum(m.sent for m in meters), sum(m.received for m in meters)

    def drain(self, stop: threading.Event) -> None:
        """After our last round (--until-round, --max-rounds), keep answering the stage before, our params frozen,
        while any of its peers still trains: its rounds need microbatches through us, and a serving stage counts
        every token its upstream peers count and some they retried, so it reaches a round first. At most
        DRAIN_SECONDS; a stop signal ends it."""
        if self.whole or self.first:
            return
        upstream = self.recipe.stage_run_id(self.index - 1)
        self.worker.frozen = True
        deadline, served, check_at = time.monotonic() + DRAIN_SECONDS, 0, 0.0
        while not stop.is_set() and time.monotonic() < deadline:
            if time.monotonic() >= check_at:
                try:
                    records, _ = parse_peer_records(self.loop.run(self.node.get(peers_key(upstream)), 30))
                except concurrent.futures.CancelledError:  # a stop signal: the loop ends (the checkpoint still comes)
                    break
                if not view.live(records, self.node.now()):
                    break
                if check_at == 0.0:
                    logger.info("pipeline: our rounds are done; answering stage %d's peers, our params frozen, "
                                "until they finish", self.index - 1)
                check_at = time.monotonic() + PEERS_SECONDS
            served += self._serve_one()[1] > 0
        logger.info("pipeline: answered %d microbatches after our last round", served)
