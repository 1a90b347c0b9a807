"""A causal LM cut into pipeline stages: stage [start, end) holds decoder blocks start..end-1, plus the input
embedding on the first stage and the final norm and LM head on the last. A stage's forward takes token ids (first
stage) or the previous stage's hidden states and returns hidden states, or logits on the last stage; chained, the
stages compute exactly what the whole model computes.

A stage runs its family's own base-model forward on its slice of the block list, fed the incoming hidden states as
`inputs_embeds`, so attention masks and rotary position embeddings are made as the family makes them. That is
exact for families whose base model hands `inputs_embeds` straight to block 0 (rotary positions: Llama, Mistral,
Qwen2, OLMo, GPT-NeoX/Pythia, ...); families that add learned position embeddings to them (GPT-2, OPT) would add
them again at every stage, and are refused with one line. A model whose head is tied to its input embedding is
refused too: the first and the last stage would each train their own copy.

With `pipeline.bottleneck: r` a boundary carries r values a token instead of the hidden size's (after ResBM, arXiv
2604.11947): the stage before it ends with a linear encoder (hidden -> r), the stage after it starts with a linear
decoder (r -> hidden) and adds its own embedding of the token ids, which travel with every microbatch anyway, so
the token's identity need not squeeze through the r values (as Protocol Models, arXiv 2506.01260, keep the token
embeddings out of their subspace). These modules are parameters of their stages like any other: trained end to end
by the stages' backward passes, averaged by each stage's DiLoCo. The cut model is then not the whole model (its
stages compute something else than the uncut model would), so it is a choice of the run's owner, in the recipe.

The activations between stages travel through a codec (swarm.compression), forward and backward: `run_pipeline`
is one training step of a whole pipeline with that wire in the middle, for the benchmark and the tests.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarm.compression import Codec, decode
from swarm import config
from swarm.config import RecipeError
from swarm.model.build import block_map, module_seed

__all__ = ["Stage", "StageError", "WireStats", "even_bounds", "make_stages", "materialize", "run_pipeline"]


class StageError(RecipeError):
    """A model that cannot be cut into stages; the message names the class and why."""


def even_bounds(n_blocks: int, stages: int) -> list[tuple[int, int]]:
    """swarm.config.even_bounds (which the monitoring reads too), raising StageError."""
    try:
        return config.even_bounds(n_blocks, stages)
    except ValueError as e:
        raise StageError(str(e)) from None


class Stage(torch.nn.Module):
    """Blocks [start, end) of `model` (sharing its parameters), with its embedding if start == 0 and its final norm
    and head if end == n_blocks; with a `bottleneck`, the boundary modules of its side of each of its boundaries
    (an encoder if it is not the last, a decoder and, with `reembed`, a token embedding if it is not the first),
    initialised from `seed` unless built on the meta device (materialize does it there). `parameters()` are the
    stage's own."""

    def __init__(self, model: torch.nn.Module, start: int, end: int, bottleneck: int = 0, seed: int = 0,
                 reembed: bool = True):
        super().__init__()
        name = type(model).__name__
        parts = block_map(model)
        n_blocks = len(parts.blocks)
        if not 0 <= start < end <= n_blocks:
            raise StageError(f"stage [{start}, {end}) is outside the {n_blocks} blocks of {name}")
        embedding = model.get_input_embeddings()
        head = model.get_output_embeddings()
        base_path, _, blocks_attr = parts.blocks_path.rpartition(".")
        embedding_paths = [p for p in parts.inputs if model.get_submodule(p) is embedding]
        if list(parts.inputs) != embedding_paths and (start > 0 or end < n_blocks):
            others = ", ".join(p for p in parts.inputs if p not in embedding_paths)
            raise StageError(f"{name} adds {others} to its embeddings before the first block (learned positions): "
                             f"only families whose blocks take the embeddings as they are (Llama, Mistral, Qwen2, "
                             f"OLMo, GPT-NeoX, ...) can be cut into stages")
        if head is not None and head.weight is embedding.weight and (start > 0 or end < n_blocks):
            raise StageError(f"{name} ties its head to its input embedding: pipeline stages need untied weights "
                             f"(tie_word_embeddings: false)")
        base = model.get_submodule(base_path) if base_path else model
        self.start, self.end, self.n_blocks = start, end, n_blocks
        self.first, self.last = start == 0, end == n_blocks
        # The base model's forward on our blocks only: a shallow copy whose child modules we choose. Children of
        # the base that we do not host become None (the forward skips the embedding when given inputs_embeds) or
        # Identity (a final norm a middle stage must not apply).
        stage_base = copy.copy(base)
        stage_base._modules = dict(base._modules)
        stage_base._modules[blocks_attr] = torch.nn.ModuleList(list(parts.blocks)[start:end])
        for path in (*parts.inputs, *parts.outputs):
            parent, _, attr = path.rpartition(".")
            if parent != base_path:
                continue  # the head, outside the base model
            if path in parts.inputs and not self.first:
                stage_base._modules[attr] = None
            elif path in parts.outputs and not self.last:
                stage_base._modules[attr] = torch.nn.Identity()
        stage_base.config = copy.copy(base.config)
        stage_base.config.num_hidden_layers = end - start
        self.body = stage_base
        self.head = head if self.last else None
        self.bottleneck = bottleneck
        hidden = int(model.config.hidden_size)
        if bottleneck and not 0 < bottleneck < hidden:
            raise StageError(f"pipeline.bottleneck {bottleneck} is not under the hidden size {hidden}: give a "
                             f"narrower one (a quarter of it, {hidden // 4}, sends 4x fewer values), or 0 for none")
        on = dict(device=embedding.weight.device)
        # The boundary modules (swarm/model/stages.py's docstring): ours alone, trained and averaged with the stage.
        self.encode = torch.nn.Linear(hidden, bottleneck, bias=False, **on) if bottleneck and not self.last else None
        self.decode = torch.nn.Linear(bottleneck, hidden, bias=False, **on) if bottleneck and not self.first else None
        self.embed = torch.nn.Embedding(embedding.num_embeddings, hidden, **on) \
            if bottleneck and reembed and not self.first else None
        if embedding.weight.device.type != "meta":
            self.init_boundaries(seed)

    def init_boundaries(self, seed: int) -> None:
        """Initialise the boundary modules from the recipe's `seed`, the same on every peer: a boundary's encoder (the
        stage before it) and decoder (the stage after) start as Q^T and Q for one orthonormal Q (hidden x bottleneck)
        drawn from the boundary's seed, so at first the pair passes on the projection of the residual stream onto Q's
        columns (the low-rank identity path); the token embedding is drawn as the family draws its own (normal, std
        initializer_range)."""
        for module, cut, transpose in ((self.encode, self.end, True), (self.decode, self.start, False)):
            if module is None:
                continue
            generator = torch.Generator().manual_seed(module_seed(seed, f"bottleneck@{cut}"))
            q, _ = torch.linalg.qr(torch.randn(max(module.weight.shape), self.bottleneck, generator=generator))
            with torch.no_grad():
                module.weight.copy_(q.T if transpose else q)
        if self.embed is not None:
            generator = torch.Generator().manual_seed(module_seed(seed, f"embed@{self.start}"))
            std = float(getattr(self.body.config, "initializer_range", 0.02))
            with torch.no_grad():
                self.embed.weight.copy_(torch.randn(self.embed.weight.shape, generator=generator) * std)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (first stage) or what the stage before sent -> what the next stage takes (hidden states, or
        their bottleneck code), or logits (last stage). `ids`: the microbatch's input token ids (b, t), which a
        stage after a bottleneck embeds again (and without which it raises StageError)."""
        if self.first:
            hidden = self.body(input_ids=x, use_cache=False).last_hidden_state
        else:
            if self.decode is not None:
                x = self.decode(x)
            if self.embed is not None:
                if ids is None or ids.shape != x.shape[:2]:
                    raise StageError(f"stage [{self.start}, {self.end}) embeds the token ids again after the "
                                     f"bottleneck: give the microbatch's input ids, shape {tuple(x.shape[:2])}")
                x = x + self.embed(ids)
            hidden = self.body(inputs_embeds=x, use_cache=False).last_hidden_state
        if self.last:
            return self.head(hidden)
        return self.encode(hidden) if self.encode is not None else hidden


def materialize(model: torch.nn.Module, stage: Stage, seed: int, device: torch.device | str = "cpu") -> None:
    """Allocate `stage`'s params and buffers (of `model`, typically built on the meta device, so that the other
    stages' weights never exist here) and initialise them as the model's family does (`_init_weights`), each module
    from its own seed (swarm.model.build.module_seed), on the CPU so every peer gets the same bits, then move them to
    `device`. The stage's init is therefore not the whole model's seeded one (that draws every module in turn from
    one stream, so a stage's share of it needs the whole model built), but the same on every peer for the recipe.
    Raises StageError naming a parameter that the family's init leaves unset."""
    stage.to_empty(device="cpu")  # (a shallow copy of the base model shares its parameter dicts: same tensors)
    owners = {}  # id of a param or buffer -> the module of `model` holding it, and that module's path
    for path, module in model.named_modules():
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            owners.setdefault(id(tensor), (path, module))
    tensors = [*stage.named_parameters(), *stage.named_buffers()]
    with torch.no_grad():
        for _, tensor in tensors:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))  # so a tensor the init skips is seen
            if hasattr(tensor, "_is_hf_initialized"):  # (transformers' init functions skip tensors marked done)
                del tensor._is_hf_initialized
    done = set()
    for _, tensor in tensors:
        path, module = owners.get(id(tensor), (None, None))
        if module is None or path in done:
            continue
        done.add(path)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(module_seed(seed, path))
            model._init_weights(module)
    stage.init_boundaries(seed)
    unset = [name for name, tensor in tensors if tensor.is_floating_point() and torch.isnan(tensor).any()]
    if unset:
        raise StageError(f"{type(model).__name__}'s init leaves {unset[0]} unset when a stage is built alone: this "
                         "model family cannot be cut into stages yet")
    stage.to(device)


def make_stages(model: torch.nn.Module, bounds: Sequence[tuple[int, int]], bottleneck: int = 0, seed: int = 0,
                reembed: bool = True) -> list[Stage]:
    """The stages of `model` for consecutive `bounds` covering all its blocks (see even_bounds), with a
    `bottleneck` at each boundary (Stage; 0: none) initialised from `seed` (the recipe's model seed)."""
    stages = [Stage(model, start, end, bottleneck, seed, reembed) for start, end in bounds]
    if stages[0].start != 0 or stages[-1].end != stages[-1].n_blocks or \
            any(a.end != b.start for a, b in zip(stages, stages[1:])):
        raise StageError(f"stage bounds {list(bounds)} do not cover the blocks one after another")
    return stages


@dataclass
class WireStats:
    """What crossed the stage boundaries: bytes forward (activations) and backward (their gradients)."""

    forward_bytes: int = 0
    backward_bytes: int = 0


def run_pipeline(stages: Sequence[Stage], batch: torch.Tensor, codec: Codec, stats: WireStats) -> torch.Tensor:
    """Forward and backward of one batch (int64, shape (b, seq_len + 1)) through `stages` as peers run them: each
    boundary's activations are sent through `codec` and arrive as a leaf tensor; the last stage's loss is
    backpropagated there, and each boundary's input gradient goes back through `codec` into the stage before.
    Leaves the gradients in each stage's parameters and returns the loss (detached)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    sent: list[torch.Tensor] = []  # each stage's output, as it computed it (for its backward)
    received: list[torch.Tensor] = []  # what the next stage got: decoded, a leaf that collects its gradient
    x = inputs
    for index, stage in enumerate(stages):
        out = stage(x, inputs)
        if index == len(stages) - 1:
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), targets.reshape(-1))
            break
        payload = codec.encode(out.detach().float().reshape(-1))
        stats.forward_bytes += len(payload)
        x = _decode_like(payload, out).requires_grad_(True)
        sent.append(out)
        received.append(x)
    loss.backward()
    for out, arrived in zip(reversed(sent), reversed(received)):
        payload = codec.encode(arrived.grad.float().reshape(-1))
        stats.backward_bytes += len(payload)
        out.backward(_decode_like(payload, out))
    return loss.detach()


def _decode_like(payload: bytes, like: torch.Tensor) -> torch.Tensor:
    return decode(payload).reshape(like.shape).to(like.dtype)
