"""Light helpers (issue 28): the DHT process is a fresh interpreter without torch, not a copy of the peer; with p2pd
it stays under 150 MB resident. The memory gauges report each process of a peer's or bootstrap's tree by role."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch  # the test process is a torch-loaded interpreter, as a peer is
from prometheus_client import CollectorRegistry

from swarm.bootstrap import SwarmMonitor
from swarm.dht.node import NetworkOptions, SwarmNode
from swarm.dht.process import DHT_PROCESS_MAIN, DHTProcessError
from swarm.monitoring.metrics import PeerMetrics, ProcessTreeMemory, process_tree, tree_resident_bytes
from swarm.monitoring.status_page import StatusBoard

HELPERS_LIMIT = 150 << 20  # issue 28: the DHT process and p2pd together
TORCH_FREE_IMPORTS = """
import sys
from swarm.dht.process import import_hivemind_without_torch
import_hivemind_without_torch()
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time, ValueWithExpiration
import hivemind, swarm.dht.validation
assert "torch" not in sys.modules, "the DHT node's imports loaded torch"
assert hivemind.__version__ and hivemind.dht.DHTNode is DHTNode and get_dht_time() > 0
hivemind.utils.MPFuture  # a re-exported name that needs torch is still there, loaded on first use
assert "torch" in sys.modules
print("ok")
"""


def _resident(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _gauges(registry: CollectorRegistry) -> dict[str, float]:
    """The tree gauges from one scrape: the total, and each process role by name."""
    found = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "swarm_process_tree_resident_bytes":
                found["total"] = sample.value
            elif sample.name == "swarm_process_resident_bytes":
                found[sample.labels["process"]] = sample.value
    return found


def _mapped_files(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as maps:
        return maps.read()


@pytest.fixture
def node():
    assert "torch" in sys.modules and torch.__version__
    started = SwarmNode([], NetworkOptions(direct_streams=False))
    yield started
    started.shutdown()


def test_the_dht_process_loads_no_torch_and_the_helpers_stay_under_150_mb(node):
    dht = node.dht.pid
    tree = process_tree(os.getpid())
    p2pd = [pid for pid in process_tree(dht) if pid != dht]
    assert dht in tree and len(p2pd) == 1 and p2pd[0] in tree
    assert "libtorch" not in _mapped_files(dht), "the DHT process loaded torch"
    helpers = _resident(dht) + _resident(p2pd[0])
    print(f"DHT process {_resident(dht) >> 20} MB, p2pd {_resident(p2pd[0]) >> 20} MB resident")
    assert helpers < HELPERS_LIMIT

    registry = CollectorRegistry()
    ProcessTreeMemory(registry)
    gauges = _gauges(registry)
    assert gauges["dht"] > 0 and gauges["p2pd"] > 0 and gauges["dht"] + gauges["p2pd"] < HELPERS_LIMIT
    assert gauges["main"] > gauges["dht"]  # the test process holds torch
    assert gauges["total"] == sum(gauges[role] for role in ("main", "dht", "p2pd", "other"))


def test_the_dht_process_answers_and_fails_requests_after_it_dies(node):
    async def scenario():
        assert await node.store("footprint", {"x": 1}, ttl=60, subkey=node.owned_subkey)  # (nodes take no other)
        assert await node.get("footprint") == {node.owned_subkey: {"x": 1}}
        os.kill(node.dht.pid, 9)
        with pytest.raises(DHTProcessError):
            await asyncio.wait_for(node.get("footprint"), 10)  # fails at once, it does not hang

    asyncio.run(scenario())
    deadline = time.monotonic() + 5
    while node.dht.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not node.dht.is_alive()


def test_hivemind_imports_for_the_dht_node_load_no_torch():
    done = subprocess.run([sys.executable, "-c", TORCH_FREE_IMPORTS], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr


def test_the_tree_gauges_count_each_process_by_role(tmp_path):
    """A stand-in tree: a root process with a `p2pd` (a copy of sleep by that name), a process with the DHT
    process's command line and another child."""
    fake_p2pd = tmp_path / "p2pd"
    shutil.copy(shutil.which("sleep"), fake_p2pd)
    root = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
children = [subprocess.Popen([{str(fake_p2pd)!r}, "60"]), subprocess.Popen(["sleep", "60"]),
            subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)",
                              {DHT_PROCESS_MAIN!r}], stdout=subprocess.PIPE)]
children[-1].stdout.readline()  # its interpreter is up: its memory no longer grows
print("up", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout.readline() == "up\n"
        pids = process_tree(root.pid)
        assert len(pids) == 4
        by_role = tree_resident_bytes(root.pid)
        assert all(by_role[role] > 0 for role in ("main", "dht", "p2pd", "other")), by_role
        assert by_role["main"] == pytest.approx(_resident(root.pid), rel=0.05)
        assert sum(by_role.values()) == pytest.approx(sum(_resident(pid) for pid in pids), rel=0.05)
        registry = CollectorRegistry()
        ProcessTreeMemory(registry, root_pid=root.pid)
        assert _gauges(registry)["p2pd"] > 0
    finally:
        for pid in reversed(process_tree(root.pid)):  # children first: none is left to init
            os.kill(pid, 9)
        root.wait(10)


def test_the_peer_and_the_bootstrap_publish_the_tree_gauges():
    registries = [PeerMetrics().registry, SwarmMonitor(StatusBoard("run", "0" * 64, "QmPeer")).registry]
    for registry in registries:
        gauges = _gauges(registry)
        assert gauges["total"] >= gauges["main"] > 0 and gauges.keys() == {"total", "main", "dht", "p2pd", "other"}


def test_a_bootstrap_and_the_clis_errors_load_no_torch(swarm):
    """A bootstrap of a run whose data peers prepare themselves needs no torch: the CLI loads only the parts of
    hivemind it uses (hivemind's own __init__ imports torch and scipy), so a bootstrap holds tens of MB and a bad
    recipe is reported in about a second rather than after torch's 3 s."""
    bootstrap, _ = swarm.bootstrap()  # the tiny recipe of the tests: a file to read, the bundled corpus
    with open(f"/proc/{bootstrap.process.pid}/maps") as maps:
        loaded = maps.read()
    assert "libtorch" not in loaded and "scipy" not in loaded, "the bootstrap loaded torch or scipy"
    assert _resident(bootstrap.process.pid) < 150e6
    code = ("import sys; from swarm.cli import main; rc = main(['bootstrap', '--recipe', '/nonexistent/run.yaml']); "
            "print(rc, 'torch' in sys.modules, 'scipy' in sys.modules)")
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert bad.stdout.splitlines()[-1] == "2 False False", bad.stdout + bad.stderr
