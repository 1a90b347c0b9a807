"""The local peer: joins the swarm, fetches the recipe, loads data and model, syncs state, then runs DiLoCo
rounds (inner AdamW steps until the swarm's progress reaches tokens_per_round, then group averaging and the
outer step), announcing itself, checkpointing and exporting metrics until stopped.
"""

from __future__ import annotations

import math
import logging
import concurrent.futures
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from swarm import __version__
from swarm.averaging.allreduce import COMMIT_GRACE, AllReduceError, AllReduceResult, GroupAllReduce
from swarm.averaging.deadlines import AdaptiveDeadlines
from swarm.averaging.faults import FaultPlan
from swarm.averaging.matchmaking import Candidate, Group, GroupPush, form_group
from swarm.compression import ErrorFeedback
from swarm.config import PeerSettings, Recipe, RecipeError, load_recipe
from swarm.dht.node import NetworkOptions, SwarmNode
from swarm.dht.records import PeerRecord
from swarm.monitoring.metrics import PeerMetrics
from swarm.monitoring.progress import ProgressLine  # issue #7
from swarm.peer import checkpoint as ckpt
from swarm.peer.announcer import Announcer, fetch_recipe
from swarm.peer.data import prepare_run_data
from swarm.peer.diloco import DiLoCo
from swarm.peer.model import build_model, n_blocks
from swarm.peer.probe import describe_device, measure_tokens_per_s  # issue #3
from swarm.peer.state_sync import StateSyncError, serve_state, sync_state
from swarm.peer.stream import DataStream
from swarm.peer.training import (inner_step, learning_rate, make_inner_optimizer, pick_device, schedule_tokens,
                                 validation_loss)
from swarm.runtime import LoopThread, install_stop_handlers

logger = logging.getLogger("swarm.peer")
EVAL_BATCHES = 4
MAX_IMMEDIATE_RETRIES = 3  # then train on and try again later: failures that keep coming need fresh views
RESYNC_BACKOFF = 10.0  # s of training after a failed state download before the next try...
RESYNC_RETRY = 1.0  # ...or after one that failed only because the holders had moved on to newer params


@dataclass(frozen=True)
class Contribution:
    """What this peer brings to one outer round's average."""

    round_no: int
    pseudo_gradient: torch.Tensor  # flat fp32: global minus local params (+ error-feedback residual)
    weight: int  # tokens processed in the round
    digest: str  # of the global params it is relative to
    snapshot: Optional[torch.Tensor]  # overlap: local params when it was taken
DEFAULT_BANDWIDTH = 12.5e6  # bytes/s (100 Mbit/s) until the first all-reduce measures the real link


class Peer:
    def __init__(self, settings: PeerSettings):
        self.settings = settings
        self.faults = FaultPlan(settings.inject_fault)
        self.stop_event = threading.Event()
        self.metrics = PeerMetrics()
        self.progress = ProgressLine()  # issue #7: a live status line when stdout is a terminal
        self.loop: Optional[LoopThread] = None
        self.node: Optional[SwarmNode] = None
        self.announcer: Optional[Announcer] = None
        self._last_checkpoint_round = -1
        self.pending: Optional[tuple[concurrent.futures.Future, Contribution]] = None  # overlap: average in flight
        # The tokens of that contribution, announced apart (set and cleared next to the statements that move our
        # tokens and round, so the announcer thread never reads them counted twice or toward the wrong round).
        self.in_flight_tokens: Optional[int] = None

    # ---- start-up ------------------------------------------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        if s.num_threads:
            torch.set_num_threads(s.num_threads)
        self.device = pick_device(s.device)
        self.loop = LoopThread()
        self.node = SwarmNode(s.initial_peers, NetworkOptions(
            host_maddrs=s.host_maddrs, announce_maddrs=s.announce_maddrs, identity_path=s.identity_path,
            nat_traversal=s.nat_traversal, client_mode=s.client_mode, direct_streams=s.direct_streams,
            direct_port=s.direct_port))
        logger.info("joined the DHT as %s", self.node.peer_id)
        if self.node.direct is not None:
            self.metrics.watch_streams(self.node.direct.opened)
        self.recipe = self.loop.run(fetch_recipe(self.node, timeout=30.0), timeout=60)
        if s.recipe_file:
            local = load_recipe(s.recipe_file)
            if local.digest() != self.recipe.digest():
                raise RecipeError(f"local recipe {s.recipe_file} differs from the swarm's in: "
                                  f"{', '.join(local.differing_fields(self.recipe))}")
        r = self.recipe
        logger.info("run %s (recipe %s): codec %s, %d tokens per round", r.run_id, r.digest()[:12],
                    r.averaging.codec, r.tokens_per_round)

        started = time.monotonic()
        data = prepare_run_data(r.data.source, r.data.tokenizer, r.data.vocab_size, r.data.val_fraction,
                                r.data.seq_len, r.data.batch_size, r.data.seed, s.cache_dir, EVAL_BATCHES)
        self.train_data, self.eval_batches = data.train, data.eval_batches
        self.stream = DataStream(self.train_data, r.data.num_shards, r.data.batch_size, r.data.seed,
                                 self.node.peer_id, pinned=s.data_shard)  # placed once we see the swarm
        logger.info("data: %d train docs (%d tokens), %d validation docs, prepared in %.1f s",
                    data.n_train_docs, len(self.train_data.tokens), data.n_val_docs, time.monotonic() - started)

        model = build_model(r.model, data.vocab_size)
        self.model = model.to(self.device)
        self.n_blocks = n_blocks(model)
        self.diloco = DiLoCo(self.model, r.outer, log_bytes=None if s.replay_log_mb is None else
                             int(s.replay_log_mb * 1e6))
        self.error_feedback = ErrorFeedback()
        self.inner_optimizer = make_inner_optimizer(self.model, r.inner)
        logger.info("model: %.2fM parameters, %d blocks, on %s; replay log up to %.2f MB", self.diloco.numel / 1e6,
                    self.n_blocks, self.device, self.diloco.log_bytes / 1e6)

        self.allreduce = GroupAllReduce(  # a mixing group averages pseudo-gradient, params and momentum: 3 x numel
            self.node, r.run_id, r.averaging.codec, 3 * self.diloco.numel,
            AdaptiveDeadlines(r.averaging.min_phase_timeout, r.averaging.allreduce_timeout),
            on_bad_peer=self._on_bad_peer, faults=self.faults, ring=r.averaging.ring)
        self.group_push = GroupPush(self.node, r.run_id)  # groups our leaders push to us, and ours to members
        if s.client_mode:
            logger.info("client mode: accepting no inbound streams; contributing to averages without reducing, "
                        "serving no state")
        else:
            self.loop.run(self.allreduce.start(), timeout=30)
            self.loop.run(self.group_push.start(), timeout=30)
            self.loop.run(serve_state(self.node, r.run_id, self.diloco), timeout=30)
        self.announcer = Announcer(self.node, r.run_id, self.n_blocks, self._record, self.metrics)
        # -- issue #3: what we announce about ourselves. Every peer trains the whole model for now, so its
        # capacity is all blocks and the chosen range is [0, n_blocks); routing will lower it.
        self.device_info = describe_device(self.device)
        self.block_range = self.loop.run(self.announcer.choose_blocks(capacity=self.n_blocks), timeout=30)
        probe_tokens_per_s = measure_tokens_per_s(self.model, r.data.batch_size, r.data.seq_len, self.device)
        # -- end issue #3
        self.loop.submit(self.announcer.run())
        port = self.metrics.serve(s.metrics_port, s.metrics_host)
        if port is not None:
            logger.info("metrics at http://%s:%d/metrics", s.metrics_host, port)
        self.metrics.describe(__version__, self.device, r.averaging.codec)  # issue #7
        self.metrics.set_blocks(*self.block_range)  # issue #7
        self.state, self.tokens_in_round, self.loss, self.tokens_per_s = "syncing", 0, None, probe_tokens_per_s
        self.inner_steps, self.attempt, self.steps_in_round, self.last_group_size = 0, 0, 0, 1
        self.bandwidth = DEFAULT_BANDWIDTH  # what we tell matchmaking, for the reduction shares
        self.bandwidth_up = self.bandwidth_down = 0.0  # what the last all-reduce moved per second (announced)
        self._excluded: set[str] = set()  # sent bad data this round: left out until the round is over
        self._unresponsive: set[str] = set()  # did not deliver in the last attempt: not waited for in the next
        self._excluded_round = -1
        self.val_loss: Optional[float] = None
        self.resync_after = 0.0  # monotonic time before which we do not try another state download (or replay)
        self._initial_state()

    def _initial_state(self) -> None:
        """The newest params (see _load_state), then where in the data we read (see _place_stream)."""
        self.announcer.refresh_now(self.loop)
        checkpoint = ckpt.load_latest(self.settings.checkpoint_dir) if self.settings.checkpoint_dir else None
        self._load_state(checkpoint)
        self._place_stream(checkpoint)

    def _load_state(self, checkpoint: Optional[ckpt.Checkpoint]) -> None:
        """Our checkpoint (else a fresh seeded init), then the swarm's state if it is newer: replayed from ours
        where a live peer still logs the rounds since, else downloaded."""
        if checkpoint is not None:
            try:
                self.diloco.load_state_tensors(checkpoint.tensors, checkpoint.round, checkpoint.tokens_seen)
            except ValueError as e:
                logger.warning("checkpoint %s does not fit this run's model (%s); not using it", checkpoint.path, e)
                checkpoint = None
        if checkpoint is not None:
            residual = {key.split(".", 1)[1]: value for key, value in checkpoint.tensors.items()
                        if key.startswith("error_feedback.")}
            if residual and residual.get("residual", torch.empty(0)).numel() == self.diloco.numel:
                self.error_feedback.load_state_dict(residual)
            logger.info("resumed from checkpoint %s (round %d, %d tokens seen)", checkpoint.path,
                        checkpoint.round, checkpoint.tokens_seen)
        else:
            logger.info("starting from the recipe's initial params (round 0, digest %s)", self.diloco.digest())
        swarm_round, digest, holders = self.announcer.swarm_reference()
        if holders and (self.diloco.round < swarm_round or
                        (self.diloco.round == swarm_round and digest != self.diloco.digest())):
            self._resync(holders, digest, reason="joining")

    def _place_stream(self, checkpoint: Optional[ckpt.Checkpoint]) -> None:
        """Where in the data we read (DataStream.place): our checkpoint's place if it is of this run."""
        ours = checkpoint is not None and checkpoint.meta.get("recipe") == self.recipe.digest()
        if ours and isinstance(checkpoint.meta.get("inner_steps"), int):
            self.inner_steps = max(checkpoint.meta["inner_steps"], 0)
        how = self.stream.place(self.announcer.live(), checkpoint.meta if ours else None)
        logger.info("data: shard %d/%d at step %d, %s", self.stream.start, self.recipe.data.num_shards,
                    self.stream.step, how)
        self.metrics.data_shard.set_function(lambda: float(self.stream.reading()))
        self.announcer.refresh_soon(self.loop)

    def _resync(self, holders: list[str], digest: str, reason: str) -> bool:
        """Bring our state to the swarm's (state digest `digest`, held by `holders`; see sync_state); False
        (keeping our own state) if no holder could, and then no other try before `resync_after`."""
        self.state = "syncing"
        try:
            # No overall timeout: a big model on a slow link takes long; a holder that stalls is dropped.
            synced = self.loop.run(sync_state(self.node, holders, self.recipe.run_id, self.diloco, digest))
        except StateSyncError as e:
            # Holders that moved on answered at once and will serve their newer params: ask again soon. Others
            # failed us: do not hammer them.
            self.resync_after = time.monotonic() + (RESYNC_RETRY if e.moved_on else RESYNC_BACKOFF)
            logger.warning("%s; continuing with my own state", e)
            return False
        how = "replay" if synced.replayed is not None else "download"
        self.metrics.resyncs.labels(how=how).inc()
        self.metrics.resync_bytes.labels(how=how).inc(synced.bytes)
        self.tokens_in_round = self.steps_in_round = 0
        self.error_feedback.reset()  # our local progress is gone, and with it what we owed the swarm
        self.inner_optimizer = make_inner_optimizer(self.model, self.recipe.inner)
        logger.info("%s (%s)", synced.describe(self.diloco), reason)
        return True

    # ---- what we announce ----------------------------------------------------------------------------------
    def _record(self) -> PeerRecord:
        return PeerRecord(
            peer_id=self.node.peer_id, state=self.state, version=__version__, run_id=self.recipe.run_id,
            round=self.diloco.round, tokens_in_round=self.tokens_in_round, block_start=self.block_range[0],
            block_end=self.block_range[1], digest=self.diloco.digest(), device=self.device.type,
            device_name=self.device_info.name, device_memory=self.device_info.memory_bytes,  # issue #3
            tokens_per_s=self.tokens_per_s, bandwidth_up=self.bandwidth_up, bandwidth_down=self.bandwidth_down,
            loss=self.loss, val_loss=self.val_loss, attempt=self.attempt, updated=self.node.now(),
            in_flight_tokens=self.in_flight_tokens, data_shard=self.stream.reading(), data_start=self.stream.start,
            client=self.settings.client_mode)

    def _counting_round(self) -> int:
        """The round our tokens_in_round count toward: with overlap, the next one as soon as this round's
        contribution went to the background all-reduce (we announce the tokens we handed in apart, so peers still
        collecting this round count them, and peers past it do not count them twice)."""
        return self.diloco.round + (self.in_flight_tokens is not None)

    def _on_bad_peer(self, peer_id: str, reason: str) -> None:
        self.metrics.bad_peers.labels(reason=reason).inc()
        logger.warning("peer %s sent a bad contribution (%s); it is excluded from this round", peer_id, reason)

    # ---- main loop -----------------------------------------------------------------------------------------
    def run(self) -> int:
        """Train until max_rounds, until_round or a stop signal; returns the number of rounds averaged."""
        s, r = self.settings, self.recipe
        batches, seen_view = self.stream.batches(), None
        self.rounds_done, self.next_attempt = 0, 0
        tokens_per_step = r.data.batch_size * r.data.seq_len
        self.retry_after_tokens = 0
        window_start, window_tokens = time.monotonic(), 0
        run_started, compute_seconds = time.monotonic(), 0.0
        self.round_started = time.monotonic()
        self.pending = None
        background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="averaging")
        self.state = "training"
        self.metrics.set_state(self.state)
        logger.info("training round %d%s", self.diloco.round, " (averaging overlaps training)" if r.outer.overlap
                    else "")
        while not self.stop_event.is_set() and not self._finished():
            lr = learning_rate(r.inner, schedule_tokens(self.diloco.tokens_seen, self.tokens_in_round,
                                                        self.last_group_size), r.total_tokens)
            if self.faults.local("diverge", self._counting_round()):  # with overlap: while an average is in flight
                with torch.no_grad():
                    self.diloco.local_params[0].fill_(float("nan"))  # as if the optimizer blew up
            step_started = time.monotonic()
            loss = inner_step(self.model, self.inner_optimizer, next(batches), self.device, lr, r.inner.grad_clip)
            compute_seconds += time.monotonic() - step_started
            self.metrics.compute_utilization.set(compute_seconds / max(time.monotonic() - run_started, 1e-9))
            self.inner_steps += 1
            self.stream.step += 1
            self.steps_in_round += 1
            self.metrics.inner_steps.inc()
            self.metrics.tokens.inc(tokens_per_step)
            window_tokens += tokens_per_step
            if not math.isfinite(loss):
                self._recover("non-finite loss")
                continue
            self.tokens_in_round += tokens_per_step
            self.loss = loss
            self.metrics.train_loss.set(loss)
            elapsed = time.monotonic() - window_start
            if elapsed >= 2.0:
                self.tokens_per_s = window_tokens / elapsed
                self.metrics.tokens_per_second.set(self.tokens_per_s)
                window_start, window_tokens = time.monotonic(), 0
            if self.announcer.view is not seen_view:  # a heartbeat read the swarm again
                seen_view = self.announcer.view
                moved = self.stream.leave_if_shared(self.announcer.live())
                if moved:
                    logger.info("data: %s", moved)
                    self.announcer.refresh_soon(self.loop)
                    batches = self.stream.batches()
            if self.pending is not None and self.pending[0].done():
                self._finish_pending()
                continue  # the round changed: re-check whether we are finished before preparing another

            behind = self.announcer.swarm_reference()
            if behind[0] > self.diloco.round and behind[2] and time.monotonic() >= self.resync_after:
                logger.info("the swarm is at round %d and I am at %d: re-syncing", behind[0], self.diloco.round)
                self.pending = self.in_flight_tokens = None  # an average in flight belongs to a round we leave
                if self._resync(behind[2], behind[1], reason="behind the swarm"):
                    self.next_attempt, self.retry_after_tokens, self.attempt = 0, 0, 0
                self.state = "training"  # (on failure: train on until resync_after)
                continue
            swarm_tokens = self.announcer.swarm_progress(self._counting_round(), self.tokens_in_round)
            # -- issue #7: per-step gauges (they also catch resyncs and resumed checkpoints) and the progress line
            self.metrics.set_state(self.state)
            self.metrics.outer_round.set(self.diloco.round)
            self.progress.update(state=self.state, round_no=self.diloco.round, tokens_per_s=self.tokens_per_s,
                                 loss=self.loss, swarm_tokens=swarm_tokens,
                                 steps_in_round=self.steps_in_round, recipe=r, view=self.announcer.view,
                                 peer_id=self.node.peer_id, last_group_size=self.metrics.last_group_size)
            # -- end issue #7
            if r.inner_steps_per_round:
                due = self.steps_in_round >= r.inner_steps_per_round
            else:
                due = swarm_tokens >= r.tokens_per_round or \
                    (self.tokens_in_round > 0 and self.announcer.handed_in(self._counting_round()))
            if not due or self.tokens_in_round < self.retry_after_tokens:
                continue
            if self.pending is not None:  # the last average is still in flight: wait for it (time not computing)
                waited = time.monotonic()
                self._finish_pending()
                logger.info("round due while the last average was in flight: waited %.2f s for it",
                            time.monotonic() - waited)
                continue
            if self.faults.local("explode", self.diloco.round):
                with torch.no_grad():
                    for param in self.diloco.local_params:
                        param.add_(1e3)  # finite, but far from anything a round of training can do
            contribution = self._prepare()
            if contribution is None:
                continue
            if r.outer.overlap:
                # Round t's average runs in the background while round t+1's inner steps start; its outer update
                # is applied when it arrives, keeping the local progress made since the snapshot.
                self.tokens_in_round = self.steps_in_round = 0
                self.in_flight_tokens = contribution.weight
                self.pending = (background.submit(self._reduce, contribution, self.next_attempt), contribution)
            else:
                self.state = "averaging"
                self.metrics.set_state(self.state)
                outcome = self._reduce(contribution, self.next_attempt)
                self.state = "training"  # before the new round is announced: "averaging" it would make it due
                self._conclude(contribution, outcome)
        if self.pending is not None:
            self._finish_pending()  # stopping: do not leave the swarm with a round half-known to us
        background.shutdown(wait=False)
        utilization = compute_seconds / max(time.monotonic() - run_started, 1e-9)
        logger.info("compute utilisation %.1f%% (time in inner steps / wall time)", 100 * utilization)
        if s.checkpoint_dir and self.diloco.round > 0 and self._last_checkpoint_round != self.diloco.round:
            self._checkpoint()
        return self.rounds_done

    def _finished(self) -> bool:
        s = self.settings
        return bool((s.until_round and self.diloco.round >= s.until_round)
                    or (s.max_rounds and self.rounds_done >= s.max_rounds))

    def _finish_pending(self) -> None:
        future, contribution = self.pending
        self.pending = None
        self._conclude(contribution, future.result())

    def _conclude(self, contribution: Contribution, outcome: tuple) -> None:
        """Apply a successful average, or arrange the retry of a failed one (main thread)."""
        kind, attempt, result, group, started = outcome
        r = self.recipe
        if kind == "applied":
            self._apply(contribution, result, group, started)
            # A new round starts at attempt 0: the attempt we announce is read as the one of our announced round,
            # and a stale one made every later round follow it (and so never average along a ring again).
            self.next_attempt, self.retry_after_tokens, self.attempt = 0, 0, 0
            self.rounds_done += 1
            self.metrics.round_seconds.set(time.monotonic() - self.round_started)
            self.round_started = time.monotonic()
            return
        self.next_attempt = attempt + (0 if kind == "alone" else 1)  # "alone": nobody used this attempt's keys
        if contribution.snapshot is not None:
            self.in_flight_tokens = None
            self.tokens_in_round += contribution.weight  # still in our local params, so in the next contribution
        # Keep training before the next try, so a lonely swarm does not spin on matchmaking.
        self.retry_after_tokens = self.tokens_in_round + max(r.tokens_per_round // 4,
                                                             r.data.batch_size * r.data.seq_len)

    def _prepare(self) -> Optional[Contribution]:
        """This round's contribution: the pseudo-gradient (plus the error-feedback residual of lossy codecs) and
        its weight; None if it is not fit to send (the peer then restarts the round from the global params)."""
        r = self.recipe
        pseudo_gradient = self.error_feedback.compensate(self.diloco.pseudo_gradient())
        norm = float(pseudo_gradient.norm())
        if not math.isfinite(norm) or norm > r.outer.max_pseudo_grad_norm:
            self._recover(f"pseudo-gradient norm {norm:.3g} over the recipe's bound")
            return None
        snapshot = self.diloco.flat_local() if r.outer.overlap else None
        return Contribution(self.diloco.round, pseudo_gradient, self.tokens_in_round, self.diloco.digest(),
                            snapshot)

    def _reduce(self, contribution: Contribution, attempt: int) -> tuple:
        """Matchmaking and all-reduce of one contribution, retrying at once without members that failed.
        Touches no model state, so it may run in the background. Returns (kind, attempt, result, group,
        started) with kind "applied" (ready to apply), "alone" or "failed"."""
        r = self.recipe
        round_no, digest = contribution.round_no, contribution.digest
        started, retries = time.monotonic(), 0
        while True:
            if self._moved_on(round_no):
                return "failed", attempt, None, None, started  # the main loop re-syncs
            if self._excluded_round != round_no:
                self._excluded, self._unresponsive, self._excluded_round = set(), set(), round_no
            # Peers that failed this round together retry together: follow the highest attempt number announced.
            self.attempt = attempt = max([attempt] + self.announcer.attempts(round_no))
            self.announcer.refresh_now(self.loop)
            # Wait for the peers of this round, unless their heartbeat stopped (crashed peers' records linger
            # until they expire; a few missed heartbeats are enough not to wait for them). Peers with other params
            # come too: with more peers than one group holds, groups of different params mix. So do peers still
            # starting up at this round (a new swarm's round 0): left out, they would only re-sync afterwards.
            # While we wait, peers that leave the round are no longer waited for; once the swarm has moved on
            # without us, we stop waiting and re-sync.
            expected = self._in_round(round_no)
            self.faults.maybe_die("matchmaking", round_no)
            me_as = Candidate(digest, self.bandwidth, client=self.settings.client_mode,
                              phase_timeout=self.allreduce.deadlines.measured())
            try:
                group, others_seen = self.loop.run(form_group(
                    self.node, r.run_id, round_no, attempt, me_as, expected, r.averaging.min_group_size,
                    r.averaging.target_group_size, r.averaging.matchmaking_timeout, excluded=self._excluded,
                    not_waiting_for=self._unresponsive,
                    still_in=lambda: None if self._moved_on(round_no) else self._in_round(round_no),
                    push=self.group_push),
                    timeout=3 * r.averaging.matchmaking_timeout + 30)
            except TimeoutError:
                group, others_seen = None, 1
            if group is None:
                # Peers that put us in their group hear at once that we are not coming.
                self.loop.run(self.allreduce.decide(round_no, attempt, None), timeout=10)
                self.metrics.averaging_failures.labels(reason="no_group").inc()
                logger.info("round %d: no group formed (attempt %d); training on", round_no, attempt)
                return ("failed" if others_seen else "alone"), attempt, None, None, started
            vector, exact_from = contribution.pseudo_gradient, None
            if group.mix:  # members hold different global params: average them (and momentum) too, losslessly
                vector, exact_from = torch.cat([vector, self.diloco.flat_state()]), vector.numel()
            try:
                result = self.loop.run(self.allreduce.run(group, vector, contribution.weight, exact_from),
                                       timeout=r.averaging.allreduce_timeout + 10)
                return "applied", attempt, result, group, started
            except (AllReduceError, TimeoutError) as e:
                reason = getattr(e, "reason", "timeout")
                self.metrics.averaging_failures.labels(reason=reason).inc()
                logger.warning("round %d: averaging failed (%s): %s", round_no, reason, e)
                suspects, rejected = getattr(e, "suspects", set()), getattr(e, "rejected", set())
                self._excluded |= rejected
                self._unresponsive = suspects  # only for the next attempt: a slow peer is welcome back
                retries += 1
                if (not suspects | rejected and reason != "conflict") or retries > MAX_IMMEDIATE_RETRIES:
                    return "failed", attempt, None, None, started
                attempt += 1  # a member failed mid-round, or views differed: redo the round at once

    def _in_round(self, round_no: int) -> set[str]:
        return {p.peer_id for p in self.announcer.in_round(round_no)}

    def _moved_on(self, round_no: int) -> bool:
        """Whether the swarm finished this round without us and nobody is left to average it with."""
        return self.announcer.swarm_reference()[0] > round_no and not self._others_still_in(round_no)

    def _others_still_in(self, round_no: int) -> bool:
        r = self.recipe.averaging
        failed = self._unresponsive | self._excluded if self._excluded_round == round_no else set()
        return self.announcer.others_still_in(round_no, failed, r.min_group_size, r.target_group_size)

    def _apply(self, contribution: Contribution, result: AllReduceResult, group: Group, started: float) -> None:
        r = self.recipe
        round_no, n = contribution.round_no, self.diloco.numel
        average, mixed_state = result.average[:n], result.average[n:] if group.mix else None
        self.error_feedback.update(contribution.pseudo_gradient, result.delivered[:n])
        global_before = self.diloco.flat_global() if self.settings.trace_dir else None
        progress_since = None if contribution.snapshot is None else self.diloco.flat_local() - contribution.snapshot
        if mixed_state is not None:
            self.diloco.load_flat_state(mixed_state)
            self.metrics.mixing_rounds.inc()
        # With several groups, each sees only its own tokens: count the swarm's (its estimate) in the schedule.
        tokens = result.total_weight * group.swarm_size / max(result.group_size, 1)
        self.diloco.outer_step(average, int(round(tokens)), result.wire, log=not group.mix)
        self.in_flight_tokens = None  # our tokens since count toward the round we are now in
        self.last_group_size = max(result.group_size, group.swarm_size)
        self.metrics.round_peers.set(group.swarm_size)
        if progress_since is None:
            self.tokens_in_round = self.steps_in_round = 0
        if result.seconds > 0 and result.bytes_sent:
            # What we moved per second on the last round: a lower bound on our link, refined every round.
            self.bandwidth = 0.5 * self.bandwidth + 0.5 * (result.bytes_sent + result.bytes_received) / result.seconds
            self.bandwidth_up = result.bytes_sent / result.seconds
            self.bandwidth_down = result.bytes_received / result.seconds
        wire_per_param = self.allreduce.codec.bytes_per_param(max(n // result.group_size, 1))
        if mixed_state is not None:
            wire_per_param = (wire_per_param + 2 * 4.0) / 3  # params and momentum travel as fp32
        self.metrics.record_allreduce(  # issue #7: also the bytes before compression and the ratio
            result.bytes_sent, result.bytes_received, result.seconds, result.group_size, wire_per_param)
        self.metrics.outer_round.set(self.diloco.round)
        self.val_loss = validation_loss(self.model, self.eval_batches, self.device)  # of the new global params
        self.metrics.val_loss.set(self.val_loss)
        if progress_since is not None:
            self.diloco.add_to_local(progress_since)  # overlap: keep the steps made while averaging
        logger.info("round %d: averaged with %d peers%s in %.2f s (%.1f MB sent, %d tokens), matchmaking %.1f s; "
                    "val loss %.4f, train loss %.4f, digest %s", round_no, result.group_size,
                    f" (one of the groups of {group.swarm_size} peers, params mixed)" if group.mix else
                    f" (one of the groups of {group.swarm_size} peers)" if group.swarm_size > result.group_size
                    else " along a ring" if self.allreduce.uses_ring(group) else "", result.seconds,
                    result.bytes_sent / 1e6, int(result.total_weight),
                    time.monotonic() - started - result.seconds,
                    self.val_loss, self.loss or float("nan"), self.diloco.digest())
        if self.settings.trace_dir:
            self._trace(round_no, group, contribution.pseudo_gradient, contribution.weight, result, global_before,
                        average, mixed_state)
        if self.settings.checkpoint_dir and self.diloco.round % r.checkpoint_every == 0:
            self._checkpoint()
        if progress_since is None:
            self.announcer.refresh_now(self.loop)
        else:
            # Overlap: our tokens already counted toward the next round, so the view needs no refresh before
            # training goes on; publishing the new round must not hold up the training thread.
            self.announcer.refresh_soon(self.loop)

    def _recover(self, why: str) -> None:
        """Never send a diverged pseudo-gradient: drop local progress and restart the round from global."""
        logger.warning("%s: discarding this round's local progress and restarting from the global params", why)
        self.metrics.averaging_failures.labels(reason="diverged").inc()
        if self.pending is not None:
            # Overlap: conclude the average in flight first. Applied later, it would keep "the progress made since
            # its snapshot", measured from a local model that no longer descends from that snapshot.
            self._finish_pending()
        self.diloco.reset_local()
        self.inner_optimizer = make_inner_optimizer(self.model, self.recipe.inner)
        self.error_feedback.reset()
        self.tokens_in_round = self.steps_in_round = 0

    def _trace(self, round_no, group, pseudo_gradient, weight, result, global_before, average, mixed_state) -> None:
        import json

        from safetensors.torch import save_file

        directory = Path(self.settings.trace_dir)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {"pseudo_gradient": pseudo_gradient.contiguous(), "average": average.contiguous(),
                   "global_before": global_before, "global_after": self.diloco.flat_global()}
        if mixed_state is not None:
            tensors["mixed_state"] = mixed_state.contiguous()  # the group's average of params and momentum
        save_file(tensors, str(directory / f"round-{round_no:06d}.safetensors"))
        (directory / f"round-{round_no:06d}.json").write_text(json.dumps({
            "peer_id": self.node.peer_id, "round": round_no, "weight": weight, "members": list(group.members),
            "shares": list(group.shares), "clients": list(group.clients), "group_id": group.group_id,
            "mix": group.mix, "swarm_size": group.swarm_size, "total_weight": result.total_weight, "loss": self.loss,
            "val_loss": self.val_loss, "digest": self.diloco.digest()}))

    def _checkpoint(self) -> None:
        tensors = self.diloco.state_tensors()
        tensors.update({f"error_feedback.{k}": v for k, v in self.error_feedback.state_dict().items()})
        path = ckpt.save_checkpoint(
            self.settings.checkpoint_dir, self.diloco.round, self.diloco.tokens_seen, tensors,
            {"digest": self.diloco.digest(), "recipe": self.recipe.digest(), "loss": self.loss,
             "val_loss": self.val_loss, "inner_steps": self.inner_steps, **self.stream.meta(),
             "version": __version__},
            keep=self.settings.keep_checkpoints, series_every=self.settings.checkpoint_series)
        self._last_checkpoint_round = self.diloco.round
        self.metrics.checkpoint_written(self.diloco.round)  # issue #7: round and age
        logger.info("checkpoint written: %s", path)

    # ---- shutdown ------------------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        def _on_stop(signum: int) -> None:
            if self.stop_event.is_set():
                raise KeyboardInterrupt  # a second Ctrl-C: stop now
            logger.info("stopping after the current step (signal %d); Ctrl-C again to stop at once", signum)
            self.stop_event.set()

        install_stop_handlers(_on_stop)

    def shutdown(self) -> None:
        self.progress.close()  # issue #7
        self.state = "offline"
        if getattr(self, "allreduce", None) is not None and self.loop is not None and not self.settings.client_mode:
            try:  # client members of our last group may still be asking whether we applied it
                self.loop.run(self.allreduce.settle(COMMIT_GRACE + 3), timeout=10)
            except Exception:  # noqa: BLE001 - they re-sync when we are gone
                logger.debug("could not wait for client members", exc_info=True)
        if self.announcer is not None and self.loop is not None:
            try:
                self.loop.run(self.announcer.announce_offline(), timeout=10)
            except Exception:  # noqa: BLE001 - the record expires on its own
                logger.debug("could not announce offline", exc_info=True)
        if self.node is not None:
            if self.node.direct is not None:
                logger.info("streams opened: %d direct, %d through libp2p", self.node.direct.opened["direct"],
                            self.node.direct.opened["fallback"])
            self.node.shutdown()
        if self.loop is not None:
            self.loop.close()
        logger.info("stopped")
