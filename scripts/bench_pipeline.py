#!/usr/bin/env python3
"""Does DiLoCo-SWARM (block ranges in pipelines of peers, DiLoCo per range) learn as well as full-model DiLoCo on
the same tokens? Simulates, in one process, with the code a peer runs (swarm/simulation.py, stages.py):

  (a) full-model DiLoCo, M = 4 peers, H inner steps per round
  (b) 2 stages x 2 peers: each first-stage peer reads a shard, every microbatch goes on to a second-stage peer
      drawn at random (SWARM's stochastic wiring), activations and their gradients through the wire codec (fp16),
      DiLoCo per stage; 2H microbatches per first-stage peer per round, so (a) and (b) see the same tokens per round
      and in all (4 peers each computing half the model process what 4 whole-model peers process)
  (c) as (b) with an int8 wire
  (d) as (b) with pipeline.schedule: flush (the first stage's gradients on the weights they are applied to; (b)
      and (c) stream, as peers do by default: each batch's gradient applied one step late)
  (e) as (b) with pipeline.bottleneck: R (--bottleneck, default 16): R values a token cross the boundary, each way,
      through a trained encoder and decoder, the stage after it embedding the token ids again (swarm/model/stages.py)
  (f) as (e) with an int8 wire
  (g) as (e) without the token ids embedded again after the boundary (all that crosses is the R values)

and prints each one's final validation loss, its gap to (a), and the bytes that crossed the stage boundary per
training token, then one JSON line. Wall time and pipeline utilisation need real peers on real links: not here.

    python scripts/bench_pipeline.py                      # 4 layers, H=50, 6 rounds: several minutes on 2 cores
    python scripts/bench_pipeline.py --rounds 2 --inner-steps 10 --only a,b   # a quick look
    python scripts/bench_pipeline.py --only f --bottleneck 24                # another bottleneck width
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from swarm.config import RecipeError, parse_recipe  # noqa: E402
from swarm.data.prepare import CorpusError, prepare_run_data  # noqa: E402
from swarm.simulation import simulate_diloco, simulate_pipeline  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4, help="peers in all (b: stages x peers per stage)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, default=50, help="H: inner steps per round of (a)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per microbatch / inner step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--warmup-frac", type=float, default=0.05)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--codec", default="int8", help="pseudo-gradient codec (recipe averaging.codec)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "swarm-bench-cache"))
    parser.add_argument("--bottleneck", type=int, default=16, help="(e)-(g): pipeline.bottleneck, values a token")
    parser.add_argument("--only", help="comma-separated subset of a-g")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.peers % args.stages:
        parser.error(f"--peers {args.peers} must be a multiple of --stages {args.stages}")
    m, h, rounds, replicas = args.peers, args.inner_steps, args.rounds, args.peers // args.stages
    total_tokens = m * h * rounds * args.batch * args.seq_len
    fields = {
        "run_id": "bench-pipeline",
        "model": {"hidden_size": args.hidden, "intermediate_size": int(args.hidden * 8 / 3) // 8 * 8,
                  "num_layers": args.layers, "num_heads": 4, "max_seq_len": args.seq_len},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch, "vocab_size": 4096},
        # (betas: the recipe's defaults before 2026-11-29, which this script's figures were taken with)
        "inner": {"lr": args.lr, "warmup_tokens": int(total_tokens * args.warmup_frac),
                  "min_lr_ratio": args.min_lr_ratio, "beta1": 0.9, "beta2": 0.95},
        "outer": {"lr": args.outer_lr, "momentum": args.outer_momentum},
        "averaging": {"codec": args.codec},
        "total_tokens": total_tokens,
    }
    try:
        recipe = parse_recipe(fields)
    except RecipeError as exc:
        parser.error(str(exc))
    try:
        data = prepare_run_data(recipe.data.source, recipe.data.tokenizer, recipe.data.vocab_size,
                                recipe.data.val_fraction, recipe.data.seq_len, recipe.data.batch_size,
                                recipe.data.seed, args.cache_dir, eval_batches=16)
    except CorpusError as exc:
        parser.error(str(exc))
    spread = lambda n: [k * recipe.data.num_shards // n for k in range(n)]  # noqa: E731 - starts as peers spread
    flush = recipe.model_copy(update={"pipeline": recipe.pipeline.model_copy(update={"schedule": "flush"})})
    narrow = recipe.model_copy(update={"pipeline": recipe.pipeline.model_copy(update={"bottleneck": args.bottleneck})})
    r = args.bottleneck
    steps = h * m // replicas  # microbatches per first-stage peer per round: the same tokens per round as (a)
    configs = {
        "a": (f"DiLoCo M={m} H={h} whole model", lambda: simulate_diloco(recipe, data, spread(m), rounds, h)),
        "b": (f"{args.stages} stages x {replicas} peers, fp16 wire",
              lambda: simulate_pipeline(recipe, data, spread(replicas), args.stages, rounds, steps, "fp16")),
        "c": (f"{args.stages} stages x {replicas} peers, int8 wire",
              lambda: simulate_pipeline(recipe, data, spread(replicas), args.stages, rounds, steps, "int8")),
        "d": (f"{args.stages} stages x {replicas} peers, fp16 wire, schedule flush",
              lambda: simulate_pipeline(flush, data, spread(replicas), args.stages, rounds, steps, "fp16")),
        "e": (f"{args.stages} stages x {replicas} peers, bottleneck {r}, fp16 wire",
              lambda: simulate_pipeline(narrow, data, spread(replicas), args.stages, rounds, steps, "fp16")),
        "f": (f"{args.stages} stages x {replicas} peers, bottleneck {r}, int8 wire",
              lambda: simulate_pipeline(narrow, data, spread(replicas), args.stages, rounds, steps, "int8")),
        "g": (f"{args.stages} stages x {replicas} peers, bottleneck {r} without re-embedding, fp16 wire",
              lambda: simulate_pipeline(narrow, data, spread(replicas), args.stages, rounds, steps, "fp16",
                                        reembed=False)),
    }
    rows = []
    for key in (args.only.split(",") if args.only else list(configs)):
        name, run = configs[key]
        started = time.monotonic()
        result = run()
        row = {"config": key, "name": name, "val_loss": result.val_losses[-1], "val_losses": result.val_losses,
               "tokens": result.tokens, "seconds": round(time.monotonic() - started, 1)}
        if hasattr(result, "activation_bytes"):
            row["boundary_bytes_per_token"] = result.activation_bytes / result.tokens
            row["microbatches_per_stage_replica"] = result.stage_microbatches[-1]
        rows.append(row)
        print(f"  {name}: val loss {row['val_loss']:.4f} ({row['seconds']:.0f} s)", flush=True)
    by_key = {row["config"]: row for row in rows}
    print(f"\n{args.layers}-layer Llama (hidden {args.hidden}), {total_tokens:,} tokens in {rounds} rounds, "
          f"microbatch {args.batch}x{args.seq_len}, pseudo-gradients {args.codec}")
    print(f"{'config':<66}{'val loss':>10}{'vs (a)':>9}{'vs (b)':>9}{'boundary B/token':>18}{'tokens':>12}")
    for row in rows:
        vs_a = f"{(row['val_loss'] / by_key['a']['val_loss'] - 1) * 100:+.2f}%" if "a" in by_key else "-"
        vs_b = f"{(row['val_loss'] / by_key['b']['val_loss'] - 1) * 100:+.2f}%" if "b" in by_key else "-"
        row["vs_a"], row["vs_b"] = vs_a, vs_b
        per_token = f"{row['boundary_bytes_per_token']:.0f}" if "boundary_bytes_per_token" in row else "-"
        print(f"{row['name']:<66}{row['val_loss']:>10.4f}{vs_a:>9}{vs_b:>9}{per_token:>18}{row['tokens']:>12,}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
