"""Training data for one peer: a tokenizer every peer derives identically from the corpus, the corpus as one flat
token stream (kept on disk in memory-mapped token files, swarm.data.token_store), and deterministic per-peer
shards of fixed-length windows over it (plus fixed validation batches). Corpus loading and the train/validation
split live in `swarm.data.corpus` and are re-exported here.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import tokenizers
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from swarm.data.corpus import (BUNDLED_CORPUS, Corpus, CorpusError, Document, Split, load_corpus,
                               split_by_keys, split_documents)
from swarm.data.token_store import BuildStats, TokenStore, build_store, load_store
from swarm.data.tokenizer import JsonTokenizer, tokenizer_digest, trained_bpe
from swarm.words import counted

if TYPE_CHECKING:  # (transformers takes a second and more to import: only what prepares data loads it)
    from transformers import PreTrainedTokenizerFast

__all__ = ["BUNDLED_CORPUS", "EOS_TOKEN", "Corpus", "CorpusError", "Document", "TokenDataset", "choose_data_shard",
           "load_corpus", "load_tokenizer", "split_documents", "tokenizer_digest"]

logger = logging.getLogger(__name__)

EVAL_BATCHES = 4  # validation batches every peer evaluates the global params on
EOS_TOKEN = "<|endoftext|>"
"""End-of-document token of the "bpe" tokenizer, also used for padding."""

# Part of every cache key: bump it whenever the BPE recipe or the token-cache layout changes, so stale files
# written by an older version are never read as current.
_CACHE_FORMAT = 1  # token files now live in tokens-<key>/ directories: old tokens-<key>.pt files are ignored
_MIN_BPE_VOCAB = 256 + 1  # every byte, plus the end-of-document token
BPE_SAMPLE_CHARS = 1 << 27
"""The "bpe" tokenizer is trained on the training documents up to this many characters (128 Mi, in corpus
order): the trainer holds every distinct word it sees, so this bounds its memory on corpora of any size."""


def load_tokenizer(
    spec: str, docs: Iterable[Document], vocab_size: int, cache_dir: str | Path
) -> JsonTokenizer | PreTrainedTokenizerFast:
    """Return the tokenizer named by `spec`; its eos token separates documents and is also its pad token.

    spec "bpe": a byte-level BPE with at most `vocab_size` entries ("<|endoftext|>" included) trained on the
    texts of `docs` (any re-iterable of documents, read as a stream twice), up to BPE_SAMPLE_CHARS; a
    JsonTokenizer, loaded without transformers. Training is deterministic, so peers that train on the same texts
    with the same `tokenizers` version get byte-identical tokenizers (check with `tokenizer_digest`). The result
    is cached in `cache_dir` as "bpe-<vocab_size>-<sha256 of texts, vocab_size and tokenizers version>.json",
    written atomically so that peers sharing the directory may train at the same moment; later calls load it in
    milliseconds. Any other spec is a local directory holding a saved fast tokenizer (tokenizer.json), loaded by
    transformers; a missing pad token is set to its eos token, and `docs`, `vocab_size` and `cache_dir` are
    ignored.

    Raises CorpusError for a vocab_size below 257 or no documents ("bpe"), or a directory that does not exist,
    holds no tokenizer.json or cannot be loaded from it, or whose tokenizer has no eos token.
    """
    if spec == "bpe":
        return _load_or_train_bpe(docs, vocab_size, Path(cache_dir))
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise CorpusError(f"tokenizer {spec!r} is neither 'bpe' nor an existing directory")
    if not (path / "tokenizer.json").is_file():
        raise CorpusError(f"tokenizer directory {str(path)!r} holds no tokenizer.json (write one with save_pretrained)")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CorpusError(f"cannot load a tokenizer from {str(path)!r}: {reason}") from None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise CorpusError(f"tokenizer in {str(path)!r} did not load as a fast (tokenizers-backed) tokenizer")
    if tokenizer.eos_token_id is None:
        raise CorpusError(f"tokenizer in {str(path)!r} has no eos token to separate documents")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_or_train_bpe(docs: Iterable[Document], vocab_size: int, cache_dir: Path) -> JsonTokenizer:
    if vocab_size < _MIN_BPE_VOCAB:
        raise CorpusError(f"bpe vocab_size must be at least {_MIN_BPE_VOCAB} (256 bytes + eos), got {vocab_size}")
    texts = _Texts(docs, limit_chars=BPE_SAMPLE_CHARS)
    key = _texts_digest(texts, f"bpe/{_CACHE_FORMAT}/{vocab_size}/{tokenizers.__version__}")
    if not texts.count:
        raise CorpusError("cannot train a bpe tokenizer on no documents")
    path = cache_dir / f"bpe-{vocab_size}-{key[:24]}.json"
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, lambda tmp: _train_bpe(texts, vocab_size).save(str(tmp)))
    return trained_bpe(path, EOS_TOKEN)


class _Texts:
    """The texts of a re-iterable stream of documents, read again on each pass, up to the first text that reaches
    `limit_chars` in all (None: every text); `count` is the number of texts the last full pass gave."""

    def __init__(self, docs: Iterable[Document], limit_chars: int | None = None) -> None:
        self.docs, self.limit_chars, self.count = docs, limit_chars, 0

    def __iter__(self) -> Iterator[str]:
        count = chars = 0
        for doc in self.docs:
            count += 1
            chars += len(doc.text)
            yield doc.text
            if self.limit_chars is not None and chars >= self.limit_chars:
                break
        self.count = count


def _train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    # Deterministic as configured (checked across processes and RAYON_NUM_THREADS=1/2/8 with tokenizers 0.23.3):
    # ids start from the sorted 256-byte alphabet and merge ties break on pair ids. The known non-determinism
    # (huggingface/tokenizers#1794) comes from continuing_subword_prefix / end_of_word_suffix tokens, which
    # are created in hash-map order, so neither is used here; no dropout either.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter(texts), trainer=trainer)
    return tokenizer


class WindowDataset:
    """A token stream cut into `num_windows` windows of seq_len + 1 tokens, and the schedule peers read them in
    (per-shard batches, validation batches); a subclass says where the windows come from (`windows`)."""

    seq_len: int
    num_windows: int

    def windows(self, indices: torch.Tensor) -> torch.Tensor:
        """Windows `indices` (a 1-D tensor) as an int64 tensor of shape (len(indices), seq_len + 1)."""
        raise NotImplementedError

    def batches(
        self, shard: int, num_shards: int, batch_size: int, seed: int, start_step: int = 0
    ) -> Iterator[torch.Tensor]:
        """Endless int64 batches of shape (batch_size, seq_len + 1) for the peer that starts at shard `shard`,
        from step `start_step` on (a restarted peer passes the number of batches it already consumed).

        Shard k owns windows i with i % num_shards == k, so shards are disjoint. Epoch e of this stream is shard
        (shard + e) % num_shards, its windows in a fresh order (a permutation drawn by a torch.Generator seeded
        from (seed, shard, e)): a peer reads the whole corpus before it sees a window twice, however few peers
        there are, and peers that start at different shards read different shards at the same epoch. A batch
        that crosses an epoch boundary ends one epoch and starts the next, so no window is dropped. Equal
        arguments give equal batches. Raises CorpusError (at the call, not at the first batch) for a shard
        outside [0, num_shards), batch_size < 1, start_step < 0 or a corpus with fewer windows than shards.
        """
        if not 0 <= shard < num_shards:
            raise CorpusError(f"shard must be in [0, {num_shards}), got {shard}")
        if batch_size < 1 or start_step < 0:
            raise CorpusError(f"need batch_size >= 1 and start_step >= 0, got {batch_size} and {start_step}")
        if self.num_windows < num_shards:
            raise CorpusError(
                f"{num_shards} shards need at least as many windows, but the corpus has only {self.num_windows} "
                f"windows of {self.seq_len + 1} tokens: lower data.num_shards"
            )
        return self._stream(shard, num_shards, batch_size, seed, start_step)

    def _epoch(self, start: int, num_shards: int, seed: int, epoch: int) -> torch.Tensor:
        """The windows of epoch `epoch` of the stream starting at shard `start`, in that epoch's order."""
        windows = torch.arange((start + epoch) % num_shards, self.num_windows, num_shards)
        return windows[_epoch_permutation(len(windows), seed, start, epoch)]

    def shard_at(self, shard: int, num_shards: int, batch_size: int, step: int) -> int:
        """The shard that step `step` of the stream starting at `shard` reads (its first window's): what a peer
        announces, so that joiners start where nobody is reading."""
        epoch, _ = self._position(shard, num_shards, batch_size, step)
        return (shard + epoch) % num_shards

    def _position(self, shard: int, num_shards: int, batch_size: int, step: int) -> tuple[int, int]:
        """(epoch, offset in that epoch's order) where step `step` begins: whole passes over the corpus, then epoch
        by epoch (epoch sizes differ by one window)."""
        passes, skip = divmod(step * batch_size, self.num_windows)
        epoch = passes * num_shards
        while skip >= len(range((shard + epoch) % num_shards, self.num_windows, num_shards)):
            skip -= len(range((shard + epoch) % num_shards, self.num_windows, num_shards))
            epoch += 1
        return epoch, skip

    def _stream(self, shard: int, num_shards: int, batch_size: int, seed: int,
                start_step: int) -> Iterator[torch.Tensor]:
        epoch, offset = self._position(shard, num_shards, batch_size, start_step)
        order = self._epoch(shard, num_shards, seed, epoch)
        while True:
            picked = []
            missing = batch_size
            while missing:
                taken = order[offset : offset + missing]
                picked.append(taken)
                missing -= len(taken)
                offset += len(taken)
                if offset == len(order):
                    epoch, offset = epoch + 1, 0
                    order = self._epoch(shard, num_shards, seed, epoch)
            yield self.windows(torch.cat(picked))

    def eval_batches(self, batch_size: int, max_batches: int) -> list[torch.Tensor]:
        """Fixed validation batches: int64 tensors of shape (batch_size, seq_len + 1), the last one possibly
        shorter, holding min(num_windows, batch_size * max_batches) windows spread evenly over the whole
        stream (so a small budget still samples every part of the corpus). Same arguments, same batches.
        Raises CorpusError if batch_size or max_batches is below 1."""
        if batch_size < 1 or max_batches < 1:
            raise CorpusError(f"need batch_size >= 1 and max_batches >= 1, got {batch_size} and {max_batches}")
        count = min(self.num_windows, batch_size * max_batches)
        picked = torch.arange(count) * self.num_windows // count
        return [self.windows(chunk) for chunk in picked.split(batch_size)]


class TokenDataset(WindowDataset):
    """The documents as one token stream (each document followed by the eos token), cut into non-overlapping
    windows of seq_len + 1 tokens (inputs plus the shifted target); a tail shorter than a window is unused.

    `docs` may be any re-iterable of documents (a list, a Corpus or a split part of one); it is read as a stream.
    len() counts tokens. With `cache_dir`, the stream is tokenized once into memory-mapped shards on disk
    (swarm.data.token_store) under a key of (tokenizer digest, document texts) and read from there after, so
    the corpus never has to fit in memory; without, it is held in memory. `stats` says what tokenizing took
    (None when the cache held it). Raises CorpusError if seq_len < 1, there are no documents, or the stream is
    shorter than one window.
    """

    def __init__(
        self,
        docs: Iterable[Document],
        tokenizer: JsonTokenizer | PreTrainedTokenizerFast,
        seq_len: int,
        cache_dir: str | Path | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        if seq_len < 1:
            raise CorpusError(f"seq_len must be at least 1, got {seq_len}")
        if tokenizer.eos_token_id is None:
            raise CorpusError("tokenizer has no eos token to separate documents")
        self.seq_len = seq_len
        texts = _Texts(docs)
        self.store, self.stats = _load_or_tokenize(texts, tokenizer, cache_dir, progress)
        if not texts.count:
            raise CorpusError("cannot build a token dataset from no documents")
        self.num_windows = self.store.total // (seq_len + 1)
        if self.num_windows == 0:
            raise CorpusError(
                f"{self.store.total} tokens do not fill one window of seq_len + 1 = {seq_len + 1} tokens"
            )

    @property
    def tokens(self) -> torch.Tensor:
        """The whole stream as a 1-D int32 tensor, read into memory: for small corpora and tests."""
        return torch.from_numpy(self.store.read(0, self.store.total).astype(np.int32))

    def windows(self, indices: torch.Tensor) -> torch.Tensor:
        """Windows `indices` (a 1-D tensor) as an int64 tensor of shape (len(indices), seq_len + 1)."""
        width = self.seq_len + 1
        rows = [self.store.read(i * width, (i + 1) * width) for i in indices.tolist()]
        return torch.from_numpy(np.stack(rows)) if rows else torch.zeros((0, width), dtype=torch.long)

    def __len__(self) -> int:
        return self.store.total


def choose_data_shard(reading: Sequence[int], num_shards: int, tie_break: int) -> int:
    """The shard a joining peer starts its stream at: inside the widest run of shards that no live peer reads now
    (`reading`: the shards they announce; values outside [0, num_shards) are ignored), so that its stream stays
    away from theirs for as long as possible. It lands in the middle half of that run, at a place drawn from
    `tie_break` (a hash of the peer id): peers that join at the same moment see the same view, and starting them
    all at the exact middle would give them identical streams. The same draw breaks ties between runs of equal
    width. With nobody reading, the shard is tie_break % num_shards; with every shard read, a least-read one."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be positive, got {num_shards}")
    rng = random.Random(tie_break)
    counts = Counter(s for s in reading if 0 <= s < num_shards)
    if not counts:
        return tie_break % num_shards
    if len(counts) == num_shards:
        fewest = min(counts.values())
        return rng.choice(sorted(s for s, n in counts.items() if n == fewest))
    taken = sorted(counts)
    # (first free shard, number of free shards) of each run between two read shards, going round the circle.
    runs = [(a + 1, (b - a - 1) % num_shards) for a, b in zip(taken, taken[1:] + [taken[0] + num_shards])]
    widest = max(length for _, length in runs)
    first, length = rng.choice([run for run in runs if run[1] == widest])
    margin = length // 4
    return (first + margin + rng.randrange(length - 2 * margin)) % num_shards


def _epoch_permutation(size: int, seed: int, shard: int, epoch: int) -> torch.Tensor:
    # Seeds come from sha256 rather than arithmetic on the three numbers, so neighbouring (seed, shard, epoch)
    # triples do not give related generator states.
    digest = hashlib.sha256(f"swarm.data/{seed}/{shard}/{epoch}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(size, generator=generator)


def _load_or_tokenize(texts: _Texts, tokenizer: JsonTokenizer | PreTrainedTokenizerFast, cache_dir: str | Path | None,
                      progress: Callable[[int, int], None] | None) -> tuple[TokenStore, BuildStats | None]:
    # The backend's batch encoder skips transformers' per-call checks (and its max-length warnings) and
    # encodes documents in parallel; encode_batch_fast (tokenizers >= 0.21) also skips character offsets.
    backend = tokenizer.backend_tokenizer
    encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)

    def encode(batch: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in encode_batch(batch, add_special_tokens=False)]

    directory = None
    if cache_dir is not None:
        key = _texts_digest(texts, f"tokens/{_CACHE_FORMAT}/{tokenizer_digest(tokenizer)}")
        directory = Path(cache_dir) / f"tokens-{key[:24]}"
        store = load_store(directory)
        if store is not None:
            return store, None
        shutil.rmtree(directory, ignore_errors=True)  # incomplete or of another format: rebuild it
        directory.parent.mkdir(parents=True, exist_ok=True)
    return _tokenize(texts, encode, tokenizer.eos_token_id, len(tokenizer), directory, progress)


def _tokenize(texts: Iterable[str], encode: Callable[[list[str]], list[list[int]]], eos: int, vocab_size: int,
              directory: Path | None, progress: Callable[[int, int], None] | None
              ) -> tuple[TokenStore, BuildStats]:
    return build_store(texts, encode, eos, vocab_size, directory, progress=progress)


def _texts_digest(texts: Iterable[str], prefix: str) -> str:
    digest = hashlib.sha256(prefix.encode())
    for text in texts:
        encoded = text.encode("utf-8")
        # Length-prefixing keeps ["ab", "c"] and ["a", "bc"] apart.
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()


def _write_atomically(path: Path, write) -> None:
    """Call write(tmp) with a unique temporary path beside `path`, then rename it over `path` in one step, so
    concurrent writers never expose a partial file (the last rename wins; their contents are identical)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class RunData:
    """What a peer trains and evaluates on, prepared identically on every peer from the recipe's data section."""

    train: TokenDataset
    eval_batches: list[torch.Tensor]
    vocab_size: int
    n_train_docs: int
    n_val_docs: int
    skipped_files: int = 0
    tokenizer: JsonTokenizer | PreTrainedTokenizerFast | None = None


def prepare_run_data(source: str, tokenizer_spec: str, vocab_size: int, val_fraction: float, seq_len: int,
                     batch_size: int, seed: int, cache_dir: str | Path, eval_batches: int = 4,
                     text_field: str = "text", show_progress: bool | None = None) -> RunData:
    """Corpus -> whole-document split -> tokenizer (trained or loaded, cached) -> token datasets, streaming the
    corpus (a scan for the split, then a pass for each of tokenizer and tokens) so it need not fit in memory.
    Unreadable files are skipped with a warning and counted. `show_progress`: a progress bar of the
    tokenization on stderr (None: only on a terminal). Raises CorpusError with one line on any problem."""
    corpus = Corpus(source, text_field)
    keys, sizes = corpus.scan(seed)
    split = split_by_keys(keys, val_fraction, seed)
    train_chars = int(sizes[keys > split.threshold].sum())
    del keys, sizes
    train_docs, val_docs = _Part(corpus, split, False), _Part(corpus, split, True)
    tokenizer = load_tokenizer(tokenizer_spec, train_docs, vocab_size, cache_dir)
    with _progress_bar(train_chars, show_progress) as progress:
        train = TokenDataset(train_docs, tokenizer, seq_len, cache_dir=cache_dir, progress=progress)
    if train.stats is not None:
        s = train.stats
        logger.info("data: tokenized %d tokens from %.1f MB of text in %.1f s (%.0f tokens/s) into %s", s.tokens,
                    s.chars / 1e6, s.seconds, s.tokens_per_s, counted(s.shards, "token file"))
    evaluation = TokenDataset(val_docs, tokenizer, seq_len, cache_dir=cache_dir).eval_batches(batch_size, eval_batches)
    return RunData(train, evaluation, len(tokenizer), split.n_train, split.n_val, len(corpus.skipped), tokenizer)


@dataclass(frozen=True)
class _Part:
    """One side of a split corpus, re-iterable."""

    corpus: Corpus
    split: Split
    validation: bool

    def __iter__(self) -> Iterator[Document]:
        return self.split.part(self.corpus, self.validation)


@contextlib.contextmanager
def _progress_bar(total_chars: int, show: bool | None) -> Iterator[Callable[[int, int], None]]:
    """progress(chars, tokens) callbacks drawing a tqdm bar of characters tokenized, with tokens and tokens/s;
    the bar appears at the first call (a cached corpus draws none)."""
    started, bars = time.monotonic(), []
    try:
        def progress(chars: int, tokens: int) -> None:
            if not bars:
                bars.append(tqdm(total=total_chars, unit="char", unit_scale=True, desc="tokenizing", mininterval=1.0,
                                 disable=None if show is None else not show, leave=False))
            bars[0].update(chars - bars[0].n)
            bars[0].set_postfix_str(f"{tokens / 1e6:.1f}M tokens, "
                                    f"{tokens / max(time.monotonic() - started, 1e-9):,.0f} tokens/s", refresh=False)

        yield progress
    finally:
        for bar in bars:
            bar.close()
