"""DiLoCo and data-parallel training simulated in one process, with exactly the pieces a real peer uses (model
construction, data shards, inner step, lr schedule, outer optimizer, codecs with error feedback where the codec
keeps it). The benchmark
compares algorithms with it, and a test checks that a real swarm computes the same global params.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from swarm.averaging.aggregate import aggregate_parts
from swarm.compression import Codec, ErrorFeedback, get_codec
from swarm.config import Recipe, sync_steps
from swarm.data.prepare import RunData
from swarm.peer.diloco import DiLoCo
from swarm.model.build import build_model, n_blocks
from swarm.peer.training import (inner_for, inner_step, learning_rate, make_inner_optimizer, schedule_tokens,
                                 validation_loss)

logger = logging.getLogger(__name__)


@dataclass
class SimulationResult:
    global_params: list[torch.Tensor]  # after the last round (DiLoCo) or step (data-parallel)
    val_losses: list[float] = field(default_factory=list)  # after each round
    bytes_per_worker: float = 0.0  # payload each worker sent, butterfly all-reduce accounting
    tokens: int = 0


def _allreduce_bytes(payload_bytes: float, workers: int, average_bytes: Optional[float] = None) -> float:
    """Bytes one worker sends in a butterfly all-reduce of a payload: its parts for the others, (M-1)/M of the
    payload, then its averaged part for everyone, (M-1)/M of the average as encoded (`average_bytes`; by default
    as large as the payload). Zero for a single worker."""
    average_bytes = payload_bytes if average_bytes is None else average_bytes
    return (workers - 1) / workers * (payload_bytes + average_bytes) if workers > 1 else 0.0


def _through_reducers(codec, average: torch.Tensor, members: int) -> tuple[torch.Tensor, Optional[int]]:
    """The average as the members get it back from their reducers (through the codec's average codec), and its
    encoded bytes (None for the lossless codec, whose average is as large as a contribution)."""
    if codec.name == "none":
        return average, None
    back = codec.average_codec(members)
    payload = back.encode(average)
    return back.decode(payload), len(payload)


def simulate_diloco(recipe: Recipe, data: RunData, shards: list[int], rounds: int, inner_steps: int,
                    codec_name: Optional[str] = None, device: str = "cpu",
                    overlap_delay: Optional[int] = None, aggregator_name: Optional[str] = None,
                    codec: Optional[Codec] = None) -> SimulationResult:
    """M = len(shards) workers, each `inner_steps` AdamW steps on its shard per round, then the token-weighted
    aggregate (the recipe's `averaging.aggregator`, or `aggregator_name`, chunk by chunk as reducers do) of their
    pseudo-gradients (through `codec_name`'s codec, or `codec` itself, with error feedback) and the outer step.

    With `overlap_delay` = d (outer.overlap, as the peers run it): workers never wait for the average; round t's
    average arrives d inner steps into round t+1 and is applied then, each worker keeping the progress it made
    since its round-t snapshot (d >= inner_steps: one full round late, Streaming DiLoCo's worst case).

    With the recipe's `outer.fragments` P > 1 (Streaming DiLoCo, as the peers run it: swarm/peer/diloco.py), each
    round is P syncs of about inner_steps / P steps (config.sync_steps), sync k averaging and stepping fragment k
    alone, so each fragment is averaged every `inner_steps` steps; `val_losses` are one a round (after its P
    syncs)."""
    fragments = recipe.outer.fragments
    if fragments > 1 and (overlap_delay is not None or inner_steps < fragments):
        raise ValueError("fragments take no overlap_delay here, and at least as many inner_steps as they are")
    codec = codec or get_codec(codec_name or recipe.averaging.codec)
    workers = [build_model(recipe.model, data.vocab_size).to(device) for _ in shards]
    inner = inner_for(recipe.inner, workers[0])  # (its lr, where the recipe leaves it to the width)
    diloco = DiLoCo(workers[0], recipe.outer)  # global params + outer optimizer; worker 0's model is its local
    optimizers = [make_inner_optimizer(model, inner) for model in workers]
    batches = [data.train.batches(shard, recipe.data.num_shards, recipe.data.batch_size, recipe.data.seed)
               for shard in shards]
    feedback = [[ErrorFeedback(codec.error_feedback, codec.feedback_decay) for _ in range(fragments)]
                for _ in shards]
    tokens_per_step = recipe.data.batch_size * recipe.data.seq_len
    result = SimulationResult(diloco.global_params)
    evaluator = build_model(recipe.model, data.vocab_size).to(device) if overlap_delay is not None else workers[0]
    group_size = 1
    pending: Optional[tuple[torch.Tensor, int]] = None  # overlap: last round's average, not yet applied
    snapshots: list[Optional[torch.Tensor]] = [None] * len(shards)  # overlap: local params when it was taken

    def apply(average: torch.Tensor, weight: int) -> None:
        local0 = _flat(workers[0])
        diloco.outer_step(average, weight)  # (resets worker 0's local params: put them back, re-based below)
        if overlap_delay is not None:
            _add_flat(workers[0], local0 - _flat(workers[0]))

    def rebase(index: int) -> None:
        """Overlap: the average arrived; keep the progress made since the snapshot, on the new global params."""
        global_now = torch.cat([g.view(-1) for g in diloco.global_params])
        _add_flat(workers[index], global_now - snapshots[index])

    for sync in range(rounds * fragments):
        round_no, fragment = sync // fragments, diloco.fragment()
        steps = sync_steps(inner_steps, fragments, fragment)
        start, end = diloco.fragments[fragment]
        arrived = pending
        if arrived is not None:
            apply(*arrived)  # the global update is the same whenever a worker sees it; workers re-base at step d
            pending = None
        contributions = []
        for index, model in enumerate(workers):
            if overlap_delay is None and index:  # worker 0's local params are reset by the outer step
                reset = slice(None) if sync == 0 else slice(*diloco.fragments[diloco.fragment(diloco.round - 1)])
                with torch.no_grad():
                    for local, global_ in zip(list(model.parameters())[reset], diloco.global_params[reset]):
                        local.copy_(global_)
            for step in range(steps):
                if arrived is not None and step == min(overlap_delay, inner_steps):
                    rebase(index)
                lr = learning_rate(inner, schedule_tokens(diloco.tokens_seen, step * tokens_per_step,
                                                          group_size), recipe.total_tokens)
                inner_step(model, optimizers[index], next(batches[index]), torch.device(device), lr,
                           inner.grad_clip)
            if arrived is not None and overlap_delay >= inner_steps:
                rebase(index)  # one full round late: just before this round's snapshot
            with torch.no_grad():
                pseudo_gradient = torch.cat([(g - l.detach().cpu().float()).view(-1) for g, l in
                                             zip(diloco.global_params[start:end], list(model.parameters())[start:end])])
            if overlap_delay is not None:
                snapshots[index] = _flat(model)
            to_send = feedback[index][fragment].compensate(pseudo_gradient)
            payload = codec.encode(to_send)
            delivered = codec.decode(payload) if codec.name != "none" else to_send
            feedback[index][fragment].update(to_send, delivered)
            contributions.append((delivered, steps * tokens_per_step, len(payload)))
        average, total_weight = aggregate_parts(aggregator_name or recipe.averaging.aggregator,
                                                [vector for vector, _, _ in contributions],
                                                [weight for _, weight, _ in contributions], [1.0] * len(shards),
                                                codec.alignment())
        total_weight = int(total_weight)
        average, average_bytes = _through_reducers(codec, average, len(shards))
        if overlap_delay is None:
            apply(average, total_weight)
        else:
            pending = (average, total_weight)
            if sync == rounds * fragments - 1:
                apply(*pending)  # stopping: the last average is applied, as a stopping peer does
        group_size = len(shards)
        result.bytes_per_worker += _allreduce_bytes(contributions[0][2], len(shards), average_bytes)
        result.tokens += total_weight
        if fragment != fragments - 1:
            continue  # (validation once a round, after its last fragment's sync)
        if evaluator is not workers[0]:
            with torch.no_grad():
                for param, global_ in zip(evaluator.parameters(), diloco.global_params):
                    param.copy_(global_)
        result.val_losses.append(validation_loss(evaluator, data.eval_batches, torch.device(device)))
        logger.info("diloco M=%d round %d: val loss %.4f", len(shards), round_no, result.val_losses[-1])
    return result


def simulate_groups(recipe: Recipe, data: RunData, shards: list[int], rounds: int, inner_steps: int,
                    group_size: int, codec_name: Optional[str] = None, device: str = "cpu") -> SimulationResult:
    """M = len(shards) workers averaging in groups of at most `group_size`, split each round exactly as peers
    split themselves (matchmaking.plan_groups, equal bandwidths): every worker holds its own global params and
    outer momentum, a group averages its pseudo-gradients (through the codec, with error feedback), and a group
    whose members hold different params averages params and momentum too (lossless) before the outer step.
    `val_losses` are the mean over the groups' params after each round; `global_params` are worker 0's."""
    from swarm.averaging.grouping import Candidate, plan_groups

    codec = get_codec(codec_name or recipe.averaging.codec)
    workers = [build_model(recipe.model, data.vocab_size).to(device) for _ in shards]
    inner = inner_for(recipe.inner, workers[0])
    dilocos = [DiLoCo(model, recipe.outer) for model in workers]
    optimizers = [make_inner_optimizer(model, inner) for model in workers]
    batches = [data.train.batches(shard, recipe.data.num_shards, recipe.data.batch_size, recipe.data.seed)
               for shard in shards]
    feedback = [ErrorFeedback(codec.error_feedback, codec.feedback_decay) for _ in shards]
    tokens_per_step = recipe.data.batch_size * recipe.data.seq_len
    result = SimulationResult(dilocos[0].global_params)
    last_swarm = 1
    for round_no in range(rounds):
        delivered = []
        for index, model in enumerate(workers):
            for step in range(inner_steps):
                lr = learning_rate(inner, schedule_tokens(dilocos[index].tokens_seen, step * tokens_per_step,
                                                          last_swarm), recipe.total_tokens)
                inner_step(model, optimizers[index], next(batches[index]), torch.device(device), lr,
                           inner.grad_clip)
            to_send = feedback[index].compensate(dilocos[index].pseudo_gradient())
            payload = codec.encode(to_send)
            delivered.append((codec.decode(payload) if codec.name != "none" else to_send, len(payload)))
            feedback[index].update(to_send, delivered[-1][0])
        weight = inner_steps * tokens_per_step
        candidates = {f"w{i:04d}": Candidate(d.digest(), 1.0, False) for i, d in enumerate(dilocos)}
        groups = [[int(peer[1:]) for peer in group] for group in plan_groups(candidates, group_size, 1, round_no)]
        losses = []
        for group in groups:
            average = sum(delivered[i][0] for i in group) / len(group)  # equal weights: equal steps
            average, average_bytes = _through_reducers(codec, average, len(group))
            exact = 0  # bytes of params and momentum a mixing group averages besides, uncompressed both ways
            if len({dilocos[i].digest() for i in group}) > 1:
                state = sum(dilocos[i].flat_state() for i in group) / len(group)
                for i in group:
                    dilocos[i].load_flat_state(state)
                exact = 8 * dilocos[0].numel
            for i in group:
                dilocos[i].outer_step(average, weight * len(shards))  # each group counts the swarm's tokens
            back = None if average_bytes is None else average_bytes + exact
            sent = _allreduce_bytes(delivered[group[0]][1] + exact, len(group), back)
            result.bytes_per_worker += sent * len(group) / len(shards)
            losses.append(validation_loss(workers[group[0]], data.eval_batches, torch.device(device)))
        last_swarm = len(shards)
        result.tokens += weight * len(shards)
        result.val_losses.append(sum(losses) / len(losses))
        logger.info("groups of %d, M=%d round %d: val loss %.4f over %d groups", group_size, len(shards), round_no,
                    result.val_losses[-1], len(groups))
    return result


def _flat(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([p.detach().cpu().float().view(-1) for p in model.parameters()])


def _add_flat(model: torch.nn.Module, delta: torch.Tensor) -> None:
    with torch.no_grad():
        offset = 0
        for param in model.parameters():
            param.add_(delta[offset:offset + param.numel()].view_as(param).to(param.device, param.dtype))
            offset += param.numel()


def simulate_data_parallel(recipe: Recipe, data: RunData, shards: list[int], steps: int,
                           eval_every: int, device: str = "cpu") -> SimulationResult:
    """The baseline: gradients averaged every step, i.e. one model trained on the M workers' batches together."""
    model = build_model(recipe.model, data.vocab_size).to(device)
    inner = inner_for(recipe.inner, model)
    optimizer = make_inner_optimizer(model, inner)
    batches = [data.train.batches(shard, recipe.data.num_shards, recipe.data.batch_size, recipe.data.seed)
               for shard in shards]
    tokens_per_step = recipe.data.batch_size * recipe.data.seq_len * len(shards)
    params = sum(p.numel() for p in model.parameters())
    result = SimulationResult([p.detach() for p in model.parameters()])
    for step in range(steps):
        lr = learning_rate(inner, step * tokens_per_step, recipe.total_tokens)
        inner_step(model, optimizer, torch.cat([next(b) for b in batches]), torch.device(device), lr,
                   inner.grad_clip)
        result.bytes_per_worker += _allreduce_bytes(4 * params, len(shards))  # fp32 gradients every step
        result.tokens += tokens_per_step
        if (step + 1) % eval_every == 0:
            result.val_losses.append(validation_loss(model, data.eval_batches, torch.device(device)))
    return result


@dataclass
class PipelineResult(SimulationResult):
    activation_bytes: int = 0  # forward activations and backward gradients, all boundaries, all microbatches
    stage_microbatches: list[list[int]] = field(default_factory=list)  # per stage, per replica


def _stages_validation_loss(stages: list, batches: list[torch.Tensor], device: str) -> float:
    """The mean loss of the stages chained (each as it stands) on `batches`, as validation_loss of a whole model."""
    losses = []
    with torch.no_grad():
        for batch in batches:
            batch = batch.to(device)
            x = inputs = batch[:, :-1]
            for stage in stages:
                x = stage(x, inputs)
            losses.append(float(torch.nn.functional.cross_entropy(x.reshape(-1, x.shape[-1]).float(),
                                                                  batch[:, 1:].reshape(-1))))
    return sum(losses) / len(losses)


def simulate_pipeline(recipe: Recipe, data: RunData, shards: list[int], stages: int, rounds: int,
                      inner_steps: int, wire_codec: str = "fp16", codec_name: Optional[str] = None,
                      seed: int = 0, device: str = "cpu", reembed: bool = True) -> PipelineResult:
    """DiLoCo-SWARM: `stages` stages of the model (swarm.model.stages.even_bounds), each hosted by R = len(shards)
    replicas (R x stages peers). Each first-stage replica reads its data shard; every microbatch goes on to a
    replica of the next stage drawn at random (SWARM's stochastic wiring, equal throughputs), activations and
    their gradients through `wire_codec`, and each replica takes an AdamW step for every microbatch it took part
    in, clipping its own gradient to grad_clip / sqrt(stages) (a stage sees only its own). With several stages and
    the recipe's pipeline.schedule: stream, a first-stage replica's gradients come one step late, as a peer's
    stream of microbatches gives them (swarm/peer/pipeline/microbatches.py): its i-th batch of a round runs on its
    weights before its step i - 1 (the first two on the round's start). After `inner_steps` microbatches per first-stage
    replica, each stage's replicas average their pseudo-gradients (weighted by the tokens each processed, through
    the recipe's codec with error feedback) and that stage takes its outer step.
    With the recipe's pipeline.bottleneck, each boundary carries that many values a token (swarm/model/stages.py;
    `reembed` False: the stage after it does not embed the token ids again, for the benchmark's comparison).
    Validation uses the stages' global params together (no wire codec: the values as computed).
    `activation_bytes` counts every boundary crossing."""
    from torch.func import functional_call

    from swarm.model.stages import WireStats, even_bounds, make_stages, run_pipeline

    codec, wire = get_codec(codec_name or recipe.averaging.codec), get_codec(wire_codec)
    replicas = len(shards)
    models = [build_model(recipe.model, data.vocab_size).to(device) for _ in shards]
    inner = inner_for(recipe.inner, models[0])
    bounds = even_bounds(n_blocks(models[0]), stages)
    hosted = [make_stages(model, bounds, recipe.pipeline.bottleneck, recipe.model.seed, reembed)
              for model in models]  # hosted[r][s]: stage s of replica r's model
    dilocos = [DiLoCo(hosted[0][s], recipe.outer) for s in range(stages)]  # replica 0 holds each stage's globals
    optimizers = [[make_inner_optimizer(hosted[r][s], inner) for s in range(stages)] for r in range(replicas)]
    feedback = [[ErrorFeedback(codec.error_feedback, codec.feedback_decay) for _ in range(stages)]
                for _ in range(replicas)]
    batches = [data.train.batches(shard, recipe.data.num_shards, recipe.data.batch_size, recipe.data.seed)
               for shard in shards]
    wiring = torch.Generator().manual_seed(seed)
    tokens_per_step = recipe.data.batch_size * recipe.data.seq_len
    clip = inner.grad_clip / stages ** 0.5
    result = PipelineResult([p for d in dilocos for p in d.global_params])
    stats = WireStats()
    for round_no in range(rounds):
        for s in range(stages):
            for r in range(1, replicas):  # replica 0's stage params are the globals after the outer step
                with torch.no_grad():
                    for local, global_ in zip(hosted[r][s].parameters(), dilocos[s].global_params):
                        local.copy_(global_)
        processed = [[0] * replicas for _ in range(stages)]
        stashed: list[Optional[dict]] = [None] * replicas  # each first stage's weights before its last step
        for step in range(inner_steps):
            lr = learning_rate(inner, schedule_tokens(dilocos[0].tokens_seen, step * tokens_per_step,
                                                      replicas if round_no else 1), recipe.total_tokens)
            for first in range(replicas):
                path = [first] + [int(torch.randint(replicas, (1,), generator=wiring)) for _ in range(stages - 1)]
                pipeline = [hosted[r][s] for s, r in enumerate(path)]
                head, weights = hosted[first][0], None
                if stages > 1 and recipe.pipeline.schedule == "stream":  # forward on the weights before its last step
                    weights = {name: (param if stashed[first] is None else stashed[first][name]).detach().clone()
                               .requires_grad_(True) for name, param in head.named_parameters()}
                    pipeline[0] = lambda x, ids, head=head, weights=weights: functional_call(head, weights, (x, ids))
                run_pipeline(pipeline, next(batches[first]).to(device), wire, stats)
                if weights is not None:
                    stashed[first] = {name: param.detach().clone() for name, param in head.named_parameters()}
                    for name, param in head.named_parameters():
                        param.grad = weights[name].grad
                for s, r in enumerate(path):
                    optimizer = optimizers[r][s]
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                    torch.nn.utils.clip_grad_norm_(hosted[r][s].parameters(), clip)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    processed[s][r] += tokens_per_step
        for s in range(stages):
            contributions, weights = [], []
            for r in range(replicas):
                if not processed[s][r]:
                    continue  # took no microbatch this round: nothing to average
                with torch.no_grad():
                    pseudo = torch.cat([(g - l.detach().cpu().float()).view(-1)
                                        for g, l in zip(dilocos[s].global_params, hosted[r][s].parameters())])
                to_send = feedback[r][s].compensate(pseudo)
                delivered = codec.decode(codec.encode(to_send)) if codec.name != "none" else to_send
                feedback[r][s].update(to_send, delivered)
                contributions.append(delivered)
                weights.append(processed[s][r])
            average, total = aggregate_parts(recipe.averaging.aggregator, contributions, weights,
                                             [1.0] * len(contributions), codec.alignment())
            average = _through_reducers(codec, average, len(contributions))[0]
            dilocos[s].outer_step(average, int(total))
        result.stage_microbatches.append([[n // tokens_per_step for n in row] for row in processed])
        result.tokens += sum(processed[0])
        result.val_losses.append(_stages_validation_loss(hosted[0], data.eval_batches, device))
        logger.info("pipeline %d stages x %d replicas, round %d: val loss %.4f", stages, replicas, round_no,
                    result.val_losses[-1])
    result.activation_bytes = stats.forward_bytes + stats.backward_bytes
    return result
