"""The codec interface every pseudo-gradient codec implements, and the input checks they share.

A codec turns a float tensor into wire bytes and back, and states a per-element bound on the error it adds.
Concrete codecs live in float_codecs.py, quantized.py and topk.py; the wire header is in wire.py.
"""

from __future__ import annotations

import abc
import math
from typing import ClassVar

import torch

from swarm.compression.errors import CodecError
from swarm.compression.wire import (
    HARD_MAX_NUMEL,
    MAX_NDIM,
    SRC_DTYPE_CODES,
    WireHeader,
    decode_header,
    pack_payload,
)


# Encoders refuse |x| > 2**126 (about 8.5e37). That leaves one binade of headroom below float32's largest
# value, so no codec's scale or rounding can overflow to inf; decoders promise |x| <= 2**127.
MAX_ABS_VALUE = 2.0**126
MAX_DECODED_ABS = 2.0**127

# Block sizes codecs accept (elements per scale). Below 16 the float32 scales cost over a quarter byte per
# element; above 4096 one outlier flattens too many neighbours to zero.
MIN_BLOCK_SIZE = 16
MAX_BLOCK_SIZE = 4096
# Elements per chunk of CPU passes that need a float32 temporary: 4 MiB stays in cache and reuses its pages, where
# a fresh full-size temporary costs more in page faults than the arithmetic itself. Much smaller chunks lose to
# per-op thread hand-off, badly so when other processes share the cores (measured on 2 cores at 16M elements).
CHUNK_ELEMENTS = 2**20
SUM_BLOCK = 2**16  # elements square_and_abs_sums copies to float64 at a time


class Codec(abc.ABC):
    """Encodes any-shape float tensors to bytes and decodes them to flat float32 CPU tensors.

    Inputs are converted to float32 first; every error bound is relative to that float32 tensor.
    Subclasses implement `_encode_flat`, `_decode_body` and `error_bound`.
    """

    name: ClassVar[str]
    # Whether a peer carries what this codec did not deliver into its next round (error feedback): worth its
    # residual, 4 bytes a parameter of the peer's memory, where the codec's error is (int8, int4, topk, bf16's
    # 2**-8), not where there is none (none) or it is 2**-11 of each value (fp16).
    error_feedback: ClassVar[bool] = True
    # What the residual counts for in the next round: to_send = pseudo_gradient + decay * residual. Below 1 (the
    # sparse codec's), the residual is SparseLoCo's decayed accumulator, which stands in for outer momentum.
    feedback_decay: ClassVar[float] = 1.0

    # Whether a reducer puts its own part of the vector through this codec too, as it gets the others' (the sparse
    # codec's: its own part whole would make the average dense); else it averages its own part as it is.
    own_part_encoded: ClassVar[bool] = False

    def alignment(self) -> int:
        """Elements the parts of a vector a butterfly cuts for reducers are whole multiples of (the sparse codec's
        chunk, so that every chunk is the one it would be in the whole vector), or 1."""
        return 1

    def average_codec(self, members: int) -> "Codec":
        """The codec a reducer sends the average of `members` contributions back with: this one, but for the sparse
        codec, whose averages keep the union of the contributions' positions (sparse.SupportCodec)."""
        return self

    def encode(self, tensor: torch.Tensor) -> bytes:
        """Returns the wire bytes for `tensor` (header + payload). The math runs on the tensor's device; only the
        encoded sections are copied to the CPU.

        Raises CodecError if the tensor is not a float tensor, holds NaN/inf or |x| > 2**126, has more than
        2**31 elements or more than 16 dimensions.
        """
        flat, shape, src_dtype = prepare_input(tensor)
        fields, sections = self._encode_flat(flat)
        return pack_payload(
            codec=self.name, src_dtype=src_dtype, shape=shape, numel=flat.numel(), sections=sections, **fields
        )

    def decode(self, payload: bytes | bytearray | memoryview, max_numel: int | None = None) -> torch.Tensor:
        """Returns the flat float32 CPU tensor that `payload` encodes, with |x| <= 2**127 everywhere.

        Validates the whole header and every section length before allocating anything; never allocates more
        than the declared number of elements, and refuses a header declaring more than `max_numel` (if given)
        or 2**31 elements. Raises CodecError on truncated, oversized, wrong-version, wrong-codec or corrupt bytes.
        """
        header = decode_header(payload, max_numel=max_numel)
        if header.codec != self.name:
            raise CodecError(f"payload was encoded with codec {header.codec!r}, this decoder is {self.name!r}")
        return self._decode_body(payload, header)

    def round_trip(self, tensor: torch.Tensor) -> torch.Tensor:
        """decode(encode(tensor)), bit for bit: what a receiver holds of `tensor` (flat float32 on the CPU). Codecs
        that can compute it without the bytes do (a butterfly member's checks read its own chunks so: Run.delivered).
        Raises CodecError for the inputs `encode` refuses."""
        return self.decode(self.encode(tensor))

    @abc.abstractmethod
    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor:
        """Returns a flat float32 CPU tensor b with |x - decode(encode(x))| <= b elementwise, x = tensor as float32.

        Raises CodecError for the same inputs `encode` refuses.
        """

    def error_bound_norm(self, tensor: torch.Tensor) -> float:
        """The float64 Euclidean norm of error_bound(tensor) (what the reducer check allows a chunk's rounding);
        codecs whose bound has a closed form work it out from sums over the tensor instead of the bound itself."""
        return float(torch.linalg.vector_norm(self.error_bound(tensor), dtype=torch.float64))

    @abc.abstractmethod
    def bytes_per_param(self, numel: int) -> float:
        """Returns the expected wire size (header included) of a 1-D tensor of `numel` elements, divided by numel."""

    @abc.abstractmethod
    def _encode_flat(self, flat: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
        """Encodes a validated flat float32 tensor; returns extra header fields and the sections (any device)."""

    @abc.abstractmethod
    def _decode_body(self, payload: bytes | bytearray | memoryview, header: WireHeader) -> torch.Tensor:
        """Decodes the sections of a payload whose header has been validated against the hard limits."""


def prepare_input(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], torch.dtype]:
    """Validates an input tensor and returns (flat contiguous float32 on its device, original shape, dtype).

    Raises CodecError with a one-line message for anything a codec must not encode.
    """
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SRC_DTYPE_CODES:
        kind = "floating point" if tensor.is_floating_point() else "not floating point"
        raise CodecError(
            f"cannot encode a {tensor.dtype} tensor ({kind}); expected float32, float16, bfloat16 or float64"
        )
    if tensor.numel() > HARD_MAX_NUMEL:
        raise CodecError(f"tensor has {tensor.numel()} elements, more than the limit of {HARD_MAX_NUMEL}")
    if tensor.dim() > MAX_NDIM:
        raise CodecError(f"tensor has {tensor.dim()} dimensions, more than the limit of {MAX_NDIM}")
    flat = tensor.detach().reshape(-1)
    # Checked in the source dtype: a float64 1e300 would otherwise turn into inf and get a misleading message.
    check_finite_range(flat)
    return flat.to(torch.float32).contiguous(), tuple(tensor.shape), tensor.dtype


def square_and_abs_sums(flat: torch.Tensor) -> tuple[float, float]:
    """(sum of x^2, sum of |x|) over a flat float tensor, in float64, a block at a time (no float64 copy of it)."""
    squares = absolutes = 0.0
    wide = torch.empty(min(SUM_BLOCK, flat.numel()), dtype=torch.float64)
    for start in range(0, flat.numel(), SUM_BLOCK):
        block = wide[:min(SUM_BLOCK, flat.numel() - start)].copy_(flat[start:start + SUM_BLOCK])
        squares += float(torch.dot(block, block))
        absolutes += float(torch.linalg.vector_norm(block, ord=1))
    return squares, absolutes


def check_finite_range(flat: torch.Tensor) -> None:
    """Raises CodecError unless every element is finite with |x| <= 2**126; one pass over the data."""
    if flat.numel() == 0:
        return
    # aminmax propagates NaN, so a single reduction catches NaN, inf and out-of-range values together.
    low, high = (float(v) for v in torch.aminmax(flat))
    if low >= -MAX_ABS_VALUE and high <= MAX_ABS_VALUE:
        return
    n_nan = int(torch.isnan(flat).sum())
    n_inf = int(torch.isinf(flat).sum())
    if n_nan or n_inf:
        raise CodecError(f"tensor has {n_nan} NaN and {n_inf} inf values; codecs refuse non-finite input")
    largest = float(flat.abs().max())
    raise CodecError(f"tensor has |x| up to {largest:.3g}; codecs accept |x| <= 2**126 ({MAX_ABS_VALUE:.3g})")


def check_block_size(block_size: int) -> None:
    """Raises CodecError unless block_size is an int within [MIN_BLOCK_SIZE, MAX_BLOCK_SIZE]."""
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise CodecError(f"block_size must be an int, got {type(block_size).__name__}")
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise CodecError(f"block_size must be within [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size}")


def require_positive_numel(numel: int) -> None:
    """Raises CodecError unless numel >= 1 (bytes_per_param is undefined for empty tensors)."""
    if numel < 1:
        raise CodecError(f"bytes_per_param needs numel >= 1, got {numel}")


def ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def check_decoded_range(values: torch.Tensor) -> None:
    """Raises CodecError unless every decoded value is finite with |x| <= 2**127 (one reduction pass)."""
    if values.numel() == 0:
        return
    low, high = (float(v) for v in torch.aminmax(values))
    if not (low >= -MAX_DECODED_ABS and high <= MAX_DECODED_ABS):
        raise CodecError("payload decodes to NaN, inf or |x| > 2**127; the bytes are corrupt")


def is_power_of_two(value: float) -> bool:
    return value > 0 and math.isfinite(value) and math.frexp(value)[0] == 0.5
