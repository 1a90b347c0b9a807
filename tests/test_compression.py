"""Tests for swarm.compression: round trips, stated error bounds on hostile inputs, size/error targets, the wire
header's validation, index coding, error feedback, and a bounded fuzz of every decoder."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.compression import (
    CODEC_NAMES,
    HARD_MAX_NUMEL,
    MAX_ABS_VALUE,
    MAX_DECODED_ABS,
    CodecError,
    ErrorFeedback,
    decode,
    decode_header,
    get_codec,
)
from swarm.compression.index_coding import (
    UINT16,
    UINT32,
    VARINT,
    decode_gaps,
    encode_gaps,
    gaps_to_indices,
    indices_to_gaps,
)
from swarm.compression.wire import FIXED_HEADER_LEN, pack_payload

pytestmark = pytest.mark.timeout(60)

LOSSY = ("fp16", "bf16", "int8", "int4", "topk")
FUZZ_SETTINGS = settings(
    max_examples=200, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _gaussian(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=_generator(seed))


def _inputs() -> dict[str, torch.Tensor]:
    """The hostile inputs issue #4 names, plus subnormals and mixed magnitudes; odd lengths leave a short block."""
    numel = 4099
    gaussian = _gaussian(numel)
    uniform = torch.rand(numel, generator=_generator(1))
    return {
        "gaussian": gaussian,
        "student_t2": _student_t(numel),
        "cauchy": torch.tan(torch.pi * (uniform - 0.5)).clamp(-1e30, 1e30),
        "zeros": torch.zeros(numel),
        "constant": torch.full((numel,), -3.25),
        "huge": gaussian * 1e30,
        "tiny": gaussian * 1e-30,
        "subnormal": gaussian * 1e-40,
        # every block's absmax just above 2**-120, where int8 scales are float32 subnormals
        "just_above_tiny": torch.where(gaussian < 0, -1.0, 1.0) * (1 + uniform) * 2.0**-120,
        "mixed_magnitudes": gaussian * torch.pow(10.0, uniform * 60 - 30),
        "limits": torch.tensor([MAX_ABS_VALUE, -MAX_ABS_VALUE, 1.0, 0.0, 1e-45, -1e-38] * 50),
        "single": torch.tensor([0.7]),
    }


def _student_t(numel: int, df: float = 2.0) -> torch.Tensor:
    # Student-t from its definition, with our own generator so the test is reproducible.
    normal = torch.randn(numel, generator=_generator(2))
    chi2 = torch.randn((numel, int(df)), generator=_generator(3)).pow(2).sum(dim=1)
    return normal / torch.sqrt(chi2 / df)


def _roundtrip_error(codec, tensor: torch.Tensor) -> torch.Tensor:
    restored = codec.decode(codec.encode(tensor))
    return (tensor.reshape(-1).double().cpu() - restored.double()).abs()


# ---------------------------------------------------------------- round trips, bounds, targets


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7, 3), (2, 3, 129), (1000,)])
def test_round_trip_returns_flat_float32_and_header_keeps_shape(name, shape):
    codec = get_codec(name)
    tensor = torch.randn(shape, generator=_generator(4))
    payload = codec.encode(tensor)
    restored = codec.decode(payload, max_numel=tensor.numel())
    assert restored.dtype == torch.float32 and restored.device.type == "cpu"
    assert restored.shape == (tensor.numel(),)
    header = decode_header(payload)
    assert header.codec == name and header.shape == tuple(shape) and header.numel == tensor.numel()
    assert header.total_len == len(payload)
    assert torch.equal(decode(payload), restored)
    if name == "none":
        assert torch.equal(restored, tensor.reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_encode_as_their_float32_value(dtype):
    tensor = torch.randn(300, generator=_generator(5)).to(dtype)
    payload = get_codec("none").encode(tensor)
    assert decode_header(payload).src_dtype == dtype
    assert torch.equal(get_codec("none").decode(payload), tensor.float())


@pytest.mark.parametrize("kind", list(_inputs()))
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_error_bound_holds_elementwise(name, kind):
    tensor = _inputs()[kind]
    codec = get_codec(name, **({"block_size": 64} if name in ("int8", "int4") else {}))
    bound = codec.error_bound(tensor)
    assert bound.shape == (tensor.numel(),) and bool(torch.isfinite(bound).all())
    error = _roundtrip_error(codec, tensor)
    worst = int(torch.argmax(error - bound.double()))
    message = f"{name}/{kind}: x={tensor[worst]} err={error[worst]} > bound {bound[worst]}"
    assert bool((error <= bound.double()).all()), message


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_a_round_trip_without_the_bytes_is_decode_of_encode_bit_for_bit(name):
    """Codec.round_trip (what a member's checks read of its own chunks where it keeps no copy: Run.delivered), on
    every hostile input kind."""
    codec = get_codec(name, **({"block_size": 64} if name in ("int8", "int4") else {}))
    for kind, tensor in _inputs().items():
        restored = codec.round_trip(tensor)
        assert torch.equal(restored, codec.decode(codec.encode(tensor))) and restored.dtype == torch.float32, kind
        assert restored.data_ptr() != tensor.data_ptr(), "never the caller's own memory"
    with pytest.raises(CodecError):
        codec.round_trip(torch.tensor([1.0, float("nan")]))


@pytest.mark.parametrize("name", LOSSY)
def test_error_bound_is_tight_on_gaussian(name):
    # A bound that is never approached would pass the test above while saying nothing.
    tensor = _gaussian(1 << 15, seed=6)
    codec = get_codec(name)
    bound = codec.error_bound(tensor).double()
    ratio = _roundtrip_error(codec, tensor)[bound > 0] / bound[bound > 0]
    assert 0.3 <= float(ratio.max()) <= 1.0


def test_error_bounds_follow_documented_formulas():
    tensor = torch.tensor([1.0, -2.0, 0.5, 0.25] * 8 + [0.0] * 31 + [3.0])  # blocks of 16: absmax 2, 2, 0, 0.., 3
    int8_bound = get_codec("int8", block_size=16).error_bound(tensor)
    assert torch.allclose(int8_bound[:32], torch.full((32,), 2.0 / 127))
    assert torch.equal(int8_bound[32:48], torch.zeros(16))
    assert torch.allclose(int8_bound[48:], torch.full((16,), 3.0 / 127))
    assert torch.allclose(get_codec("int4", block_size=16).error_bound(tensor)[:16], torch.full((16,), 2.0 / 8))
    assert torch.equal(get_codec("none").error_bound(tensor), torch.zeros(64))
    fp16_bound = get_codec("fp16").error_bound(tensor)  # absmax 3 -> scale 2**-14
    assert torch.allclose(fp16_bound, tensor.abs() * 2.0**-11 + 2.0**-38)
    topk_bound = get_codec("topk", fraction=0.05).error_bound(tensor)  # keeps 4: 3.0 and three of the 2.0s
    assert int((topk_bound == tensor.abs()).sum()) == 60
    assert torch.allclose(topk_bound[topk_bound != tensor.abs()], torch.full((4,), 3.0 / 127))


def test_relative_error_and_size_targets():
    tensor = _gaussian(1 << 18, seed=7)
    targets = {"none": (4.01, 0.0), "fp16": (2.01, 2.0**-11), "bf16": (2.01, 2.0**-8), "int8": (1.07, 0.01),
               "int4": (0.57, 0.12), "topk": (0.05, 1.0)}
    for name, (max_bytes, max_rel_error) in targets.items():
        codec = get_codec(name)
        payload = codec.encode(tensor)
        restored = codec.decode(payload)
        assert len(payload) / tensor.numel() <= max_bytes, name
        assert codec.bytes_per_param(tensor.numel()) == pytest.approx(len(payload) / tensor.numel(), rel=0.1)
        assert float((tensor - restored).norm() / tensor.norm()) <= max_rel_error, name


def test_topk_keeps_the_largest_entries_exactly_where_they_were():
    tensor = _gaussian(10_000, seed=8)
    restored = get_codec("topk", fraction=0.01).decode(get_codec("topk", fraction=0.01).encode(tensor))
    expected_positions = torch.topk(tensor.abs(), 100).indices.sort().values
    assert torch.equal(restored.nonzero().squeeze(1), expected_positions)


# ---------------------------------------------------------------- what encoders refuse


@pytest.mark.parametrize(
    "tensor, message",
    [
        (torch.tensor([1.0, float("nan")]), "NaN"),
        (torch.tensor([1.0, float("inf")]), "inf"),
        (torch.tensor([float("-inf")] * 3), "inf"),
        (torch.tensor([1.0, 2.0**127]), "|x|"),
        (torch.tensor([1e300], dtype=torch.float64), "|x|"),
        (torch.tensor([1, 2, 3]), "not floating point"),
        (torch.tensor([True]), "not floating point"),
        (torch.tensor([1 + 2j]), "complex"),
        (torch.zeros(1).expand(HARD_MAX_NUMEL + 1), "more than the limit"),
        (torch.zeros([1] * 17), "dimensions"),
    ],
)
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_encode_and_error_bound_refuse_bad_tensors_with_one_line(name, tensor, message):
    codec = get_codec(name)
    for method in (codec.encode, codec.error_bound):
        with pytest.raises(CodecError, match=message.replace("|", r"\|")) as caught:
            method(tensor)
        assert "\n" not in str(caught.value)


def test_get_codec_refuses_unknown_names_and_options():
    assert CODEC_NAMES == ("none", "fp16", "bf16", "int8", "int4", "topk", "sparse")
    for name, options in [("int2", {}), ("fp16", {"block_size": 128}), ("int8", {"block_size": 8}),
                          ("int8", {"block_size": 128.0}), ("topk", {"fraction": 0.0}),
                          ("topk", {"fraction": float("nan")}), ("topk", {"fractoin": 0.1})]:
        with pytest.raises(CodecError):
            get_codec(name, **options)
    assert get_codec("int8", block_size=64).block_size == 64
    assert isinstance(CodecError("x"), ValueError)


# ---------------------------------------------------------------- wire header and corrupt payloads


def _small_payloads() -> dict[str, bytes]:
    tensor = _gaussian(300, seed=9).reshape(3, 100)
    return {name: get_codec(name, **({"fraction": 0.1} if name == "topk" else {})).encode(tensor)
            for name in CODEC_NAMES}


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_every_truncation_and_extension_is_refused(name):
    payload = _small_payloads()[name]
    codec = get_codec(name)
    for length in range(len(payload)):
        with pytest.raises(CodecError):
            codec.decode(payload[:length])
    for extra in (b"\0", b"x" * 9):
        with pytest.raises(CodecError, match="oversized"):
            codec.decode(payload + extra)


def test_header_fields_are_validated():
    payload = bytearray(_small_payloads()["int8"])

    def patched(offset: int, fmt: str, value: int) -> bytes:
        copy = bytearray(payload)
        struct.pack_into(fmt, copy, offset, value)
        return bytes(copy)

    cases = [
        (patched(0, "<B", ord("X")), "magic"),
        (patched(4, "<B", 2), "version 2"),
        (patched(5, "<B", 99), "codec id"),
        (patched(6, "<B", 77), "dtype"),
        (patched(10, "<H", 1), "reserved"),
        (patched(12, "<I", 8), "block_size"),
        (patched(16, "<Q", 301), "numel"),
        (patched(16, "<Q", 2**40), "more than the allowed"),
        (patched(FIXED_HEADER_LEN, "<Q", 4), "shape"),
    ]
    for corrupt, message in cases:
        with pytest.raises(CodecError, match=message):
            get_codec("int8").decode(corrupt)
    with pytest.raises(CodecError, match="more than the allowed 299"):
        get_codec("int8").decode(bytes(payload), max_numel=299)
    with pytest.raises(CodecError, match="'int8'"):
        get_codec("int4").decode(bytes(payload))
    with pytest.raises(CodecError, match="bytes-like"):
        get_codec("int8").decode("not bytes")
    assert torch.equal(get_codec("int8").decode(memoryview(payload)), get_codec("int8").decode(bytes(payload)))


def test_header_declaring_billions_of_elements_is_refused_before_allocating():
    fixed = struct.pack("<4sBBBBBBHIQQ", b"SWGC", 1, 0, 0, 1, 0, 1, 0, 0, HARD_MAX_NUMEL + 1, 0)
    forged = fixed + struct.pack("<QQ", HARD_MAX_NUMEL + 1, 4 * (HARD_MAX_NUMEL + 1))
    with pytest.raises(CodecError, match="more than the allowed"):
        decode(forged)
    sparse = get_codec("topk").encode(torch.ones(2**21))  # 20972 kept, fine
    header = decode_header(sparse)
    assert header.aux == 20972
    forged_topk = bytearray(sparse)
    struct.pack_into("<QQ", forged_topk, 16, 2**31, 0)  # numel = 2**31 with the same 20972 entries...
    struct.pack_into("<Q", forged_topk, FIXED_HEADER_LEN, 2**31)  # ...and a matching shape
    with pytest.raises(CodecError):
        get_codec("topk").decode(bytes(forged_topk), max_numel=2**22)


@pytest.mark.parametrize(
    "name, section, value, message",
    [
        ("none", 0, float("nan"), "NaN"),
        ("bf16", 0, float("inf"), "NaN, inf"),
        ("fp16", 0, 3.0, "power of two"),
        ("int8", 0, float("nan"), "scales"),
        ("int4", 0, -1.0, "scales"),
        ("topk", 0, 2.0**121, "scales"),
    ],
)
def test_corrupt_section_values_are_refused(name, section, value, message):
    payload = bytearray(_small_payloads()[name])
    header = decode_header(bytes(payload))
    if name == "bf16":
        struct.pack_into("<H", payload, header.section_offset(section), 0x7F80)  # bfloat16 +inf
    else:
        struct.pack_into("<f", payload, header.section_offset(section), value)
    with pytest.raises(CodecError, match=message):
        get_codec(name).decode(bytes(payload))


# ---------------------------------------------------------------- top-k index coding


@pytest.mark.parametrize(
    "positions, coding",
    [
        ([0, 1, 2, 3, 500], VARINT),
        (list(range(0, 10_000, 300)), VARINT),  # gaps of 299 take 2 varint bytes, but the first takes 1
        (list(range(0, 1_000_000, 20_000)), UINT16),  # gaps of 19999 take 3 varint bytes
        ([2**28 + 5, 2**29 + 10, 2**30 + 20, 2**31 - 1], UINT32),  # every gap >= 2**28 takes 5
        ([127, 128 + 128, 128 + 128 + 16384 + 1, 2**28 + 2**20], VARINT),
    ],
)
def test_index_gaps_round_trip_in_the_smallest_coding(positions, coding):
    indices = torch.tensor(positions, dtype=torch.int64)
    chosen, coded = encode_gaps(indices_to_gaps(indices))
    assert chosen == coding
    decoded = decode_gaps(chosen, coded, len(positions), numel=2**31)
    assert torch.equal(gaps_to_indices(decoded), indices)


def test_topk_positions_past_the_end_are_refused():
    # Each gap (200) is within the tensor, but together they point past its 300 elements.
    forged = pack_payload(
        codec="topk", src_dtype=torch.float32, shape=(300,), numel=300, block_size=16, variant=VARINT, aux=2,
        sections=[torch.tensor([0.01]), torch.tensor([0xC8, 0x01, 0xC8, 0x01], dtype=torch.uint8),
                  torch.tensor([1, -1], dtype=torch.int8)],
    )
    with pytest.raises(CodecError, match="index beyond"):
        get_codec("topk").decode(forged)


def test_malformed_varints_are_refused():
    for coded, count in [([0x80], 1), ([0x01, 0x02], 1), ([0xFF] * 5 + [0x01], 1), ([0x05], 2)]:
        with pytest.raises(CodecError):
            decode_gaps(VARINT, torch.tensor(coded, dtype=torch.uint8), count, numel=2**31)
    with pytest.raises(CodecError, match="beyond"):
        decode_gaps(VARINT, torch.tensor([0x64], dtype=torch.uint8), 1, numel=100)


# ---------------------------------------------------------------- error feedback


@pytest.mark.parametrize("name, options", [("topk", {"fraction": 0.05}), ("int4", {"block_size": 64})])
def test_error_feedback_makes_the_sum_of_decoded_rounds_converge(name, options):
    codec = get_codec(name, **options)
    feedback = ErrorFeedback()
    inputs_sum = torch.zeros(2000, dtype=torch.float64)
    with_feedback_sum = torch.zeros_like(inputs_sum)
    without_feedback_sum = torch.zeros_like(inputs_sum)
    relative_errors = []
    for outer_round in range(60):
        pseudo_gradient = 0.1 + _gaussian(2000, seed=100 + outer_round)  # a persistent direction plus noise
        to_send = feedback.compensate(pseudo_gradient)
        decoded = codec.decode(codec.encode(to_send))
        feedback.update(to_send, decoded)
        inputs_sum += pseudo_gradient.double()
        with_feedback_sum += decoded.double()
        without_feedback_sum += codec.decode(codec.encode(pseudo_gradient)).double()
        # What is still owed is exactly the residual; nothing leaks.
        assert torch.allclose(with_feedback_sum + feedback.residual.double(), inputs_sum, atol=1e-3)
        relative_errors.append(float((with_feedback_sum - inputs_sum).norm() / inputs_sum.norm()))
    without_error = float((without_feedback_sum - inputs_sum).norm() / inputs_sum.norm())
    assert relative_errors[-1] < relative_errors[4] / 3
    assert relative_errors[-1] < without_error / 3


def test_error_feedback_state_round_trips_through_safetensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    feedback = ErrorFeedback()
    assert feedback.state_dict() == {}
    to_send = feedback.compensate(_gaussian(500).reshape(5, 100))
    feedback.update(to_send, get_codec("int4").decode(get_codec("int4").encode(to_send)))
    safetensors_torch.save_file(feedback.state_dict(), str(tmp_path / "ef.safetensors"))
    restored = ErrorFeedback()
    restored.load_state_dict(safetensors_torch.load_file(str(tmp_path / "ef.safetensors")))
    assert torch.equal(restored.residual, feedback.residual)
    next_round = _gaussian(500, seed=1).reshape(5, 100)
    assert torch.equal(restored.compensate(next_round), next_round + feedback.residual)
    with pytest.raises(ValueError, match="elements"):
        restored.compensate(torch.zeros(499))
    with pytest.raises(ValueError, match="unknown"):
        restored.load_state_dict({"residual": torch.zeros(3), "momentum": torch.zeros(3)})


def test_fragment_feedback_keeps_each_fragments_residual_and_restores_only_those_that_fit():
    from swarm.compression import FragmentFeedback

    single, fragments = FragmentFeedback([500]), FragmentFeedback([300, 200])
    codec = get_codec("int4")
    for feedback in (single, fragments):
        for k, size in enumerate(feedback.sizes):
            to_send = feedback[k].compensate(_gaussian(size, seed=k))
            feedback[k].update(to_send, codec.decode(codec.encode(to_send)))
    assert set(single.state_dict()) == {"residual"}  # (a checkpoint of a plain run, as before fragments)
    assert set(fragments.state_dict()) == {"residual.0", "residual.1"}
    restored = FragmentFeedback([300, 200])
    assert restored.load_state_dict(fragments.state_dict()) == 2
    assert all(torch.equal(restored[k].residual, fragments[k].residual) for k in range(2))
    other = FragmentFeedback([250, 250])  # a checkpoint of another cut: nothing of it fits
    assert other.load_state_dict(fragments.state_dict()) == 0 and other.state_dict() == {}
    assert FragmentFeedback([500]).load_state_dict(fragments.state_dict()) == 0
    fragments.reset()
    assert fragments.state_dict() == {}
    # fp16 (2**-11 of each value) and none (exact) keep no residual: 4 bytes a parameter saved, nothing carried
    assert [get_codec(name).error_feedback for name in ("none", "fp16", "bf16", "int8", "int4", "topk")] == \
        [False, False, True, True, True, True]
    for name, kept in (("fp16", False), ("int8", True)):
        feedback, pseudo = FragmentFeedback.for_codec([300], name), _gaussian(300)
        to_send = feedback[0].compensate(pseudo.clone(), in_place=True)
        feedback[0].update(to_send, get_codec(name).decode(get_codec(name).encode(to_send)))
        assert torch.equal(feedback[0].compensate(pseudo), pseudo) != kept and bool(feedback.state_dict()) == kept
        assert feedback.load_state_dict({"residual": torch.ones(300)}) == int(kept)


# ---------------------------------------------------------------- bounded fuzz (scripts/fuzz_codecs.py runs 100k+)


def _check_decode_outcome(payload: bytes, max_numel: int = 4096, decoders=None) -> None:
    """Every decoder either refuses with CodecError or returns a sane tensor; anything else fails the test."""
    for decoder in decoders or [get_codec(name).decode for name in CODEC_NAMES] + [decode]:
        try:
            restored = decoder(payload, max_numel=max_numel)
        except CodecError as error:
            assert "\n" not in str(error)
            continue
        assert restored.dtype == torch.float32 and restored.dim() == 1 and restored.numel() <= max_numel
        if restored.numel():
            assert float(restored.abs().max()) <= MAX_DECODED_ABS


@FUZZ_SETTINGS
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(payload):
    _check_decode_outcome(payload)
    _check_decode_outcome(b"SWGC\x01" + payload)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_every_single_byte_edit_of_header_and_section_starts_is_handled(name):
    # Deterministic and exhaustive where decoding is most fragile: every header byte and the first bytes of every
    # section (scales, the fp16 scale, index gaps), each set to boundary values.
    payload = _small_payloads()[name]
    header = decode_header(payload)
    positions = set(range(header.header_len)) | {len(payload) - 1}
    for index in range(len(header.section_lengths)):
        start = header.section_offset(index)
        positions |= set(range(start, min(start + 8, len(payload))))
    for position in sorted(positions):
        for value in (0x00, 0x01, 0x7F, 0x80, 0xC8, 0xFF, payload[position] ^ 0x01):
            edited = bytearray(payload)
            edited[position] = value
            _check_decode_outcome(bytes(edited), decoders=(get_codec(name).decode, decode))


@FUZZ_SETTINGS
@given(
    name=st.sampled_from(CODEC_NAMES),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
)
def test_fuzz_mutated_valid_payloads(name, edits):
    payload = bytearray(_small_payloads()[name])
    for position, value in edits:
        payload[position % len(payload)] = value
    _check_decode_outcome(bytes(payload))


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(
    values=st.lists(
        st.floats(min_value=-MAX_ABS_VALUE, max_value=MAX_ABS_VALUE, allow_nan=False, width=32),
        min_size=1,
        max_size=300,
    ),
    name=st.sampled_from(CODEC_NAMES),
)
def test_fuzz_error_bound_holds_for_arbitrary_floats(values, name):
    tensor = torch.tensor(np.array(values, dtype=np.float32))
    codec = get_codec(name, **({"block_size": 16} if name in ("int8", "int4") else {}))
    assert bool((_roundtrip_error(codec, tensor) <= codec.error_bound(tensor).double()).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_cuda_tensors_encode_within_the_same_bound(name):
    tensor = _gaussian(10_000, seed=11)
    codec = get_codec(name)
    error = _roundtrip_error(codec, tensor.cuda())
    assert error.device.type == "cpu"
    assert bool((error <= codec.error_bound(tensor).double()).all())


@pytest.mark.parametrize("name", LOSSY)
def test_error_bound_norm_is_the_norm_of_the_bound(name):
    """The reducer check allows each chunk its codec's rounding as the norm of the error bound; fp16 and bf16 work it
    out from sums over the tensor (a closed form, exact in float64 where the bound's elements are float32), the others
    from the bound itself: the same number either way, to far less than the check's 1% slack."""
    codec = get_codec(name)
    for tensor in (_gaussian(200_003, seed=8), _gaussian(70_000, seed=9) * torch.logspace(-30, 30, 70_000)):
        expected = float(torch.linalg.vector_norm(codec.error_bound(tensor), dtype=torch.float64))
        assert codec.error_bound_norm(tensor) == pytest.approx(expected, rel=1e-6)
