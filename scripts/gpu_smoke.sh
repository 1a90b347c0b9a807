#!/usr/bin/env bash
# A smoke check of peers on a CUDA GPU (the CPU machines cannot run one): the CUDA-only tests, then a bootstrap and
# three `--device cuda` peers of tests/recipes/tiny.yaml averaging 3 rounds (verified groups of three), then two
# peers on the two stages of tests/recipes/rebalance.yaml, then (SCALE=1, about 10 minutes) two CUDA peers of a
# 311M-parameter GPT-2-style model through scripts/bench_scale.py. Prints each part's outcome; logs go to $OUT (default: a
# new temporary directory). Where the machine lacks packages, put their wheels in .whl/ first (they are installed
# to /tmp/site). Run from the repository root:  bash scripts/gpu_smoke.sh
set -u
OUT=${OUT:-$(mktemp -d)}
W=$(mktemp -d)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_compression.py tests/test_pipeline.py -k "cuda or gpu" \
  2>&1 | tail -2

bootstrap() {  # recipe, log -> the multiaddr in $M, the pid in $B
  python3 -m swarm bootstrap --recipe "$1" > "$2" 2>&1 &
  B=$!
  M=
  for _ in $(seq 60); do
    M=$(grep -o -- "--initial-peers [^ ]*" "$2" | head -1 | cut -d' ' -f2)
    [ -n "$M" ] && break
    sleep 1
  done
}
finish() {  # pids...: wait up to 300 s for them, then report their exit codes
  local codes=""
  for _ in $(seq 300); do
    local alive=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 1
  done
  for p in "$@"; do kill -0 "$p" 2>/dev/null && kill -TERM "$p"; wait "$p"; codes="$codes $?"; done
  echo "exit codes:$codes"
}

echo "=== three peers on cuda, whole model"
bootstrap tests/recipes/tiny.yaml "$W/bootstrap.log"
pids=()
for p in 0 1 2; do
  python3 -m swarm join --initial-peers "$M" --device cuda --until-round 3 --cache-dir "$W/cache" \
    --checkpoint-dir "$W/ck$p" > "$OUT/peer$p.log" 2>&1 &
  pids+=($!)
  # The first peer prepares the corpus in the shared cache; the others start once it has (together, so that none
  # joins after the others have finished their few tiny rounds).
  for _ in $(seq 120); do [ $p != 0 ] || grep -q "model: " "$OUT/peer0.log" && break; sleep 1; done
done
finish "${pids[@]}"
kill -TERM $B
grep -h "checks passed\|device memory\|on cuda\|done:\|ERROR" "$OUT"/peer?.log | cut -c1-200

echo "=== two stages on cuda"
bootstrap tests/recipes/rebalance.yaml "$W/bootstrap2.log"
pids=()
for p in 0 1; do
  python3 -m swarm join --initial-peers "$M" --device cuda --stage $p --until-round 2 --cache-dir "$W/cache" \
    --checkpoint-dir "$W/st$p" > "$OUT/stage$p.log" 2>&1 &
  pids+=($!)
done
finish "${pids[@]}"
kill -TERM $B
grep -h "checks passed\|on cuda\|done:\|ERROR" "$OUT"/stage?.log | cut -c1-200

if [ "${SCALE:-0}" = 1 ]; then
  echo "=== two peers of a 311M-parameter model on cuda (scripts/bench_scale.py)"
  timeout 900 python3 scripts/bench_scale.py --size 350m --device cuda --peers 2 --rounds 3 --round-seconds 60 \
    --checkpoints --log-dir "$OUT/scale" 2>&1 | tail -8 | cut -c1-400
  echo "=== the same with Streaming DiLoCo: 4 fragments, overlap (a sync every 15 s, a quarter of the model's bytes)"
  timeout 900 python3 scripts/bench_scale.py --size 350m --device cuda --peers 2 --rounds 8 --skip-rounds 4 \
    --round-seconds 60 --fragments 4 --overlap --checkpoints --log-dir "$OUT/scale-fragments" 2>&1 | tail -8 | cut -c1-400
fi
