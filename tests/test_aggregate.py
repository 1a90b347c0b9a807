"""The reducers' aggregates (swarm/averaging/aggregate.py) on their own: the mean's bits, CenteredClip's and the
trimmed mean's bounds against lying contributions (scaled, sign-flipped, inflated weights, 1 and 2 of 6), and that
without a liar CenteredClip is the mean exactly."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.averaging import verify
from swarm.combinations import AGGREGATORS
from swarm.averaging.aggregate import (OTHERS_SHARE, WEIGHT_SPREAD, aggregator, capped_weights,
                                      centered_clip, centered_clip_radius, mean, trimmed, trimmed_mean)
from swarm.averaging.verify import NORM_SPREAD

NUMEL = 50_000


def _honest(n: int, noise: float = 1.0, seed: int = 0) -> list[torch.Tensor]:
    """n pseudo-gradients that share a direction, each with its own noise (as peers' data differ)."""
    common = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 + seed))
    return [common + noise * torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed * 100 + i))
            for i in range(n)]


def _error(result: torch.Tensor, honest: list[torch.Tensor]) -> float:
    """How far `result` is from the honest members' mean, in units of their largest distance to it."""
    target = torch.stack(honest).mean(0)
    return float((result - target).norm()) / max(float((h - target).norm()) for h in honest)


def test_the_mean_sums_in_order_like_the_butterfly_always_did():
    parts, weights = _honest(4), [1.0, 2.0, 3.0, 4.0]
    expected = parts[0] * 1.0
    for part, weight in zip(parts[1:], weights[1:]):
        expected += part * weight
    average, total = mean(parts, weights)
    assert torch.equal(average, expected / 10.0) and total == 10.0


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("noise", [0.1, 1.0, 5.0])
def test_without_a_liar_centered_clip_is_the_mean_exactly(n, noise):
    parts, weights = _honest(n, noise, seed=n), [1.0 + (i % 3) * 0.25 for i in range(n)]
    robust, total = centered_clip(parts, weights)
    plain, plain_total = mean(parts, capped_weights(weights))
    assert torch.equal(robust, plain) and total == plain_total


@pytest.mark.parametrize("name", ["centered_clip", "trimmed_mean"])
@pytest.mark.parametrize("n, liars", [(3, 1), (4, 1), (6, 1), (6, 2)])
@pytest.mark.parametrize("lie", ["scaled", "flipped", "flipped x10"])
def test_a_minority_of_liars_moves_a_robust_aggregate_a_bounded_way(name, n, liars, lie):
    """Liars send a lie made from their own honest pseudo-gradient. A robust aggregate ends within about the
    honest members' spread of their mean (the bound grows with the liars' share); the mean is taken anywhere."""
    parts = _honest(n)
    honest = parts[:n - liars]
    factor = {"scaled": 1000.0, "flipped": -1.0, "flipped x10": -10.0}[lie]
    sent = honest + [factor * p for p in parts[n - liars:]]
    bound = 1.0 if liars / n < 0.25 else 2.0
    robust, _ = aggregator(name)(sent, [1.0] * n)
    assert _error(robust, honest) < bound, (name, lie, _error(robust, honest))
    if lie == "scaled":
        assert _error(mean(sent, [1.0] * n)[0], honest) > 50 * bound, "the lie would have moved the mean"


@pytest.mark.parametrize("n", [3, 4, 6])
@pytest.mark.parametrize("noise", [1.0, 3.0])
def test_a_scaled_member_counts_as_an_honest_one_cut_to_the_norm_cap(n, noise, monkeypatch):
    """A member sending x1000 of its honest pseudo-gradient is cut to 1.5x the (weighted) lower median of the norms:
    it moves CenteredClip from the honest mean by about its share of (cap - its honest norm), as an honest member
    1.5x longer would. Without the cap it counted a radius past the result (~1.5x the honest members' distances): 2.5-4x
    further in these groups, every round, in the direction of its lie."""
    parts = _honest(n, noise)
    honest_mean, _ = mean(parts, [1.0] * n)
    sent = parts[:-1] + [parts[-1] * 1000]
    norms = sorted(float(p.double().norm()) for p in parts)
    bound = (NORM_SPREAD * norms[(n - 1) // 2] - float(parts[-1].double().norm())) / n
    capped, _ = centered_clip(sent, [1.0] * n)
    assert float((capped - honest_mean).norm()) <= 1.05 * bound, (float((capped - honest_mean).norm()), bound)
    monkeypatch.setattr(verify, "NORM_SPREAD", math.inf)
    uncapped, _ = centered_clip(sent, [1.0] * n)
    assert float((uncapped - honest_mean).norm()) > 2.5 * float((capped - honest_mean).norm())


def test_members_that_barely_trained_do_not_cut_the_ones_that_did():
    """A round 0 of four: two members joined late and took one step (1000x shorter pseudo-gradients, a quarter of
    the tokens), two trained four. The norm cap is the median weighted by tokens, so it follows the members that
    trained, and nobody honest is cut; the unweighted lower median would cut the trained ones to 1.5x a step."""
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(NUMEL, generator=g) * 1e-6 for _ in range(2)] + \
        [torch.randn(NUMEL, generator=g) * 1e-3 for _ in range(2)]
    weights = capped_weights([256.0, 256.0, 1024.0, 1024.0])
    _, _, _, cap = centered_clip_radius(parts, weights)
    assert cap >= NORM_SPREAD * min(float(p.double().norm()) for p in parts[2:])
    assert cap > max(float(p.double().norm()) for p in parts)


def test_an_inflated_weight_counts_as_at_most_the_spread_times_the_median():
    parts = _honest(4)
    weights = [100.0, 120.0, 90.0, 1e9]
    assert capped_weights(weights) == [100.0, 120.0, 90.0, WEIGHT_SPREAD * 100.0]
    liar = parts[:3] + [parts[3] * 1000]
    robust, total = centered_clip(liar, weights)
    assert total == 310.0 + WEIGHT_SPREAD * 100.0, "the total weight counts the capped weight"
    assert _error(robust, parts[:3]) < 2.0
    assert _error(trimmed_mean(liar, weights)[0], parts[:3]) < 2.0


@pytest.mark.parametrize("lie", [1e3, -1e3, 1e6])
def test_no_member_holds_half_the_weight_when_honest_weights_differ(lie):
    """Three members of honest weights 1 and 2 and a liar declaring 4: the median cap alone left the liar 3 of 6,
    half the weight, and CenteredClip breaks down at half (its fixed point follows the liar as far as it goes). The
    cap on a member's share of the others' total leaves it 3/7, and the result stays near the honest members."""
    parts = _honest(3)
    weights = [1.0, 2.0, 4.0]
    capped = capped_weights(weights)
    assert capped == [1.0, 2.0, OTHERS_SHARE * 3.0] and max(capped) / sum(capped) <= 3 / 7 + 1e-12
    for many in ([1.0] * 4 + [50.0], [0.5, 1.0, 1.0, 1.5, 1.5, 1e9], [3.0, 1.0, 1.0]):
        shares = [w / sum(capped_weights(many)) for w in capped_weights(many)]
        assert max(shares) <= 3 / 7 + 1e-12, (many, shares)
    sent = parts[:2] + [parts[2] * lie]
    robust, total = centered_clip(sent, weights)
    assert total == sum(capped)
    assert _error(robust, parts[:2]) < 3.0, _error(robust, parts[:2])


def test_members_that_trained_nothing_do_not_cap_the_others_to_nothing():
    """A pipeline stage's peer that no microbatch reached hands in weight 0. With the median over all weights, a
    group of one trained member and two idle ones capped every weight to 0, and the aggregate was 0/0: NaN, which
    the codec refused and the peer died of. The cap follows the members that trained; the idle ones count nothing,
    and zero weights from Sybils cannot cap honest members either."""
    parts = _honest(3)
    assert capped_weights([8192.0, 0.0, 0.0]) == [8192.0, 0.0, 0.0]
    assert capped_weights([100.0, 0.0, 0.0, 0.0, 120.0, 1e9]) == [100.0, 0.0, 0.0, 0.0, 120.0, OTHERS_SHARE * 220.0]
    for name in AGGREGATORS:
        average, total = aggregator(name)(parts, [8192.0, 0.0, 0.0])
        assert total == 8192.0 and torch.isfinite(average).all(), name
        assert torch.allclose(average, parts[0], atol=1e-6), (name, "the one member that trained is the average")


def test_the_trimmed_mean_drops_each_coordinate_s_extremes():
    parts = [torch.tensor([1.0, -5.0]), torch.tensor([2.0, 0.0]), torch.tensor([3.0, 1.0]),
             torch.tensor([100.0, 2.0])]
    assert trimmed(2) == 0 and trimmed(3) == 1 and trimmed(4) == 1 and trimmed(6) == 2
    average, total = trimmed_mean(parts, [1.0, 1.0, 3.0, 1.0])
    # Per coordinate, the middle two remain: (2, 3) with weights (1, 1.5: 3 capped at 1.5x the median 1),
    # and (0, 1) with weights (1, 1.5).
    torch.testing.assert_close(average, torch.tensor([(2 + 3 * 1.5) / 2.5, (0 + 1.5) / 2.5]))
    assert total == 4.5


@pytest.mark.parametrize("far", [1e3, 1e9])
def test_centered_clip_reaches_its_fixed_point_when_every_member_is_clipped(far, monkeypatch):
    """Two members barely moved, two moved `far` times as much and hold 3/5 of the capped weight: the radius is cut
    to 4x the small norms, every member is clipped, and the fixed point lies far from the medoid (plain steps, a
    radius each at most, stopped short of it). The sum members check (verify.py) vanishes at the result. (The
    norm cap now cuts such far members first; without it, the fixed point must still be found.)"""
    monkeypatch.setattr(verify, "NORM_SPREAD", math.inf)
    g = torch.Generator().manual_seed(5)
    small = [torch.randn(NUMEL, generator=g) * 1e-3 for _ in range(2)]
    parts = small + [(torch.randn(NUMEL, generator=g) + 1.0) * 1e-3 * far for _ in range(2)]
    weights = capped_weights([1.0, 1.0, 4.0, 4.0])
    result, total, tau, _ = centered_clip_radius(parts, weights)
    pull = torch.zeros(NUMEL, dtype=torch.float64)
    for part, weight in zip(parts, weights):
        offset = part.double() - result.double()
        pull += weight * offset * min(1.0, tau / float(offset.norm()))
    assert min(float((p - result).norm()) for p in parts) > tau, "every member is clipped"
    assert float(pull.norm()) < 1e-5 * total * tau, float(pull.norm()) / (total * tau)
