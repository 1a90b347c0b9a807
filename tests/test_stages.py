"""Pipeline stages (swarm/model/stages.py): chained stages compute what the whole model computes, forward and
backward, for every family that can be cut; the others are refused with one line; activations and their gradients
cross the boundaries through a codec, and the bytes are counted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from swarm.compression import get_codec
from swarm.model import llama
from swarm.model.stages import Stage, StageError, WireStats, even_bounds, make_stages, materialize, run_pipeline

VOCAB = 300
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
             tie_word_embeddings=False)
CUTTABLE = {
    "llama": transformers.LlamaConfig(**SMALL),
    "swarm-llama": llama.LlamaConfig(**{**SMALL, "max_position_embeddings": 64}),  # a recipe's own fields
    "gpt_neox": transformers.GPTNeoXConfig(**SMALL, max_position_embeddings=64),
    "mistral": transformers.MistralConfig(**SMALL, num_key_value_heads=1),
    "qwen2": transformers.Qwen2Config(**SMALL, num_key_value_heads=1),
}


def _build(config) -> torch.nn.Module:
    if isinstance(config, llama.LlamaConfig):
        return llama.LlamaForCausalLM(config)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def _model(config) -> torch.nn.Module:
    torch.manual_seed(0)
    return _build(config)


def test_even_bounds_cover_the_blocks_in_order():
    assert even_bounds(4, 2) == [(0, 2), (2, 4)]
    assert even_bounds(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert even_bounds(3, 1) == [(0, 3)]
    with pytest.raises(StageError):
        even_bounds(2, 3)


@pytest.mark.parametrize("family", sorted(CUTTABLE))
@pytest.mark.parametrize("bounds", [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]])
def test_chained_stages_compute_the_whole_models_logits_and_gradients(family, bounds):
    model = _model(CUTTABLE[family])
    model.eval()  # no dropout: the two passes must see the same computation
    batch = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=batch[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    loss.backward()
    whole = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    stages = make_stages(model, bounds)
    owned = [{id(p) for p in stage.parameters()} for stage in stages]
    assert sum(len(ids) for ids in owned) == len(list(model.parameters())), "every parameter on exactly one stage"
    assert all(not a & b for i, a in enumerate(owned) for b in owned[i + 1:])
    stats = WireStats()
    piped = run_pipeline(stages, batch, get_codec("none"), stats)
    assert torch.allclose(piped, loss.detach(), rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, whole[name], rtol=1e-4, atol=1e-6), name
    boundaries, hidden = len(bounds) - 1, model.config.hidden_size
    assert stats.forward_bytes >= boundaries * 3 * 16 * hidden * 4 and stats.backward_bytes == stats.forward_bytes


def test_a_compressed_wire_costs_fewer_bytes_and_stays_close():
    model = _model(CUTTABLE["llama"])
    model.eval()
    batch = torch.randint(0, VOCAB, (4, 33), generator=torch.Generator().manual_seed(2))
    stages = make_stages(model, even_bounds(4, 2))
    exact, half = WireStats(), WireStats()
    loss = run_pipeline(stages, batch, get_codec("none"), exact)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss16 = run_pipeline(stages, batch, get_codec("fp16"), half)
    assert half.forward_bytes < 0.55 * exact.forward_bytes
    assert abs(loss16 - loss) < 1e-3
    cosine = F.cosine_similarity(torch.cat([g.view(-1) for g in grads]),
                                 torch.cat([p.grad.view(-1) for p in model.parameters()]), dim=0)
    assert cosine > 0.999


def test_families_with_learned_positions_or_tied_heads_are_refused_with_one_line():
    gpt2 = _model(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=2, n_positions=64))
    with pytest.raises(StageError, match="GPT2LMHeadModel adds transformer.wpe"):
        make_stages(gpt2, even_bounds(4, 2))
    assert len(make_stages(gpt2, [(0, 4)])) == 1  # uncut, any family runs as one stage
    tied = _model(transformers.LlamaConfig(**{**SMALL, "tie_word_embeddings": True}))
    with pytest.raises(StageError, match="ties its head"):
        make_stages(tied, even_bounds(4, 2))
    assert len(make_stages(tied, [(0, 4)])) == 1  # one stage holding everything is the whole model
    with pytest.raises(StageError, match="do not cover"):
        make_stages(_model(CUTTABLE["llama"]), [(0, 1), (2, 4)])


def _meta(config) -> torch.nn.Module:
    with torch.device("meta"):
        return _build(config)


@pytest.mark.parametrize("family", sorted(CUTTABLE))
def test_a_stage_is_built_alone_the_same_on_every_peer(family):
    """A peer hosting a stage builds the model on the meta device and allocates its stage alone: the other stages'
    weights never exist on it. Two peers building the same stage get the same bits; the init has the family's
    shape (normal weights of its initializer_range, norms at one, the rotary tables of a whole build), and stages
    built on different peers chain into a pipeline that trains."""
    config = CUTTABLE[family]
    whole = _model(config)
    built = []
    for start, end in even_bounds(4, 2):
        model = _meta(config)
        stage = Stage(model, start, end)
        materialize(model, stage, seed=7)
        hosted = {id(p) for p in stage.parameters()}
        assert all(p.is_meta for p in model.parameters() if id(p) not in hosted), "another stage's weights exist"
        assert not any(p.is_meta for p in stage.parameters()) and all(torch.isfinite(p).all() for p in stage.parameters())
        again = _meta(config)
        twin = Stage(again, start, end)
        materialize(again, twin, seed=7)
        assert all(torch.equal(a, b) for a, b in zip(stage.state_dict().values(), twin.state_dict().values()))
        reference = dict(Stage(whole, start, end).named_parameters())
        for name, param in stage.named_parameters():
            if param.dim() == 2:  # linear and embedding weights: normal, of the family's std
                assert abs(float(param.std()) - float(reference[name].std())) < 0.25 * float(reference[name].std())
            elif name.endswith("norm.weight"):
                assert torch.equal(param, reference[name]), name
        for name, buffer in stage.named_buffers():
            assert torch.equal(buffer, dict(Stage(whole, start, end).named_buffers())[name]), name
        built.append(stage)
    other = _meta(config)
    differs = Stage(other, 0, 2)
    materialize(other, differs, seed=8)
    assert not torch.equal(next(differs.parameters()), next(built[0].parameters())), "the recipe's seed matters"
    batch = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    loss = run_pipeline(built, batch, get_codec("fp16"), WireStats())
    assert 0.5 * torch.log(torch.tensor(VOCAB)) < loss < 2 * torch.log(torch.tensor(VOCAB))
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for stage in built for p in stage.parameters())


def test_max_memory_decides_which_stages_a_peer_may_host():
    """--max-memory bounds what a peer trains (weights, gradients, AdamW moments, one microbatch's activations):
    stages.yaml's model needs about 10.0 MB whole, 4.9 MB for stage 0 (with the embedding, and the two copies of its
    weights its stream of microbatches keeps) and 5.8 MB for stage 1
    (with the head and its logits). A limit below what it would host stops the peer with one line naming the fix;
    without --stage, a peer takes a stage it can hold."""
    from swarm.checks import check_max_memory
    from swarm.config import RecipeError, load_recipe
    from swarm.settings import PeerSettings
    from swarm.model.build import build_model
    from swarm.peer.pipeline.part import Part

    recipe = load_recipe(Path(__file__).parent / "recipes" / "stages.yaml")
    whole = recipe.model_copy(update={"pipeline": recipe.pipeline.model_copy(update={"stages": 1})})

    def part(run, **settings):
        model = build_model(run.model, run.data.vocab_size, meta=run.pipeline.stages > 1)  # (as a peer builds it)
        return Part(run, PeerSettings(initial_peers=("/ip4/127.0.0.1/tcp/1/p2p/x",), **settings), model, None, None, 2)

    with pytest.raises(RecipeError, match=r"the whole model needs about 10\.0 MB but --max-memory allows 6\.0 MB: "
                                          r"join a run cut into pipeline stages"):
        part(whole, max_memory=6)
    assert part(whole, max_memory=11).whole and part(whole).whole
    assert part(recipe, max_memory=6, stage=1).bounds == (1, 2), "half the model's memory holds either stage"
    with pytest.raises(RecipeError, match=r"stage 1 needs about 5\.8 MB to train but --max-memory allows 5\.0 MB: "
                                          r"host a stage that fits \(0\)"):
        part(recipe, max_memory=5, stage=1)
    assert part(recipe, max_memory=5).index == 0, "the one stage it can hold, without asking the swarm"
    with pytest.raises(RecipeError, match=r"no stage of this run fits in --max-memory 4\.0 MB: the smallest needs "
                                          r"about 4\.9 MB"):
        part(recipe, max_memory=4)
    # `swarm-peer doctor --max-memory` and join's start-up checks estimate the same (on the meta device).
    check = check_max_memory(recipe, 5)
    assert check.ok and check.message == "stage 0 of 2 fits in 5.0 MB"
    assert check.details["needs"] == part(recipe, stage=0).needs
    assert not check_max_memory(recipe, 4).ok and check_max_memory(recipe, 4).fatal
    assert not check_max_memory(whole, 6).ok and check_max_memory(whole, 11).ok


def test_a_bottleneck_sends_its_width_a_token_starts_as_a_projection_and_trains_end_to_end():
    """pipeline.bottleneck R: a boundary carries R values a token each way (the wire counts R, not the hidden size);
    its encoder and decoder start as Q^T and Q for one orthonormal Q, the same on two peers that built the two
    stages alone, so the pair first passes on a projection of the hidden states; the stage after it embeds the
    token ids again and refuses a microbatch without them; every boundary parameter gets a gradient."""
    config, r = CUTTABLE["llama"], 8
    built = []
    for start, end in even_bounds(4, 2):
        model = _meta(config)
        stage = Stage(model, start, end, bottleneck=r)
        materialize(model, stage, seed=7)
        built.append(stage)
    first, last = built
    assert first.decode is None and first.embed is None and last.encode is None and last.head is not None
    assert first.encode.weight.shape == (r, 32) and torch.equal(first.encode.weight, last.decode.weight.T)
    hidden = torch.randn(5, 32)
    with torch.no_grad():
        projected = last.decode(first.encode(hidden))
        torch.testing.assert_close(last.decode(first.encode(projected)), projected)  # a projection: idempotent
    assert 0.1 < float(projected.norm() / hidden.norm()) < 0.9
    whole = make_stages(_model(config), even_bounds(4, 2), bottleneck=r, seed=7)
    assert torch.equal(whole[0].encode.weight, first.encode.weight), "built alone or whole, the same boundary"
    batch = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(3))
    stats = WireStats()
    loss = run_pipeline(built, batch, get_codec("fp16"), stats)
    values = 4 * 16 * r
    assert values * 2 <= stats.forward_bytes < values * 2 + 64 and stats.backward_bytes == stats.forward_bytes
    assert 0.5 * torch.log(torch.tensor(VOCAB)) < loss < 2 * torch.log(torch.tensor(VOCAB))
    for module in (first.encode, last.decode, last.embed):
        assert module.weight.grad is not None and float(module.weight.grad.norm()) > 0
    with pytest.raises(StageError, match=r"stage \[2, 4\) embeds the token ids again after the bottleneck: give the "
                                         r"microbatch's input ids, shape \(4, 16\)"):
        last(torch.zeros(4, 16, r))
    with pytest.raises(StageError, match="pipeline.bottleneck 32 is not under the hidden size 32"):
        Stage(_model(config), 0, 2, bottleneck=32)
