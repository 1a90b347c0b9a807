#!/usr/bin/env python3
"""Memory and time of one whole-model peer's inner steps, in one process: the resident bytes a parameter at rest
after the model, after the optimizer's state, after steps, the activations a step's forward pass adds (its peak
over the resting memory, sampled every 5 ms), and the seconds a step takes. A GPT-2-style config of
scripts/bench_scale.py's sizes (vocab 8192) on the CPU, AdamW as the recipe builds it, batches of --batch x
--seq-len random tokens. Prints a table, then one JSON line.

    python scripts/bench_step_memory.py --size 92m
    python scripts/bench_step_memory.py --size 92m --recompute-activations
    MALLOC_MMAP_THRESHOLD_=65536 python scripts/bench_step_memory.py --size 92m   # resident = live

glibc keeps freed memory in its heap (it is resident, and reused by the next step); with every allocation above
64 KiB mapped on its own (the variable above), what is resident is what is live, at a cost in speed.
"""

from __future__ import annotations

import argparse
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


def resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
    args = parser.parse_args()

    import torch

    from swarm.config import InnerRecipe, ModelRecipe
    from swarm.model.build import build_model
    from swarm.peer.training import inner_step, lm_loss, make_inner_optimizer

    torch.set_num_threads(args.threads)
    config = Path(tempfile.mkdtemp()) / "config.json"
    config.write_text(json.dumps(gpt2_config(args.size, args.seq_len)))
    base = resident()
    model = build_model(ModelRecipe(config_file=str(config)), 8192, recompute=args.recompute_activations)
    n = sum(p.numel() for p in model.parameters())
    rows = {"model": (resident() - base) / n}
    optimizer = make_inner_optimizer(model, InnerRecipe())
    batch = torch.randint(0, 8192, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    inner_step(model, optimizer, batch, torch.device("cpu"), 1e-4, 1.0)
    rows["after the first step (AdamW's state)"] = (resident() - base) / n
    started = time.monotonic()
    for _ in range(args.steps):
        inner_step(model, optimizer, batch, torch.device("cpu"), 1e-4, 1.0)
    seconds = (time.monotonic() - started) / args.steps
    rows["at rest after the steps"] = (resident() - base) / n
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
          f"{os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}")
    for what, value in rows.items():
        print(f"  {what:<60}{value:>8.1f} bytes a parameter")
    print(f"  {'seconds a step':<60}{seconds:>8.2f}")
    print(json.dumps({"size": args.size, "parameters": n, "batch": args.batch, "seq_len": args.seq_len,
                      "recompute_activations": args.recompute_activations,
                      "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"), "seconds_a_step": seconds,
                      "bytes_a_parameter": rows}))


if __name__ == "__main__":
    main()
