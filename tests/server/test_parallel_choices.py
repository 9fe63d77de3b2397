"""`n > 1` through the HTTP API with the official openai client: a choice per index, streamed or whole, the
same text either way, usage counting the prompt once and every choice's completion."""

from __future__ import annotations

import asyncio

from server_harness import scrape

from pdserve.engine.sampling_params import SamplingParams

SEEDED = dict(temperature=1.0, seed=11, extra_body={"ignore_eos": True})
PROMPT = "The capital of France is"


def _engine_choices(engine, ids: list[int], params: SamplingParams) -> dict[int, str]:
    """Each choice's text straight from the engine, bypassing HTTP."""
    async def go():
        texts: dict[int, str] = {}
        async for out in engine.generate(ids, params):
            texts[out.index] = texts.get(out.index, "") + out.new_text
        return texts
    return asyncio.run(go())


def test_completions_give_each_choice_streamed_or_whole(client, engine):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, **SEEDED)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, stream=True,
                                            stream_options={"include_usage": True}, **SEEDED))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)}
    ids = engine.tokenizer.encode(PROMPT)
    truth = _engine_choices(engine, ids, SamplingParams(max_tokens=8, temperature=1.0, seed=11, n=3,
                                                        ignore_eos=True))
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert {c.index: c.text for c in full.choices} == streamed == truth
    assert len(set(streamed.values())) > 1  # the choices drew apart
    assert all(c.finish_reason == "length" for c in full.choices)
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason == "length") == 3
    assert full.usage.prompt_tokens == len(ids) and full.usage.completion_tokens == 3 * 8
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 * 8
    one = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, **SEEDED)
    assert one.choices[0].text == full.choices[0].text  # choice 0 is the n = 1 request


def test_chat_streams_each_choice_with_its_role_chunk(client, http):
    messages = [{"role": "user", "content": "Say something"}]
    key, tokens = 'pdserve_request_success_total{finished_reason="length"}', "pdserve_generation_tokens_total"
    before = scrape(http)
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, n=2, logprobs=True,
                                          **SEEDED)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, n=2,
                                                 stream=True, **SEEDED))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    for choice in full.choices:
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == choice.index)
        assert choice.message.content == text
        assert len(choice.logprobs.content) == 6
    assert full.usage.completion_tokens == 12
    after = scrape(http)
    assert after[key] - before.get(key, 0.0) == 2  # a request each, not a choice each
    assert after[tokens] - before[tokens] == 2 * 12  # every choice's tokens, to the last
