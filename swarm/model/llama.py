"""The Llama-style causal LM that a recipe's own model fields describe, built without transformers: importing
transformers' model code costs a peer process seconds and about 110 MB before it trains, which every peer, `doctor`
and every test's peers paid. Same parameter names, seeded initialisation and forward as transformers'
LlamaForCausalLM of the same config, bit for bit on the CPU (tests/test_model.py builds both and compares), so
checkpoints and states pass between the two. Other families still come from a transformers config.json (build.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["LlamaConfig", "LlamaForCausalLM"]


@dataclass
class LlamaConfig:
    """The fields transformers' LlamaConfig would hold for a recipe (its defaults where the recipe says nothing);
    one key-value head per attention head."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def get_text_config(self) -> "LlamaConfig":
        return self


class ModelOutput(NamedTuple):
    last_hidden_state: torch.Tensor


class CausalLMOutput(NamedTuple):
    logits: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """On the CPU even in a model built on the meta device: torch computes arange on meta in Python reference code
    whose first call imports torch._dynamo (2-3 s of CPU; swarm.model.build._NoInitOnMeta)."""
    dim = config.head_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))


class RotaryEmbedding(nn.Module):
    """cos and sin of each position's rotation (shape (1, seq, head_dim)), in the hidden states' dtype."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = config.head_dim
        width = config.num_attention_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[:2]
        shape = (batch, seq, -1, self.head_dim)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=self.head_dim ** -0.5, is_causal=seq > 1)
        return self.o_proj(out.transpose(1, 2).contiguous().reshape(batch, seq, -1).contiguous())


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.recompute = False  # keep the input alone and compute the rest again in the backward pass

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder blocks and final norm. A pipeline stage runs a shallow copy of it whose block list is its
    own slice, whose embedding is None (it is fed `inputs_embeds`) and whose norm may be an Identity
    (swarm.model.stages.Stage)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                use_cache: bool = False) -> ModelOutput:  # (use_cache: transformers' signature; nothing is cached)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        cos, sin = self.rotary_emb(x, positions)
        for layer in self.layers:
            if layer.recompute and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return ModelOutput(self.norm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        if config.tie_word_embeddings:
            raise ValueError("swarm's Llama keeps its head apart from its embedding (tie_word_embeddings: false)")
        self.config = config
        self.model = LlamaModel(config)
        self._init_model()  # (before the head exists: transformers draws the seeded init in this order)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.lm_head.weight.device.type != "meta":
            self._init_weights(self.lm_head)

    def _init_model(self) -> None:
        if self.model.embed_tokens.weight.device.type == "meta":
            return  # shapes only (a pipeline stage initialises its own part: swarm.model.stages.materialize)
        for module in _post_order(self.model):
            self._init_weights(module)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """One module's initialisation, drawn from the global RNG as transformers' `_init_weights` draws it."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, RotaryEmbedding):
            module.inv_freq.copy_(inverse_frequencies(self.config))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def activation_checkpointing_enable(self, kwargs: dict | None = None) -> None:
        """Every block keeps its input alone and recomputes the rest in the backward pass (always non-reentrant)."""
        for layer in self.model.layers:
            layer.recompute = True

    def forward(self, input_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> CausalLMOutput:
        hidden = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds).last_hidden_state
        return CausalLMOutput(self.lm_head(hidden))


def _post_order(module: nn.Module):
    """Children before their parent, in declaration order (transformers' `smart_apply`)."""
    for child in module.children():
        yield from _post_order(child)
    yield module
