"""The CLI surface: every subcommand's flags are documented and snapshotted, and expected failures end with one
clear line and a non-zero exit, never a traceback."""

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.cli import build_parser
from swarm.settings import BootstrapSettings, PeerSettings
from swarm.settings_cli import FlagError, add_flags, settings_from_args

GOLDEN = Path(__file__).parent / "golden" / "cli_flags.txt"


def _surface() -> str:
    parser = build_parser()
    lines = []
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in sorted(subparsers.choices.items()):
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings} has no help text"
                lines.append(f"{name} {' '.join(action.option_strings)}")
    return "\n".join(lines) + "\n"


def test_cli_flags_match_snapshot():
    """A new or removed flag must be a deliberate change: update tests/golden/cli_flags.txt with it. The order
    flags are declared in is not part of the surface (generated flags come grouped by settings section)."""
    assert sorted(_surface().splitlines()) == sorted(GOLDEN.read_text().splitlines())


@pytest.mark.parametrize("argv", [["--help"], ["join", "--help"], ["bootstrap", "--help"], ["status", "--help"],
                                  ["demo", "--help"]])
def test_help_works(argv):
    result = subprocess.run([sys.executable, "-m", "swarm", *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "usage: swarm-peer" in result.stdout


def _run(*argv, timeout=90):
    return subprocess.run([sys.executable, "-m", "swarm", *argv], capture_output=True, text=True, timeout=timeout)


def test_unreachable_bootstrap_is_one_clear_line(tmp_path):
    # A well-formed multiaddr of a peer that does not exist (nothing listens on port 9 of loopback).
    maddr = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJCzWR6VCzZs3KXREoSqLCUMhQ3NXDzxZspqHZujgPZxC"
    result = _run("join", "--initial-peers", maddr, "--device", "cpu", "--cache-dir", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "Traceback" not in output
    assert "could not start the DHT node or reach" in output, output


def test_multiaddr_without_peer_id_is_rejected(tmp_path):
    """As a bad flag, before the start-up checks and the slow imports (it took 6 s, now a fraction of one)."""
    result = _run("join", "--initial-peers", "/ip4/127.0.0.1/tcp/4000", "--cache-dir", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    assert "bad flag --initial-peers: /ip4/127.0.0.1/tcp/4000 has no /p2p/<peer id> part" in result.stdout


def test_bad_recipe_file_is_one_clear_line(tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text("inner:\n  lr: -3\n")
    result = _run("bootstrap", "--recipe", str(recipe))
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    assert "field 'inner.lr'" in result.stdout


def test_bad_flag_values_are_rejected():
    result = _run("join", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--max-rounds", "0")
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    assert "bad flag --max-rounds: Input should be greater than 0" in result.stdout, result.stdout
    result = _run("join", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--replay-log-mb", "-1")
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    assert "bad flag --replay-log-mb: Input should be greater than or equal to 0" in result.stdout, result.stdout
    result = _run("bootstrap", "--metrics-port", "70000")
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    assert "bad flag --metrics-port: Input should be less than or equal to 65535" in result.stdout, result.stdout


# ---- flags generated from the settings models (swarm/settings_cli.py) ------------------------------------------

MADDR = "/ip4/127.0.0.1/tcp/1/p2p/x"


def _parse(argv):
    args = build_parser().parse_args(argv)
    return settings_from_args(BootstrapSettings if args.command == "bootstrap" else PeerSettings, args)


def test_flags_left_out_keep_the_model_defaults():
    assert _parse(["join", "--initial-peers", MADDR]) == PeerSettings(initial_peers=(MADDR,))
    assert _parse(["bootstrap"]) == BootstrapSettings()


def test_flags_reach_their_nested_fields():
    other = "/ip4/127.0.0.1/tcp/2/p2p/y"
    settings = _parse(["join", "--initial-peers", MADDR, other, "--host-maddrs", "/ip4/0.0.0.0/tcp/31337",
                       "--no-direct-streams", "--client-mode", "--direct-port", "4000", "--checkpoint-dir", "ckpt",
                       "--keep-checkpoints", "5", "--checkpoint-series", "0", "--metrics-port", "0",
                       "--metrics-host", "0.0.0.0", "--recipe", "run.yaml", "--replay-log-mb", "2.5",
                       "--device", "cpu", "--max-rounds", "7"])
    assert settings.initial_peers == (MADDR, other)
    assert settings.network.host_maddrs == ("/ip4/0.0.0.0/tcp/31337",)
    assert settings.network.direct_streams is False and settings.network.client_mode is True
    assert settings.network.direct_port == 4000 and settings.network.nat_traversal is False
    assert (settings.checkpoints.dir, settings.checkpoints.keep, settings.checkpoints.series) == ("ckpt", 5, 0)
    assert (settings.metrics.port, settings.metrics.host) == (0, "0.0.0.0")
    assert (settings.recipe_file, settings.replay_log_mb, settings.device, settings.max_rounds) == \
        ("run.yaml", 2.5, "cpu", 7)
    boot = _parse(["bootstrap", "--identity-path", "boot.id", "--nat-traversal", "--recipe", "run.yaml"])
    assert boot.network.identity_path == "boot.id" and boot.network.nat_traversal and boot.recipe_file == "run.yaml"


def test_bootstrap_has_no_peer_only_network_flags():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bootstrap", "--client-mode"])


def test_a_refused_value_is_one_line_naming_the_nested_flag():
    args = build_parser().parse_args(["join", "--initial-peers", MADDR, "--keep-checkpoints", "0"])
    with pytest.raises(FlagError) as excinfo:
        settings_from_args(PeerSettings, args)
    assert str(excinfo.value) == "bad flag --keep-checkpoints: Input should be greater than or equal to 1"


def test_choices_come_from_the_annotation():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["join", "--initial-peers", MADDR, "--device", "tpu"])


def test_fields_that_cannot_be_flags_are_refused_when_the_parser_is_built():
    from typing import Optional

    from pydantic import BaseModel, Field

    class OnByDefault(BaseModel):
        streams: bool = Field(True, description="a switch whose flag would turn it on although it is on")

    class Undocumented(BaseModel):
        port: Optional[int] = None

    class Unflaggable(BaseModel):
        table: dict[str, int] = Field({}, description="no single flag holds a mapping")

    for model, reason in ((OnByDefault, "--no-"), (Undocumented, "needs a description"), (Unflaggable, "no flag")):
        with pytest.raises(TypeError, match=reason):
            add_flags(argparse.ArgumentParser(), model)


@pytest.mark.slow
def test_the_demo_trains_a_model_cut_into_two_stages(tmp_path):
    """`swarm-peer demo --stages 2`: a bootstrap and 4 peers, two per stage, each stage averaging its own params.
    Every peer finishes (the last stage answers the first until the first has trained its last round too), and
    the two peers of each stage end on one digest, the stages on different ones."""
    tiny = Path(__file__).parent / "recipes" / "tiny.yaml"
    result = _run("demo", "--stages", "2", "--rounds", "2", "--recipe", str(tiny), "--workdir", str(tmp_path),
                  timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "demo finished: 4 peers trained 2 rounds" in output, output[-3000:]
    finals = {}
    for index in range(4):
        log = (tmp_path / f"peer{index}.log").read_text()
        assert f"hosting stage {index % 2} of 2" in log, log[-2000:]
        finals[index] = re.search(r"done: \d+ rounds averaged, round 2, digest (\w+)", log).group(1)
    assert finals[0] == finals[2] and finals[1] == finals[3] and finals[0] != finals[1], finals


def test_the_demo_run_schedules_its_lr_over_its_own_rounds(tmp_path):
    """Without --recipe, the demo's run is the default recipe with total_tokens its rounds' tokens, so its warm-up
    (a fifth of total_tokens) and cosine fit in the demo; a given recipe is taken as it is (cut into stages only
    with --stages)."""
    from swarm.config import Recipe, load_recipe
    from swarm.demo import _demo_recipe

    demo = load_recipe(_demo_recipe(None, 1, 3, tmp_path))
    assert demo.total_tokens == 3 * Recipe().tokens_per_round and demo.inner.warmup(demo.total_tokens) < 20_000
    assert demo.model_copy(update={"total_tokens": Recipe().total_tokens}) == Recipe()
    tiny = Path(__file__).parent / "recipes" / "tiny.yaml"
    assert _demo_recipe(str(tiny), 1, 3, tmp_path) is None
    staged = load_recipe(_demo_recipe(str(tiny), 2, 3, tmp_path))
    assert staged.pipeline.stages == 2 and staged.total_tokens == load_recipe(tiny).total_tokens
