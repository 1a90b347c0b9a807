"""Top-k sparsification: keep the largest-magnitude fraction of a pseudo-gradient, drop the rest.

Kept positions are delta-coded (index_coding.py) and kept values are int8 blockwise quantized (quantized.py).
Dropped mass is lost unless the sender carries it to the next round with ErrorFeedback.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from swarm.compression.base import Codec, CodecError, ceil_div, check_block_size, prepare_input, require_positive_numel
from swarm.compression.index_coding import (
    check_index_section,
    encode_gaps,
    expected_varint_len,
    indices_to_gaps,
    read_positions,
)
from swarm.compression.quantized import (
    INT8_LEVELS,
    INT8_MAX_ABS_CODE,
    blockwise_bound,
    dequantize_blockwise,
    quantize_blockwise,
    read_block_size,
    read_scales,
)
from swarm.compression.wire import WireHeader, expect_sections, header_len, section_tensor

# The smallest fraction a codec accepts. Decoders refuse headers declaring more than MAX_SPARSITY elements per
# kept element, which caps how much a small forged payload can make a receiver allocate.
MIN_FRACTION = 1e-6
MAX_SPARSITY = 2**20
# Above this many elements, selection first thresholds on a strided sample (see top_positions).
SAMPLED_SELECTION_MIN_NUMEL = 2**18
SELECTION_SAMPLE = 2**16


def top_positions(magnitudes: torch.Tensor, count: int) -> torch.Tensor:
    """Positions of the `count` largest magnitudes (unordered); the same set torch.topk picks, up to ties.

    A full torch.topk over 16M elements costs ~0.35 s on 2 CPU cores. For large inputs a threshold taken from a
    strided sample, set to let through about twice `count` plus sampling slack, first shrinks the candidates.
    If fewer than `count` pass (a freak sample), it falls back to the full topk, so the result is always exact:
    when at least `count` magnitudes are >= the threshold, every one of the top `count` is among them.
    """
    numel = magnitudes.numel()
    if numel >= SAMPLED_SELECTION_MIN_NUMEL:
        sample = magnitudes[:: numel // SELECTION_SAMPLE]
        wanted = 2.0 * count / numel + 4.0 * math.sqrt(count / numel / sample.numel())
        sample_count = math.ceil(wanted * sample.numel())
        if sample_count < sample.numel() // 2:
            threshold = torch.kthvalue(sample, sample.numel() - sample_count + 1).values
            candidates = (magnitudes >= threshold).nonzero().squeeze(1)
            if candidates.numel() >= count:
                return candidates[torch.topk(magnitudes[candidates], count, sorted=False).indices]
    return torch.topk(magnitudes, count, sorted=False).indices


@dataclass(frozen=True)
class TopKCodec(Codec):
    """Keeps k = max(1, ceil(fraction * numel)) entries of largest |x|; values int8 per block of `block_size` kept.

    Error bound: |x| for dropped entries (they decode to 0); for kept entries absmax / 127 of their block of
    kept values (absmax if that is below 2**-120), as for the int8 codec. Wire size at fraction 0.01 with
    randomly spread positions: about 0.023 bytes per element (index gaps ~1.3 bytes, value 1 byte, scales).
    """

    fraction: float = 0.01
    block_size: int = 128
    name = "topk"

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, numbers.Real):
            raise CodecError(f"fraction must be a number, got {type(self.fraction).__name__}")
        if not MIN_FRACTION <= self.fraction <= 1.0:  # also False for NaN
            raise CodecError(f"fraction must be within [{MIN_FRACTION}, 1], got {self.fraction}")
        check_block_size(self.block_size)

    def kept_count(self, numel: int) -> int:
        """Number of entries kept from a tensor of `numel` elements (0 only for an empty tensor)."""
        if numel == 0:
            return 0
        # round() first, so float noise (0.07 * 100 is 7.000000000000001) does not keep one entry too many.
        return min(numel, max(1, math.ceil(round(self.fraction * numel, 6))))

    def select(self, flat: torch.Tensor) -> torch.Tensor:
        """Returns the ascending int64 positions this codec keeps from a flat float32 tensor (deterministic)."""
        count = self.kept_count(flat.numel())
        if count == flat.numel():
            return torch.arange(count, device=flat.device)
        return torch.sort(top_positions(flat.abs(), count)).values

    def _encode_flat(self, flat: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
        positions = self.select(flat)
        scales, codes = quantize_blockwise(flat[positions], self.block_size, INT8_LEVELS)
        coding, coded_gaps = encode_gaps(indices_to_gaps(positions))
        fields = {"block_size": self.block_size, "variant": coding, "aux": positions.numel()}
        return fields, [scales, coded_gaps, codes]

    def _decode_body(self, payload, header: WireHeader) -> torch.Tensor:
        block_size = read_block_size(header)
        numel, count = header.numel, header.aux
        if count > numel or (numel > 0 and count == 0) or numel > count * MAX_SPARSITY:
            raise CodecError(f"topk payload keeps {count} of {numel} elements, outside [numel / 2**20, numel]")
        check_index_section(header, count)
        expect_sections(header, (4 * ceil_div(count, block_size), header.section_lengths[1], count))
        scales = read_scales(payload, header, 0, INT8_MAX_ABS_CODE)
        positions = read_positions(header, payload, count)
        codes = section_tensor(payload, header, 2, torch.int8)
        restored = torch.zeros(numel, dtype=torch.float32)
        restored[positions] = dequantize_blockwise(codes, scales, block_size, count)
        return restored

    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor:
        flat, _, _ = prepare_input(tensor)
        positions = self.select(flat)
        bound = flat.abs()
        bound[positions] = blockwise_bound(flat[positions], self.block_size, INT8_LEVELS)
        return bound.cpu()

    def bytes_per_param(self, numel: int) -> float:
        """Expected wire size per element, assuming kept positions spread at random (real gradients may cluster)."""
        require_positive_numel(numel)
        count = self.kept_count(numel)
        index_bytes = min(expected_varint_len(count / numel), 4.0)
        if numel <= 2**16:
            index_bytes = min(index_bytes, 2.0)
        wire = header_len(1, 3) + 4 * ceil_div(count, self.block_size) + count * index_bytes + count
        return wire / numel
