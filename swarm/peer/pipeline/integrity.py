"""What a stage peer may not claim about itself (issue 37, class 9): how fast it is, and that its answers are sound.
`routing_weights` weighs the next stage's peers by the throughput we measured of them (an unmeasured one starts at
the median of the measured, and none weighs more than WEIGHT_CAP times the median), never by an announced rate
alone. `AnswerCheck` keeps each peer's recent answers' statistics and refuses an answer far outside what the other
peers answer (a strict majority of them) or what the same peer answered before, and leaves out for EXCLUDE_SECONDS a
peer with STRIKES answers refused in a row. `decide` compares two peers' answers to one microbatch (a sampled share
is computed twice, routing.py), with a third peer's when they disagree, and names the peer outvoted. Pure functions
and O(1) bookkeeping per microbatch, beyond the norms of what it checks."""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

PRIOR_CAP = 2.0  # while nobody is measured, an announced rate counts for at most this many times the median announced
WEIGHT_CAP = 4.0  # no peer weighs more than this many times the median weight: a fast liar takes a bounded share
RATE_SMOOTHING = 0.3  # the weight of a peer's newest hop in its measured rate (an exponential average)
WINDOW = 16  # answers of each peer whose statistics are kept
MIN_ANSWERS = 3  # a peer's own history sets its scale from this many answers on
MIN_EVIDENCE = 2  # and weighs in judging the other peers' answers from this many on
EXCLUDE_SECONDS = 600.0  # how long a peer whose answers were refused is left out (about a round)
# Refused answers in a row that leave a peer out. One refused answer costs a retry; an honest peer's answers reached
# 10x the median of its last 16 in 3 of 584 microbatches of a tiny model memorising its data (loss 4 to 0.01), never
# twice in a row, while a liar's answers are refused one after the other.
STRIKES = 2
FRESH_SECONDS = 300.0  # a peer's answers weigh in judging the others' while its last one is this recent


@dataclass(frozen=True)
class Rule:
    """When a statistic's value `v` disagrees with a reference `ref` (a median): v > ref * factor + slack or
    v < ref / factor - slack; `factor` against the other peers' answers, `own_factor` against the peer's own."""

    factor: float
    own_factor: float
    slack: float = 1e-12
    upper_only: bool = False  # only a value too large disagrees
    # a value far from the peer's own is refused only where the other peers' (one or more) are as far: what grows
    # for every peer at once (a stage's activations as its first outer steps move its embeddings) is no lie. One
    # other is enough: with two senders, the one that sent little early (its history from the init) came 174x over
    # it once the stage's averaged params moved, was refused by every next-stage peer, then left out (a full test run)
    own_unless_others: bool = False

    def disagrees(self, value: float, ref: float, own: bool = False) -> bool:
        factor = self.own_factor if own else self.factor
        if math.isinf(factor):
            return False
        return value > ref * factor + self.slack or (not self.upper_only and value < ref / factor - self.slack)


# What a next stage answers. sensitivity: |x| * |dL/dx| / scale, the change of the microbatch's loss per relative
# change of the activations' scale: the norm of the gradient alone shrinks as the activations grow (the next stage
# normalizes them), and the microbatch's share of its batch (`scale`) multiplies it. loss: the microbatch's loss.
ANSWER_RULES = {"sensitivity": Rule(factor=10.0, own_factor=100.0),
                "loss": Rule(factor=2.0, own_factor=4.0, slack=1.0)}
# What the stage before sends: the root mean square of its activations, held only to its own sender's earlier ones
# of the same round (x100 up; server.StageServer._judge): honest senders of one stage may hold very different params
# (one starting the stage from the recipe's init sent activations 1/20,000 of a trained one's in
# tests/test_pipeline.py's rebalancing run), so no sender is judged by the others' by this rule (LOSS_RULES below
# judge them by what they predict).
REQUEST_RULES = {"activations": Rule(factor=math.inf, own_factor=100.0, upper_only=True, own_unless_others=True)}
# Where a last stage follows the first, the loss of each sender's microbatches there, before anything is applied, is
# held to the other senders' (not the sender's own: a loss falls as the stage learns): activations that are not the
# first stage's computation predict nothing, and their loss stays near ln(vocabulary) while the honest ones' falls. On
# tests/recipes/stages.yaml (vocabulary 512, ln 6.24), after 10, 40, 100 and 200 steps of the whole model, honest
# activations gave 5.51, 4.78, 4.67, 4.23 and noise of their norm 6.22, 6.19, 6.43, 6.51 (activations of other
# rows and positions 5.52, 5.30, 5.91, 6.24): a loss more than LOSS_SLACK above the others' is refused, so garbage
# is caught once the stage has learnt that much, and not before (at the recipe's init nothing tells them apart). Each
# microbatch is judged, and none leaves its sender out: honest senders give higher losses for a while too (one a
# round behind early in a run, when a round takes a nat off the loss; one starting a stage that lost its hosts from
# the recipe's init), and are refused until they catch up, not banished. Only senders heard from in the last
# LOSS_FRESH_SECONDS weigh in (a sender that died or moved is no reference for one that took its place).
LOSS_SLACK = 0.5
LOSS_FRESH_SECONDS = 10.0
LOSS_RULES = {"loss": Rule(factor=1.0, own_factor=math.inf, slack=LOSS_SLACK, upper_only=True)}


def sensitivity(x: torch.Tensor, grad: torch.Tensor, scale: float) -> float:
    """|x| * |grad| / scale (see ANSWER_RULES)."""
    return float(x.detach().float().norm()) * float(grad.detach().float().norm()) / scale


def rms(x: torch.Tensor) -> float:
    return float(x.detach().float().pow(2).mean().sqrt()) if x.numel() else 0.0


def routing_weights(candidates: Sequence[tuple[str, float]], measured: dict[str, float]) -> list[float]:
    """A weight for each of `candidates` (peer id, announced tokens/s): its measured tokens/s where `measured` has
    it; an unmeasured peer the median of the candidates' measured rates, or, while none is measured, its announced
    rate up to PRIOR_CAP times the median announced. Each is then kept within WEIGHT_CAP times the median weight, so
    one peer (however fast it answers, or says it is) takes at most about WEIGHT_CAP times a fair share, and one
    measured slow once (a cold start) still gets microbatches to be measured again."""
    if not candidates:
        return []
    known = [measured[peer] for peer, _ in candidates if peer in measured]
    if known:
        prior = statistics.median(known)
        weights = [measured.get(peer, prior) for peer, _ in candidates]
    else:
        announced = statistics.median(max(speed, 0.0) for _, speed in candidates)
        weights = [min(max(speed, 0.0), PRIOR_CAP * announced) for _, speed in candidates]
    middle = statistics.median(weights)
    return [max(min(w, WEIGHT_CAP * middle), middle / WEIGHT_CAP, 1e-9) for w in weights]


def smoothed(previous: Optional[float], rate: float) -> float:
    """A peer's measured rate after one more hop at `rate`."""
    return rate if previous is None else (1 - RATE_SMOOTHING) * previous + RATE_SMOOTHING * rate


@dataclass
class AnswerCheck:
    """Each peer's last WINDOW accepted values of each statistic of `rules`, and the peers left out. `judge` accepts
    (and records) or refuses one answer; a peer with `limit` answers refused in a row is left out for EXCLUDE_SECONDS
    and its history forgotten, so it weighs in no judgement of the others."""

    rules: dict[str, Rule]
    limit: Optional[int] = STRIKES  # refusals in a row that leave a peer out (None: refused, never left out)
    fresh: float = FRESH_SECONDS  # another peer's answers weigh in a judgement while its last is this recent
    history: dict[str, dict[str, deque]] = field(default_factory=dict)
    excluded: dict[str, tuple[float, str]] = field(default_factory=dict)  # peer -> (until, time.monotonic; why)
    disputes: int = 0  # answers two lone peers disagreed on (nobody to tell who lies: accepted)
    strikes: dict[str, int] = field(default_factory=dict)  # peer -> its answers refused in a row
    answered_at: dict[str, float] = field(default_factory=dict)  # peer -> when its last accepted answer came
    epochs: dict[str, int] = field(default_factory=dict)  # peer -> the round its own history is of (judge's epoch)

    def is_excluded(self, peer: str, now: Optional[float] = None) -> bool:
        left_out = self.excluded.get(peer)
        return left_out is not None and (time.monotonic() if now is None else now) < left_out[0]

    def judge(self, peer: str, values: dict[str, float], now: Optional[float] = None,
              epoch: Optional[int] = None) -> Optional[str]:
        """None, and `values` recorded as `peer`'s: its answer is accepted. Otherwise why it is refused, with the
        numbers (one line); at its `limit`-th refusal in a row `peer` is left out (is_excluded). An answer is refused
        when a statistic disagrees (its Rule) with the median of the peer's own last answers (from MIN_ANSWERS on:
        the first answers set the scale; with `own_unless_others`, not where it is within the own factor of the
        median of the other peers' latest values, one or more), or with the medians of a strict majority of the other
        peers not left out that have MIN_EVIDENCE answers, the last within `fresh` seconds, where there are at least
        two such (with one, nobody can tell which of the two lies: `disputes` counts it). An `epoch` (the round
        the values come from) above the one `peer`'s history is of starts that history anew: its params moved, so
        its earlier answers are no scale for its new ones; the caller bounds how far an epoch may run ahead."""
        now = time.monotonic() if now is None else now
        mine = self.history.setdefault(peer, {name: deque(maxlen=WINDOW) for name in self.rules})
        if epoch is not None and epoch > self.epochs.get(peer, epoch - 1):
            self.epochs[peer] = epoch
            for own in mine.values():
                own.clear()
        for name, value in values.items():
            rule = self.rules[name]
            own = mine[name]
            others = [h[name] for q, h in self.history.items()
                      if q != peer and len(h[name]) >= MIN_EVIDENCE and not self.is_excluded(q, now)
                      and now - self.answered_at.get(q, now) <= self.fresh]
            refs = [statistics.median(h) for h in others]
            if len(own) >= MIN_ANSWERS:
                ref = statistics.median(own)
                # (the others' latest values: a scale every sender reached at once shows there before their medians)
                as_others = rule.own_unless_others and bool(others) and \
                    not rule.disagrees(value, statistics.median(h[-1] for h in others), own=True)
                if rule.disagrees(value, ref, own=True) and not as_others:
                    return self._refuse(peer, now, f"{name} {value:.4g}, {_times(value, ref)} the median {ref:.4g} "
                                                   f"of its own last {len(own)} answers")
            against = [ref for ref in refs if rule.disagrees(value, ref)]
            if len(refs) >= 2 and 2 * len(against) > len(refs):
                ref = statistics.median(against)
                return self._refuse(peer, now, f"{name} {value:.4g}, {_times(value, ref)} the median {ref:.4g} of "
                                                f"{len(against)} of the {len(refs)} other peers' recent answers")
            if refs and against and len(refs) == 1:
                self.disputes += 1
        for name, value in values.items():
            mine[name].append(value)
        self.answered_at[peer] = now
        self.strikes.pop(peer, None)
        return None

    def exclude(self, peer: str, why: str, now: Optional[float] = None) -> None:
        """Leave `peer` out for EXCLUDE_SECONDS at once (`why`: the evidence), its history forgotten."""
        self.excluded[peer] = ((time.monotonic() if now is None else now) + EXCLUDE_SECONDS, why)
        self.history.pop(peer, None)
        self.strikes.pop(peer, None)

    def _refuse(self, peer: str, now: float, why: str) -> str:
        self.strikes[peer] = self.strikes.get(peer, 0) + 1
        if self.limit is not None and self.strikes[peer] >= self.limit:
            self.exclude(peer, why, now)
        return why


def _times(value: float, ref: float) -> str:
    if ref > 0 and value >= ref:
        return f"{value / ref:.3g}x"
    if value > 0 and ref > value:
        return f"1/{ref / value:.3g} of"
    return "far from"


# -- the same microbatch on two peers of a stage, a third deciding ------------------------------------------------
# Two peers of a stage hold the same params only as a round starts: each then takes inner steps on the microbatches it
# gets, so their answers to one microbatch drift apart within the round, on a CPU as on a GPU (whose nondeterministic
# kernels add far less). On the test recipe's last stage (tests/recipes/stages.yaml, AdamW at lr 3e-3), two copies
# stepped on different batches answered one microbatch with input-gradients of cosine 0.94, 0.55, 0.36 and 0.14 after
# 1, 8, 16 and 64 steps each from the recipe's init, norms within 1.25x and losses within 0.8; from 100 steps in, 0.95
# or more over 64 steps. So two answers are held to being the same computation, not the same bits: an answer made up
# without computing (noise of any norm) has a cosine with the true one of about N(0, 1/n) over its n values, one
# scaled is off in norm, a sign-flipped one has cosine -1, a made-up loss is off by the loss rule.
AGREE_SIGMAS = 6.0  # two input-gradients agree when their cosine is at least this many standard deviations of chance
AGREE_COSINE_CAP = 0.5  # (that bound, 6 / sqrt(n), never above this: tensors of under 144 values)
AGREE_NORM_FACTOR = 4.0  # and their norms are within this factor of each other


@dataclass(frozen=True)
class Agreement:
    """When two peers' tensors for one microbatch are taken for the same computation (`disagreement`): a cosine of
    at least AGREE_SIGMAS / sqrt(values), and never above `cosine_cap`, and norms within `norm_factor`."""

    norm_factor: float = AGREE_NORM_FACTOR
    cosine_cap: float = AGREE_COSINE_CAP
    what: str = "gradient"  # what the tensors are, as `disagreement` names them


ANSWERS = Agreement()  # a next stage's input-gradients (above)
# A first stage's activations recomputed by another of its peers (recompute.py). Two copies of the first stage of
# tests/recipes/stages.yaml's model, stepped on different batches of the bundled corpus from one point, gave
# activations (8,192 values, threshold 0.066) of cosine 0.54 and 0.39 after 64 and 300 steps each from the recipe's
# init, 0.91 and 0.88 from 300 steps in, and 0.14 to 0.29 where one had taken 0 or 10 steps and the other 64 or
# 300 (their norms then 1/14 to 1/90 of each other: no norm is held to another's here, the sender's own history
# holds its scale, server.py); noise of their norm: 0.014 and 0.003 (scripts/bench_drift.py). Held to 0.1 at most,
# for tiny microbatches (noise then passes about once in a hundred: 2.3 sigmas of 512 values).
ACTIVATIONS = Agreement(norm_factor=math.inf, cosine_cap=0.1, what="activation")
PROBATION = MIN_ANSWERS  # a peer's answers are all computed twice until this many agreed with another peer's
# Peers of a stage are one round apart for a while, honestly: one averaged while another waits in matchmaking or
# re-syncs (for as long as a round, minutes in a real run). An answer claiming a round next to the one two others agree
# on is left aside then (not compared, not used, nobody blamed); only claims further off count against a peer.
ROUND_STRIKES = 3  # answers in a row claiming a round 2 or more from the one two others agreed on: left out


@dataclass(frozen=True)
class Answer:
    """A peer's answer to a training microbatch: the gradient of its activations, the microbatch's loss, and the
    round of its stage it was computed in (None: the peer did not say). A first stage's activations for token ids
    (recompute.py) are answers too: `grad` the activations, `loss` 0."""

    peer: str
    grad: torch.Tensor
    loss: float
    round: Optional[int] = None


@dataclass(frozen=True)
class Verdict:
    """What two or three answers to one microbatch settle (`decide`). `use`: the answer to apply, None when no two
    agree (apply none); `agreed`: the peers whose answers agreed; `outvoted`: the peer whose answer disagreed with two
    that agree, all three of one round (leave it out: `evidence` has the numbers); `odd_round`: a peer that claimed a
    round the two that agree did not (not compared, not applied); `far_round`: that claim is 2 or more rounds from
    theirs (a round boundary cannot explain it: a strike against the peer)."""

    use: Optional[Answer]
    agreed: tuple[str, ...] = ()
    outvoted: Optional[str] = None
    odd_round: Optional[str] = None
    far_round: bool = False
    evidence: str = ""


def tally(verdict: Verdict, microbatch: str, verified: Counter, odd_rounds: Counter,
          leave_out: Callable[[str, str], None]) -> None:
    """What a settled comparison says about its peers (a router's answers, routing.py; a first stage's activations
    computed again, recompute.py): the agreeing peers' probation advances (`verified`); the one outvoted is left out
    at once (`leave_out(peer, why)`, with the evidence); one of a round far from the agreeing peers' counts a strike
    in `odd_rounds`, and is left out at ROUND_STRIKES in a row."""
    for peer in verdict.agreed:
        verified[peer] += 1
        odd_rounds.pop(peer, None)
    if verdict.outvoted is not None:
        leave_out(verdict.outvoted, f"outvoted on microbatch {microbatch}: {verdict.evidence}")
    if verdict.odd_round is not None:
        odd_rounds[verdict.odd_round] += verdict.far_round
        if odd_rounds[verdict.odd_round] >= ROUND_STRIKES:
            leave_out(verdict.odd_round, f"{ROUND_STRIKES} answers in a row claiming rounds far from the others', "
                                         f"the last on microbatch {microbatch}: {verdict.evidence}")


def microbatch_id(x: torch.Tensor, targets: torch.Tensor) -> str:
    """A short name for a microbatch that every peer it reached can recompute: sha256 of its activations (fp32) and
    its targets (int32), 12 hex digits."""
    digest = hashlib.sha256(x.detach().float().cpu().contiguous().numpy().tobytes())
    digest.update(targets.to("cpu", torch.int32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:12]


def same_round(a: Answer, b: Answer) -> bool:
    """Whether `a` and `b` are compared: computed in the same round, or one of them does not say (then it is held to
    the comparison all the same: leaving the round out buys no escape)."""
    return a.round is None or b.round is None or a.round == b.round


def disagreement(a: Answer, b: Answer, agreement: Agreement = ANSWERS) -> Optional[str]:
    """None when `a` and `b` are answers of the same computation: losses within ANSWER_RULES' loss rule both ways,
    gradient norms within `agreement`'s factor, and a cosine of at least AGREE_SIGMAS / sqrt(values) (at most its
    cap). Otherwise how they differ: one phrase that starts with the two tensors' norms."""
    norm_a, norm_b = float(a.grad.detach().float().norm()), float(b.grad.detach().float().norm())
    norms = f"{agreement.what} norm {norm_a:.4g} against {norm_b:.4g}"
    rule = ANSWER_RULES["loss"]
    if rule.disagrees(a.loss, b.loss) or rule.disagrees(b.loss, a.loss):
        return f"{norms}, loss {a.loss:.4g} against {b.loss:.4g}"
    if max(norm_a, norm_b) > agreement.norm_factor * min(norm_a, norm_b):
        return f"{norms} ({_times(max(norm_a, norm_b), min(norm_a, norm_b))} the other)"
    if a.grad.shape != b.grad.shape:
        return f"{norms}, of shapes {tuple(a.grad.shape)} and {tuple(b.grad.shape)}"
    if norm_a == 0.0 or norm_b == 0.0:  # (zeros are no direction: the same computation only as both zero)
        return None if norm_a == norm_b else f"{norms}, one of them zero"
    cosine = float(a.grad.detach().float().flatten() @ b.grad.detach().float().flatten()) / (norm_a * norm_b)
    least = min(AGREE_SIGMAS / math.sqrt(a.grad.numel()), agreement.cosine_cap)
    if cosine < least:
        return f"{norms}, cosine {cosine:.3f} (the same computation's: at least {least:.3f})"
    return None


def decide(primary: Answer, duplicate: Answer, decider: Optional[Answer] = None,
           agreement: Agreement = ANSWERS) -> Verdict:
    """Settle one microbatch that `primary` and `duplicate` (two peers of a stage) answered, and `decider` (a third)
    when those two do not agree or claim different rounds. Answers agree when `same_round` and `disagreement` is
    None. The answer used is one that another agrees with (the primary's first); a peer whose answer disagrees with
    two that agree with each other, in one round, is outvoted; one whose claimed round differs is left aside. With no
    two agreeing, or no decider yet, nothing is used."""
    def agree(a: Answer, b: Answer) -> bool:
        return same_round(a, b) and disagreement(a, b, agreement) is None

    def _differ(a: Answer, b: Answer) -> str:
        return differ(a, b, agreement)

    if agree(primary, duplicate):
        return Verdict(primary, (primary.peer, duplicate.peer))
    if decider is None:
        return Verdict(None, evidence=_differ(primary, duplicate))
    for kept, other in ((primary, duplicate), (duplicate, primary)):
        if agree(kept, decider) and not agree(other, decider):
            agreed = (kept.peer, decider.peer)
            if same_round(other, kept) and same_round(other, decider):
                return Verdict(kept, agreed, outvoted=other.peer,
                               evidence=f"{_differ(other, kept)}; {decider.peer}'s agrees with {kept.peer}'s")
            their_round = kept.round if kept.round is not None else decider.round
            return Verdict(kept, agreed, odd_round=other.peer, far_round=abs(other.round - their_round) >= 2,
                           evidence=f"it claimed round {other.round} where {kept.peer} and {decider.peer} agree on "
                                    f"round {their_round}")
    if agree(primary, decider):  # (each agrees with the decider, not with the other: nobody is outvoted)
        return Verdict(primary, (primary.peer, duplicate.peer, decider.peer))
    return Verdict(None, evidence=f"{_differ(primary, duplicate)}; {_differ(decider, primary)}; "
                                  f"{_differ(decider, duplicate)}")


def differ(a: Answer, b: Answer, agreement: Agreement = ANSWERS) -> str:
    """How `a` differs from `b`, naming both peers (and their rounds)."""
    if not same_round(a, b):
        where = f" (rounds {a.round} and {b.round})"
    else:
        round_no = a.round if a.round is not None else b.round
        where = "" if round_no is None else f" (round {round_no})"
    return f"{a.peer}'s answer differs from {b.peer}'s{where}: {disagreement(a, b, agreement) or 'another round'}"
