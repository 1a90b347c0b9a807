"""How far two honest copies of a first pipeline stage drift apart, which is what the check of a first stage's
activations by recomputation must tolerate (swarm/peer/pipeline/recompute.py, integrity.ACTIVATIONS).

The model of tests/recipes/stages.yaml cut into its two stages; from a common point (the recipe's init, or after
`--common` steps), two copies of the first stage, each with a copy of the last, take AdamW steps on different
batches of the bundled corpus; the table gives the cosine between the two copies' activations for one microbatch
and the ratio of their norms, and the cosine of noise of their norm with the first copy's. Prints a table, then
one JSON line.

    python scripts/bench_drift.py
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from swarm.config import load_recipe  # noqa: E402
from swarm.data.prepare import prepare_run_data  # noqa: E402
from swarm.model.build import build_model  # noqa: E402
from swarm.model.stages import even_bounds, make_stages  # noqa: E402
from swarm.peer.training import inner_for  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "tests" / "recipes" / "stages.yaml"
PAIRS = ((0, 64), (64, 64), (0, 300), (300, 300), (10, 300))  # steps each copy takes from the common point


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--common", default="0,300", help="comma-separated steps the copies take together first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "swarm-bench-cache"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    recipe = load_recipe(RECIPE)
    d = recipe.data
    data = prepare_run_data(d.source, d.tokenizer, d.vocab_size, d.val_fraction, d.seq_len, d.batch_size, d.seed,
                            args.cache_dir)
    model = build_model(recipe.model, data.vocab_size)
    stages = make_stages(model, even_bounds(len(model.model.layers), 2))
    probe = data.train.windows(torch.arange(4))[:, :-1]
    n = probe.numel() * recipe.model.hidden_size
    lr = inner_for(recipe.inner, model).lr  # (the peer's lr for this model)

    def train(pair, steps: int, seed: int):
        first, last = copy.deepcopy(pair[0]), copy.deepcopy(pair[1])
        optimizer = torch.optim.AdamW([*first.parameters(), *last.parameters()], lr=lr)
        generator = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            batch = data.train.windows(torch.randint(0, data.train.num_windows, (d.batch_size,), generator=generator))
            out = last(first(batch[:, :-1]))
            F.cross_entropy(out.reshape(-1, out.shape[-1]), batch[:, 1:].reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return first, last

    rows = []
    for common in (int(c) for c in args.common.split(",")):
        root = train(stages, common, 1)
        with torch.no_grad():
            ours = root[0](probe).flatten()
        noise = torch.randn(ours.shape, generator=torch.Generator().manual_seed(0))
        rows.append({"common": common, "steps": None, "cosine": float(ours @ noise / (ours.norm() * noise.norm())),
                     "norm_ratio": 1.0})
        for a, b in PAIRS:
            copies = [train(root, steps, seed)[0] for steps, seed in ((a, 2), (b, 3))]
            with torch.no_grad():
                x, y = (stage(probe).flatten() for stage in copies)
            rows.append({"common": common, "steps": [a, b], "cosine": float(x @ y / (x.norm() * y.norm())),
                         "norm_ratio": float(x.norm() / y.norm())})
    print(f"first stage of {RECIPE.name}, a microbatch of {n} activation values; the check's threshold "
          f"min(6/sqrt(n), 0.1) = {min(6 / math.sqrt(n), 0.1):.3f}")
    print(f"{'common steps':>13}{'steps each':>14}{'cosine':>9}{'norm ratio':>12}")
    for row in rows:
        steps = "noise" if row["steps"] is None else f"{row['steps'][0]} and {row['steps'][1]}"
        print(f"{row['common']:>13}{steps:>14}{row['cosine']:>9.3f}{row['norm_ratio']:>12.2f}")
    print(json.dumps({"values": n, "threshold": min(6 / math.sqrt(n), 0.1), "rows": rows}))


if __name__ == "__main__":
    main()
