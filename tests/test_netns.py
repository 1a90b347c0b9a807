"""The network-namespace harness: three peers, each in its own namespace behind a `tc tbf`-shaped veth link,
average through real (slow) links. Checks that the shaping is really in effect (a round cannot beat the
butterfly bound of the links) and that the results are still the exact weighted mean."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from allreduce_bench import Namespaces, netns_available  # noqa: E402

REASON = netns_available()
MBIT, PEERS, NUMEL = 40.0, 3, 1_000_000


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable here: {REASON}")
def test_shaped_links_in_namespaces(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "allreduce_bench.py"), "--peers", str(PEERS),
                             "--numel", str(NUMEL), "--netns", "--mbit", str(MBIT), "--rounds", "2",
                             "--save", str(tmp_path), "--timeout", "150"],
                            capture_output=True, text=True, timeout=200, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])[0]
    assert summary["errors"] == 0 and summary["netns"]
    # Butterfly bound: every peer moves 2 (N-1)/N of the vector through its link.
    bound = 2 * (PEERS - 1) / PEERS * NUMEL * 4 * 8 / (MBIT * 1e6)
    assert summary["round_seconds"] >= 0.9 * bound, f"links are not shaped: {summary} vs bound {bound:.2f} s"
    for round_no in range(2):
        saved = [torch.load(tmp_path / f"peer{i}-round{round_no}.pt") for i in range(PEERS)]
        weights = sum(s["weight"] for s in saved)
        exact = sum(s["vector"] * s["weight"] for s in saved) / weights
        for s in saved:
            torch.testing.assert_close(s["average"], exact, rtol=1e-6, atol=1e-6)
            assert torch.equal(s["average"], saved[0]["average"])
    leftovers = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "swh" not in leftovers, "the harness must remove its namespaces"


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable here: {REASON}")
def test_plain_tcp_floor_obeys_the_shaping():
    """The bench's `tcp` engine (a butterfly's bytes over plain sockets, the floor quoted beside our engine) goes
    through the same shaped links: it too cannot beat the bound, and it moves its bytes every round."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "allreduce_bench.py"), "--engine", "tcp",
                             "--peers", str(PEERS), "--numel", str(NUMEL), "--netns", "--mbit", str(MBIT),
                             "--rounds", "3", "--timeout", "100"],
                            capture_output=True, text=True, timeout=150, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])[0]
    assert summary["engine"] == "tcp" and summary["errors"] == 0 and summary["rounds"] == 2  # round 0 is warm-up
    bound = 2 * (PEERS - 1) / PEERS * NUMEL * 4 * 8 / (MBIT * 1e6)
    assert summary["round_seconds"] >= 0.9 * bound, f"links are not shaped: {summary} vs bound {bound:.2f} s"


@pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable here: {REASON}")
def test_namespaces_use_the_congestion_control_asked_for():
    """`--congestion-control` holds for every socket in the harness's namespaces (every engine alike): the
    namespaces report it, not the host's default they would otherwise inherit."""
    host = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    other = next((name for name in allowed if name != host), None)
    if other is None:
        pytest.skip(f"no congestion control other than the host's ({host}) is allowed in namespaces here")
    for wanted, expected in ((other, other), (None, host)):
        with Namespaces(2, [50.0], wanted) as spaces:
            for index in range(2):
                seen = subprocess.run(spaces.prefix(index) + ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"],
                                      capture_output=True, text=True, check=True).stdout.strip()
                assert seen == expected, (wanted, index, seen)
