#!/usr/bin/env python3
"""Memory and time of one whole-model peer's inner steps, in one process: the resident bytes a parameter at rest
after the model, after the optimizer's state, after steps, the activations a step's forward pass adds (its peak
over the resting memory, sampled every 5 ms), and the seconds a step takes. A GPT-2-style config of
scripts/bench_scale.py's sizes (vocab 8192) on the CPU, AdamW as the recipe builds it, batches of --batch x
--seq-len random tokens. Prints a table, then one JSON line.

    python scripts/bench_step_memory.py --size 92m
    python scripts/bench_step_memory.py --size 92m --recompute-activations
    MALLOC_MMAP_THRESHOLD_=65536 python scripts/bench_step_memory.py --size 92m   # resident = live
    THP_MEM_ALLOC_ENABLE=0 python scripts/bench_step_memory.py --size 92m         # no huge pages
    python scripts/bench_step_memory.py --size 92m --fresh-memory                 # what fresh pages cost
    python scripts/bench_step_memory.py --size 92m --recompute-activations --step free   # as before 2026-12-01

glibc keeps freed memory in its heap (it is resident, and reused by the next step); with every allocation above
64 KiB mapped on its own (the variable above), what is resident is what is live, at a cost in speed. Like a peer
(swarm/cli.py), the script has torch put allocations of 2 MB and more on transparent huge pages unless
THP_MEM_ALLOC_ENABLE is set otherwise. --fresh-memory times, instead, writing a round buffer's worth of fresh
memory (4 bytes a parameter) right after the last one was freed and after it lay freed a while: what a round that
takes its buffers afresh pays (a VM's host may take freed memory back, and gives it again page by page).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
STEPS = ("peer", "free", "trim")


def resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def high_water() -> int:
    """The most this process has held resident (VmHWM)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM"))
    return int(line.split()[1]) * 1024


class Peak:
    """The highest resident bytes seen every 5 ms while in the `with` block."""

    def __enter__(self):
        self.peak, self._stop = resident(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, resident())
            self._stop.wait(0.005)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident())


def main() -> None:
    from bench_scale import SIZES, gpt2_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="92m", choices=list(SIZES))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after one untimed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--recompute-activations", action="store_true")
    parser.add_argument("--fresh-memory", action="store_true", help="time writing fresh memory instead of steps")
    parser.add_argument("--step", choices=STEPS, default="peer",
                        help="peer: a peer's inner step (on the CPU the gradients stay, zeroed in place, and the "
                             "heap's free pages go back to the kernel: glibc's malloc_trim); free: the gradients "
                             "freed and nothing trimmed (a peer's step before 2026-12-01); trim: freed and trimmed")
    args = parser.parse_args()

    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # (before torch loads, as a peer does)
    import torch

    if args.fresh_memory:
        return fresh_memory(torch, args.size)

    from swarm.config import InnerRecipe, ModelRecipe
    from swarm.model.build import build_model
    from swarm.peer.training import inner_for, inner_step, lm_loss, make_inner_optimizer

    torch.set_num_threads(args.threads)
    config = Path(tempfile.mkdtemp()) / "config.json"
    config.write_text(json.dumps(gpt2_config(args.size, args.seq_len)))
    base = resident()
    model = build_model(ModelRecipe(config_file=str(config)), 8192, recompute=args.recompute_activations)
    n = sum(p.numel() for p in model.parameters())
    rows = {"model": (resident() - base) / n}
    optimizer = make_inner_optimizer(model, inner_for(InnerRecipe(), model))
    batch = torch.randint(0, 8192, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        if args.step == "peer":
            inner_step(model, optimizer, batch, torch.device("cpu"), 1e-4, 1.0)
            return
        for group in optimizer.param_groups:
            group["lr"] = 1e-4
        lm_loss(model, batch, torch.device("cpu")).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.step == "trim":
            ctypes.CDLL(None).malloc_trim(0)

    step()
    rows["after the first step (AdamW's state)"] = (resident() - base) / n
    started = time.monotonic()
    for _ in range(args.steps):
        step()
    seconds = (time.monotonic() - started) / args.steps
    rows["at rest after the steps"] = (resident() - base) / n
    rows["the process's peak (VmHWM) over the start, the steps' included"] = (high_water() - base) / n
    resting = resident()
    with Peak() as forward:
        loss = lm_loss(model, batch, torch.device("cpu"))
    with Peak() as backward:
        loss.backward()
    model.zero_grad(set_to_none=True)
    rows["a forward pass's peak over rest"] = (forward.peak - resting) / n
    rows["the backward's peak over rest (gradients and activations)"] = (backward.peak - resting) / n
    print(f"{args.size}: {n / 1e6:.1f}M parameters, batch {args.batch} x {args.seq_len}, {args.threads} thread(s), "
          f"recomputed activations: {args.recompute_activations}, MALLOC_MMAP_THRESHOLD_="
          f"{os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}, THP_MEM_ALLOC_ENABLE="
          f"{os.environ.get('THP_MEM_ALLOC_ENABLE')}, step: {args.step}")
    for what, value in rows.items():
        print(f"  {what:<60}{value:>8.1f} bytes a parameter")
    print(f"  {'seconds a step':<60}{seconds:>8.2f}")
    print(json.dumps({"size": args.size, "parameters": n, "batch": args.batch, "seq_len": args.seq_len,
                      "recompute_activations": args.recompute_activations,
                      "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"), "seconds_a_step": seconds,
                      "thp": os.environ.get("THP_MEM_ALLOC_ENABLE"), "step": args.step,
                      "bytes_a_parameter": rows}))


def fresh_memory(torch, size: str, idle: tuple[float, ...] = (0.0, 0.0, 5.0, 20.0)) -> None:
    """Seconds to allocate and write 4 bytes a parameter of `size`'s model, after each of `idle` seconds with the
    last such buffer freed."""
    from bench_scale import SIZES

    layers, hidden, _ = SIZES[size]
    n = 12 * layers * hidden * hidden + (8192 + 256) * hidden  # (GPT-2's count, near enough)
    held = torch.ones(3 * n)  # (a process of some size, as a peer's is)
    rows = []
    for wait in idle:
        time.sleep(wait)
        started = time.monotonic()
        buffer = torch.empty(n).fill_(1.0)
        rows.append({"idle_seconds": wait, "seconds": time.monotonic() - started})
        del buffer
    print(f"{size}: writing {4 * n / 1e6:.0f} MB of fresh memory, THP_MEM_ALLOC_ENABLE="
          f"{os.environ.get('THP_MEM_ALLOC_ENABLE')}, {held.numel() * 4 / 1e9:.1f} GB held")
    for row in rows:
        print(f"  after {row['idle_seconds']:>4.0f} s with the last one freed{row['seconds']:>10.3f} s")
    print(json.dumps({"size": size, "bytes": 4 * n, "thp": os.environ.get("THP_MEM_ALLOC_ENABLE"), "rows": rows}))


if __name__ == "__main__":
    main()
