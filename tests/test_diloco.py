"""The DiLoCo outer step against a hand computation, the lr schedule, and the all-reduce partition."""

import json

import pytest
import torch

from swarm.averaging.partition import partition
from swarm.config import InnerRecipe, OuterRecipe, Recipe, recipe_from_json
from swarm.peer.diloco import DiLoCo
from swarm.peer.training import learning_rate


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))


def test_pseudo_gradient_is_global_minus_local():
    model = _model()
    diloco = DiLoCo(model, OuterRecipe())
    start = diloco.pseudo_gradient()
    assert start.shape == (diloco.numel,) and torch.count_nonzero(start) == 0
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.25)
    assert torch.allclose(diloco.pseudo_gradient(), torch.full((diloco.numel,), 0.25))


def test_outer_nesterov_step_matches_hand_computation():
    model = _model()
    diloco = DiLoCo(model, OuterRecipe(lr=0.7, momentum=0.9, nesterov=True))
    theta = torch.cat([p.detach().view(-1) for p in model.parameters()]).clone()
    g1 = torch.linspace(-1, 1, diloco.numel)
    g2 = torch.linspace(2, -3, diloco.numel)
    diloco.outer_step(g1, tokens=100)
    # Nesterov SGD, by hand: buf_1 = g1; theta_1 = theta_0 - lr * (g1 + m * buf_1)
    buf = g1.clone()
    theta = theta - 0.7 * (g1 + 0.9 * buf)
    assert torch.allclose(torch.cat([p.view(-1) for p in diloco.global_params]), theta, atol=1e-6)
    diloco.outer_step(g2, tokens=50)
    buf = 0.9 * buf + g2
    theta = theta - 0.7 * (g2 + 0.9 * buf)
    assert torch.allclose(torch.cat([p.view(-1) for p in diloco.global_params]), theta, atol=1e-6)
    # Local params were reset to the new global params; round and tokens advanced.
    assert torch.allclose(torch.cat([p.detach().view(-1) for p in model.parameters()]), theta, atol=1e-6)
    assert diloco.round == 2 and diloco.tokens_seen == 150


def test_the_digest_covers_the_outer_momentum():
    a = DiLoCo(_model(), OuterRecipe())
    b = DiLoCo(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)), OuterRecipe())
    b.load_state_tensors(a.state_tensors(), 0, 0)
    assert a.digest() == b.digest()
    zeros = {name.replace("params.", "momentum."): torch.zeros_like(p) for name, p in a.state_tensors().items()}
    b.load_state_tensors({**a.state_tensors(), **zeros}, 0, 0)  # zero buffers take the same next step as none
    assert b.outer_optimizer.state and a.digest() == b.digest()
    a.outer_step(torch.ones(a.numel), tokens=10)
    tensors = a.state_tensors()
    tensors = {k: v * 2 if k.startswith("momentum.") else v for k, v in tensors.items()}
    b.load_state_tensors(tensors, a.round, a.tokens_seen)
    assert all(torch.equal(x, y) for x, y in zip(a.global_params, b.global_params))
    assert a.digest() != b.digest(), "same params, other momentum: another state"


def test_state_round_trip_restores_params_and_momentum():
    a, b = DiLoCo(_model(), OuterRecipe()), DiLoCo(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)),
                                                   OuterRecipe())
    a.outer_step(torch.ones(a.numel), tokens=10)
    b.load_state_tensors(a.state_tensors(), a.round, a.tokens_seen)
    assert a.digest() == b.digest() and b.round == 1
    grad = torch.randn(a.numel)
    a.outer_step(grad, 1)
    b.outer_step(grad, 1)
    assert a.digest() == b.digest(), "momentum must travel with the state"
    with pytest.raises(ValueError):
        b.load_state_tensors({}, 0, 0)
    with pytest.raises(ValueError):
        a.outer_step(torch.ones(3), 1)


def test_the_replay_log_keeps_the_latest_unbroken_steps_within_its_bytes():
    from swarm.config import AveragingRecipe

    assert AveragingRecipe(codec="none").replay_bytes_per_param == 4.5  # (a round of fp32 averages and headers)
    default = DiLoCo(_model(), OuterRecipe())
    assert AveragingRecipe().replay_bytes_per_param == 2.5 and default.log_bytes == int(2.5 * default.numel)
    diloco = DiLoCo(_model(), OuterRecipe(), log_bytes_per_param=4)
    n = diloco.numel
    for step in range(3):  # fp32 averages: 4 bytes a param, so a lossless run's log holds the last one
        diloco.outer_step(torch.full((n,), 0.5 * (step + 1)), tokens=10)
    diloco.hashed()  # (a step is logged once its end state is hashed, beside training)
    assert [s.round for s in diloco.replay_log] == [2]
    wire = [(0, n, b"x" * n)]  # as an all-reduce that sent a byte a param delivered it (not decoded here)
    for step in range(8):
        diloco.outer_step(torch.full((n,), 0.1), tokens=10, wire=wire)
    diloco.hashed()
    assert [s.round for s in diloco.replay_log] == [7, 8, 9, 10]
    assert all(s.wire == tuple(wire) and s.average is None for s in diloco.replay_log)
    assert [s.after for s in diloco.replay_log][:-1] == [s.digest for s in diloco.replay_log][1:], "unbroken"
    assert diloco.steps_since(8, diloco.replay_log[1].digest) == list(diloco.replay_log)[1:]
    assert diloco.steps_since(4, "other params") == [] and diloco.steps_since(1, diloco.digest()) == []
    diloco.load_flat_state(diloco.flat_state())
    assert not diloco.replay_log, "after a mixing group's state, the log starts again"
    small, none = DiLoCo(_model(), OuterRecipe(), log_bytes=3 * n), DiLoCo(_model(), OuterRecipe(), log_bytes=0)
    for step in range(5):  # --replay-log-mb: 3 bytes a param hold 3 steps of a byte a param; 0 holds none
        for d in (small, none):
            d.outer_step(torch.full((n,), 0.1), tokens=10, wire=wire)
    small.hashed(), none.hashed()
    assert [s.round for s in small.replay_log] == [2, 3, 4] and not none.replay_log


def test_a_refused_replay_leaves_global_and_local_params_as_they_were():
    from swarm.compression import get_codec
    from swarm.peer.outer import OuterStep

    ahead, behind = (DiLoCo(_model(), OuterRecipe(), log_bytes_per_param=4) for _ in range(2))  # (a round of fp32)
    n = ahead.numel
    for step in range(2):
        ahead.outer_step(torch.full((n,), 0.25 * (step + 1)), tokens=10)
    behind.outer_step(torch.full((n,), 0.25), tokens=10)
    ahead.hashed()
    with torch.no_grad():
        for p in behind.local_params:
            p.add_(1.0)  # a round of local training in progress
    local = [p.detach().clone() for p in behind.local_params]
    state = {k: v.clone() for k, v in behind.state_tensors().items()}
    steps = behind_steps = ahead.steps_since(1, behind.digest())
    assert len(behind_steps) == 1

    def refused(bad):
        with pytest.raises(ValueError):
            behind.replay(bad)
        assert behind.round == 1 and behind.tokens_seen == 10
        assert all(torch.equal(state[k], v) for k, v in behind.state_tensors().items())
        assert all(torch.equal(a, b) for a, b in zip(local, behind.local_params)), "local progress is kept"

    step = steps[0]
    refused([OuterStep(step.round, step.digest, "elsewhere", step.tokens, step.average)])  # ends elsewhere
    refused([OuterStep(step.round, "other", step.after, step.tokens, step.average)])  # not from our state
    short = get_codec("fp16").encode(torch.ones(1))
    refused([OuterStep(step.round, step.digest, step.after, step.tokens, wire=((0, n, short),))])  # too short
    zeros = bytes(get_codec("none").encode(torch.zeros(n)))
    nan = zeros[:-4 * n] + torch.full((n,), float("nan")).numpy().tobytes()
    refused([OuterStep(step.round, step.digest, step.after, step.tokens, wire=((0, n, nan),))])  # not finite
    behind.replay(steps)
    assert behind.digest() == ahead.digest() and behind.round == 2 and behind.tokens_seen == 20
    assert all(torch.equal(v, ahead.state_tensors()[k]) for k, v in behind.state_tensors().items())
    assert list(behind.replay_log)[-1] == step, "it can pass the step on"


def test_learning_rate_warmup_then_cosine():
    inner = InnerRecipe(lr=1e-3, warmup_tokens=1000, min_lr_ratio=0.1)
    assert learning_rate(inner, 500, 10_000) == pytest.approx(5e-4)
    assert learning_rate(inner, 1000, 10_000) == pytest.approx(1e-3)
    assert learning_rate(inner, 5500, 10_000) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert learning_rate(inner, 10_000, 10_000) == pytest.approx(1e-4)
    assert learning_rate(inner, 50_000, 10_000) == pytest.approx(1e-4)


def test_the_default_warmup_is_a_fifth_of_the_run_and_an_explicit_one_is_kept():
    """Where a recipe names no warm-up, it is a fifth of total_tokens, so a short run and a long one both warm up
    over the share that won on a corpus read once; a recipe that names one (every recipe published before) keeps it,
    and its digest."""
    inner = InnerRecipe(lr=1e-3, min_lr_ratio=0.1)
    assert inner.warmup_tokens is None and inner.warmup(10_000) == 2000 and inner.warmup(10**9) == 2 * 10**8
    assert learning_rate(inner, 1000, 10_000) == pytest.approx(5e-4)
    assert learning_rate(inner, 2000, 10_000) == pytest.approx(1e-3)
    assert learning_rate(inner, 10_000, 10_000) == pytest.approx(1e-4)
    published = Recipe().model_dump(mode="json")
    published["inner"]["warmup_tokens"] = 50_000
    older = recipe_from_json(json.dumps(published))
    assert older.inner.warmup(10**9) == 50_000 and '"warmup_tokens":50000' in older.canonical_json()
    assert recipe_from_json(older.canonical_json()).digest() == older.digest() != Recipe().digest()


@pytest.mark.parametrize("numel, parts", [(10, 3), (7, 7), (5, 8), (1_000_003, 4)])
def test_partition_covers_everything_once(numel, parts):
    bounds = partition(numel, parts)
    assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_the_digest_is_hashed_beside_training_and_a_heartbeat_never_waits_for_it(monkeypatch):
    """After an outer step the state is hashed on a thread of its own: `identity()` (what a heartbeat announces)
    answers at once with the last (round, digest) known, `digest()` waits for the current one, the replay log gets
    the step with its end digest, and the next change of the state waits for the hash (issue 39)."""
    import threading

    from swarm.peer import diloco as module

    release, hashing = threading.Event(), threading.Event()
    real = module.state_digest

    def slow(params, momenta, round_no, *fragments):
        if round_no == 1:
            hashing.set()
            assert release.wait(10)
        return real(params, momenta, round_no, *fragments)

    monkeypatch.setattr(module, "state_digest", slow)
    diloco = DiLoCo(_model(), OuterRecipe(lr=0.7, momentum=0.9), log_bytes_per_param=8)  # (two rounds of fp32)
    before = diloco.digest()
    diloco.outer_step(torch.full((diloco.numel,), 0.1), tokens=5)  # returns while round 1 is being hashed
    assert hashing.wait(10) and diloco.identity() == (0, before) and not diloco.replay_log
    changed = threading.Thread(target=diloco.outer_step, args=(torch.full((diloco.numel,), 0.1), 5))
    changed.start()
    changed.join(0.3)
    assert changed.is_alive() and diloco.round == 1  # the next outer step waits for the hash of round 1
    release.set()
    changed.join(10)
    current = diloco.digest()  # (waits for the hash of round 2, which identity() only reports once done)
    assert diloco.round == 2 and diloco.identity() == (2, current)
    assert [(s.round, s.digest) for s in diloco.replay_log] == [(0, before), (1, diloco.replay_log[1].digest)]
    assert diloco.replay_log[0].after == diloco.replay_log[1].digest != before
    momenta = [diloco.outer_optimizer.state[p]["momentum_buffer"] for p in diloco.global_params]
    assert diloco.digest() == real(diloco.global_params, momenta, 2)


def test_a_background_reader_holds_off_every_change_of_the_state():
    """A checkpoint being written reads the params in place: an outer step, a mixing group's state or a loaded
    state waits for it, so what it writes is one state, whole."""
    import concurrent.futures
    import threading

    diloco = DiLoCo(_model(), OuterRecipe())
    executor, reading, seen = concurrent.futures.ThreadPoolExecutor(1), threading.Event(), []
    proceed = threading.Event()

    def read():
        reading.set()
        assert proceed.wait(10)
        seen.append(torch.cat([p.view(-1) for p in diloco.state_views().values()]).clone())

    diloco.read_in_background(read, executor)
    assert reading.wait(10)
    first = torch.cat([p.view(-1) for p in diloco.state_views().values()]).clone()
    changes = [lambda: diloco.outer_step(torch.ones(diloco.numel), 1),
               lambda: diloco.load_flat_state(torch.zeros(2 * diloco.numel)),
               lambda: diloco.load_state_tensors(diloco.state_tensors(), 3, 0)]
    for change in changes:
        thread = threading.Thread(target=change)
        thread.start()
        thread.join(0.2)
        assert thread.is_alive(), "a change of the state did not wait for the reader"
        proceed.set()
        thread.join(10)
        assert not thread.is_alive()
        proceed.clear()
        diloco.read_in_background(read, executor)
        assert reading.wait(10)
    proceed.set()
    diloco.settle()
    assert torch.equal(seen[0], first)


def test_validation_takes_at_most_its_share_of_a_peers_time():
    """A small model's validation (milliseconds) runs after every round, however short; one that takes seconds (a
    92M model's ten on one CPU thread) waits until enough time has passed for it to stay within VALIDATION_SHARE."""
    from swarm.peer.training import VALIDATION_SHARE, ValidationBudget

    now = [0.0]
    budget = ValidationBudget(clock=lambda: now[0])

    def costing(seconds: float):
        def loss() -> float:
            now[0] += seconds
            return 1.0
        return loss

    measured = []
    for _ in range(10):  # rounds of 0.2 s, a validation of 0.05 s (under VALIDATION_FREE): every round
        now[0] += 0.2
        measured.append(budget.measure(costing(0.05)))
    assert measured == [1.0] * 10
    measured = []
    for _ in range(12):  # the same rounds, a validation of 6 s: one round in five at a 2% share
        now[0] += 60
        measured.append(budget.measure(costing(6.0)))
    assert VALIDATION_SHARE == 0.02 and measured.count(1.0) in (2, 3) and measured[0] == 1.0, measured
    spent = 6.0 * measured.count(1.0)
    assert spent <= VALIDATION_SHARE * 12 * 60 + 6.0


@pytest.mark.parametrize("momentum, nesterov", [(0.9, True), (0.9, False), (0.0, False)])
def test_the_outer_step_is_torchs_sgd_bit_for_bit_without_a_models_worth_of_gradients(momentum, nesterov):
    """The outer update steps one parameter at a time (no whole-model gradients set first: issue 39's memory) and
    ends bit-identical to torch's SGD.step, momentum buffers included, over several steps."""
    from swarm.peer.outer import outer_update

    torch.manual_seed(0)
    ours = [torch.randn(7, 5), torch.randn(11)]
    torchs = [p.clone() for p in ours]
    optimizers = [torch.optim.SGD(ps, lr=0.7, momentum=momentum, nesterov=nesterov) for ps in (ours, torchs)]
    for _ in range(3):
        average, offset = torch.randn(46), 0
        for param in torchs:
            param.grad = average[offset:offset + param.numel()].view_as(param).clone()
            offset += param.numel()
        optimizers[1].step()
        optimizers[1].zero_grad(set_to_none=True)
        outer_update(ours, optimizers[0], average)
    assert all(torch.equal(a, b) for a, b in zip(ours, torchs))
    if momentum:
        assert all(torch.equal(optimizers[0].state[a]["momentum_buffer"], optimizers[1].state[b]["momentum_buffer"])
                   for a, b in zip(ours, torchs))


def test_fragments_are_runs_of_whole_parameters_of_about_equal_size():
    from swarm.peer.outer import fragment_bounds

    sizes = [100, 10, 10, 50, 50, 10, 10, 100]
    for parts in range(1, len(sizes) + 1):
        bounds = fragment_bounds(sizes, parts)
        assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == len(sizes)
        assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
    assert [sum(sizes[a:b]) for a, b in fragment_bounds(sizes, 2)] == [170, 170]
    assert [sum(sizes[a:b]) for a, b in fragment_bounds(sizes, 4)] == [100, 70, 70, 100]
    with pytest.raises(ValueError, match="cannot cut 8 parameters into 9 fragments: set outer.fragments to at most 8"):
        fragment_bounds(sizes, 9)


def test_a_fragment_round_steps_its_fragment_alone_and_replays_to_the_same_state():
    """Streaming DiLoCo: round r's outer step moves fragment r mod P's params and momentum and resets its local
    params only; the others keep their local progress. A peer behind replays the steps, each on its fragment."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])  # 8 params: 4 fragments of 2
    ahead, behind = (DiLoCo(m, OuterRecipe(fragments=4), log_bytes_per_param=6 * 4) for m in (model, _copy(model)))
    assert ahead.fragments == [(0, 2), (2, 4), (4, 6), (6, 8)] and ahead.fragment_sizes() == [20] * 4
    assert behind.digest() == ahead.digest()
    with torch.no_grad():
        for p in ahead.local_params:
            p.add_(1.0)  # local progress everywhere
    for round_no in range(6):
        fragment = ahead.fragment()
        assert fragment == round_no % 4
        before = [p.clone() for p in ahead.global_params]
        pseudo = ahead.pseudo_gradient(fragment)
        assert pseudo.numel() == 20 and torch.allclose(pseudo, torch.full((20,), -1.0))
        with pytest.raises(ValueError, match="expected 20"):
            ahead.outer_step(torch.ones(ahead.numel), tokens=1)
        ahead.outer_step(torch.full((20,), 0.1 * (round_no + 1)), tokens=10)
        a, b = ahead.fragments[fragment]
        moved = [i for i, (p, q) in enumerate(zip(before, ahead.global_params)) if not torch.equal(p, q)]
        assert moved == list(range(a, b))
        for i, (local, global_) in enumerate(zip(ahead.local_params, ahead.global_params)):
            assert torch.equal(local, global_) == (a <= i < b), (round_no, i)  # (the others: 1.0 of progress)
        with torch.no_grad():
            for p in ahead.local_params[a:b]:
                p.add_(1.0)
    assert ahead.round == 6
    ahead.hashed()
    steps = ahead.steps_since(0, behind.digest())
    assert [s.round for s in steps] == list(range(6))
    behind.replay(steps)
    assert (behind.round, behind.digest()) == (6, ahead.digest())
    # Each step rehashed its fragment alone; the digest is still that of the whole state hashed afresh.
    from swarm.peer.diloco import state_digest
    from swarm.peer.outer import momenta
    momenta = momenta(ahead.global_params, ahead.outer_optimizer)
    assert ahead.digest() == state_digest(ahead.global_params, momenta, 6, ahead.fragments)
    assert ahead.digest() != state_digest(ahead.global_params, momenta, 6)  # (not the one-fragment layout)


def _copy(model):
    import copy
    return copy.deepcopy(model)


def test_progress_since_a_snapshot_is_written_over_it_bit_for_bit():
    """Overlap keeps the inner steps made while averaging: local params now minus the snapshot taken when the
    contribution left, computed in the snapshot's own memory (no fragment's worth more), equal to the subtraction."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    diloco = DiLoCo(model, OuterRecipe(fragments=2))
    snapshot = _flat_local(diloco, 1)
    with torch.no_grad():
        for p in diloco.local_params:
            p.add_(torch.randn_like(p) / 3)
    expected = _flat_local(diloco, 1) - snapshot
    progress = diloco.progress(snapshot, 1)
    assert progress.data_ptr() == snapshot.data_ptr() and torch.equal(progress, expected)
    assert progress.numel() == diloco.fragment_numel(1)


def test_round_buffers_handed_back_are_reused_with_the_right_values():
    """With overlap a round's pseudo-gradient and snapshot live through inner steps anyway: handed back
    (recycle), the next round's are made in their memory (no whole model's pages faulted in afresh), at most two
    kept, each the size of the largest fragment, and what they hold is exactly what fresh ones would."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    diloco = DiLoCo(model, OuterRecipe(fragments=3))
    largest = max(diloco.fragment_sizes())
    with torch.no_grad():
        for p in diloco.local_params:
            p.add_(torch.randn_like(p))
    for fragment in (0, 1, 2):
        pseudo, snapshot = diloco.pseudo_gradient(fragment), diloco.snapshot(fragment)
        assert torch.equal(snapshot, _flat_local(diloco, fragment))
        assert torch.equal(pseudo, torch.cat([g.view(-1) for g in diloco.global_params[slice(
            *diloco.fragments[fragment])]]) - snapshot)
        assert pseudo.untyped_storage().nbytes() == snapshot.untyped_storage().nbytes() == 4 * largest
        kept = {pseudo.data_ptr(), snapshot.data_ptr()}
        diloco.recycle(pseudo, snapshot, diloco.snapshot(fragment))  # (a third is not kept)
        assert len(diloco._spare) == 2
        again = diloco.pseudo_gradient((fragment + 1) % 3)
        assert again.data_ptr() in kept and again.numel() == diloco.fragment_numel((fragment + 1) % 3)
        diloco.recycle(again)
    diloco.recycle(torch.empty(3))  # (not a round buffer: not kept)
    assert all(b.numel() == largest for b in diloco._spare)


def _flat_local(diloco, fragment):
    """The fragment's local params, flat fp32, made independently of DiLoCo's round buffers."""
    start, end = diloco.fragments[fragment]
    return torch.cat([p.detach().float().view(-1) for p in diloco.local_params[start:end]])
