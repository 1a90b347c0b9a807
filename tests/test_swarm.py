"""End to end: a bootstrap and two peers, started through the real CLI on 127.0.0.1, train 3 DiLoCo rounds.
Checks what the peers end with against an independent computation from their round traces."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from swarm.averaging.aggregate import aggregator
from swarm.averaging.common import chunk_bounds
from swarm.averaging.partition import partition
from swarm.config import OuterRecipe

pytestmark = pytest.mark.slow
ROUNDS = 3
OUTER_LR, OUTER_MOMENTUM = OuterRecipe().lr, OuterRecipe().momentum  # the tiny recipe keeps the recipe's defaults


def _traces(directory: Path) -> dict[int, tuple[dict, dict]]:
    out = {}
    for meta_path in sorted(directory.glob("round-*.json")):
        meta = json.loads(meta_path.read_text())
        out[meta["round"]] = (meta, load_file(str(meta_path.with_suffix(".safetensors"))))
    return out


def _reduced(vectors: list[torch.Tensor], weights: list[float], shares: list[float]) -> tuple[torch.Tensor, float]:
    """What the butterfly's reducers make of the members' vectors under the default aggregator, computed as they do
    it: reducer j aggregates each chunk of part j with its own contribution first, then the others' in member order
    (the same operations in the same order, so the same bits)."""
    aggregate, average, total = aggregator("centered_clip"), torch.empty_like(vectors[0]), 0.0
    for j, (start, end) in enumerate(partition(vectors[0].numel(), shares)):
        order = [j] + [i for i in range(len(vectors)) if i != j]
        for a, b in chunk_bounds(start, end):
            average[a:b], total = aggregate([vectors[i][a:b] for i in order], [weights[i] for i in order])
    return average, total


def test_two_peers_train_three_rounds_with_exact_averages(swarm):
    bootstrap, maddr = swarm.bootstrap()
    peers = [swarm.peer(maddr, "--max-rounds", str(ROUNDS), "--trace-dir", str(swarm.workdir / f"trace{i}"),
                        "--checkpoint-dir", str(swarm.workdir / f"ckpt{i}"), "--metrics-port", "0", name=f"peer{i}")
             for i in range(2)]
    for peer in peers:
        assert peer.wait(240) == 0, peer.output()[-3000:]
        assert not peer.session_alive(), f"{peer.name} left processes behind (p2pd?)"

    traces = [_traces(swarm.workdir / f"trace{i}") for i in range(2)]
    assert sorted(traces[0]) == sorted(traces[1]) == list(range(ROUNDS)), "every peer averaged every round"
    momentum = None
    for round_no in range(ROUNDS):
        (meta_a, tensors_a), (meta_b, tensors_b) = traces[0][round_no], traces[1][round_no]
        assert meta_a["members"] == meta_b["members"] and len(meta_a["members"]) == 2
        assert meta_a["weight"] > 0 and meta_b["weight"] > 0
        # The exact weighted mean, computed here from what each peer says it contributed.
        total = meta_a["weight"] + meta_b["weight"]
        expected = (tensors_a["pseudo_gradient"] * meta_a["weight"]
                    + tensors_b["pseudo_gradient"] * meta_b["weight"]) / total
        assert meta_a["total_weight"] == meta_b["total_weight"] == total
        torch.testing.assert_close(tensors_a["average"], expected, rtol=1e-5, atol=1e-7)
        assert torch.equal(tensors_a["average"], tensors_b["average"]), "peers must hold bit-identical averages"
        assert torch.equal(tensors_a["global_before"], tensors_b["global_before"])
        assert torch.equal(tensors_a["global_after"], tensors_b["global_after"])
        # The outer Nesterov step by hand: buf = m * buf + g; p -= lr * (g + m * buf).
        grad = tensors_a["average"]
        momentum = grad.clone() if momentum is None else OUTER_MOMENTUM * momentum + grad
        by_hand = tensors_a["global_before"] - OUTER_LR * (grad + OUTER_MOMENTUM * momentum)
        torch.testing.assert_close(tensors_a["global_after"], by_hand, rtol=1e-5, atol=1e-6)
        if round_no:
            assert torch.equal(tensors_a["global_before"], traces[0][round_no - 1][1]["global_after"])
    val = [traces[0][r][0]["val_loss"] for r in range(ROUNDS)]
    assert val[-1] < val[0], f"validation loss did not fall: {val}"
    first_train_loss = peers[0].events("averaged")[0]["loss"]
    assert first_train_loss is not None and first_train_loss < 6.3, \
        "the tiny model starts near ln(512)=6.24 and must have learned something"
    for i in range(2):
        assert len(list((swarm.workdir / f"ckpt{i}").glob("round-*"))) >= 1
        # Both peers listen on 127.0.0.1: every stream between them skips the daemons.
        stopped = peers[i].events("stopped")[0]
        direct, fallback = stopped["streams_direct"], stopped["streams_fallback"]
        # One stream goes through libp2p: the start-up dial-back to the bootstrap, which serves no direct streams.
        assert direct >= 3 * ROUNDS and fallback <= 1, (direct, fallback)

    bootstrap.process.send_signal(signal.SIGTERM)
    assert bootstrap.wait(30) == 0
    assert not bootstrap.session_alive()


@pytest.mark.parametrize("fragments", [1, 2])
def test_overlapping_rounds_keep_peers_identical(swarm, fragments):
    """With outer.overlap the all-reduce of round t runs while round t+1 trains: every peer must still apply the
    exact average, hold the same global params, and keep its local progress made meanwhile. With 2 fragments
    (Streaming DiLoCo with overlap) each round averages half the model, rounds as long as before, and one of the
    peers keeps its outer state in a file (--outer-state-dir): the same bits."""
    recipe = Path(__file__).parent / "recipes" / "overlap.yaml"
    if fragments > 1:
        fields = yaml.safe_load(recipe.read_text())
        fields["outer"]["fragments"], fields["tokens_per_round"] = fragments, fragments * fields["tokens_per_round"]
        recipe = swarm.workdir / "fragments.yaml"
        recipe.write_text(yaml.safe_dump(fields))
    _, maddr = swarm.bootstrap(recipe=recipe)
    on_disk = ("--outer-state-dir", str(swarm.workdir / "outer")) if fragments > 1 else ()
    peers = [swarm.peer(maddr, "--until-round", str(ROUNDS), "--trace-dir", str(swarm.workdir / f"trace{i}"),
                        *(on_disk if i else ()), name=f"peer{i}") for i in range(2)]
    for peer in peers:
        assert peer.wait(240) == 0, peer.output()[-3000:]
        assert peer.events("training", overlap=True)
    if on_disk:
        assert "outer state: 0." in peers[1].output() and not any((swarm.workdir / "outer").iterdir())
    traces = [_traces(swarm.workdir / f"trace{i}") for i in range(2)]
    assert sorted(traces[0]) == sorted(traces[1]) == list(range(ROUNDS))
    for round_no in range(ROUNDS):
        (meta_a, a), (meta_b, b) = traces[0][round_no], traces[1][round_no]
        total = meta_a["weight"] + meta_b["weight"]
        expected = (a["pseudo_gradient"] * meta_a["weight"] + b["pseudo_gradient"] * meta_b["weight"]) / total
        torch.testing.assert_close(a["average"], expected, rtol=1e-5, atol=1e-7)
        assert torch.equal(a["global_after"], b["global_after"])
        changed = (a["global_after"] != a["global_before"]).float().mean()  # (a fragment's share of the params)
        assert (0.3 < changed < 0.7) if fragments == 2 else changed > 0.9, float(changed)
    for trace in traces:  # delayed updates still learn: the global params' validation loss (fixed held-out
        # batches, so not the noise of one training batch) falls from round to round
        val = [trace[r][0]["val_loss"] for r in range(ROUNDS)]
        assert val[-1] < val[0], f"validation loss did not fall with overlap: {val}"


def test_client_mode_peer_contributes_without_accepting_streams(swarm):
    """A peer behind NAT (`--client-mode`: it registers no stream handler at all, so any stream opened to it would
    fail the round) takes part in every average: it reduces nothing, pulls the averaged parts and asks the others
    for their decision; its contribution is in what every member applies: the recipe's aggregate, recomputed
    here from every member's trace."""
    _, maddr = swarm.bootstrap(recipe=Path(__file__).parent / "recipes" / "three.yaml")  # groups of exactly 3
    rounds = 3
    names = ["server0", "server1", "client"]
    peers = [swarm.peer(maddr, "--until-round", str(rounds), "--trace-dir", str(swarm.workdir / name),
                        *(["--client-mode"] if name == "client" else []), name=name) for name in names]
    for peer in peers:
        assert peer.wait(240) == 0, peer.output()[-3000:]
    assert peers[2].events("training", client=True)
    client_id = peers[2].events("joined")[0]["peer_id"]
    traces = [_traces(swarm.workdir / name) for name in names]
    assert all(sorted(t) == list(range(rounds)) for t in traces), "every peer, the client too, averaged every round"
    for round_no in range(rounds):
        metas = [t[round_no][0] for t in traces]
        tensors = [t[round_no][1] for t in traces]
        members = metas[0]["members"]
        assert len(members) == 3 and all(m["members"] == members for m in metas)
        client_index = members.index(client_id)
        assert metas[0]["clients"][client_index] and metas[0]["shares"][client_index] == 0, "a client reduces nothing"
        # What the recipe's aggregator (centered_clip: weights capped at 1.5x the median, then clipped where
        # needed) makes of every member's contribution, the client's included, chunk by chunk as reducers do.
        order = [members.index(m["peer_id"]) for m in metas]
        vectors = [tensors[order.index(i)]["pseudo_gradient"] for i in range(3)]
        weights = [metas[order.index(i)]["weight"] for i in range(3)]
        expected, total = _reduced(vectors, weights, metas[0]["shares"])
        assert total == metas[0]["total_weight"]
        torch.testing.assert_close(tensors[0]["average"], expected, rtol=1e-5, atol=1e-7)
        assert all(torch.equal(t["global_after"], tensors[0]["global_after"]) for t in tensors)


def test_checked_groups_keep_a_lone_server_from_reducing_for_clients_and_average_once_a_second_comes(swarm):
    """averaging.checked_groups: one server and two client-mode peers form no group (the server would reduce every
    part for clients, which receive no reports, checked by nobody), and each client says why in one line; once a
    second server joins, the four average in groups whose reducers are the two servers, every member applying."""
    import yaml
    recipe = yaml.safe_load((Path(__file__).parent / "recipes" / "three.yaml").read_text())
    recipe["averaging"].update(checked_groups=True, matchmaking_timeout=3)
    path = swarm.workdir / "checked.yaml"
    path.write_text(yaml.safe_dump(recipe))
    _, maddr = swarm.bootstrap(recipe=path)
    first = [swarm.peer(maddr, "--until-round", "2", *(["--client-mode"] if name != "server0" else []), name=name)
             for name in ("server0", "client0", "client1")]
    for client in first[1:]:
        client.wait_for(r"forms only groups whose reducers are checked \(averaging.checked_groups\), so a group "
                        r"needs 2 peers that accept connections", 120)
    assert not any(peer.events("averaged") for peer in first), "a lone server reduced for clients"
    second = swarm.peer(maddr, "--until-round", "2", name="server1")
    peers = [*first, second]
    for peer in peers:
        assert peer.wait(240) == 0, peer.output()[-3000:]
    servers = {peer.events("joined")[0]["peer_id"] for peer in (first[0], second)}
    for peer in peers:
        averaged = peer.events("averaged")
        assert len(averaged) == 2 and all(e["group_size"] >= 3 and servers <= set(e["members"]) for e in averaged), \
            averaged


def test_more_peers_than_a_group_average_in_mixing_groups(swarm):
    """Four peers, groups of at most two: every round the swarm averages in two groups. Round 0 (all params equal)
    averages pseudo-gradients only, so the two groups end with different params; round 1 puts one member of each
    of them in every group, which then averages global params and outer momentum too (losslessly, besides the
    int8 pseudo-gradients). Within a group everyone ends bit-identical; nobody's work is dropped."""
    _, maddr = swarm.bootstrap(recipe=Path(__file__).parent / "recipes" / "moshpit.yaml")
    rounds, names = 3, [f"peer{i}" for i in range(4)]
    peers = [swarm.peer(maddr, "--until-round", str(rounds), "--trace-dir", str(swarm.workdir / name), name=name)
             for name in names]
    for peer in peers:
        assert peer.wait(300) == 0, peer.output()[-3000:]
    traces = [_traces(swarm.workdir / name) for name in names]
    assert all(sorted(t) == list(range(rounds)) for t in traces), "every peer averaged every round"
    groups_by_round, split_from_four = [], 0
    for round_no in range(rounds):
        groups: dict[str, list[tuple[dict, dict]]] = {}
        for t in traces:
            groups.setdefault(t[round_no][0]["group_id"], []).append(t[round_no])
        assert len(groups) == 2 and all(len(g) == 2 for g in groups.values()), f"round {round_no}: {groups.keys()}"
        for members in groups.values():
            (meta_a, tensors_a), (meta_b, tensors_b) = members
            assert meta_a["members"] == meta_b["members"]
            split_from_four += meta_a["swarm_size"] == 4  # (a retry after a failed attempt plans fewer)
            assert torch.equal(tensors_a["global_after"], tensors_b["global_after"]), "a group ends bit-identical"
            total = meta_a["weight"] + meta_b["weight"]
            assert meta_a["total_weight"] == total, "both members' tokens are in the average"
            exact = (tensors_a["pseudo_gradient"] * meta_a["weight"]
                     + tensors_b["pseudo_gradient"] * meta_b["weight"]) / total
            assert (tensors_a["average"] - exact).abs().max() < 0.05 * exact.abs().max() + 1e-6, "int8 bound"
            mixed = not torch.equal(tensors_a["global_before"], tensors_b["global_before"])
            assert meta_a["mix"] == mixed, "a group mixes exactly when its members' params differ"
            if mixed:
                # Global params averaged losslessly, weighted by tokens like the pseudo-gradients.
                n = tensors_a["global_before"].numel()
                expected = (tensors_a["global_before"] * meta_a["weight"]
                            + tensors_b["global_before"] * meta_b["weight"]) / total
                torch.testing.assert_close(tensors_a["mixed_state"][:n], expected, rtol=1e-6, atol=1e-7)
                assert torch.equal(tensors_a["mixed_state"], tensors_b["mixed_state"])
        groups_by_round.append([set(g[0][0]["members"]) for g in groups.values()])
        mixes = [g[0][0]["mix"] for g in groups.values()]
        assert (not any(mixes)) if round_no == 0 else all(mixes) if round_no == 1 else True, \
            f"round {round_no}: round 0 starts from equal params, round 1 must mix: {mixes}"
    assert split_from_four, "no round was split into groups from a plan of all four peers"
    first, second = groups_by_round[0], groups_by_round[1]
    assert all(len(group & other) == 1 for group in second for other in first), \
        f"round 1 must take one member of each round-0 group: {first} then {second}"
    digests = {t[0][0]["digest"] for t in traces}
    assert len(digests) == 2, "after round 0 the two groups hold different params"
