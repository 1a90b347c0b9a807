"""The CLI surface: every subcommand's flags are documented and snapshotted, and expected failures end with one
clear line and a non-zero exit, never a traceback."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.cli import build_parser

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
    """A new or removed flag must be a deliberate change: update tests/golden/cli_flags.txt with it."""
    assert _surface() == GOLDEN.read_text()


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
    result = _run("join", "--initial-peers", "/ip4/127.0.0.1/tcp/4000", "--cache-dir", str(tmp_path))
    assert result.returncode != 0 and "Traceback" not in result.stdout + result.stderr
    assert "has no /p2p/<peer id> part" in result.stdout


def test_bad_recipe_file_is_one_clear_line(tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text("inner:\n  lr: -3\n")
    result = _run("bootstrap", "--recipe", str(recipe))
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    assert "field 'inner.lr'" in result.stdout


def test_bad_flag_values_are_rejected():
    result = _run("join", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--max-rounds", "0")
    assert result.returncode != 0 and "--max-rounds must be a positive integer" in result.stdout + result.stderr
    result = _run("join", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--replay-log-mb", "-1")
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    assert "bad flag --replay-log-mb: Input should be greater than or equal to 0" in result.stdout, result.stdout
