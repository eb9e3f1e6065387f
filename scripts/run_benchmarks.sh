#!/usr/bin/env bash
# Every figure of docs/benchmarks.md (the real-model scheduling table included), in one go.
#   bash scripts/run_benchmarks.sh [OUT_DIR]      (about 40 minutes on a quiet 2-core machine)
# Run it with nothing else busy: the machine has two cores and torch uses both. Each command writes
# one JSON file (its figures, the date, the command and the machine) into OUT_DIR, by default
# bench/results/<date>-<machine>/.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
OUT=${1:-bench/results/$(date +%F)-$(python -c 'from radixserve.results import machine_tag; print(machine_tag())')}
PORT=${PORT:-30123}
mkdir -p "$OUT"

# issue: engine core -- offline engine vs HF transformers on the same prompts, same dtype
# (dtype auto: bfloat16 on CPUs with native bf16 GEMMs, float32 elsewhere; float32 for comparison)
radixserve bench offline --workload random --compare-hf --decode-batch 64 --output "$OUT/random.json"
radixserve bench offline --workload random --dtype float32 --compare-hf --decode-batch 64 \
    --output "$OUT/random_fp32.json"
radixserve bench offline --workload shared-prefix --compare-hf --output "$OUT/shared_prefix.json"

# the cpu_paged decode kernel: one layer per backend, then the whole decode step with each
radixserve bench attention --output "$OUT/attention.json"
radixserve bench offline --workload random --num-prompts 8 --decode-batch 64 --compare-attention 3 \
    --output "$OUT/attention_step.json"

# issue: policies -- fcfs, lpm, dfs-weight and the unified scheduler on the shared-prefix workload
for p in fcfs lpm dfs-weight; do
    radixserve bench offline --workload shared-prefix --schedule-policy "$p" --output "$OUT/sched_$p.json"
done
radixserve bench offline --workload shared-prefix --scheduler unified --output "$OUT/sched_unified.json"
# the same under KV pressure: a 12,000-token pool holds the running requests but not every group's prefix
for p in fcfs lpm dfs-weight; do
    radixserve bench offline --workload shared-prefix --schedule-policy "$p" --max-total-tokens 12000 \
        --output "$OUT/sched_${p}_tight.json"
done
radixserve bench offline --workload shared-prefix --scheduler unified --max-total-tokens 12000 \
    --output "$OUT/sched_unified_tight.json"

# issue: serving -- the server at concurrency 32 vs the offline engine capped at 32 running
radixserve bench offline --workload shared-prefix --max-running-requests 32 --output "$OUT/offline_c32.json"
radixserve serve --port "$PORT" > "$OUT/server.log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    sleep 1
done
common=(--base-url "http://127.0.0.1:$PORT" --workload shared-prefix --output-len 128 --disable-tqdm)
radixserve bench serve "${common[@]}" --num-prompts 16 --max-concurrency 32 --output "$OUT/serve_c32.json"
curl -s -X POST "http://127.0.0.1:$PORT/flush_cache" > /dev/null
radixserve bench serve "${common[@]}" --num-prompts 2 --max-concurrency 1 --output "$OUT/serve_c1.json"
