"""Model construction and block addressing, apart from how the model is trained or distributed.

Builds a causal LM from the recipe (Llama-style from its fields, swarm.model.llama, or any family transformers
builds from a local config.json; never downloads weights) with a seeded initialisation, so every peer of a fresh run
starts from the same parameters; `block_map` finds its embeddings, decoder blocks and head whatever the family names
them. transformers is imported only for a config.json: its model code takes seconds to import.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from swarm.config import ModelRecipe, RecipeError
from swarm.model.device import autocast
from swarm.model.llama import LlamaConfig, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def model_config(recipe: ModelRecipe, vocab_size: int) -> LlamaConfig | PretrainedConfig:
    """The config the recipe describes, with the tokenizer's vocabulary size: swarm's Llama config from its fields,
    or the transformers config its config_file holds."""
    if recipe.config_file:
        from transformers import AutoConfig

        path = Path(recipe.config_file)
        if not path.is_file():
            raise RecipeError(f"model.config_file {path} does not exist: give a path to a transformers config.json")
        config = AutoConfig.from_pretrained(str(path.parent if path.name == "config.json" else path),
                                            local_files_only=True)
        if getattr(config, "vocab_size", vocab_size) < vocab_size:
            raise RecipeError(f"model.config_file vocab_size {config.vocab_size} is smaller than the tokenizer's "
                              f"{vocab_size}")
        return config
    return LlamaConfig(vocab_size=vocab_size, hidden_size=recipe.hidden_size,
                       intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_layers,
                       num_attention_heads=recipe.num_heads, max_position_embeddings=recipe.max_seq_len)


def build_model(recipe: ModelRecipe, vocab_size: int, meta: bool = False, recompute: bool = False) -> torch.nn.Module:
    """A freshly initialised model on the CPU in fp32; identical on every peer for the same recipe. With `meta`, on
    the meta device instead: shapes only, nothing allocated (a pipeline stage then allocates and initialises its own
    part alone, swarm.model.stages.materialize). `recompute`: each block keeps its input alone and recomputes the
    rest in the backward pass (gradient checkpointing, done by the blocks themselves, so a pipeline
    stage calling them does it too): the same gradients for less memory and more compute."""
    config = model_config(recipe, vocab_size)
    on_meta = contextlib.ExitStack()
    if meta:
        on_meta.enter_context(torch.device("meta"))
        on_meta.enter_context(_NoInitOnMeta())
    with torch.random.fork_rng(devices=[]), on_meta:
        torch.manual_seed(recipe.seed)
        if isinstance(config, LlamaConfig):
            model = LlamaForCausalLM(config)
        else:
            import transformers

            if isinstance(config, transformers.LlamaConfig):
                model = transformers.LlamaForCausalLM(config)
            else:
                model = transformers.AutoModelForCausalLM.from_config(config)
    if recompute:
        model.config.use_cache = False  # (a cache is for generation; transformers warns of it under checkpointing)
        model.activation_checkpointing_enable({"use_reentrant": False})
    return model.float()


class _NoInitOnMeta(TorchFunctionMode):
    """Skips the initialisation of meta tensors (torch.nn.init's functions and a tensor's random fills), which hold
    no values: torch runs its random fills on meta in Python reference code whose first call imports torch._dynamo,
    2-3 s of CPU in every process that counts a model's parameters (swarm.model.memory) or cuts it into stages
    (swarm.model.stages.materialize initialises the real tensors)."""

    SKIPPED = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.random_, torch.Tensor.exponential_,
               torch.Tensor.bernoulli_, torch.Tensor.log_normal_, torch.Tensor.geometric_, torch.Tensor.cauchy_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SKIPPED or getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")  # (torch.nn.init's functions pass it by name)
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def hidden_size(model: torch.nn.Module) -> int:
    """The width of a built model's residual stream (its config's hidden_size: transformers maps GPT-2's n_embd and
    OPT's onto it), which sizes the recipe's default inner lr (InnerRecipe.peak_lr)."""
    return int(model.config.hidden_size)


def module_seed(seed: int, path: str) -> int:
    """The seed of one module's initialisation in a model built part by part: the recipe's seed and the module's
    path in the whole model, so a block gets the same params whichever stage holds it."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{path}".encode()).digest()[:8], "little")


@dataclass(frozen=True)
class BlockMap:
    """Where a causal LM keeps its parts, by dotted module path: `blocks_path` is the list of decoder blocks
    (Llama "model.layers", GPT-2 "transformer.h", GPT-NeoX "gpt_neox.layers", OPT "model.decoder.layers");
    `inputs` are the modules applied before block 0 (token and position embeddings), `outputs` those after the last
    block (final norm, LM head). Every parameter lies under exactly one of these paths (a head tied to the token
    embedding is listed in `outputs` but holds no parameter of its own), so block ranges can be sliced by path."""

    blocks_path: str
    blocks: torch.nn.ModuleList
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def block_map(model: torch.nn.Module) -> BlockMap:
    """The model's BlockMap, found generically: the blocks are the one ModuleList whose length is the config's
    num_hidden_layers (the shallowest, if several); the block list's siblings that hold parameters are inputs if a
    one-token forward pass calls them before block 0 and outputs otherwise (declaration order is no guide: OPT
    declares its final norm first); the output embedding (`get_output_embeddings`) is an output. The probe runs in
    eval mode under a forked RNG, so it changes neither the model nor the random state. Raises RecipeError naming
    the model class when no such list exists or a parameter lies outside every part. swarm's own Llama declares
    its map (the same: tests/test_model.py), so building one on the meta device runs no forward pass there (torch
    runs meta ops in Python reference code whose first call imports torch._dynamo, 2-3 s of CPU a process)."""
    if type(model) is LlamaForCausalLM:
        return BlockMap("model.layers", model.model.layers, ("model.embed_tokens",), ("model.norm", "lm_head"))
    return probed_block_map(model)


def probed_block_map(model: torch.nn.Module) -> BlockMap:
    """block_map as found by probing the model, whatever its class."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    n_layers = getattr(config.get_text_config() if config is not None else None, "num_hidden_layers", None)
    lists = [(path, module) for path, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList) and n_layers and len(module) == n_layers
             and len({type(block) for block in module}) == 1]
    if not lists:
        raise RecipeError(f"cannot find the decoder blocks of {name} (no list of {n_layers} identical layers): "
                          f"use a causal-LM family with a decoder layer list (Llama, GPT-2, GPT-NeoX, OPT, ...)")
    blocks_path, blocks = min(lists, key=lambda item: item[0].count("."))
    parent_path, _, attr = blocks_path.rpartition(".")
    siblings = [(f"{parent_path}.{child_name}".lstrip("."), child)
                for child_name, child in model.get_submodule(parent_path).named_children()
                if child_name != attr and any(True for _ in child.parameters())]
    called = _call_order(model, [blocks[0]] + [child for _, child in siblings])
    first_block = called.get(id(blocks[0]), -1)
    inputs = [path for path, child in siblings if called.get(id(child), first_block + 1) < first_block]
    outputs = [path for path, _ in siblings if path not in inputs]
    head = model.get_output_embeddings()
    for path, module in model.named_modules():
        if module is head and path not in outputs:
            outputs.append(path)
    parts = (blocks_path, *inputs, *outputs)
    for param_name, _ in model.named_parameters():
        if not any(param_name.startswith(part + ".") for part in parts):
            raise RecipeError(f"cannot map parameter {param_name} of {name} to its embeddings, blocks or head: "
                              f"this model family is not supported")
    return BlockMap(blocks_path, blocks, tuple(inputs), tuple(outputs))


def _call_order(model: torch.nn.Module, modules: list[torch.nn.Module]) -> dict[int, int]:
    """id(module) -> the position of its first call in a one-token forward pass, for those of `modules` it calls."""
    order: dict[int, int] = {}

    def record(module: torch.nn.Module, args: object) -> None:  # a pre-hook that returned a value would replace args
        order.setdefault(id(module), len(order))

    hooks = [module.register_forward_pre_hook(record) for module in modules]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            device = next(model.parameters()).device
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device))
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return order


def blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks, addressable by index (see block_map)."""
    return block_map(model).blocks


def n_blocks(model: torch.nn.Module) -> int:
    return len(blocks(model))


def lm_loss(model: torch.nn.Module, batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Mean next-token cross-entropy of a (batch, seq_len + 1) token tensor."""
    batch = batch.to(device, non_blocking=True)
    with autocast(device):
        logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
