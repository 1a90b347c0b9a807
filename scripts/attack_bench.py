#!/usr/bin/env python3
"""What participating attackers do to a real swarm: for each scenario, a bootstrap, honest peers and --attackers
attackers (processes on 127.0.0.1) train --rounds rounds of a tiny run with the int8 codec; the same honest peers
without the attackers are the baseline. Prints, per scenario, the honest peers' validation loss after the last round
against the clean swarm's, the rounds they completed, whether any honest peer took an attacker's state, the honest
peers' peak resident memory (their whole process trees) and the longest any honest peer waited for a round; then
one JSON line. Several attackers of one scenario collude (the same lie, the same forged state).

Scenarios (an attacker is a peer with --inject-fault, which lies in what it sends, or scripts/attackers.py):
  clean              no attacker (the baseline)
  scaled             a member sends its pseudo-gradient x1000 every round (finite, well-formed, an honest weight)
  flipped            a member sends its pseudo-gradient x-1 every round
  inflated           a member declares the most weight the swarm accepts (four rounds' tokens) and sends x1000
  lying-reducer      a member reduces its part x1000 and makes up its own verification term to hide it
  accuse-all         a member names every other peer of the round as one it caught sending bad data
  accuse-one         a member names one honest peer (the first by id) in every entry, to keep it out of every group
  reject-all         a member, as a reducer, names every other member as having sent it bad data
  unverified-entry   a member's entries carry no nonce commitment and declare a bandwidth of 1e11 B/s
  foreign-digest     a member's entries declare a state digest no other peer holds (its group would mix params)
  inflated-swarm-size  a member publishes the groups it leads with a swarm size of 2^20
  forged-reference   announces the swarm's round + 1 with a state of its own and serves it (attackers.py)
  dribbling-holder   announces the swarm's state and serves it a byte every half second (attackers.py)
  wipe               writes plain values under the peers key and the rounds' matchmaking keys (attackers.py)
  idle-streams       holds 500 idle all-reduce streams to the honest peers (attackers.py)
  oversized-frames   keeps feeding all-reduce streams that claim 1 GiB chunks, as a non-member (attackers.py)
  sybils             writes 1,000 signed peer records of 1,000 keys, ~7 kB each (attackers.py)
  future-record      keeps a signed record at the swarm's round claiming 2^40 tokens, dated an hour ahead (attackers.py)
  handshake-flood    holds 64 idle TCP connections to each honest peer's direct-stream port (attackers.py)

Pipelined scenarios run the same tiny model cut into two stages (PIPELINE_RECIPE): 2 honest peers per stage, the
attackers on stage 1, lying in what they answer the first stage (or on stage 0, lying in what they send stage 1);
their baseline is the clean pipelined swarm (stage-clean, run first whenever one of them is asked for), and their
rows also say when each honest peer of the other stage left every attacker out (the latest of them: seconds into its
training, and in which of its rounds):
  stage-clean        no attacker, two stages (the baseline of the stage-* rows)
  stage-scale-grad   a stage-1 peer answers every microbatch with its input-gradients x1000
  stage-garbage      a stage-1 peer answers with noise of its input-gradients' norm (no statistic shows it)
  stage-garbage-act  a stage-0 peer sends noise of its activations' norm in place of its training activations

"lies told" counts the attackers' `attacking` events (scripted) and `fault` events (an injected fault that fired:
each all-reduce it lies in, each entry, group or accusation it rewrites).

    python scripts/attack_bench.py                                 # 4 peers (3 honest), 6 rounds, all scenarios
    python scripts/attack_bench.py --peers 6 --attackers 2 --scenarios scaled,forged-reference   # 2 of 6
    python scripts/attack_bench.py --scenarios clean,scaled --rounds 4 --aggregator mean   # what the mean does
    python scripts/attack_bench.py --scenarios stage-scale-grad,stage-garbage,stage-garbage-act   # lying stage peers
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm.events import read_events  # noqa: E402

FAULTS = {name: f"{name}@0" for name in ("scaled", "flipped", "inflated", "lying-reducer", "accuse-all", "accuse-one",
                                         "reject-all", "unverified-entry", "foreign-digest", "inflated-swarm-size")}
SCRIPTED = ("forged-reference", "dribbling-holder", "wipe", "idle-streams", "oversized-frames", "sybils",
            "future-record", "handshake-flood")
STAGE_FAULTS = {"stage-scale-grad": "scale-grad@0", "stage-garbage": "garbage-grad@0",  # a stage-1 peer's lie
                "stage-garbage-act": "garbage-act@0"}  # a stage-0 peer's
ATTACKER_STAGE = {"stage-garbage-act": 0}  # (the others': stage 1)
SCENARIOS = ("clean", *FAULTS, *SCRIPTED, "stage-clean", *STAGE_FAULTS)
STAGED = ("stage-clean", *STAGE_FAULTS)
RECIPE = """run_id: attack-bench
model: {hidden_size: 64, intermediate_size: 172, num_layers: 2, num_heads: 4, max_seq_len: 64}
data: {vocab_size: 512, seq_len: 32, batch_size: 8}
inner: {lr: 0.003, warmup_tokens: 2048, beta1: 0.9, beta2: 0.95}
outer: {lr: 0.7, momentum: 0.9}
averaging: {codec: int8, aggregator: %s, verify_reducers: true, min_group_size: %d, matchmaking_timeout: 30,
            allreduce_timeout: 30}
inner_steps_per_round: 16
total_tokens: 1000000
"""
# Fixed inner steps per round (min_group_size: the honest peers): every scenario trains the same tokens, so the
# losses compare what the attacker did, not how long rounds took. The betas and the outer step are the recipe's
# defaults before 2026-11-29, which docs/measured.md's figures were measured with.
# The same model cut into two stages (tests/recipes/stages.yaml with this bench's codec and aggregator), each stage
# averaged by its own 2 honest peers (and the attackers of stage 1); a round is the stage's tokens_per_round, so
# every scenario trains the same tokens. pipeline.duplicate_share is the recipe's default.
PIPELINE_RECIPE = """run_id: attack-bench-stages
model: {hidden_size: 64, intermediate_size: 172, num_layers: 2, num_heads: 4, max_seq_len: 64}
data: {vocab_size: 512, seq_len: 32, batch_size: 8}
inner: {lr: 0.003, warmup_tokens: 2048, beta1: 0.9, beta2: 0.95}
outer: {lr: 0.7, momentum: 0.9}
averaging: {codec: int8, aggregator: %s, verify_reducers: true, min_group_size: 2, matchmaking_timeout: 30,
            allreduce_timeout: 30}
tokens_per_round: 8192
total_tokens: 1000000
pipeline: {stages: 2}
"""
STAGE_PEERS = 2  # honest peers on each stage
GRACE_SECONDS = 60.0  # how long the second stage's peers may go on once the first stage's are done
LEFT_OUT = r"^(\d\d:\d\d:\d\d) .*(?:left out (?:first-)?stage peer (\S+)" \
           r"|refused the answer of stage peer (\S+) and left it out" \
           r"|refused the activations of peer (\S+) and left it out)"


def _tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and its descendants (0 once gone)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/status") as status:
                total += next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
            with open(f"/proc/{current}/task/{current}/children") as children:
                pending += [int(child) for child in children.read().split()]
        except (OSError, StopIteration):
            continue
    return total


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})


def _wait_for(path: Path, event: str, process: subprocess.Popen, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        found = [e for e in read_events(path) if e["event"] == event]
        if found:
            return found[0]
        time.sleep(0.2)
    raise RuntimeError(f"no {event} event in {path} within {timeout} s")


def _bootstrap(recipe: Path, workdir: Path, processes: list[subprocess.Popen]) -> str:
    """Start a bootstrap of `recipe` (its process appended to `processes`); its address once it listens."""
    events = workdir / "bootstrap.events.jsonl"
    processes.append(_start([sys.executable, "-m", "swarm", "bootstrap", "--recipe", str(recipe),
                             "--events-file", str(events)], workdir / "bootstrap.log"))
    return _wait_for(events, "listening", processes[-1], 60)["maddrs"][0]


def _kill(processes: list[subprocess.Popen]) -> None:
    """SIGKILL each process's group (a peer's DHT process and p2pd with it)."""
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(10)


def run_scenario(scenario: str, args: argparse.Namespace, workdir: Path) -> dict:
    recipe = workdir / "recipe.yaml"
    honest = args.peers - args.attackers  # the clean swarm is the same honest peers, without the attackers
    recipe.write_text(RECIPE % (args.aggregator, honest))
    swarm = [sys.executable, "-m", "swarm"]
    processes: list[subprocess.Popen] = []
    try:
        maddr = _bootstrap(recipe, workdir, processes)
        attackers = 0 if scenario == "clean" else args.attackers
        attacker_events = [workdir / f"attacker{i}.events.jsonl" for i in range(attackers)]
        common = ["join", "--initial-peers", maddr, "--device", "cpu", "--num-threads", "1",
                  "--cache-dir", args.cache_dir]
        if scenario in SCRIPTED:  # it prepares the run's data (and the shared tokenizer cache) before the others
            for i, events in enumerate(attacker_events):
                attacker = _start([sys.executable, str(ROOT / "scripts" / "attackers.py"), "--initial-peers", maddr,
                                   "--scenario", scenario, "--cache-dir", args.cache_dir, "--events-file",
                                   str(events), "--seconds", str(args.timeout)], workdir / f"attacker{i}.log")
                processes.append(attacker)
                _wait_for(events, "ready", attacker, 180)
        if scenario in FAULTS:  # in the swarm before the honest peers, so its round 0 is theirs (as test_faults)
            for i, events in enumerate(attacker_events):
                attacker = _start(swarm + common + ["--inject-fault", FAULTS[scenario], "--events-file", str(events)],
                                  workdir / f"attacker{i}.log")
                processes.append(attacker)
                _wait_for(events, "training", attacker, 180)
        peers = []
        for i in range(honest):
            events = workdir / f"honest{i}.events.jsonl"
            peers.append((_start(swarm + common + ["--until-round", str(args.rounds), "--events-file", str(events)],
                                 workdir / f"honest{i}.log"), events))
        processes += [process for process, _ in peers]
        peak, deadline = 0, time.monotonic() + args.timeout
        while any(process.poll() is None for process, _ in peers) and time.monotonic() < deadline:
            peak = max([peak] + [_tree_rss(process.pid) for process, _ in peers])
            time.sleep(0.5)
        finished = [process.poll() == 0 for process, _ in peers]
        logs = [read_events(events) for _, events in peers]  # each peer's events, read once
        told = [e for path in attacker_events for e in read_events(path)]  # the attackers' together
        averaged = [[e for e in log if e["event"] == "averaged"] for log in logs]
        last = [max(rounds, key=lambda e: e["round"]) for rounds in averaged if rounds]
        lies = {e.get("digest") for e in told if e["event"] == "attacking"}
        taken = sum(1 for log in logs for e in log if e["event"] == "synced" and e.get("digest") in lies)
        # The longest an honest peer went without a round: from its start (or last round) to its next.
        waits = []
        for log, rounds in zip(logs, averaged):
            times = [e["time"] for e in log if e["event"] == "training"][:1] + [e["time"] for e in rounds]
            waits += [b - a for a, b in zip(times, times[1:])]
        # That the attack ran: the rounds the attackers averaged with the swarm, and the lies scripted ones told.
        attacker_rounds = sum(1 for e in told if e["event"] == "averaged")
        attacks = sum(1 for e in told if e["event"] in ("attacking", "fault"))
        return {"scenario": scenario, "honest_peers": honest, "attackers": attackers, "finished": sum(finished),
                "attacker_rounds": attacker_rounds, "attacks": attacks,
                "rounds": min((e["round"] + 1 for e in last), default=0) if len(last) == honest else 0,
                "val_loss": statistics.mean(e["val_loss"] for e in last) if last else None,
                "took_attacker_state": taken, "peak_rss_mb": peak / 2**20,
                "longest_round_s": max(waits, default=None)}
    finally:
        _kill(processes)


def run_stage_scenario(scenario: str, args: argparse.Namespace, workdir: Path) -> dict:
    """A pipelined run: STAGE_PEERS honest peers on each of the two stages and (but in stage-clean) --attackers
    peers of ATTACKER_STAGE (stage 1 by default) lying with STAGE_FAULTS[scenario]. The row's loss is the honest
    first-stage peers' validation loss (the pipeline's) after the last round."""
    recipe = workdir / "recipe.yaml"
    recipe.write_text(PIPELINE_RECIPE % args.aggregator)
    swarm = [sys.executable, "-m", "swarm"]
    processes: list[subprocess.Popen] = []
    try:
        maddr = _bootstrap(recipe, workdir, processes)
        common = ["join", "--initial-peers", maddr, "--device", "cpu", "--num-threads", "1",
                  "--cache-dir", args.cache_dir]
        peers = []  # (process, events, log, stage)
        for stage in (1, 0):
            for i in range(STAGE_PEERS):
                name = f"stage{stage}-honest{i}"
                events, log = workdir / f"{name}.events.jsonl", workdir / f"{name}.log"
                peers.append((_start(swarm + common + ["--stage", str(stage), "--until-round", str(args.rounds),
                                                       "--events-file", str(events)], log), events, log, stage))
        processes += [process for process, *_ in peers]
        # The attackers start with the honest peers: a stage-1 peer alone in the swarm first sits in round 0's
        # matchmaking with the microbatches it holds (up to a minute, on any code), which would be measured instead.
        attackers = 0 if scenario == "stage-clean" else args.attackers
        attacker_events = [workdir / f"attacker{i}.events.jsonl" for i in range(attackers)]
        for i, events in enumerate(attacker_events):
            stage = str(ATTACKER_STAGE.get(scenario, 1))
            processes.append(_start(swarm + common + ["--stage", stage, "--inject-fault", STAGE_FAULTS[scenario],
                                                      "--events-file", str(events)], workdir / f"attacker{i}.log"))
        attacker_ids = [_wait_for(events, "joined", process, 180)["peer_id"]
                        for events, process in zip(attacker_events, processes[-attackers:] if attackers else [])]
        # Until the first stage's honest peers are done, and the second stage's a minute more at most: a serving
        # peer whose stage is a round behind when the first stage stops can wait for tokens that never come.
        peak, deadline = 0, time.monotonic() + args.timeout
        for stages, wait in (((0,), args.timeout), ((0, 1), GRACE_SECONDS)):
            until = min(deadline, time.monotonic() + wait)
            while any(process.poll() is None for process, *_, stage in peers if stage in stages) \
                    and time.monotonic() < until:
                peak = max([peak] + [_tree_rss(process.pid) for process, *_ in peers])
                time.sleep(0.5)
        finished = [process.poll() == 0 for process, *_ in peers]
        logs = [read_events(events) for _, events, _, _ in peers]
        averaged = [[e for e in log if e["event"] == "averaged"] for log in logs]
        firsts = [(log, rounds, path) for log, rounds, (_, _, path, stage) in zip(logs, averaged, peers) if stage == 0]
        # (who judges the attackers: the honest peers of the other stage)
        judged_by = 1 - ATTACKER_STAGE.get(scenario, 1)
        judges = [(log, rounds, path) for log, rounds, (_, _, path, stage) in zip(logs, averaged, peers)
                  if stage == judged_by]
        done = {k: [max((e["round"] + 1 for e in rounds), default=0)
                    for rounds, (*_, stage) in zip(averaged, peers) if stage == k] for k in (0, 1)}
        # (a round's validation microbatches find no next-stage peer now and then, the last one most: the stage-1
        # peers are done; each first-stage peer's last validation loss is taken)
        val = [max((e for e in rounds if e.get("val_loss") is not None), key=lambda e: e["round"])["val_loss"]
               for _, rounds, _ in firsts if any(e.get("val_loss") is not None for e in rounds)]
        # A state only the attackers reached (none of the honest peers averaged into it) that an honest peer synced to.
        told = [e for path in attacker_events for e in read_events(path)]
        honest_digests = {e.get("digest") for rounds in averaged for e in rounds}
        theirs = {e.get("digest") for e in told if e["event"] in ("averaged", "synced")} - honest_digests
        taken = sum(1 for log in logs for e in log if e["event"] == "synced" and e.get("digest") in theirs)
        waits = []
        for log, rounds in zip(logs, averaged):
            times = [e["time"] for e in log if e["event"] == "training"][:1] + [e["time"] for e in rounds]
            waits += [b - a for a, b in zip(times, times[1:])]
        # When each honest first-stage peer left each attacker out: seconds into its training and its round then.
        exclusions, disputes, honest_left_out = [], 0, 0
        for _, _, path in firsts:
            lines = path.read_text(errors="replace").splitlines() if path.exists() else []
            disputes += sum("no two stage peers agree" in line for line in lines)
        for log, rounds, path in judges:
            started = [e["time"] for e in log if e["event"] == "training"][:1]
            lines = path.read_text(errors="replace").splitlines() if path.exists() else []
            honest_left_out += sum(1 for m in map(re.compile(LEFT_OUT).match, lines)
                                   if m and (m.group(2) or m.group(3) or m.group(4)) not in attacker_ids)
            for attacker_id in attacker_ids:
                found = [m for m in map(re.compile(LEFT_OUT).match, lines)
                         if m and attacker_id in (m.group(2), m.group(3), m.group(4))]
                if not found or not started:
                    exclusions.append(None)
                    continue
                when = _clock_time(found[0].group(1), started[0])
                exclusions.append((when - started[0], sum(1 for e in rounds if e["time"] <= when)))
        caught = [e for e in exclusions if e is not None]
        return {"scenario": scenario, "honest_peers": len(peers), "attackers": attackers, "finished": sum(finished),
                "attacker_rounds": sum(1 for e in told if e["event"] == "averaged"),
                "attacks": None,  # (a stage peer's lies are in its answers, which it does not count)
                "rounds": min(done[0]), "stage1_rounds": min(done[1]),
                "val_loss": statistics.mean(val) if val else None, "took_attacker_state": taken,
                "peak_rss_mb": peak / 2**20, "longest_round_s": max(waits, default=None),
                "left_out_by": f"{len(caught)}/{len(exclusions)}" if exclusions else None,
                "left_out_after_s": max(s for s, _ in caught) if caught else None,
                "left_out_in_round": max(r for _, r in caught) if caught else None, "disputes": disputes,
                "honest_left_out": honest_left_out}
    finally:
        _kill(processes)


def _clock_time(clock: str, near: float) -> float:
    """The epoch time of a log line's HH:MM:SS (local time), the one nearest `near` (an epoch time)."""
    day = datetime.datetime.fromtimestamp(near)
    hours, minutes, seconds = map(int, clock.split(":"))
    candidates = [(day.replace(hour=hours, minute=minutes, second=seconds, microsecond=0)
                   + datetime.timedelta(days=shift)).timestamp() for shift in (-1, 0, 1)]
    return min(candidates, key=lambda t: abs(t - near))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {SCENARIOS}")
    parser.add_argument("--peers", type=int, default=4, help="peers in the swarm, the attackers included (the clean "
                                                                 "swarm runs the others alone)")
    parser.add_argument("--attackers", type=int, default=1, help="attackers among --peers (they collude)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--aggregator", default="centered_clip", choices=("mean", "trimmed_mean", "centered_clip"))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per scenario")
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "swarm-attack-bench-cache"))
    parser.add_argument("--log-dir", help="keep every scenario's logs and events there (DIR/<n>-<scenario>)")
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}: choose from {', '.join(SCENARIOS)}")
    if not 1 <= args.attackers < args.peers:
        parser.error(f"--attackers {args.attackers}: give 1 to {args.peers - 1} (some peers must be honest)")
    if "stage-clean" not in scenarios and any(scenario in STAGED for scenario in scenarios):
        scenarios.insert(0, "stage-clean")  # every stage-* row is compared with it
    if "clean" not in scenarios and any(scenario not in STAGED for scenario in scenarios):
        scenarios.insert(0, "clean")  # every other row is compared with it
    rows = []
    for scenario in scenarios:
        with tempfile.TemporaryDirectory(prefix=f"attack-{scenario}-") as workdir:
            started = time.monotonic()
            run = run_stage_scenario if scenario in STAGED else run_scenario
            rows.append({**run(scenario, args, Path(workdir)), "seconds": time.monotonic() - started})
            if args.log_dir:
                shutil.copytree(workdir, Path(args.log_dir) / f"{len(rows) - 1}-{scenario}", dirs_exist_ok=True)
            print(f"  {scenario}: {rows[-1]}", file=sys.stderr, flush=True)
    cleans = {False: next((row["val_loss"] for row in rows if row["scenario"] == "clean"), None),
              True: next((row["val_loss"] for row in rows if row["scenario"] == "stage-clean"), None)}
    print(f"{args.peers - args.attackers} honest peers and {args.attackers} attacker(s) (stage-*: {2 * STAGE_PEERS} "
          f"honest peers, {STAGE_PEERS} a stage, and the attackers on stage 1), {args.rounds} rounds, int8, "
          f"aggregator {args.aggregator}")
    print(f"{'scenario':<20}{'val loss':>10}{'vs clean':>10}{'rounds':>8}{'took its state':>16}{'peak RSS MB':>13}"
          f"{'longest round s':>17}{'attacker rounds':>17}{'lies told':>11}{'left out (s, round)':>21}")
    for row in rows:
        clean = cleans[row["scenario"] in STAGED]
        row["vs_clean"] = (row["val_loss"] / clean - 1) if row["val_loss"] and clean else None
        loss = f"{row['val_loss']:.4f}" if row["val_loss"] else "-"
        versus = f"{row['vs_clean'] * 100:+.2f}%" if row["vs_clean"] is not None else "-"
        longest = f"{row['longest_round_s']:.0f}" if row["longest_round_s"] is not None else "-"
        left_out = "-" if not row.get("left_out_by") else \
            f"by {row['left_out_by']}, {row['left_out_after_s']:.0f} s, {row['left_out_in_round']}" \
            if row["left_out_after_s"] is not None else f"by {row['left_out_by']}"
        print(f"{row['scenario']:<20}{loss:>10}{versus:>10}{row['rounds']:>8}{row['took_attacker_state']:>16}"
              f"{row['peak_rss_mb']:>13.0f}{longest:>17}{row['attacker_rounds']:>17}"
              f"{'-' if row['attacks'] is None else row['attacks']:>11}{left_out:>21}")
    print(json.dumps({"peers": args.peers, "attackers": args.attackers, "rounds": args.rounds,
                      "aggregator": args.aggregator, "rows": rows}))


if __name__ == "__main__":
    main()
