"""`swarm-peer demo`: a bootstrap and N peers on 127.0.0.1, as separate processes, training the embedded demo
run (or a given recipe) for R rounds, with their logs interleaved and prefixed."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

logger = logging.getLogger("swarm.demo")
MADDR_LINE = re.compile(r"--initial-peers (\S+)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _relay(process: subprocess.Popen, prefix: str, log_path: Path, found: Optional[list] = None,
           ready: Optional[threading.Event] = None) -> None:
    with open(log_path, "w") as log:
        for line in process.stdout:
            log.write(line)
            log.flush()
            print(f"{prefix} {line}", end="", flush=True)
            if found is not None and not found:
                match = MADDR_LINE.search(line)
                if match:
                    found.append(match.group(1))
                    ready.set()
    if ready is not None:
        ready.set()


def _demo_recipe(path: Optional[str], stages: int, rounds: int, workdir: Path) -> Optional[Path]:
    """The recipe file the demo's processes take: `path` as it is, or cut into `stages` pipeline stages; without a
    path, the embedded demo run with total_tokens its `rounds` rounds' tokens, so that its learning-rate schedule
    (a warm-up over a fifth of total_tokens, then cosine) runs its course in the demo, not over 50M tokens. None:
    `path` itself."""
    from swarm.config import Recipe, load_recipe, parse_recipe

    if path and stages == 1:
        return None
    data = (load_recipe(path) if path else Recipe()).model_dump(mode="json")
    data["pipeline"]["stages"] = stages
    if not path:
        data["total_tokens"] = rounds * data["tokens_per_round"]
    recipe = parse_recipe(data, origin=f"{path or 'the demo recipe'} with --stages {stages} --rounds {rounds}")
    out = workdir / "recipe.json"
    out.write_text(json.dumps(recipe.model_dump(mode="json"), indent=1))
    return out


def run_demo(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="swarm-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.peers)
    base = args.metrics_port
    ports = [base + i if base else _free_port() for i in range(args.peers + 1)]
    command = [sys.executable, "-m", "swarm"]
    processes: list[subprocess.Popen] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def spawn(argv: list[str], prefix: str, log_name: str, **relay_kwargs) -> subprocess.Popen:
        process = subprocess.Popen(command + argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env=env, start_new_session=True)  # our Ctrl-C handling stops them in order
        processes.append(process)
        threading.Thread(target=_relay, args=(process, prefix, workdir / log_name), kwargs=relay_kwargs,
                         daemon=True).start()
        return process

    stopping = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    logger.info("demo: bootstrap + %d peers%s, %d rounds, %d torch threads each; logs and checkpoints in %s",
                args.peers, f" in {args.stages} pipeline stages" if args.stages > 1 else "", args.rounds, threads,
                workdir)
    found: list[str] = []
    ready = threading.Event()
    recipe = ["--recipe", str(_demo_recipe(args.recipe, args.stages, args.rounds, workdir) or args.recipe)]
    spawn(["bootstrap", "--metrics-port", str(ports[0])] + recipe, "[bootstrap]", "bootstrap.log",
                      found=found, ready=ready)
    try:
        if not ready.wait(60) or not found:
            logger.error("the bootstrap did not start; see %s", workdir / "bootstrap.log")
            return 1
        maddr = found[0]
        logger.info("swarm metrics: http://127.0.0.1:%d/metrics", ports[0])
        peers = []
        for index in range(args.peers):
            peers.append(spawn(["join", "--initial-peers", maddr, "--until-round", str(args.rounds),
                                "--num-threads", str(threads), "--device", "cpu",
                                "--metrics-port", str(ports[index + 1]),
                                "--checkpoint-dir", str(workdir / f"peer{index}" / "checkpoints")] + recipe
                               + (["--stage", str(index % args.stages)] if args.stages > 1 else []),
                               f"[peer{index}]", f"peer{index}.log"))
            logger.info("peer%d metrics: http://127.0.0.1:%d/metrics", index, ports[index + 1])
        while not stopping.is_set() and any(p.poll() is None for p in peers):
            time.sleep(0.5)
        codes = [p.wait() if not stopping.is_set() else None for p in peers]
        if stopping.is_set():
            logger.info("demo interrupted")
            return 130
        if any(code != 0 for code in codes):
            logger.error("a peer failed (exit codes %s); logs in %s", codes, workdir)
            return 1
        logger.info("demo finished: %d peers trained %d rounds; checkpoints in %s", args.peers, args.rounds, workdir)
        return 0
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for process in processes:
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
