"""The check of a reducer's CenteredClip (swarm/averaging/verify.py), in process: honest reducers pass with every
verifiable codec, over many random groups (a false alarm parts an honest pair); a reducer that moves its result,
names a radius out of bounds, or misreports a member's term fails, and the right peer is accused."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.averaging.aggregate import capped_weights, centered_clip_radius
from swarm.averaging.common import chunk_bounds
from swarm.averaging.verify import (Sketch, Term, chunk_norms, judge, lower_median, part_seed, rounding, sketched,
                                    term)
from swarm.compression import get_codec

PART = 3 * 65536 + 1000  # four chunks (the last one short)


def _group(n: int, seed: int, liar: float = 1.0) -> list[torch.Tensor]:
    """n contributions around a common direction; the last scaled by `liar`."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(PART, generator=g) * 0.01
    parts = [common + torch.randn(PART, generator=g) * 0.01 * (0.5 + i / n) for i in range(n)]
    parts[-1] = parts[-1] * liar
    return parts


def _reduce(parts, weights, codec_name: str):
    """What a reducer does: each chunk's CenteredClip, encoded; returns (decoded result, radii, chunks, codec,
    norm caps)."""
    codec = get_codec(codec_name)
    chunks = chunk_bounds(0, PART)
    result, radii, caps = torch.empty(PART), [], []
    for a, b in chunks:
        average, _, radius, cap = centered_clip_radius([p[a:b] for p in parts], weights)
        result[a:b] = codec.decode(codec.encode(average), max_numel=b - a)
        radii.append(radius)
        caps.append(cap)
    return result, radii, chunks, codec, caps


def _verdict(parts, weights, result, radii, chunks, codec, members, me="m0", claims=None, own=None, caps=None):
    sketch = Sketch.of(part_seed("group", [b"n%d" % i for i in range(len(members))], 0), PART)
    true = {m: term(p, result, chunks, radii, sketch, caps) for m, p in zip(members, parts)}
    return judge(me, members[0], members, capped_weights(weights), radii, claims or true, own or true,
                 chunk_norms(result, chunks), rounding([codec] * len(chunks), result, chunks), caps), true


@pytest.mark.parametrize("codec_name", ["none", "fp16", "bf16", "int8", "int4"])
def test_honest_reducers_pass_with_every_verifiable_codec(codec_name):
    for seed in range(4):
        n = 3 + seed % 4
        members = [f"m{i}" for i in range(n)]
        weights = [100.0 * (1 + (i * seed) % 3) for i in range(n)]
        for liar in (1.0, 1000.0, -1.0):  # a lying member, honestly reduced, leaves the check intact
            parts = _group(n, seed, liar)
            result, radii, chunks, codec, caps = _reduce(parts, weights, codec_name)
            verdict, _ = _verdict(parts, weights, result, radii, chunks, codec, members, caps=caps)
            assert verdict.ok, (codec_name, seed, liar, verdict.why)


def test_an_honest_reducer_passes_when_one_member_trained_far_more_than_the_rest():
    """A real swarm's round 0: one peer trained many steps, two joined late and barely moved (norms 30x apart). The
    radius bounds follow the contributions' norms, so the honest reducer's radius meets them (bounds that followed
    the distances to the result excluded each other here, and an honest reducer was accused)."""
    g = torch.Generator().manual_seed(11)
    parts = [torch.randn(PART, generator=g) * 0.001, torch.randn(PART, generator=g) * 0.001,
             torch.randn(PART, generator=g) * 0.03]
    members = ["r", "a", "b"]
    for weights in ([10.0, 12.0, 400.0], [100.0] * 3):
        for codec_name in ("none", "int8"):
            result, radii, chunks, codec, caps = _reduce(parts, weights, codec_name)
            for me in members:
                verdict, _ = _verdict(parts, weights, result, radii, chunks, codec, members, me=me, caps=caps)
                assert verdict.ok, (weights, codec_name, verdict.why)


def _warm_up_group(seed: int) -> list[torch.Tensor]:
    """A real round 0 of four (test_attacks' scaled round, which also fails without its x1000 member): two members
    joined late and took one inner step, AdamW's first, which moves every element by about +-lr at the warm-up's
    first lr (0.003 / 2048) and leaves parameters without a gradient where they were; two trained a few steps, and
    their pseudo-gradients are ~1000x longer and heavy-tailed."""
    g = torch.Generator().manual_seed(seed)
    gradient = torch.randn(PART, generator=g)
    unused = torch.rand(PART, generator=g) < 0.1  # (rows of tokens nobody's batch held)
    late = [torch.where(unused, 0.0, 1.5e-6 * torch.sign(gradient + 2 * torch.randn(PART, generator=g)))
            for _ in range(2)]
    trained = [1e-3 * (gradient + torch.randn(PART, generator=g)) * torch.randn(PART, generator=g).exp()
               for _ in range(2)]
    return late + trained


@pytest.mark.parametrize("codec_name", ["none", "fp16", "int8"])
def test_an_honest_reducer_passes_when_two_members_took_one_warm_up_step(codec_name):
    """The radius is cut to 4x the late members' norms, ~200x less than the trained members' distance, so every
    member is clipped and the fixed point lies ~100 radii from the medoid: plain CenteredClip steps move at most a
    radius each, and after 100 of them the reducer's residual was a tenth of the weight times the radius (0.16
    against a tolerance of 0.04 on the real pseudo-gradients), and every member accused the honest reducer."""
    members = ["late0", "late1", "trained0", "trained1"]
    weights = [256.0, 256.0, 1024.0, 1024.0]  # tokens: one step and four
    for seed in range(2):
        parts = _warm_up_group(seed)
        for order in (members, members[::-1]):  # (the reducer's own contribution comes first)
            ordered = [parts[members.index(m)] for m in order]
            ordered_weights = [weights[members.index(m)] for m in order]
            result, radii, chunks, codec, caps = _reduce(ordered, ordered_weights, codec_name)
            assert max(radii) < 1e-2 * min(float(p.norm()) for p in parts[2:]), "every member is clipped"
            for me in order:
                verdict, _ = _verdict(ordered, ordered_weights, result, radii, chunks, codec, order, me=me,
                                      caps=caps)
                assert verdict.ok, (codec_name, seed, order[0], me, verdict.why)


def test_a_reducer_that_moves_its_result_is_caught_and_accused():
    members = ["r", "a", "b", "c"]
    parts, weights = _group(4, 1), [100.0] * 4
    result, radii, chunks, codec, caps = _reduce(parts, weights, "int8")
    for shift in (result * 1000, result + 0.05 * torch.randn(PART), result * -1):
        verdict, _ = _verdict(parts, weights, shift, radii, chunks, codec, members, me="a", caps=caps)
        assert not verdict.ok and verdict.accused == {"r"}, verdict


def test_a_lie_the_reducer_hides_in_its_own_term_is_bounded():
    """The reducer's own term is the one nobody else can recompute: it may claim any within the radius. The best
    it can do then is cancel the residual of a result moved by about its share of the radius; a larger move fails."""
    members = ["r", "a", "b", "c"]
    parts, weights = _group(4, 2), [100.0] * 4
    result, radii, chunks, codec, caps = _reduce(parts, weights, "none")
    radius_norm = math.sqrt(sum(r * r for r in radii))
    direction = torch.randn(PART)
    for size, caught in ((0.01, False), (3.0, True)):
        moved = result + direction / direction.norm() * size * radius_norm
        sketch = Sketch.of(part_seed("group", [b"n%d" % i for i in range(4)], 0), PART)
        honest = {m: term(p, moved, chunks, radii, sketch, caps) for m, p in zip(members, parts)}
        # The liar's best claim of its own term: minus the others' sum, shortened to the longest it may claim.
        others = sum(torch.tensor(honest[m].sketch, dtype=torch.float64) for m in members[1:])
        own = -others / weights[0] * weights[1]
        longest = math.sqrt(1.5) * radius_norm
        if own.norm() > longest:
            own = own / own.norm() * longest * 0.999
        claims = {**honest, "r": Term(tuple(own.tolist()), honest["r"].norms, honest["r"].distances)}
        verdict = judge("a", "r", members, capped_weights(weights), radii, claims, {**honest, "r": claims["r"]},
                        chunk_norms(moved, chunks), [0.0] * len(chunks), caps)
        assert verdict.ok is not caught, (size, verdict)


def test_radius_out_of_bounds_is_caught():
    members = ["r", "a", "b"]
    parts, weights = _group(3, 3, liar=1000.0), [100.0] * 3
    result, radii, chunks, codec, caps = _reduce(parts, weights, "fp16")
    norms = [float(p[chunks[0][0]:chunks[0][1]].double().norm()) for p in parts]
    for bad in ([1e9] * len(radii), [0.0] * len(radii), [5 * lower_median(norms)] * len(radii)):
        verdict, _ = _verdict(parts, weights, result, bad, chunks, codec, members, me="a", caps=caps)
        assert not verdict.ok and verdict.accused == {"r"}, (bad[0], verdict)


def test_a_norm_cap_other_than_the_members_is_caught():
    """The reducer cuts every contribution to 1.5x the weighted lower median of the chunk's norms; the members
    recompute that cap from the norms they report. A reducer that names a larger cap (letting its own or a
    colluder's x1000 contribution through longer) or none, or a smaller one, is accused."""
    members = ["r", "a", "b", "c"]
    parts, weights = _group(4, 6, liar=1000.0), [100.0] * 4
    result, radii, chunks, codec, caps = _reduce(parts, weights, "int8")
    a, b = chunks[0]
    norms = sorted(float(p[a:b].double().norm()) for p in parts)
    assert caps[0] == pytest.approx(1.5 * norms[1]), "1.5x the lower median of the four norms"
    verdict, _ = _verdict(parts, weights, result, radii, chunks, codec, members, me="a", caps=caps)
    assert verdict.ok, verdict.why
    for bad in ([c * 2 for c in caps], [math.inf] * len(caps), [c / 2 for c in caps]):
        verdict, _ = _verdict(parts, weights, result, radii, chunks, codec, members, me="a", caps=bad)
        assert not verdict.ok and verdict.accused == {"r"}, (bad[0], verdict)
        assert "norm cap" in verdict.why


def test_a_misreported_term_parts_exactly_the_two_who_disagree():
    members = ["r", "a", "b"]
    parts, weights = _group(3, 4), [100.0] * 3
    result, radii, chunks, codec, caps = _reduce(parts, weights, "int8")
    _, true = _verdict(parts, weights, result, radii, chunks, codec, members, caps=caps)
    forged = Term(tuple(x + 1.0 for x in true["a"].sketch), true["a"].norms, true["a"].distances)
    args = (capped_weights(weights), radii)
    extra = (chunk_norms(result, chunks), rounding([codec] * len(chunks), result, chunks), caps)
    # The reducer misreports a's term: a accuses the reducer, b accuses nobody but does not accept the part.
    claims = {**true, "a": forged}
    assert judge("a", "r", members, *args, claims, true, *extra).accused == {"r"}
    verdict = judge("b", "r", members, *args, claims, true, *extra)
    assert not verdict.ok and not verdict.accused
    # a misreports its own term: the reducer accuses a, b accuses nobody.
    own = {**true, "a": forged}
    assert judge("r", "r", members, *args, true, own, *extra).accused == {"a"}
    verdict = judge("b", "r", members, *args, true, own, *extra)
    assert not verdict.ok and not verdict.accused


def test_terms_survive_the_wire_and_malformed_ones_are_refused():
    result = torch.randn(PART)
    chunks = chunk_bounds(0, PART)
    sketch = Sketch.of(b"\x01" * 32, PART)
    t = term(result * 2, result, chunks, [1.0] * len(chunks), sketch)
    assert Term.from_wire(t.to_wire(), len(chunks)) == t
    assert Term.from_wire(t.to_wire(), len(chunks) + 1) is None
    assert Term.from_wire([[float("nan")] * 1024, [1.0] * 4, [1.0] * 4], 4) is None
    assert Term.from_wire("x", 4) is None


def test_the_sketch_worked_out_in_blocks_is_the_count_sketch_of_the_clipped_offsets():
    """Sketch.offsets works SKETCH_BLOCK elements at a time, from whole parts or their pieces chunk by chunk; it
    must give what one float64 pass over the whole clipped, cut offset vector gives (every slot of every block
    counted once, with its sign, each chunk's cut and scale applied to its own elements only)."""
    g = torch.Generator().manual_seed(7)
    contribution, result = torch.randn(PART, generator=g), torch.randn(PART, generator=g)
    chunks = chunk_bounds(0, PART)
    cuts, scales = [1.0, 0.5, 1.0, 0.25], [0.3, 1.0, 1.0, 0.7]
    sketch = Sketch.of(b"\x02" * 32, PART)
    assert int(sketch.slots.min()) >= 0 and int(sketch.slots.max()) < 2048
    offsets = torch.empty(PART, dtype=torch.float64)
    for (a, b), cut, scale in zip(chunks, cuts, scales):
        offsets[a:b] = ((contribution[a:b] * cut - result[a:b]) * scale).double()
    sums = torch.zeros(2048, dtype=torch.float64).index_add_(0, sketch.slots.long(), offsets)
    expected = sums[:1024] - sums[1024:]
    whole = sketch.offsets([contribution[a:b] for a, b in chunks], result, chunks, cuts, scales)
    assert torch.allclose(whole, expected, rtol=1e-12, atol=1e-9)
    stats = [(0.0, 0.0, scale, cut) for cut, scale in zip(cuts, scales)]
    assert sketched(contribution, result, chunks, stats, sketch).sketch == tuple(whole.tolist())
    assert torch.allclose(sketch.apply(offsets.float()), expected, rtol=1e-6, atol=1e-4)

