#!/usr/bin/env python3
"""Memory footprint of a local swarm: starts `swarm-peer demo`-like processes (a bootstrap and N peers on
127.0.0.1), waits until every peer has averaged a round (model loaded, all-reduce buffers in use), then reads RSS
, PSS and USS (/proc/PID/smaps_rollup) of each process of each peer and of the bootstrap: main, DHT process,
p2pd, and any other. Prints a table, then a JSON line. RSS counts pages shared with other processes in full, PSS
splits them between their sharers, USS (private pages) is what the process's exit would free: a forked process
shares its parent's pages until either writes them, so its RSS overstates what it costs at first.

    python scripts/footprint.py --peers 2              # the demo run: 5.3M-parameter Llama
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from swarm.monitoring.metrics import process_role, process_tree

MB = 1024  # smaps_rollup counts kB
MEASURES = ("rss", "pss", "uss")


def memory_kb(pid: int) -> dict[str, int]:
    """RSS, PSS and USS in kB from /proc/PID/smaps_rollup; zeros if it exited."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return dict.fromkeys(MEASURES, 0)
    field = {name: int(value) for name, value in re.findall(r"^(\w+):\s+(\d+) kB", text, re.M)}
    return {"rss": field["Rss"], "pss": field["Pss"], "uss": field["Private_Clean"] + field["Private_Dirty"]}


def measure(name: str, root_pid: int) -> list[dict]:
    """One row per process of `root_pid`'s tree."""
    rows = []
    for pid in process_tree(root_pid):
        kb = memory_kb(pid)
        rows.append({"tree": name, "process": process_role(pid, root_pid), "pid": pid,
                     **{f"{measure}_mb": round(kb[measure] / MB, 1) for measure in MEASURES}})
    return rows


def totals(rows: list[dict]) -> dict:
    """Per tree: all its processes, and its helpers (all but the main process)."""
    out: dict = {}
    for row in rows:
        tree = out.setdefault(row["tree"], {"processes": 0, **{f"{prefix}{measure}_mb": 0.0 for measure in MEASURES
                                                               for prefix in ("", "helpers_")}})
        tree["processes"] += 1
        for key in (f"{measure}_mb" for measure in MEASURES):
            tree[key] = round(tree[key] + row[key], 1)
            if row["process"] != "main":
                tree["helpers_" + key] = round(tree["helpers_" + key] + row[key], 1)
    return out


def start_swarm(args: argparse.Namespace, workdir: Path, processes: list) -> list:
    """Start the bootstrap and the peers (appended to `processes` as they start); returns the peers' logs."""
    command = [sys.executable, "-m", "swarm"]
    recipe = ["--recipe", args.recipe] if args.recipe else []
    boot = subprocess.Popen(command + ["bootstrap"] + recipe, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    processes.append(boot)
    maddr = None
    for line in boot.stdout:
        match = re.search(r"--initial-peers (\S+)", line)
        if match:
            maddr = match.group(1)
            break
    if maddr is None:
        raise SystemExit("the bootstrap exited before printing its address")
    logs = [workdir / f"peer{i}.log" for i in range(args.peers)]
    threads = str(max(1, (os.cpu_count() or 1) // args.peers))
    for log in logs:
        with open(log, "w") as out:
            processes.append(subprocess.Popen(command + ["join", "--initial-peers", maddr, "--device", "cpu",
                                                         "--num-threads", threads] + recipe,
                                              stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True))
    return logs


def stop(processes: list) -> None:
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--recipe", help="recipe file (default: the embedded demo run)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="swarm-footprint-"))
    processes: list = []
    try:
        logs = start_swarm(args, workdir, processes)
        deadline = time.monotonic() + 600
        while not all("round 0: averaged" in log.read_text() for log in logs):
            if time.monotonic() > deadline:
                raise SystemExit(f"peers did not average a round within 10 minutes; see {workdir}")
            time.sleep(1)
        rows = measure("bootstrap", processes[0].pid)
        for index, peer in enumerate(processes[1:]):
            rows += measure(f"peer{index}", peer.pid)
    finally:
        stop(processes)
    print(f"{'tree':<11}{'process':<9}{'pid':>8}" + "".join(f"{measure.upper() + ' MB':>9}" for measure in MEASURES))
    for row in rows:
        print(f"{row['tree']:<11}{row['process']:<9}{row['pid']:>8}"
              + "".join(f"{row[measure + '_mb']:>9.0f}" for measure in MEASURES))
    summary = totals(rows)
    for tree, total in summary.items():
        for label, prefix, count in (("all", "", total["processes"]), ("helpers", "helpers_", total["processes"] - 1)):
            print(f"{tree:<11}{label:<9}{count:>8}"
                  + "".join(f"{total[prefix + measure + '_mb']:>9.0f}" for measure in MEASURES))
    print(json.dumps({"processes": rows, "trees": summary}))


if __name__ == "__main__":
    main()
