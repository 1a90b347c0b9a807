"""What a tokenizer is to the swarm: its digest (`tokenizer_digest`: peers with equal digests produce equal ids),
and the run's dataset's tokenizer as a peer loads it (`SharedTokenizer`), by `tokenizers` alone. Preparing data
(swarm.data.prepare) makes tokenizers with transformers; a peer that reads the shared dataset never imports it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import tokenizers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


class SharedTokenizer:
    """The dataset's tokenizer as its file gives it, loaded by `tokenizers` alone: what a peer needs of it (its size,
    digest and encoding) without transformers, which takes a second and more to import in every peer process. The
    file holds the tokenizer as transformers set it up for the run's owner (its post-processor included), so it
    encodes as the owner's does, and `tokenizer_digest` reads it as it reads the owner's."""

    def __init__(self, path: Path, eos_token: str, pad_token: str):
        self.backend_tokenizer = tokenizers.Tokenizer.from_file(str(path))
        self.eos_token, self.pad_token = eos_token, pad_token

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend_tokenizer.encode(text).ids


def tokenizer_digest(tokenizer: PreTrainedTokenizerFast | SharedTokenizer) -> str:
    """sha256 hex digest of what decides how `tokenizer` (transformers' or a shared dataset's) maps
    text to ids: its vocabulary, merges, added tokens, normalizer, pre-tokenizer, post-processor and decoder, plus
    its eos and pad tokens. Padding and truncation settings, which transformers changes on the fly while encoding,
    are left out. Peers with equal digests produce equal token ids."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    state.pop("padding", None)
    state.pop("truncation", None)
    state["eos_token"] = tokenizer.eos_token
    state["pad_token"] = tokenizer.pad_token
    canonical = json.dumps(state, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
