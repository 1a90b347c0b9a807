#!/usr/bin/env python3
"""Memory a peer needs to build the stage it hosts: in a fresh process per case, the peak RSS above the imports
while it builds stage K of S of a Llama, (a) as peers did until 2026-11-26 (the whole model built and seeded, then
the other stages' weights freed) and (b) as they do now (the model on the meta device, the stage allocated and
initialised alone: swarm.model.stages.materialize). Prints a table, then a JSON line.

    python scripts/bench_stage_memory.py                       # hidden 1024, 16 blocks: a 0.9 GB model in fp32
    python scripts/bench_stage_memory.py --layers 32 --stages 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASE = r"""
import json, sys
from pathlib import Path
import torch

def hwm_kb():
    text = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("VmHWM:")))

from swarm.config import ModelRecipe
from swarm.model.build import build_model
from swarm.model.stages import Stage, even_bounds, materialize
args = json.loads(sys.argv[1])
recipe = ModelRecipe(hidden_size=args["hidden"], intermediate_size=args["intermediate"], num_layers=args["layers"],
                     num_heads=args["heads"], max_seq_len=256, seed=0)
before = hwm_kb()
start, end = even_bounds(args["layers"], args["stages"])[args["stage"]]
if args["how"] == "whole":
    model = build_model(recipe, args["vocab"])
    stage = Stage(model, start, end)
    hosted = {id(p) for p in stage.parameters()}
    for param in model.parameters():
        if id(param) not in hosted:
            param.data = torch.empty(0, dtype=param.dtype)
else:
    model = build_model(recipe, args["vocab"], meta=True)
    stage = Stage(model, start, end)
    materialize(model, stage, recipe.seed)
whole = sum(p.numel() for p in build_model(recipe, args["vocab"], meta=True).parameters())
print(json.dumps({"peak_mb": (hwm_kb() - before) / 1024, "stage_mb": 4 * sum(p.numel() for p in stage.parameters()) / 2**20,
                  "whole_mb": 4 * whole / 2**20}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--stage", type=int, default=1, help="which stage the peer hosts (default 1: a middle one)")
    args = parser.parse_args()
    rows = []
    for how in ("whole", "alone"):
        case = {**vars(args), "how": how}
        out = subprocess.run([sys.executable, "-c", CASE, json.dumps(case)], capture_output=True, text=True,
                             check=True).stdout
        rows.append({"how": how, **json.loads(out.strip().splitlines()[-1])})
    print(f"stage {args.stage} of {args.stages} of a Llama with hidden {args.hidden}, {args.layers} blocks "
          f"({rows[0]['whole_mb']:.0f} MB of fp32 weights; the stage's: {rows[0]['stage_mb']:.0f} MB)")
    print(f"{'how the stage is built':48} {'peak RSS above imports MB':>26}")
    labels = {"whole": "whole model built and seeded, others freed (a)", "alone": "the stage alone, on meta (b)"}
    for row in rows:
        print(f"{labels[row['how']]:48} {row['peak_mb']:26.0f}")
    print(json.dumps({"bench": "stage_memory", **{k: v for k, v in vars(args).items()},
                      "whole_mb": rows[0]["whole_mb"], "stage_mb": rows[0]["stage_mb"],
                      "peak_mb": {row["how"]: round(row["peak_mb"], 1) for row in rows}}))


if __name__ == "__main__":
    main()
