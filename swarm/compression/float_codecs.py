"""Codecs that send every element as a float: `none` (float32, exact), `fp16` (scaled half) and `bf16`.

These are the safe defaults: no state, no error feedback needed for fp32, and a small relative error for the
16-bit ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from swarm.compression.base import (
    CHUNK_ELEMENTS,
    Codec,
    CodecError,
    check_decoded_range,
    is_power_of_two,
    prepare_input,
    require_positive_numel,
    square_and_abs_sums,
)
from swarm.compression.wire import (
    WireHeader,
    expect_fields,
    expect_sections,
    header_len,
    section_tensor,
)

# fp16 scales are powers of two within these exponents: the upper one follows from |x| <= 2**126, the lower one
# keeps every decoded product a normal float32 (exact), at the price of a floor of 2**-124 for tiny tensors.
FP16_MIN_EXPONENT = -100
FP16_MAX_EXPONENT = 112
# The encoder maps the tensor's absmax into [2**14, 2**15): below half's largest value (65504), one binade left
# as headroom for rounding up.
FP16_TARGET_EXPONENT = 15


@dataclass(frozen=True)
class NoneCodec(Codec):
    """float32 as is. Error bound: 0 (exact for float32 input)."""

    name = "none"
    error_feedback = False  # (exact: the residual would be zeros)

    def _encode_flat(self, flat: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
        return {}, [flat]

    def round_trip(self, tensor: torch.Tensor) -> torch.Tensor:
        flat, _, _ = prepare_input(tensor)
        return flat.cpu().clone()  # (its float32 values, unchanged, never aliasing the caller's)

    def _decode_body(self, payload, header: WireHeader) -> torch.Tensor:
        expect_fields(header)
        expect_sections(header, (4 * header.numel,))
        values = section_tensor(payload, header, 0, torch.float32)
        check_decoded_range(values)
        return values.clone()  # never hand out a tensor that aliases the caller's (immutable) bytes

    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor:
        flat, _, _ = prepare_input(tensor)
        return torch.zeros(flat.numel(), dtype=torch.float32)

    def bytes_per_param(self, numel: int) -> float:
        require_positive_numel(numel)
        return (header_len(1, 1) + 4 * numel) / numel


def _affine_norm(flat: torch.Tensor, a: float, b: float) -> float:
    """The norm of a |x| + b over `flat`, from its sums: ||a|x| + b||^2 = a^2 sum x^2 + 2ab sum |x| + n b^2."""
    squares, absolutes = square_and_abs_sums(flat.cpu())
    return math.sqrt(a * a * squares + 2 * a * b * absolutes + flat.numel() * b * b)


def fp16_scale(flat: torch.Tensor) -> float:
    """The power-of-two scale s the fp16 codec divides by: absmax / s lands in [2**14, 2**15) when possible."""
    if flat.numel() == 0:
        return 1.0
    low, high = torch.aminmax(flat)
    absmax = max(-float(low), float(high))
    exponent = math.frexp(absmax)[1] - FP16_TARGET_EXPONENT  # absmax in [2**(e+14), 2**(e+15))
    return 2.0 ** min(max(exponent, FP16_MIN_EXPONENT), FP16_MAX_EXPONENT)


@dataclass(frozen=True)
class Float16Codec(Codec):
    """IEEE half with one power-of-two scale per tensor, so 1e30 and 1e-30 survive (plain half overflows at 65504).

    Error bound: |x| * 2**-11 + s * 2**-24, where s is the tensor's scale (absmax / s in [2**14, 2**15),
    s clamped to [2**-100, 2**112]): round-to-nearest in half's 11-bit significand, plus half's subnormal step.
    Scaling by a power of two is exact, so the fp16 rounding is the only error.
    """

    name = "fp16"
    error_feedback = False  # (a 2**-11 rounding of each value, unbiased: not worth a residual the model's size)

    def _encode_flat(self, flat: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
        scale = fp16_scale(flat)
        halves = torch.empty(flat.numel(), dtype=torch.float16, device=flat.device)
        step = CHUNK_ELEMENTS if flat.device.type == "cpu" else max(flat.numel(), 1)
        buffer = torch.empty(min(step, flat.numel()), dtype=torch.float32, device=flat.device)
        for start in range(0, flat.numel(), step):
            stop = min(start + step, flat.numel())
            scaled = torch.mul(flat[start:stop], 1.0 / scale, out=buffer[: stop - start])
            halves[start:stop].copy_(scaled)
        return {}, [torch.tensor([scale], dtype=torch.float32), halves]

    def round_trip(self, tensor: torch.Tensor) -> torch.Tensor:
        flat, _, _ = prepare_input(tensor)  # (the same operations as _encode_flat and _decode_body, 3x faster)
        scale = fp16_scale(flat)
        halves = torch.mul(flat.cpu(), 1.0 / scale).to(torch.float16)
        return torch.mul(halves, torch.tensor([scale], dtype=torch.float32))

    def _decode_body(self, payload, header: WireHeader) -> torch.Tensor:
        expect_fields(header)
        expect_sections(header, (4, 2 * header.numel))
        scale = float(section_tensor(payload, header, 0, torch.float32)[0])
        if not is_power_of_two(scale) or not 2.0**FP16_MIN_EXPONENT <= scale <= 2.0**FP16_MAX_EXPONENT:
            raise CodecError(f"fp16 scale {scale!r} is not a power of two within [2**-100, 2**112]")
        halves = section_tensor(payload, header, 1, torch.float16)
        restored = torch.empty(header.numel, dtype=torch.float32)
        # A 1-element float32 tensor (not a scalar) makes the multiply run in float32: a half product could overflow.
        scale_tensor = torch.tensor([scale], dtype=torch.float32)
        for start in range(0, header.numel, CHUNK_ELEMENTS):
            stop = min(start + CHUNK_ELEMENTS, header.numel)
            torch.mul(halves[start:stop], scale_tensor, out=restored[start:stop])
        check_decoded_range(restored)
        return restored

    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor:
        flat, _, _ = prepare_input(tensor)
        scale = fp16_scale(flat)
        return (flat.abs() * 2.0**-11 + scale * 2.0**-24).cpu()

    def error_bound_norm(self, tensor: torch.Tensor) -> float:
        flat, _, _ = prepare_input(tensor)
        return _affine_norm(flat, 2.0**-11, fp16_scale(flat) * 2.0**-24)

    def bytes_per_param(self, numel: int) -> float:
        require_positive_numel(numel)
        return (header_len(1, 2) + 4 + 2 * numel) / numel


@dataclass(frozen=True)
class BFloat16Codec(Codec):
    """bfloat16: float32's exponent range, so no scale is needed.

    Error bound: |x| * 2**-8 + 2**-133: round-to-nearest in bfloat16's 8-bit significand, plus its subnormal step.
    """

    name = "bf16"

    def _encode_flat(self, flat: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
        return {}, [flat.to(torch.bfloat16)]

    def _decode_body(self, payload, header: WireHeader) -> torch.Tensor:
        expect_fields(header)
        expect_sections(header, (2 * header.numel,))
        restored = section_tensor(payload, header, 0, torch.bfloat16).to(torch.float32)
        check_decoded_range(restored)
        return restored

    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor:
        flat, _, _ = prepare_input(tensor)
        return (flat.abs() * 2.0**-8 + 2.0**-133).cpu()

    def error_bound_norm(self, tensor: torch.Tensor) -> float:
        flat, _, _ = prepare_input(tensor)
        return _affine_norm(flat, 2.0**-8, 2.0**-133)

    def bytes_per_param(self, numel: int) -> float:
        require_positive_numel(numel)
        return (header_len(1, 1) + 2 * numel) / numel
