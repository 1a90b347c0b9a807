"""Fuzz every swarm.compression decoder with mutated valid payloads and random bytes.

Each input goes to all six codec decoders and to the header-dispatching `decode`; each call must either raise
CodecError or return a flat float32 tensor of the declared size with |x| <= 2**127. Prints a table per decoder
and per mutation, then one JSON line. Exit status 1 if anything else happened.

    python scripts/fuzz_codecs.py                   # 100,000 inputs, seed 0
    python scripts/fuzz_codecs.py --inputs 2000 --seed 3
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.compression import CODEC_NAMES, MAX_DECODED_ABS, CodecError, decode, decode_header, get_codec  # noqa: E402
from swarm.compression.index_coding import UINT32, VARINT  # noqa: E402
from swarm.compression.wire import FIXED_HEADER_LEN, pack_payload  # noqa: E402

MAX_NUMEL = 2**20  # what a receiver passes: the size of the part it expects
INTERESTING_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFE, 0xFF)
# (offset, struct format) of each fixed header field, after the 4-byte magic
FIXED_FIELDS = {
    "version": (4, "<B"), "codec_id": (5, "<B"), "dtype": (6, "<B"), "ndim": (7, "<B"), "variant": (8, "<B"),
    "n_sections": (9, "<B"), "reserved": (10, "<H"), "block_size": (12, "<I"), "numel": (16, "<Q"), "aux": (24, "<Q"),
}


def seed_payloads() -> list[bytes]:
    """Valid payloads of every codec over awkward shapes and values, including hand-packed rare top-k codings."""
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(shape, generator=generator) * scale
        for shape, scale in [((0,), 1.0), ((), 1.0), ((1,), 1.0), ((5,), 1e30), ((3, 100), 1.0), ((257,), 1e-30),
                             ((2, 2, 2, 2), 1.0), ((1000,), 1e-3)]
    ]
    tensors.append(torch.zeros(64))
    seeds = []
    for tensor in tensors:
        for name in CODEC_NAMES:
            seeds.append(get_codec(name).encode(tensor))
        seeds.append(get_codec("int8", block_size=16).encode(tensor))
        seeds.append(get_codec("int4", block_size=17).encode(tensor))
        seeds.append(get_codec("topk", fraction=0.3, block_size=16).encode(tensor))
        seeds.append(get_codec("sparse", per_chunk=4, chunk=16).encode(tensor))
        seeds.append(get_codec("support").encode(tensor))  # (a reducer's: every nonzero position)
    sparse = torch.zeros(200_000)
    sparse[[7, 90_000, 199_999]] = torch.tensor([1.0, -2.0, 3.0])
    seeds.append(get_codec("topk", fraction=1e-5).encode(sparse))  # varint gaps of 3 bytes
    for coding, gaps in [(UINT32, torch.tensor([3, 10, 100], dtype=torch.int32)),
                         (VARINT, torch.tensor([3, 10, 100], dtype=torch.uint8))]:
        seeds.append(pack_payload(
            codec="topk", src_dtype=torch.float32, shape=(300,), numel=300, block_size=16, variant=coding, aux=3,
            sections=[torch.tensor([0.01]), gaps, torch.tensor([1, -127, 64], dtype=torch.int8)],
        ))
    return seeds


def mutate(rng: random.Random, seeds: list[bytes]) -> tuple[str, bytes]:
    """Returns (mutation name, input). Most mutations start from a valid payload so they reach codec code."""
    base = bytearray(rng.choice(seeds))
    kind = rng.choice(MUTATIONS)
    if kind == "random_bytes":
        return kind, rng.randbytes(rng.randrange(0, 300))
    if kind == "valid_magic_random_rest":
        return kind, b"SWGC\x01" + bytes([rng.randrange(6)]) + rng.randbytes(rng.randrange(0, 300))
    if kind == "bit_flips":
        for _ in range(rng.randint(1, 8)):
            position = rng.randrange(len(base))
            base[position] ^= 1 << rng.randrange(8)
    elif kind == "byte_overwrite":
        for _ in range(rng.randint(1, 4)):
            base[rng.randrange(len(base))] = rng.choice(INTERESTING_BYTES + (rng.randrange(256),))
    elif kind == "body_overwrite":  # aims past the header, at scales, indices and codes
        header = decode_header(bytes(base))
        if header.total_len > header.header_len:
            for _ in range(rng.randint(1, 6)):
                base[rng.randrange(header.header_len, header.total_len)] = rng.randrange(256)
    elif kind == "truncate":
        del base[rng.randrange(len(base)):]
    elif kind == "append":
        base += rng.randbytes(rng.randint(1, 64))
    elif kind == "header_field":
        offset, fmt = FIXED_FIELDS[rng.choice(list(FIXED_FIELDS))]
        struct.pack_into(fmt, base, offset, _interesting_int(rng, fmt))
    elif kind == "shape_or_length_word":
        header = decode_header(bytes(base))
        n_words = len(header.shape) + len(header.section_lengths)
        if n_words:
            struct.pack_into("<Q", base, FIXED_HEADER_LEN + 8 * rng.randrange(n_words), _interesting_int(rng, "<Q"))
    elif kind == "consistent_numel":  # keeps shape == numel so the header passes and codec checks are reached
        base = _with_numel(base, rng.choice([0, 1, 2, 255, 256, 257, rng.randrange(1, 5000), MAX_NUMEL + 1]))
    elif kind == "move_section_bytes":  # section lengths still add up, but split differently
        base = _move_section_bytes(rng, base)
    elif kind == "splice":
        other = rng.choice(seeds)
        cut = rng.randrange(FIXED_HEADER_LEN, len(base) + 1)
        base = base[:cut] + other[rng.randrange(len(other) + 1):]
    return kind, bytes(base)


MUTATIONS = ("random_bytes", "valid_magic_random_rest", "bit_flips", "byte_overwrite", "body_overwrite", "truncate",
             "append", "header_field", "shape_or_length_word", "consistent_numel", "move_section_bytes", "splice")


def _interesting_int(rng: random.Random, fmt: str) -> int:
    bits = struct.calcsize(fmt) * 8
    return rng.choice([0, 1, 2, 3, 5, 16, 255, 2**bits - 1, 2 ** (bits - 1), rng.randrange(2**bits), 2**31, 2**31 + 1]
                      ) % 2**bits


def _with_numel(base: bytearray, numel: int) -> bytearray:
    header = decode_header(bytes(base))
    if len(header.shape) != 1:
        return base
    struct.pack_into("<Q", base, 16, numel)
    struct.pack_into("<Q", base, FIXED_HEADER_LEN, numel)
    return base


def _move_section_bytes(rng: random.Random, base: bytearray) -> bytearray:
    header = decode_header(bytes(base))
    lengths = list(header.section_lengths)
    if len(lengths) < 2:
        return base
    source, target = rng.sample(range(len(lengths)), 2)
    moved = rng.randint(0, lengths[source])
    lengths[source] -= moved
    lengths[target] += moved
    struct.pack_into(f"<{len(lengths)}Q", base, FIXED_HEADER_LEN + 8 * len(header.shape), *lengths)
    return base


def check_outcome(decoder, payload: bytes) -> str:
    """'ok', 'refused', or a failure description."""
    try:
        restored = decoder(payload, max_numel=MAX_NUMEL)
    except CodecError as error:
        return "refused" if "\n" not in str(error) else "failure: multi-line CodecError"
    except Exception as error:  # noqa: BLE001 - any other exception is exactly what the fuzzer hunts
        return f"failure: {type(error).__name__}: {error}"[:200]
    if not (isinstance(restored, torch.Tensor) and restored.dtype == torch.float32 and restored.dim() == 1):
        return "failure: decoded something other than a flat float32 tensor"
    if restored.device.type != "cpu" or restored.numel() != decode_header(payload).numel:
        return "failure: decoded tensor does not match the header"
    if restored.numel() and not float(restored.abs().max()) <= MAX_DECODED_ABS:
        return "failure: decoded NaN, inf or |x| > 2**127"
    return "ok"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=100_000, help="number of fuzz inputs (each hits 9 decoders)")
    parser.add_argument("--seed", type=int, default=0, help="random seed; a run is reproducible from it")
    args = parser.parse_args()
    torch.set_num_threads(1)  # inputs are tiny: thread hand-off would cost more than the work

    rng = random.Random(args.seed)
    seeds = seed_payloads()
    decoders = {name: get_codec(name).decode for name in (*CODEC_NAMES, "support")} | {"decode()": decode}
    by_decoder = {name: Counter() for name in decoders}
    by_mutation = {name: Counter() for name in MUTATIONS}
    failures: list[dict] = []
    started = time.perf_counter()
    for _ in range(args.inputs):
        mutation, payload = mutate(rng, seeds)
        for name, decoder in decoders.items():
            outcome = check_outcome(decoder, payload)
            bucket = "failure" if outcome.startswith("failure") else outcome
            by_decoder[name][bucket] += 1
            by_mutation[mutation][bucket] += 1
            if bucket == "failure" and len(failures) < 10:
                failures.append({"decoder": name, "mutation": mutation, "outcome": outcome, "hex": payload.hex()})
    seconds = time.perf_counter() - started

    print(f"{'decoder':<10} {'calls':>8} {'decoded':>8} {'refused':>8} {'failures':>8}")
    for name, counts in by_decoder.items():
        print(f"{name:<10} {sum(counts.values()):>8} {counts['ok']:>8} {counts['refused']:>8} {counts['failure']:>8}")
    print(f"\n{'mutation':<24} {'calls':>8} {'decoded':>8} {'refused':>8} {'failures':>8}")
    for name, counts in by_mutation.items():
        print(f"{name:<24} {sum(counts.values()):>8} {counts['ok']:>8} {counts['refused']:>8} {counts['failure']:>8}")
    for failure in failures:
        print(f"FAILURE {failure['decoder']} after {failure['mutation']}: {failure['outcome']}\n  {failure['hex']}")
    total_failures = sum(counts["failure"] for counts in by_decoder.values())
    print(f"\n{args.inputs} inputs, {sum(sum(c.values()) for c in by_decoder.values())} decoder calls, "
          f"{total_failures} failures, {seconds:.1f} s")
    print(json.dumps({
        "inputs": args.inputs, "seed": args.seed, "seeds": len(seeds), "decoder_calls": sum(
            sum(c.values()) for c in by_decoder.values()), "failures": total_failures, "seconds": round(seconds, 1),
        "by_decoder": {name: dict(counts) for name, counts in by_decoder.items()},
    }))
    return 1 if total_failures else 0


if __name__ == "__main__":
    sys.exit(main())
