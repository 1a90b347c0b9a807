"""Model construction and block addressing, apart from how the model is trained or distributed.

Builds a Llama-style causal LM from the recipe (never downloads weights) with a seeded, device-independent
initialisation, so every peer of a fresh run starts from the same parameters.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PretrainedConfig

from swarm.config import ModelRecipe, RecipeError


def model_config(recipe: ModelRecipe, vocab_size: int) -> PretrainedConfig:
    """The transformers config the recipe describes, with the tokenizer's vocabulary size."""
    if recipe.config_file:
        path = Path(recipe.config_file)
        if not path.is_file():
            raise RecipeError(f"model.config_file {path} does not exist: give a path to a transformers config.json")
        config = AutoConfig.from_pretrained(str(path.parent if path.name == "config.json" else path),
                                            local_files_only=True)
        if getattr(config, "vocab_size", vocab_size) < vocab_size:
            raise RecipeError(f"model.config_file vocab_size {config.vocab_size} is smaller than the tokenizer's "
                              f"{vocab_size}")
        return config
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=recipe.max_seq_len,
        tie_word_embeddings=False,
    )


def build_model(recipe: ModelRecipe, vocab_size: int) -> torch.nn.Module:
    """A freshly initialised model on the CPU in fp32; identical on every peer for the same recipe."""
    config = model_config(recipe, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        if isinstance(config, LlamaConfig):
            model = LlamaForCausalLM(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
    return model.float()


def blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer blocks, addressable by index (`model.model.layers`)."""
    return model.model.layers


def n_blocks(model: torch.nn.Module) -> int:
    return len(blocks(model))


def state_digest(params: list[torch.Tensor], momenta: list[Optional[torch.Tensor]], round_no: int) -> str:
    """sha256 (first 16 hex digits) of the outer round, the raw bytes of `params`, then those of their outer
    momentum buffers (None, no buffer yet, counts as zeros: torch's SGD treats the two the same): equal iff the two
    states are of the same round and bit-identical, and so take the same next outer step."""
    digest = hashlib.sha256(int(round_no).to_bytes(8, "little"))
    for tensor in params:
        digest.update(_raw(tensor))
    for param, momentum in zip(params, momenta, strict=True):
        digest.update(bytes(param.numel() * param.element_size()) if momentum is None else _raw(momentum))
    return digest.hexdigest()[:16]


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
