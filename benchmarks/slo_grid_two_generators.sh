#!/usr/bin/env bash
# Issue 18 section 1, the second load generator: pdserve aggregated and vLLM aggregated, both up,
# each loaded by `pdserve bench` and by vLLM's own `bench serve` (benchmarks/vllm_bench_serve.sh) at
# every rate, then `pdserve bench grid` scores goodput at every SLO pair for the four
# (system, generator) pairs. Rate by rate, the four runs go in turn, in alternate order, so the
# runs compared at one rate are close in time on a machine whose speed drifts.
#   agg       :8100  `pdserve serve`, 2 threads, 512-token steps (chunked prefill), as slo_grid_vs_vllm.sh
#   vllm_agg  :8300  vLLM's OpenAI server, OpenMP bound to both cores (benchmarks/vllm_serving.sh)
# The generators' prompts differ: pdserve bench sends token ids (seed SEED + k at the k-th rate),
# vLLM's bench serve sends text it decoded from random ids (seed SEED + k), which the server tokenizes.
# Both make exactly INPUT_LEN prompt tokens and OUTPUT_LEN output tokens (ignore_eos).
#
#   usage: VLLM_PYTHON=/work/vllm-venv/bin/python benchmarks/slo_grid_two_generators.sh [OUT_DIR]
#   env:   RATES ("0.5 1 1.5 2 3"), NUM_PROMPTS (30), INPUT_LEN (256), OUTPUT_LEN (32), SEED (500)
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-benchmarks/results/two-generators}
VLLM_PYTHON=${VLLM_PYTHON:-python}
"$VLLM_PYTHON" -c "import vllm" 2>/dev/null || { echo "$VLLM_PYTHON cannot import vllm; set VLLM_PYTHON" >&2; exit 2; }
export RATES=${RATES:-0.5 1 1.5 2 3} NUM_PROMPTS=${NUM_PROMPTS:-30} INPUT_LEN=${INPUT_LEN:-256}
export OUTPUT_LEN=${OUTPUT_LEN:-32} SEED=${SEED:-500} VLLM_PYTHON R
mkdir -p "$R/runs"

pdserve serve --port 8100 --num-threads 2 --max-num-tokens 512 --enable-chunked-prefill > "$R/agg.log" 2>&1 &
agg=$!
trap 'kill -TERM $agg 2>/dev/null || true; wait $agg 2>/dev/null || true' EXIT
for _ in $(seq 600); do curl -sf 127.0.0.1:8100/health > /dev/null && break; sleep 1; done
curl -sf 127.0.0.1:8100/health > /dev/null || { echo "pdserve did not come up (see $R/agg.log)" >&2; exit 1; }

# One run: SYSTEM URL GENERATOR RATE K -> $R/runs/SYSTEM.GENERATOR-rRATE.json
one_run() {
  local system=$1 url=$2 gen=$3 rate=$4 k=$5 out="$R/runs/$1.$3-r$4.json"
  echo "== $system by $gen at $rate req/s"
  if [[ $gen == pdserve ]]; then
    pdserve bench --base-url "$url" --model SmolLM2-135M-Instruct --request-rate "$rate" \
      --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --seed $((SEED + k)) \
      --goodput ttft:2500 tpot:100 --disable-tqdm --result-json "$out" | grep -E "attainment|Mean (TTFT|TPOT)" || true
  else
    SEED=$((SEED + k)) GOODPUT="ttft:2500 tpot:100" benchmarks/vllm_bench_serve.sh "$url" "$rate" "$NUM_PROMPTS" \
      "$out" --disable-tqdm > "$R/runs/$system.$gen-r$rate.log" 2>&1
    grep -E "Request goodput|Mean (TTFT|TPOT)" "$R/runs/$system.$gen-r$rate.log" || true
  fi
  sleep 3
}
export -f one_run

# Inside vllm_serving.sh's run, which stops vLLM's process group when the loop ends.
SYSTEMS=agg benchmarks/vllm_serving.sh run "$R/vllm-agg-logs" -- bash -c '
  set -euo pipefail
  turns=("agg http://127.0.0.1:8100 pdserve" "agg http://127.0.0.1:8100 vllm"
         "vllm_agg http://127.0.0.1:8300 vllm" "vllm_agg http://127.0.0.1:8300 pdserve")
  k=0
  for rate in $RATES; do
    if ((k % 2)); then order=(3 2 1 0); else order=(0 1 2 3); fi
    for i in "${order[@]}"; do one_run ${turns[$i]} "$rate" "$k"; done
    k=$((k + 1))
  done'

runs() { ls "$R"/runs/"$1"-r*.json; }
pdserve bench sweep --model SmolLM2-135M-Instruct --goodput ttft:2500 tpot:100 --out "$R/sweep.json" \
  --from-results agg.pdserve=$(runs agg.pdserve) --from-results agg.vllm=$(runs agg.vllm) \
  --from-results vllm_agg.pdserve=$(runs vllm_agg.pdserve) --from-results vllm_agg.vllm=$(runs vllm_agg.vllm)
pdserve bench grid "$R/sweep.json" --ttft 500 1000 2500 5000 --tpot 40 60 100 150 --reference ttft:1000 tpot:100 \
  --out "$R/grid.json" --plot "$R/grid.png"
