#!/usr/bin/env bash
# The issue-4 serving comparison on this machine: SmolLM2, 1024 input / 64 output tokens, Poisson
# arrivals over a sweep of rates, SLO TTFT <= 10 s and TPOT <= 150 ms.
#   agg:    one `pdserve serve` instance on both cores, chunked prefill
#   disagg: `pdserve launch` with 1 context instance on core 0 and 1 generation instance on core 1
# Both run side by side (idle while the other is measured); the sweep sends every system the same
# prompts and arrival times. Results: $OUT/sweep.json, per-run files, and plots.
# Peers already serving elsewhere join the same sweep through EXTRA_ENDPOINTS, e.g. vLLM started by
# `benchmarks/vllm_serving.sh serve`: EXTRA_ENDPOINTS="vllm_agg=http://127.0.0.1:8300 vllm_pd=http://127.0.0.1:8400".
# SEED picks the prompts (rate k of a sweep uses seed SEED+k; default 0): servers that already saw
# a sweep (vLLM kept up) need a SEED past that sweep's seeds, or their prefix caches would serve
# repeated prompts.
#   usage: benchmarks/serving_sweep.sh [OUT_DIR] [RATES...]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/serving}; shift || true
RATES=${*:-0.05 0.1 0.2 0.3}
NUM_PROMPTS=${NUM_PROMPTS:-16}
mkdir -p "$OUT"

cat > "$OUT/agg.yaml" <<YAML
port: 8100
num_threads: 2
max_num_tokens: 512
enable_chunked_prefill: true
YAML
cat > "$OUT/cluster.yaml" <<YAML
port: 8200
backend: shm
log_dir: $OUT/cluster-logs
context:
  - {port: 8201, cpus: [0], config: {num_threads: 1, max_num_tokens: 2048}}
generation:
  - {port: 8202, cpus: [1], config: {num_threads: 1}}
YAML

pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT
pdserve serve --config "$OUT/agg.yaml" > "$OUT/agg.log" 2>&1 & pids+=($!)
pdserve launch "$OUT/cluster.yaml" > "$OUT/launch.log" 2>&1 & pids+=($!)
for url in http://127.0.0.1:8100/health http://127.0.0.1:8200/health; do
  for _ in $(seq 600); do curl -sf "$url" > /dev/null && break; sleep 1; done
  curl -sf "$url" > /dev/null || { echo "not ready: $url"; exit 1; }
done

extra=()
for e in ${EXTRA_ENDPOINTS:-}; do extra+=(--endpoint "$e"); done
pdserve bench sweep --endpoint agg=http://127.0.0.1:8100 --endpoint disagg=http://127.0.0.1:8200 "${extra[@]}" \
  --model SmolLM2-135M-Instruct --request-rates $RATES --num-prompts "$NUM_PROMPTS" \
  --input-len 1024 --output-len 64 --goodput ttft:10000 tpot:150 --cooldown 5 --seed "${SEED:-0}" \
  --out "$OUT/sweep.json" --run-dir "$OUT/runs"
python benchmarks/plot_serving.py rates "$OUT/sweep.json" --out "$OUT/rates.png"
