"""Which codec, aggregator, ring mode and reducer verification go together: the one table that the recipe's
validation (swarm/config.py) and the all-reduce (swarm/averaging/) both read, and that docs/design.md prints.

- A ring passes on partial sums: only the mean can combine them (no robust aggregate is a running sum), and only a
  lossless codec keeps them (a lossy one would re-quantize the sums at every hop).
- Members can check a reducer's CenteredClip (swarm/averaging/verify.py), whose result is the fixed point of a sum
  of per-member terms, not a mean's or a trimmed mean's; and only where a codec's rounding can be bounded from what
  it decoded (top-k's dropped values decode to zero, so its error cannot be read off the result; the sparse codec's
  averages travel back with every position they have, compression/sparse.py, so theirs can).
- Whatever the recipe says, a group of two is not checked (either member could have sent anything).
"""

from __future__ import annotations

from typing import Optional

# The codecs a recipe may name: swarm/compression/registry.py's, listed here so that checking a recipe loads no
# torch (a bootstrap needs none); tests/test_config.py holds the two lists equal.
CODEC_NAMES = ("none", "fp16", "bf16", "int8", "int4", "topk", "sparse")
AGGREGATORS = ("mean", "trimmed_mean", "centered_clip")
RING_MODES = ("auto", "always", "never")
LOSSLESS_CODECS = ("none",)
RING_AGGREGATORS = ("mean",)
VERIFIABLE_AGGREGATORS = ("centered_clip",)
VERIFIABLE_CODECS = ("none", "fp16", "bf16", "int8", "int4", "sparse")
MIN_VERIFIED_GROUP = 3


def ring_can_carry(codec: str, aggregator: str) -> bool:
    """Whether groups of this codec and aggregator may average along a ring (where `averaging.ring` allows)."""
    return codec in LOSSLESS_CODECS and aggregator in RING_AGGREGATORS


def reducers_verified(codec: str, aggregator: str, verify_reducers: bool) -> bool:
    """Whether members check their reducers in a run of these settings (in groups of MIN_VERIFIED_GROUP or more)."""
    return verify_reducers and aggregator in VERIFIABLE_AGGREGATORS and codec in VERIFIABLE_CODECS


def problem(aggregator: str, ring: str) -> Optional[str]:
    """Why a recipe's averaging settings do not go together (one line naming the fields and the fix), or None."""
    if ring == "always" and aggregator not in RING_AGGREGATORS:
        return (f"averaging.ring: always needs averaging.aggregator: mean (a ring passes on partial sums, which "
                f"{aggregator} cannot combine); set one or the other")
    return None  # (ring: always with a lossy codec is allowed: its groups use the butterfly, as with `never`)


def table(codecs: tuple[str, ...]) -> list[tuple[str, str, str, str]]:
    """(codec, aggregator, ring, reducers checked) for every codec of `codecs` and every aggregator: what
    docs/design.md prints (a test holds the two equal)."""
    rows = []
    for codec in codecs:
        for aggregator in AGGREGATORS:
            ring = "auto or always" if ring_can_carry(codec, aggregator) else "never"
            checked = (f"yes, in groups of {MIN_VERIFIED_GROUP}+, unless verify_reducers: false"
                       if reducers_verified(codec, aggregator, True) else "no")
            rows.append((codec, aggregator, ring, checked))
    return rows
