"""The asyncio front of the engine when callers give up early: a caller cancelled while its request
waits in the command queue must neither kill the step thread nor leave a request nobody reads."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing import make_tiny_model

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=2, num_heads=4, num_kv_heads=2)
    eng = AsyncEngine.from_config(EngineConfig(model=str(d), device="cpu", max_model_len=512, num_kv_blocks=64,
                                               tokens_per_block=8))
    yield eng
    eng.shutdown()


async def _outputs(engine: AsyncEngine, prompt: list[int], max_tokens: int = 2) -> list:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [out async for out in engine.generate(prompt, params)]


def _ask(engine: AsyncEngine, fn):
    """Run fn on the step thread; a dead step thread is a TimeoutError here, not a hung test."""
    return asyncio.run(asyncio.wait_for(engine.call(fn), 10))


@pytest.mark.parametrize("when", ["before the engine takes it", "while the engine adds it"])
def test_cancelled_before_the_first_output(engine, when):
    baseline = _ask(engine, lambda e: e.blocks.num_free_blocks)
    busy, go_on = threading.Event(), threading.Event()

    def hold(_engine):  # keeps the step thread inside a command until released
        busy.set()
        go_on.wait(10)

    async def scenario():
        blocker = asyncio.ensure_future(engine.call(hold))
        await asyncio.get_running_loop().run_in_executor(None, busy.wait, 10)
        task = asyncio.ensure_future(_outputs(engine, list(range(5, 40)), max_tokens=400))
        await asyncio.sleep(0.05)  # its add is now queued behind `hold`
        if when == "before the engine takes it":
            task.cancel()
            await asyncio.sleep(0.05)  # the loop cancels the queued command's future...
            go_on.set()  # ...before the engine reaches it
        else:
            # Let the engine apply the add, then cancel before the caller sees the id: the add's
            # result is delivered through the loop, which this coroutine keeps busy meanwhile.
            go_on.set()
            deadline = asyncio.get_running_loop().time() + 10
            while not engine._commands.empty() and asyncio.get_running_loop().time() < deadline:
                threading.Event().wait(0.001)  # block the loop, not yield to it
            threading.Event().wait(0.05)
            task.cancel()
        await asyncio.wait_for(blocker, 10)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        # Asked after the cancellation (commands apply in order): no request is left running for
        # nobody, not even one the engine had already added when its caller left.
        assert await asyncio.wait_for(engine.call(lambda e: e.has_unfinished()), 10) is False

    asyncio.run(scenario())
    # The engine is alive, holds no orphaned request, and serves the next one.
    assert engine.error is None
    outs = asyncio.run(asyncio.wait_for(_outputs(engine, [7, 8, 9]), 10))
    assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 2
    assert _ask(engine, lambda e: e.has_unfinished()) is False
    assert _ask(engine, lambda e: e.blocks.num_free_blocks) == baseline
