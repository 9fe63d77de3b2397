#!/usr/bin/env bash
# vLLM (CPU build) as the peer of pdserve in the serving sweep, on the same weights and fixed ports:
#   vllm_agg  :8300  one vLLM server computing on every core (VLLM_CPU_OMP_THREADS_BIND=0-N by default;
#                    vLLM's own default, auto, computes on all cores but one, i.e. on 1 of 2 here,
#                    which leaves its prefill one core)
#   vllm_pd   :8400  benchmarks/vllm_pd_proxy.py in front of
#                      prefill :8401, OpenMP threads on core 0 (VLLM_CPU_OMP_THREADS_BIND=0)
#                      decode  :8402, OpenMP threads on core 1
#                    joined by vLLM's NixlConnector with the KV in CPU memory (the decode server pulls it)
# The pairing mirrors serving_sweep.sh (pdserve agg on both cores; context on core 0, generation on core 1).
#
#   usage: benchmarks/vllm_serving.sh serve [LOG_DIR]            bring both up, stay up until Ctrl-C
#          benchmarks/vllm_serving.sh run LOG_DIR -- CMD [ARGS]  bring both up, run CMD, shut down
#   env:   VLLM_PYTHON   interpreter with vllm (required unless `python` has it)
#          MODEL         HF model dir (default: the one pdserve serves, resolved by pdserve)
#          SYSTEMS       "agg pd" (default), or just one of them
#          DTYPE (float32), VLLM_CPU_KVCACHE_SPACE (GiB of KV per server, 2), READY_TIMEOUT (s, 900)
#          KEEP_VLLM_KV_CORE (0), NIXL_PROGRESS_THREAD (0): see the P/D hooks below
# CMD sees VLLM_AGG_URL and VLLM_PD_URL. Every server runs in its own process group and the whole
# group is stopped on exit, so vLLM's engine-core and worker children do not outlive the script.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-}; shift || true
case "$MODE" in
  serve) LOG_DIR=${1:-benchmarks/results/vllm-serving} ;;
  run)   LOG_DIR=${1:?run needs LOG_DIR}; shift; [[ ${1:-} == -- ]] && shift
         (($#)) || { echo "run needs a command after --" >&2; exit 2; } ;;
  *)     sed -n '2,20p' "$0" >&2; exit 2 ;;
esac

VLLM_PYTHON=${VLLM_PYTHON:-python}
"$VLLM_PYTHON" -c "import vllm" 2>/dev/null || {
  echo "$VLLM_PYTHON cannot import vllm; set VLLM_PYTHON to the vLLM venv's python" >&2; exit 2; }
MODEL=${MODEL:-$(python -c "from pdserve.weights import resolve_model; print(resolve_model(None))")}
DTYPE=${DTYPE:-float32}
SYSTEMS=${SYSTEMS:-agg pd}
READY_TIMEOUT=${READY_TIMEOUT:-900}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export VLLM_AGG_URL=http://127.0.0.1:8300 VLLM_PD_URL=http://127.0.0.1:8400
mkdir -p "$LOG_DIR"

pids=()
cleanup() {
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  for _ in $(seq 30); do
    alive=0; for p in "${pids[@]}"; do kill -0 -- "-$p" 2>/dev/null && alive=1; done
    ((alive)) || break; sleep 1
  done
  for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# start NAME CMD...: CMD in a new process group (setsid), output to $LOG_DIR/NAME.log
start() {
  local name=$1; shift
  setsid "$@" > "$LOG_DIR/$name.log" 2>&1 &
  pids+=($!)
  echo "started $name (pid $!, log $LOG_DIR/$name.log)"
}

# The `vllm` console script does not start from the vllm-cpu distribution; the module does.
VLLM_SERVER=("$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL"
             --served-model-name SmolLM2-135M-Instruct --dtype "$DTYPE" --max-model-len 4096 --host 127.0.0.1)

# vLLM's connector config; which side prefills is decided per request by the proxy.
kv_config() { echo "{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"$1\", \"kv_buffer_device\": \"cpu\"}"; }

# Two hooks, loaded by the P/D servers' Python processes only (sitecustomize on PYTHONPATH), for
# what vLLM 0.32's NixlConnector on CPU does that does not fit a 2-core machine:
# - it moves the worker's main thread, the one that runs the model, onto the last core of each
#   NUMA node, which it reserves for KV transfer. Here that is core 1, the decode server's core,
#   so prefill would compute there and core 0 would idle. The hook keeps the thread on the core
#   VLLM_CPU_OMP_THREADS_BIND gave it (KEEP_VLLM_KV_CORE=1 lets vLLM move it).
# - NIXL's Python agent runs a progress thread that polls UCX with a zero timeout: one busy core
#   per server even when idle, on the core that server computes on. The hook turns that thread off
#   (NIXL_PROGRESS_THREAD=1 keeps it); vLLM already polls transfer status every engine step.
SITE_DIR=$(cd "$LOG_DIR" && pwd)/vllm-site
mkdir -p "$SITE_DIR"
cat > "$SITE_DIR/sitecustomize.py" <<'PY'
import os
import sys

if os.environ.get("KEEP_VLLM_KV_CORE") != "1":
    _set_affinity = os.sched_setaffinity

    def _keep_omp_binding(pid, cpus):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if pid == 0 and caller.startswith("vllm.distributed.kv_transfer.kv_connector.v1.nixl"):
            print(f"vllm_serving.sh: {caller} asked to move this thread to cores {sorted(cpus)}; "
                  f"kept on {sorted(os.sched_getaffinity(0))}", file=sys.stderr, flush=True)
            return
        _set_affinity(pid, cpus)

    os.sched_setaffinity = _keep_omp_binding

if os.environ.get("NIXL_PROGRESS_THREAD") != "1":
    # vLLM sets this itself only if nixl is not imported yet; importing it here preempts that.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        import nixl._api as _nixl_api
    except ImportError:
        _nixl_api = None
    if _nixl_api is not None:
        class _NoProgressThread(_nixl_api.nixl_agent_config):
            def __init__(self, *args, **kwargs):
                kwargs.setdefault("enable_prog_thread", False)
                super().__init__(*args, **kwargs)

        _nixl_api.nixl_agent_config = _NoProgressThread
PY
PD_ENV=(env "PYTHONPATH=$SITE_DIR${PYTHONPATH:+:$PYTHONPATH}")
urls=()
if [[ " $SYSTEMS " == *" agg "* ]]; then
  start vllm_agg env "VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}" \
    "${VLLM_SERVER[@]}" --port 8300
  urls+=(http://127.0.0.1:8300)
fi
if [[ " $SYSTEMS " == *" pd "* ]]; then
  # Each side listens on its own NIXL side-channel port (the handshake that exchanges agent metadata).
  VLLM_CPU_OMP_THREADS_BIND=0 VLLM_NIXL_SIDE_CHANNEL_PORT=5601 start vllm_prefill "${PD_ENV[@]}" \
    "${VLLM_SERVER[@]}" --port 8401 --kv-transfer-config "$(kv_config kv_producer)"
  VLLM_CPU_OMP_THREADS_BIND=1 VLLM_NIXL_SIDE_CHANNEL_PORT=5602 start vllm_decode "${PD_ENV[@]}" \
    "${VLLM_SERVER[@]}" --port 8402 --kv-transfer-config "$(kv_config kv_consumer)"
  start vllm_pd_proxy python benchmarks/vllm_pd_proxy.py --prefill http://127.0.0.1:8401 \
    --decode http://127.0.0.1:8402 --port 8400
  urls+=(http://127.0.0.1:8401 http://127.0.0.1:8402 http://127.0.0.1:8400)
fi

deadline=$((SECONDS + READY_TIMEOUT))
for url in "${urls[@]}"; do
  until curl -sf "$url/health" > /dev/null; do
    for p in "${pids[@]}"; do
      kill -0 "$p" 2>/dev/null || { echo "pid $p exited before $url was ready; see $LOG_DIR/*.log" >&2; exit 1; }
    done
    ((SECONDS < deadline)) || { echo "not ready after ${READY_TIMEOUT}s: $url" >&2; exit 1; }
    sleep 2
  done
  echo "ready: $url"
done

if [[ $MODE == serve ]]; then
  echo "serving: vllm_agg=$VLLM_AGG_URL vllm_pd=$VLLM_PD_URL (Ctrl-C stops)"
  wait -n "${pids[@]}" || true
  echo "a server exited; stopping the rest" >&2
  exit 1
fi
"$@"
