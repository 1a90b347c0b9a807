"""What training a recipe's model needs in memory (estimates, in bytes), whole or cut into pipeline stages, and
the number of stages a recipe of `pipeline.stages: auto` gets: read by the checks of `doctor` and `join`, the
bootstrap (which resolves `auto` before it publishes) and a stage peer choosing its stage."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from swarm.compression import get_codec
from swarm.config import Recipe, RecipeError
from swarm.data.paths import local_files
from swarm.model.build import build_model, n_blocks
from swarm.model.stages import Stage, even_bounds


@dataclass(frozen=True)
class Needs:
    """What a peer of a recipe needs, in bytes (estimates)."""

    params: int
    checkpoint: int  # one checkpoint: global params and outer momentum (+ error feedback), fp32
    host: int  # the CPU's share: global state, replay log, all-reduce buffers (+ training on a CPU device)
    device: int  # training on a GPU: weights, gradients, AdamW moments, activations


def estimate_needs(recipe: Recipe, device: str, replay_log_mb: Optional[float], recompute: bool = False,
                   outer_on_disk: bool = False) -> Needs:
    """Counts the model's parameters on the meta device (nothing allocated). The host holds the global params and
    outer momentum and the replay log (with `outer_on_disk`, --outer-state-dir, a fragment's outer state at a time
    and no log: it is on disk), error feedback's residual (for the codecs that keep one), and a sync's buffers (its
    fragment's pseudo-gradient and average); `recompute`: the peer recomputes activations in the backward pass.
    Raises RecipeError for a model the recipe cannot build."""
    n = sum(params for params, _, _ in part_params(recipe))
    training = training_bytes(recipe, n, recipe.model.num_layers, last=True, recompute=recompute)
    replay = int(recipe.averaging.replay_bytes_per_param * n) if replay_log_mb is None else int(replay_log_mb * 1e6)
    residual = 4 * n if get_codec(recipe.averaging.codec).error_feedback else 0
    outer, replay = (8 * n // recipe.outer.fragments, 0) if outer_on_disk else (8 * n, replay)
    host = outer + replay + residual + 8 * n // recipe.outer.fragments + (training if device == "cpu" else 0)
    return Needs(n, 8 * n + residual, host, training if device != "cpu" else 0)


def part_params(recipe: Recipe, model=None) -> list[tuple[int, int, bool]]:
    """(parameters, blocks, whether it holds the head) of each pipeline stage of the recipe's model (one entry for
    a whole-model run): of `model`, or of one built on the meta device."""
    if model is None:
        model = build_model(recipe.model, recipe.data.vocab_size, meta=True)
    blocks = n_blocks(model)
    if recipe.pipeline.stages == 1:
        return [(sum(p.numel() for p in model.parameters()), blocks, True)]
    return [(sum(p.numel() for p in Stage(model, a, b, recipe.pipeline.bottleneck).parameters()), b - a, b == blocks)
            for a, b in even_bounds(blocks, recipe.pipeline.stages)]


def stage_costs(recipe: Recipe, model, parts: list[tuple[int, int, bool]]) -> list[int]:
    """Each stage's work a token (of part_params' `parts` of `model`), counted in its parameters but its token
    embedding's, a lookup of no work: the first stage's, and with a bottleneck every later stage's own."""
    embedding = model.get_input_embeddings().weight.numel()
    return [params - (embedding if k == 0 or recipe.pipeline.bottleneck else 0) for k, (params, *_) in enumerate(parts)]


def stage_needs(recipe: Recipe, model=None, parts: Optional[list[tuple[int, int, bool]]] = None) -> list[int]:
    """The memory to train each pipeline stage (one entry for a whole-model run; `parts`: part_params, if known):
    training_bytes, plus on every stage of a pipeline but the last the copies of its weights that its microbatches
    in flight keep (swarm/peer/pipeline/microbatches.py on the first: two batches in flight, each on the weights it
    started with; relay.py on a middle one: two generations; one of each with `schedule: flush`, which has one batch
    in flight; a last stage none)."""
    parts = part_params(recipe, model) if parts is None else parts
    copies = 2 if recipe.pipeline.schedule == "stream" else 1
    return [training_bytes(recipe, *part) + (4 * copies * part[0] if k < len(parts) - 1 else 0)
            for k, part in enumerate(parts)]


def resolve_stages(recipe: Recipe, data_dir: str | Path) -> Recipe:
    """`recipe` with `pipeline.stages: auto` made a number: the fewest even stages each of which trains within
    `pipeline.stage_memory` MB as stage_needs estimates (1, the whole model, when it fits), the model built on the
    meta device from the recipe (a `config_file` read inside `data_dir`). A recipe with a number is returned as it
    is. Raises RecipeError, saying what to do, when even one block a stage does not fit."""
    if recipe.pipeline.stages != "auto":
        return recipe
    here = recipe.model_copy(update={"model": local_files(recipe, data_dir)[2]})
    blocks = n_blocks(build_model(here.model, recipe.data.vocab_size, meta=True))
    limit = int(recipe.pipeline.stage_memory * 1e6)
    for stages in range(1, blocks + 1):
        pipeline = recipe.pipeline.model_copy(update={"stages": stages})
        needs = stage_needs(here.model_copy(update={"pipeline": pipeline}))
        if max(needs) <= limit:
            return recipe.model_copy(update={"pipeline": pipeline})
    raise RecipeError(f"pipeline.stages: auto: even one block a stage needs about {fmt_bytes(max(needs))} to train, "
                      f"over pipeline.stage_memory {fmt_bytes(limit)}: raise stage_memory, or train a smaller model")


def training_bytes(recipe: Recipe, params: int, layers: int, last: bool, recompute: bool = False) -> int:
    """Memory to train `params` parameters in `layers` blocks (and the LM head's logits when `last`): fp32 weights
    and gradients, AdamW's two moments, and one microbatch's activations (`recompute`: each block's input kept, one
    block's activations live at a time)."""
    d, m = recipe.data, recipe.model
    per_block = 34 * m.hidden_size + 5 * m.num_heads * d.seq_len
    kept = layers * m.hidden_size + per_block if recompute else layers * per_block
    return 16 * params + 4 * d.batch_size * d.seq_len * (kept + (3 * d.vocab_size if last else 0))


def fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
