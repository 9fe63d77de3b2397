"""An AsyncEngine builds its model on its own step thread, so a serving process holds one OpenMP team.

OpenMP keeps a team of worker threads per thread that starts parallel work. A model loaded in the main
thread and stepped in the engine thread would leave two teams, more OpenMP threads than cores, and
libgomp then parks its workers between parallel regions, which slows every decode step of `pdserve
serve`. Timing is for benchmarks; this checks the cause. In a fresh process that built an engine and served a request, the
main thread's first parallel op must start a new worker thread: proof that it had no team before.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from pdserve.testing import make_tiny_model

PROBE = textwrap.dedent("""
    import asyncio, os, sys
    import torch
    from pdserve.config import EngineConfig
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.engine.sampling_params import SamplingParams

    def threads():
        return set(os.listdir("/proc/self/task"))

    eng = AsyncEngine.from_config(EngineConfig(model=sys.argv[1], device="cpu", max_model_len=512,
                                               num_kv_blocks=64, tokens_per_block=8, num_threads=2))

    async def serve_one():
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        return [o async for o in eng.generate(list(range(1, 100)), params)]

    asyncio.run(serve_one())
    torch.set_num_threads(2)  # this thread's team size (it sets no team up)
    before = threads()
    x = torch.ones(1 << 22)
    for _ in range(5):
        x.mul_(1.0)
    print("NEW_THREADS", len(threads() - before))
    eng.shutdown()
""")


def test_the_main_thread_starts_no_openmp_team(tmp_path):
    model = make_tiny_model(tmp_path / "m", num_layers=2, num_heads=4, num_kv_heads=2)
    out = subprocess.run([sys.executable, "-c", PROBE, str(model)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("NEW_THREADS"))
    assert int(line.split()[1]) >= 1, (
        "the main thread already had an OpenMP team after the engine started: the engine did parallel "
        "work outside its step thread")
