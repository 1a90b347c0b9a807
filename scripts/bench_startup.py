#!/usr/bin/env python3
"""What a peer process pays before it trains: the wall and CPU seconds and the peak resident memory of a fresh
interpreter that imports the peer (swarm.peer.peer), builds the recipe's model, and takes a first inner step with the
peer's optimizers (the inner AdamW and DiLoCo's outer SGD), the way every `swarm-peer join` and every test's peer
starts. `swarm` builds a recipe's Llama as a peer does (swarm/model/llama.py); `transformers`
builds the same model with transformers' LlamaForCausalLM instead, as peers did before (the same parameters, bit
for bit). Each case runs --repeats times, alternating; the table gives medians. Prints a table, then a JSON line.

    python scripts/bench_startup.py
    python scripts/bench_startup.py --hidden 768 --layers 12 --heads 12 --repeats 3   # a 100M-class Llama
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import resource, sys, time
started = time.perf_counter()
import swarm.peer.peer
from swarm.config import ModelRecipe
recipe = ModelRecipe(hidden_size={hidden}, intermediate_size={intermediate}, num_layers={layers}, num_heads={heads})
if {transformers}:
    import torch, transformers
    config = transformers.LlamaConfig(vocab_size={vocab}, hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_heads,
        max_position_embeddings=recipe.max_seq_len, tie_word_embeddings=False)
    imported = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = transformers.LlamaForCausalLM(config).float()
else:
    from swarm.model.build import build_model
    imported = time.perf_counter()
    model = build_model(recipe, {vocab})
built = time.perf_counter()
import torch
from swarm.config import InnerRecipe, OuterRecipe
from swarm.peer.diloco import DiLoCo
from swarm.peer.training import inner_step, make_inner_optimizer
optimizer = make_inner_optimizer(model, InnerRecipe().resolved(recipe.hidden_size))
DiLoCo(model, OuterRecipe())
batch = torch.randint(0, {vocab}, (2, 65), generator=torch.Generator().manual_seed(0))
inner_step(model, optimizer, batch, torch.device("cpu"), 1e-4, 1.0)
stepped = time.perf_counter()
usage = resource.getrusage(resource.RUSAGE_SELF)
loaded = int("transformers.modeling_utils" in sys.modules)  # transformers' model code
print(imported - started, built - imported, stepped - built, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024,
      loaded, int("torch._dynamo" in sys.modules), sum(p.numel() for p in model.parameters()))
"""


def run_once(case: str, args: argparse.Namespace) -> dict:
    code = CHILD.format(hidden=args.hidden, intermediate=args.intermediate or int(args.hidden * 2.6875),
                        layers=args.layers, heads=args.heads, vocab=args.vocab, transformers=case == "transformers")
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    imported, built, stepped, cpu, peak, loaded, dynamo, params = out.stdout.split()
    return {"wall_s": wall, "import_s": float(imported), "build_s": float(built), "first_step_s": float(stepped),
            "cpu_s": float(cpu), "peak_rss_bytes": int(peak), "transformers_model_code": int(loaded),
            "torch_dynamo": int(dynamo), "parameters": int(params)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256, help="the recipe's hidden_size (default: the recipe's)")
    parser.add_argument("--intermediate", type=int, default=None, help="intermediate_size (default: 2.6875 x hidden)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cases = ("swarm", "transformers")
    runs = {case: [] for case in cases}
    for _ in range(args.repeats):
        for case in cases:
            runs[case].append(run_once(case, args))
    rows = []
    for case in cases:
        median = {key: statistics.median(run[key] for run in runs[case]) for key in runs[case][0]}
        rows.append({"case": case, **median, "repeats": args.repeats})
    print(f"{'case':<13} {'params':>10} {'wall s':>7} {'import s':>9} {'build s':>8} {'first step s':>13} "
          f"{'CPU s':>6} {'peak MB':>8} {'transformers model code':>24} {'torch._dynamo':>14}")
    for row in rows:
        print(f"{row['case']:<13} {row['parameters'] / 1e6:>9.2f}M {row['wall_s']:>7.2f} {row['import_s']:>9.2f} "
              f"{row['build_s']:>8.2f} {row['first_step_s']:>13.2f} {row['cpu_s']:>6.2f} "
              f"{row['peak_rss_bytes'] / 2**20:>8.0f} "
              f"{'loaded' if row['transformers_model_code'] else 'not loaded':>24} "
              f"{'loaded' if row['torch_dynamo'] else 'not loaded':>14}")
    print("medians of --repeats fresh interpreters; wall: the whole process; import: the peer's modules (and "
          "transformers' Llama, for `transformers`); build: the seeded model; first step: the peer's optimizers "
          "built and one inner step of 2 x 64 tokens; CPU: user + system of the process")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
