"""The local peer: joins the swarm, fetches the recipe, loads data and model, syncs state, then runs DiLoCo
rounds (inner AdamW steps until the swarm's progress reaches tokens_per_round, then group averaging and the
outer step), announcing itself, checkpointing and exporting metrics until stopped. The round's bookkeeping is
`Rounds` (rounds.py), the averaging `Averager` (averager.py); this module wires them to the model, the data
and the network and runs the training loop."""

from __future__ import annotations

import math
import logging
import time
from typing import Optional

import torch

from swarm import __version__
from swarm.averaging.allreduce import COMMIT_GRACE, GroupAllReduce
from swarm.averaging.deadlines import AdaptiveDeadlines
from swarm.averaging.faults import SLOWDOWN, FaultPlan
from swarm.averaging.group_push import GroupPush
from swarm.compression import FragmentFeedback
from swarm.checks import require_recipe
from swarm.settings import PeerSettings
from swarm.dht.node import SwarmNode
from swarm.dht.recipes import fetch_run, take_part
from swarm.dht.records import PeerRecord
from swarm.doctor import join_checked
from swarm.events import EventLog
from swarm.monitoring.metrics import PeerMetrics
from swarm.model.device import pick_device
from swarm.model.probe import describe_device, measure_tokens_per_s
from swarm.monitoring.progress import ProgressLine
from swarm.peer.state import checkpoint as ckpt
from swarm.peer.announcer import Announcer
from swarm.peer.averager import Averager, LinkEstimate
from swarm.peer.state.catch_up import CatchUp
from swarm.peer.diloco import DiLoCo
from swarm.peer.rounds import Averaged, Contribution, Outcome, Rounds
from swarm.peer.state.sync import serve_state
from swarm.peer.shared_data import load_data
from swarm.peer.pipeline.part import Part
from swarm.peer.stop import Stop
from swarm.peer.stream import DataStream
from swarm.peer.report import Timeline, report_round, write_trace
from swarm.peer.training import (StepClock, ValidationBudget, inner_for, learning_rate, make_inner_optimizer,
                                 schedule_tokens)
from swarm.runtime import LoopThread

logger = logging.getLogger("swarm.peer")


class Peer:
    def __init__(self, settings: PeerSettings, move_to: Optional[int] = None):
        self.settings = settings
        self.metrics = PeerMetrics()
        self.events = EventLog(settings.events_file)
        self.stop = Stop(self.events)
        self.faults = FaultPlan(settings.inject_fault, self.events)
        self.progress = ProgressLine()  # a live status line when stdout is a terminal
        self.loop: Optional[LoopThread] = None
        self.node: Optional[SwarmNode] = None
        self.announcer: Optional[Announcer] = None
        self.allreduce: Optional[GroupAllReduce] = None
        self.rounds: Optional[Rounds] = None
        self.checkpoints, self.move_to = None, move_to  # move_to: a stage to host (rebalancing), not pinned
        self._seen_view: Optional[list[PeerRecord]] = None  # the swarm view the data stream last looked at

    # ---- start-up ------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Join the network, read the recipe, build data and model, start serving, and reach the swarm's state."""
        if self.settings.num_threads:
            torch.set_num_threads(self.settings.num_threads)
        self.device = pick_device(self.settings.device)
        self.loop = self.stop.loop = LoopThread()  # a stop signal cancels what the peer waits for on it
        self._join_network()
        self._read_recipe()
        self._build_data_and_model()
        self._start_services()
        self._initial_state()

    def _join_network(self) -> None:
        # What `swarm-peer doctor` checks, around the node's start; a peer the swarm cannot dial comes back in client
        # mode, and its settings say so from here on.
        self.node, self.settings = join_checked(self.settings, self.loop, self.events)
        logger.info("joined the DHT as %s", self.node.peer_id)
        self.events.emit("joined", peer_id=self.node.peer_id)
        if self.node.direct is not None:
            self.metrics.watch_streams(self.node.direct.opened)

    def _read_recipe(self) -> None:
        self.recipe, self.dataset_id = self.loop.run(fetch_run(self.node, timeout=30.0), timeout=60)
        r = self.recipe
        take_part(self.node, r, self.settings.invite)  # a private run's stranger stops here, saying what to do
        if self.settings.recipe_file:  # --recipe: refuse to start unless the swarm's is this one
            require_recipe(self.settings.recipe_file, self.settings.data_dir or self.settings.cache_dir, r)
        logger.info("run %s (recipe %s): codec %s, %d tokens per round", r.run_id, r.digest()[:12],
                    r.averaging.codec, r.tokens_per_sync())

    def _build_data_and_model(self) -> None:
        s, r = self.settings, self.recipe
        data, model_recipe, self.shared = load_data(self.node, self.loop, r, self.dataset_id, s, self.metrics,
                                                    self.events)
        self.eval_batches = data.eval_batches
        self.stream = DataStream(data.train, r.data.num_shards, r.data.batch_size, r.data.seed,
                                 self.node.peer_id, pinned=s.data_shard)  # placed once we see the swarm
        self.part = Part.build(r, s, model_recipe, len(data.tokenizer), self.node, self.loop, self.device,
                               self.move_to)  # the whole model, or a stage of it
        self.model, self.n_blocks = self.part.model, self.part.n_blocks
        self.settings = s = self.part.settings  # (a stage's checkpoints go in a directory of their own)
        self.diloco = DiLoCo(self.part.module, r.outer, None if s.replay_log_mb is None else int(s.replay_log_mb * 1e6),
                             r.averaging.replay_bytes_per_param, s.outer_state_dir)
        self.error_feedback = FragmentFeedback.for_codec(self.diloco.fragment_sizes(), r.averaging.codec)
        self.inner = inner_for(r.inner, self.model)  # (its lr, where the recipe leaves it to the width)
        self.inner_optimizer = make_inner_optimizer(self.part.module, self.inner)
        self.checkpoints = ckpt.CheckpointWriter(s.checkpoints.dir, s.checkpoints.keep, s.checkpoints.series,
                                                 self.metrics, self.events) if s.checkpoints.dir else None
        logger.info("model: %.2fM parameters, %d blocks, on %s; inner lr %.2g; replay log up to %.2f MB",
                    self.diloco.numel / 1e6, self.n_blocks, self.device, self.inner.lr, self.diloco.log_bytes / 1e6)
        self.events.emit("model", parameters=self.diloco.numel, blocks=self.n_blocks, device=str(self.device),
                         replay_log_bytes=self.diloco.log_bytes, inner_lr=self.inner.lr)

    def _start_services(self) -> None:
        """The all-reduce and state servers, the announcer, its heartbeat, the metrics and the rounds' averager."""
        s, r = self.settings, self.part.run  # a stage's peers average, sync and announce under its own run id
        self.allreduce = GroupAllReduce(  # a mixing group averages pseudo-gradient, params and momentum: 3 x numel
            self.node, r.run_id, r.averaging.codec, 3 * self.diloco.numel,
            AdaptiveDeadlines(r.averaging.min_phase_timeout, r.averaging.allreduce_timeout),
            on_bad_peer=self._on_bad_peer, faults=self.faults, ring=r.averaging.ring,
            max_weight=r.max_contribution_tokens(), aggregator_name=r.averaging.aggregator,
            verify_reducers=r.averaging.verify_reducers)
        group_push = GroupPush(self.node, r.run_id, self.allreduce.verifiable)  # groups our leaders push to us
        if s.network.client_mode:
            logger.info("client mode: accepting no inbound streams; contributing to averages without reducing, "
                        "serving no state")
        else:
            self.loop.run(self.allreduce.start(), timeout=30)
            self.loop.run(group_push.start(), timeout=30)
            self.loop.run(serve_state(self.node, r.run_id, self.diloco, self.faults), timeout=30)
            if self.shared is not None:
                self.shared.serve(corrupt=self.faults.serves_corrupt_data())
        self.rounds = Rounds(overlap=r.outer.overlap, tokens_per_round=r.tokens_per_sync(),
                             steps_per_round=lambda: r.steps_per_sync(self.rounds.counting_round(self.diloco.round)),
                             retry_tokens=0 if not (self.part.whole or self.part.first) else  # (pipeline/part.py)
                             max(r.tokens_per_sync() // 4, r.data.batch_size * r.data.seq_len))
        self.announcer = Announcer(self.node, r.run_id, self.n_blocks, self._record, self.metrics)
        self.device_info, self.block_range = describe_device(self.device), self.part.bounds
        self.link = LinkEstimate()
        self.averager = Averager(
            loop=self.loop, node=self.node, recipe=r, allreduce=self.allreduce, group_push=group_push, link=self.link,
            announcer=self.announcer, rounds=self.rounds, faults=self.faults, metrics=self.metrics, events=self.events,
            client_mode=s.network.client_mode, flat_state=self.diloco.flat_state, stopping=self.stop.event)
        self.catch_up = CatchUp(loop=self.loop, node=self.node, run_id=r.run_id, diloco=self.diloco,
                                rounds=self.rounds, announcer=self.announcer, metrics=self.metrics,
                                events=self.events, on_synced=self._drop_local_progress, kept=self.part.kept)
        self.loss, self.val_loss, self.validation = None, None, ValidationBudget()  # (the last measured losses)
        self.tokens_per_s = measure_tokens_per_s(self.model, r.data.batch_size, r.data.seq_len, self.device) \
            if self.part.whole else 0.0  # a stage's pace is the pipeline's: announced once measured
        self.inner_steps, self.last_group_size = 0, 1
        self.loop.submit(self.announcer.run())
        self.part.start(self.metrics)
        self.part.drill(self.faults.stage_lie())  # (a drill: a stage peer that lies in its answers or activations)
        self.part.follow(lambda: self.diloco.round)  # (microbatches and answers say it: see Part.follow)
        port = self.metrics.serve(s.metrics.port, s.metrics.host)
        if port is not None:
            logger.info("metrics at http://%s:%d/metrics", s.metrics.host, port)
            self.events.emit("metrics", port=port)
        self.metrics.describe(__version__, self.device, r.averaging.codec)
        self.metrics.set_blocks(*self.block_range)

    def _initial_state(self) -> None:
        """The newest params (see _load_state), then where in the data we read (see _place_stream)."""
        self.announcer.refresh_now(self.loop)
        checkpoint = ckpt.load_latest(self.settings.checkpoints.dir) if self.settings.checkpoints.dir else None
        self.part.check(checkpoint)  # refuses one of another run or stage
        self._load_state(checkpoint)
        self._place_stream(checkpoint)
        if self.shared is not None:
            self.shared.fetch_rest(self.stream.start)

    def _load_state(self, checkpoint: Optional[ckpt.Checkpoint]) -> None:
        """Our checkpoint (else a fresh seeded init), then the swarm's state if it is newer (see CatchUp)."""
        if checkpoint is not None and ckpt.resume(checkpoint, self.diloco, self.error_feedback):
            self.events.emit("resumed", round=checkpoint.round, path=str(checkpoint.path))
        else:
            logger.info("starting from the recipe's initial params (round 0, digest %s)", self.diloco.digest())
        self.catch_up.join()

    def _place_stream(self, checkpoint: Optional[ckpt.Checkpoint]) -> None:
        """Where in the data we read (DataStream.place): our checkpoint's place if it is of this run."""
        ours = checkpoint is not None  # of this run: _initial_state refuses others
        if ours and isinstance(checkpoint.meta.get("inner_steps"), int):
            self.inner_steps = max(checkpoint.meta["inner_steps"], 0)
        live = self.announcer.live()
        how = self.stream.place(live, checkpoint.meta if ours else None)
        logger.info("data: shard %d/%d at step %d, %s", self.stream.start, self.recipe.data.num_shards,
                    self.stream.step, how)
        self.events.emit("data", shard=self.stream.start, step=self.stream.step, resumed=ours, how=how,
                         others_reading=sorted(p.data_shard for p in live if p.data_shard is not None))
        self.metrics.data_shard.set_function(lambda: float(self.stream.reading()))
        self.announcer.refresh_soon(self.loop)

    # ---- what we announce ----------------------------------------------------------------------------------
    def _record(self) -> PeerRecord:
        snap, (round_no, digest) = self.rounds.snapshot(), self.diloco.identity()  # (never waits for a hash)
        return PeerRecord(
            peer_id=self.node.peer_id, state=snap.state, version=__version__, run_id=self.recipe.run_id,
            round=round_no, tokens_in_round=snap.tokens_in_round, block_start=self.block_range[0],
            block_end=self.block_range[1], digest=digest, device=self.device.type,
            device_name=self.device_info.name, device_memory=self.device_info.memory_bytes,
            tokens_per_s=self.tokens_per_s, capacity=self.tokens_per_s if self.part.whole else self.part.capacity(),
            bandwidth_up=self.link.up, bandwidth_down=self.link.down,
            loss=self.loss, val_loss=self.val_loss, attempt=snap.attempt, updated=self.node.now(),
            in_flight_tokens=snap.in_flight_tokens, data_shard=self.stream.reading(), data_start=self.stream.start,
            client=self.settings.network.client_mode, **(self.shared.record_fields() if self.shared else {}),
            **(self.part.keeper.fields() if self.part.keeper else {}))

    def _on_bad_peer(self, peer_id: str, reason: str) -> None:
        self.metrics.bad_peers.labels(reason=reason).inc()
        logger.warning("peer %s sent a bad contribution (%s); it is excluded from this round", peer_id, reason)
        self.events.emit("bad_peer", peer_id=peer_id, reason=reason)

    # ---- main loop -----------------------------------------------------------------------------------------
    def run(self) -> int:
        """Train until max_rounds, until_round or a stop signal; returns the number of rounds averaged."""
        batches = self.stream.batches()
        self.rounds.start_training()
        self.metrics.set_state("training")
        self.clock = StepClock()
        logger.info("training round %d%s", self.diloco.round,
                    " (averaging overlaps training)" if self.recipe.outer.overlap else "")
        self.events.emit("training", round=self.diloco.round, overlap=self.recipe.outer.overlap,
                         client=self.settings.network.client_mode)
        while not self.stop.event.is_set() and not self._finished():
            if not self._inner_step(batches):
                continue  # diverged: the round restarts from the global params
            if self.announcer.view is not self._seen_view:  # a heartbeat read the swarm again
                batches = self._follow_data(batches)
            outcome = self.rounds.poll()
            if outcome is not None:
                self._conclude(outcome)
                continue  # the round changed: re-check whether we are finished before preparing another
            if self.catch_up.behind():
                continue
            counting = self.rounds.counting_round(self.diloco.round)
            swarm_tokens = self.announcer.swarm_progress(counting, self.rounds.tokens_in_round)
            self._show_progress(swarm_tokens)
            if not self.rounds.due(swarm_tokens, self.announcer.handed_in(counting), self.part.behind(counting)):
                continue
            if self.part.in_flight and not self._inner_step(batches, settle=True):  # (a first stage's batches)
                continue
            if self.rounds.in_flight:  # the last average is still in flight: wait for it (time not computing)
                self._conclude(self.rounds.wait(due=True))
                continue
            contribution = self._prepare()
            if contribution is not None:
                outcome = self.rounds.hand_in(contribution, self.averager.reduce)
                if outcome is not None:
                    self._conclude(outcome)
        if self.rounds.in_flight:
            self._conclude(self.rounds.wait())  # stopping: do not leave the swarm with a round half-known to us
        self.part.finish(self.stop.event, self.events)  # (a serving stage answers the stage before until it ends)
        self.rounds.close()
        logger.info("compute utilisation %.1f%% (time in inner steps / wall time)", 100 * self.clock.utilization())
        if self.checkpoints is not None and self.diloco.round > 0 and self.checkpoints.last_round != self.diloco.round:
            self._checkpoint()
        return self.rounds.rounds_done

    def _inner_step(self, batches, settle: bool = False) -> bool:
        """One inner AdamW step, with its metrics; False if the loss was not finite (the round then restarts)."""
        r = self.recipe
        lr = learning_rate(self.inner, schedule_tokens(self.diloco.tokens_seen, self.rounds.tokens_in_round,
                                                       self.last_group_size), r.total_tokens)
        if self.faults.local("diverge", self.rounds.counting_round(self.diloco.round)):
            with torch.no_grad():
                self.diloco.local_params[0].fill_(float("nan"))  # as if the optimizer blew up
        if self.faults.local("slow", self.diloco.round):
            self.part.slow_down(SLOWDOWN)
        started = time.monotonic()
        loss, tokens, read = self.part.step(batches, self.device, self.inner_optimizer, lr, r.inner.grad_clip, settle)
        self.stream.step += read
        if loss is None:
            return True  # a stage that got no microbatch, or one its next stage did not take: nothing trained
        tokens_per_s = self.clock.stepped(time.monotonic() - started, tokens)
        self.metrics.compute_utilization.set(self.clock.utilization())
        self.inner_steps += 1
        self.metrics.inner_steps.inc()
        self.metrics.tokens.inc(tokens)
        if not math.isfinite(loss):
            self._recover("non-finite loss")
            return False
        self.rounds.trained(tokens)
        self.loss = loss
        self.metrics.train_loss.set(loss)
        if tokens_per_s is not None:
            self.tokens_per_s = tokens_per_s
            self.metrics.tokens_per_second.set(tokens_per_s)
        return True

    def _follow_data(self, batches):
        """Move our data stream off a shard another live peer reads (see DataStream.leave_if_shared)."""
        self._seen_view = self.announcer.view
        moved = self.stream.leave_if_shared(self.announcer.live())
        if not moved:
            return batches
        logger.info("data: %s", moved.text)
        self.events.emit("data_moved", shard=self.stream.start, step=self.stream.step, how=moved.text,
                         rival=moved.rival, from_shard=moved.from_shard)
        self.announcer.refresh_soon(self.loop)
        return self.stream.batches()

    def _show_progress(self, swarm_tokens: int) -> None:
        """Per-step gauges (they also catch resyncs and resumed checkpoints) and the terminal's progress line."""
        self.metrics.set_state(self.rounds.state)
        self.metrics.outer_round.set(self.diloco.round)
        self.progress.update(state=self.rounds.state, round_no=self.diloco.round, tokens_per_s=self.tokens_per_s,
                             loss=self.loss, swarm_tokens=swarm_tokens, steps_in_round=self.rounds.steps_in_round,
                             recipe=self.recipe, view=self.announcer.view, peer_id=self.node.peer_id,
                             last_group_size=self.metrics.last_group_size)

    def _finished(self) -> bool:
        s = self.settings
        return bool((s.until_round and self.diloco.round >= s.until_round) or self.part.move_to is not None
                    or (s.max_rounds and self.rounds.rounds_done >= s.max_rounds))

    # ---- one round's contribution and outcome --------------------------------------------------------------
    def _prepare(self) -> Optional[Contribution]:
        """This round's contribution: the pseudo-gradient (plus the error-feedback residual of lossy codecs) and
        its weight; None if it is not fit to send (the peer then restarts the round from the global params)."""
        r, started = self.recipe, time.monotonic()
        if self.faults.local("explode", self.diloco.round):  # (finite, but far from anything a round can do)
            self.diloco.add_to_local(torch.full((self.diloco.numel,), 1e3))
        fragment = self.diloco.fragment()  # (Streaming DiLoCo: this round's fragment alone; else all)
        pseudo_gradient = self.error_feedback[fragment].compensate(self.diloco.pseudo_gradient(fragment), True)
        norm = float(pseudo_gradient.norm())
        if not math.isfinite(norm) or norm > r.outer.max_pseudo_grad_norm:
            self._recover(f"pseudo-gradient norm {norm:.3g} over the recipe's bound")
            return None
        snapshot = self.diloco.snapshot(fragment) if r.outer.overlap else None
        weight = self.faults.declared_weight(min(self.rounds.tokens_in_round, r.max_contribution_tokens()),
                                             r.max_contribution_tokens(), self.diloco.round)  # (what others accept)
        return Contribution(self.diloco.round, pseudo_gradient, weight, self.diloco.digest(), snapshot,
                            time.monotonic() - started)

    def _conclude(self, outcome: Outcome) -> None:
        """Apply a successful average, or arrange the retry of a failed one (training thread)."""
        self._apply(outcome) if isinstance(outcome, Averaged) else self.rounds.failed(outcome)

    def _apply(self, averaged: Averaged) -> None:
        contribution, result, group = averaged.contribution, averaged.result, averaged.group
        n, fragment = contribution.pseudo_gradient.numel(), self.diloco.fragment(contribution.round_no)
        timeline = Timeline(averaged.phases | {"prepare": contribution.prepared_seconds})
        average, mixed_state = result.average[:n], result.average[n:] if group.mix else None
        timeline.add("checkpoint", self.diloco.settle())  # (the last checkpoint's write, if it is still going)
        if result.delivered is not None:  # (None for a codec without error feedback: Run.delivered)
            self.error_feedback[fragment].update(contribution.pseudo_gradient, result.delivered[:n])
        global_before = self.diloco.flat_global() if self.settings.trace_dir else None
        progress = None if contribution.snapshot is None else self.diloco.progress(contribution.snapshot, fragment)
        if mixed_state is not None:
            self.diloco.load_flat_state(mixed_state)
            self.metrics.mixing_rounds.inc()
        # With several groups, each sees only its own tokens: count the swarm's (its estimate) in the schedule.
        tokens = result.total_weight * group.swarm_size / max(result.group_size, 1)
        self.diloco.outer_step(average, int(round(tokens)), result.wire, log=not group.mix)  # (hashed meanwhile)
        self.rounds.landed(averaged)  # right after the step, so no record counts tokens twice
        timeline.lap("outer_step")
        self.last_group_size = max(result.group_size, group.swarm_size)
        self.announcer.averaged_with(group.members, group.swarm_size)  # its majority must hold any state we follow
        self.link.update(result.bytes_sent, result.bytes_received, result.seconds)
        # (the whole model's, or a first stage's through the pipeline, as often as ValidationBudget says)
        measured = self.validation.measure(lambda: self.part.validation_loss(self.eval_batches, self.device))
        self.val_loss = measured if measured is not None else self.val_loss  # (None: not measured this round)
        timeline.lap("validation")
        if progress is not None:
            self.diloco.add_to_local(progress, fragment)  # overlap: keep the steps made while averaging
        digest = self.diloco.digest()
        timeline.lap("digest")  # (what the training thread waited for the hash, which ran beside validation)
        if self.checkpoints is not None and self.diloco.round % self.recipe.checkpoint_every == 0:
            self._checkpoint()
        timeline.lap("checkpoint")
        report_round(averaged, metrics=self.metrics, events=self.events,
                     uses_ring=self.allreduce.uses_ring(group), round_now=self.diloco.round, loss=self.loss,
                     val_loss=measured, digest=digest, timeline=timeline.done(self.clock, self.diloco),
                     wire_per_param=self.allreduce.codec.bytes_per_param(max(n // result.group_size, 1)))
        if self.settings.trace_dir:
            write_trace(self.settings.trace_dir, self.node.peer_id, averaged, global_before, average, mixed_state,
                        self.diloco.flat_global(), self.loss, self.val_loss, digest)
        if progress is None:
            self.announcer.refresh_now(self.loop)
        else:
            # Overlap: our tokens already counted toward the next round, so publishing the new round need not hold
            # up training; the round's buffers lived through inner steps, so keeping them costs no peak memory.
            self.announcer.refresh_soon(self.loop)
            self.diloco.recycle(contribution.pseudo_gradient, progress)

    def _drop_local_progress(self) -> None:
        """Our state was replaced by the swarm's: error feedback and inner moments are of a model we left."""
        self.error_feedback.reset()
        self.inner_optimizer = make_inner_optimizer(self.part.module, self.inner)

    def _recover(self, why: str) -> None:
        """Never send a diverged pseudo-gradient: drop local progress and restart the round from global."""
        logger.warning("%s: discarding this round's local progress and restarting from the global params", why)
        self.metrics.averaging_failures.labels(reason="diverged").inc()
        self.events.emit("recovered", round=self.diloco.round, reason=why)
        if self.rounds.in_flight:
            # Overlap: conclude the average in flight first. Applied later, it would keep "the progress made since
            # its snapshot", measured from a local model that no longer descends from that snapshot.
            self._conclude(self.rounds.wait())
        self.diloco.reset_local()
        self._drop_local_progress()
        self.rounds.dropped()

    def _checkpoint(self) -> None:
        """Have the state of now written in the background, read in place (see CheckpointWriter)."""
        extra = {f"error_feedback.{k}": v for k, v in self.error_feedback.state_dict().items()}
        self.checkpoints.write(self.diloco, extra, {
            "digest": self.diloco.digest(), "recipe": self.recipe.digest(), "stage": self.part.index,
            "loss": self.loss, "val_loss": self.val_loss, "inner_steps": self.inner_steps, **self.stream.meta(),
            "version": __version__})

    # ---- shutdown ------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.stop.wait_handled()  # (before our own network work: a stop's cancellations must not cut it)
        self.progress.close()
        if self.rounds is not None:
            self.rounds.set_state("offline")
        if self.allreduce is not None and self.loop is not None and not self.settings.network.client_mode:
            try:  # client members of our last group may still be asking whether we applied it
                wait = self.stop.time_left(COMMIT_GRACE + 3)
                self.loop.run(self.allreduce.settle(wait), timeout=wait + 1)
            except Exception:  # noqa: BLE001 - they re-sync when we are gone
                logger.debug("could not wait for client members", exc_info=True)
        if self.announcer is not None and self.loop is not None:
            try:  # best effort: with the swarm gone, the record expires on its own
                self.loop.run(self.announcer.announce_offline(), timeout=self.stop.time_left(3.0))
            except Exception:  # noqa: BLE001 - the record expires on its own
                logger.debug("could not announce offline", exc_info=True)
        if self.checkpoints is not None:
            self.checkpoints.close()  # (the newest state we have is written before we go)
        opened = self.node.direct.opened if self.node is not None and self.node.direct is not None else {}
        if opened:
            logger.info("streams opened: %d direct, %d through libp2p", opened["direct"], opened["fallback"])
        if self.node is not None:
            self.node.shutdown()
        if self.loop is not None:
            self.loop.close()
        self.metrics.close()
        logger.info("stopped")
        self.events.emit("stopped", streams_direct=opened.get("direct", 0), streams_fallback=opened.get("fallback", 0))
        self.events.close()
