"""What a tokenizer is to the swarm: its digest (`tokenizer_digest`: peers with equal digests produce equal ids),
and a tokenizer.json loaded by `tokenizers` alone (`JsonTokenizer`): the trained "bpe" tokenizer of a run, and the
run's shared dataset's tokenizer as a peer loads it. transformers, which takes a second and more to import in
every peer process, is needed only for a tokenizer directory a recipe names (swarm.data.prepare.load_tokenizer)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import tokenizers
from tokenizers import processors

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


class JsonTokenizer:
    """A tokenizer.json with its eos and pad tokens, as a peer needs it: its size, digest, ids and text. A shared
    dataset's file holds the tokenizer as transformers set it up on the run owner's machine (its post-processor
    included), so it encodes as the owner's does, and `tokenizer_digest` reads it as it reads the owner's."""

    def __init__(self, backend: tokenizers.Tokenizer, eos_token: str, pad_token: str):
        self.backend_tokenizer, self.eos_token, self.pad_token = backend, eos_token, pad_token

    @classmethod
    def from_file(cls, path: str | Path, eos_token: str, pad_token: str) -> JsonTokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)), eos_token, pad_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.backend_tokenizer.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.backend_tokenizer.token_to_id(self.pad_token)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend_tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend_tokenizer.decode(ids)


def trained_bpe(path: str | Path, eos_token: str) -> JsonTokenizer:
    """The trained "bpe" tokenizer in `path`, set up as transformers' PreTrainedTokenizerFast sets up that file
    with `eos_token` as its eos and pad token, and no bos or eos added to a sequence: the same JSON, digest and ids
    (`tests/test_data.py` checks it against transformers), without importing it."""
    tokenizer = JsonTokenizer.from_file(path, eos_token, eos_token)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    return tokenizer


def tokenizer_digest(tokenizer: PreTrainedTokenizerFast | JsonTokenizer) -> str:
    """sha256 hex digest of what decides how `tokenizer` maps text to ids: its vocabulary, merges, added tokens,
    normalizer, pre-tokenizer, post-processor and decoder, plus its eos and pad tokens. Padding and truncation
    settings, which transformers changes on the fly while encoding, are left out. Peers with equal digests
    produce equal token ids."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    state.pop("padding", None)
    state.pop("truncation", None)
    state["eos_token"] = tokenizer.eos_token
    state["pad_token"] = tokenizer.pad_token
    canonical = json.dumps(state, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
