#!/usr/bin/env bash
# What the machine serves at most: NUM_PROMPTS requests of the SLO grid's workload (slo_grid_vs_vllm.sh) sent at
# once to pdserve aggregated (2 threads, MAX_NUM_TOKENS-token steps, chunked prefill) and to vLLM aggregated (its CPU
# server's defaults), one server measured at a time, in each dtype. The completed requests per second bound any
# goodput of that server: an SLO grid cell whose 1.5x of vLLM's goodput lies past it cannot be won by scheduling.
#
#   usage: VLLM_PYTHON=/work/vllm-venv/bin/python benchmarks/burst_vs_vllm.sh [OUT_DIR]
#   env:   DTYPES ("bfloat16 float32"), NUM_PROMPTS (90), INPUT_LEN (256), OUTPUT_LEN (32), SEED (500),
#          MAX_NUM_TOKENS (512, the grid's agg; vLLM's CPU server steps up to 2048 by default)
# Prints each run's report; the result files are OUT_DIR/{agg,vllm}-DTYPE.json.
set -euo pipefail
cd "$(dirname "$0")/.."
O=${1:-benchmarks/results/burst}
mkdir -p "$O"
B=(--model SmolLM2-135M-Instruct --input-len "${INPUT_LEN:-256}" --output-len "${OUTPUT_LEN:-32}" --seed "${SEED:-500}"
   --request-rate inf --num-prompts "${NUM_PROMPTS:-90}" --disable-tqdm)
pid=
stop() { [[ -n $pid ]] && kill -TERM "$pid" 2>/dev/null && wait "$pid" || true; pid=; }
trap stop EXIT
for D in ${DTYPES:-bfloat16 float32}; do
  printf 'port: 8100\ndtype: %s\nnum_threads: 2\nmax_num_tokens: %s\nenable_chunked_prefill: true\n' "$D" \
    "${MAX_NUM_TOKENS:-512}" \
    > "$O/agg-$D.yaml"
  pdserve serve --config "$O/agg-$D.yaml" > "$O/agg-$D.log" 2>&1 & pid=$!
  for _ in $(seq 300); do curl -sf 127.0.0.1:8100/health > /dev/null && break; sleep 1; done
  curl -sf 127.0.0.1:8100/health > /dev/null || { echo "pdserve not ready (log: $O/agg-$D.log)" >&2; exit 1; }
  DTYPE=$D SYSTEMS=agg benchmarks/vllm_serving.sh run "$O/vllm-$D-logs" -- bash -c "
    pdserve bench --base-url http://127.0.0.1:8100 ${B[*]} --result-json $O/agg-$D.json && sleep 3 &&
    pdserve bench --base-url http://127.0.0.1:8300 ${B[*]} --result-json $O/vllm-$D.json"
  stop
done
python - "$O" ${DTYPES:-bfloat16 float32} <<'PY'
import json, sys
out, dtypes = sys.argv[1], sys.argv[2:]
print("| dtype | pdserve agg, req/s | vLLM agg, req/s | pdserve / vLLM | mean TPOT, pdserve / vLLM |")
print("|---|---|---|---|---|")
for d in dtypes:
    a, v = (json.load(open(f"{out}/{s}-{d}.json")) for s in ("agg", "vllm"))
    print(f"| {d} | {a['request_throughput']:.2f} | {v['request_throughput']:.2f} | "
          f"{a['request_throughput'] / v['request_throughput']:.2f}x | "
          f"{a['mean_tpot_ms']:.0f} / {v['mean_tpot_ms']:.0f} ms |")
PY
