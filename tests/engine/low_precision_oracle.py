"""The accuracy oracle of bf16 and fp16 engines: greedy tokens cannot be compared with transformers' token for
token (in bf16 the two part ways within a few tokens on near-ties, both right to the precision they have),
so teacher-forced on the tokens pdserve generated, transformers in fp32 gives the reference log-probabilities,
and pdserve's log-probability of each token it chose must be as close to that as transformers' own forward
in the same dtype is."""

from __future__ import annotations

import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams


def greedy_with_logprobs(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)


def errors(model_dir, prompts: list[list[int]], dtype: str, max_tokens: int,
           **engine) -> tuple[torch.Tensor, torch.Tensor]:
    """`errors_of` pdserve's greedy outputs of `prompts` with `dtype` weights (and `engine` config keys)."""
    with LLM(EngineConfig(model=str(model_dir), dtype=dtype, **engine)) as llm:
        return errors_of(model_dir, prompts, llm.generate(prompts, greedy_with_logprobs(max_tokens)), dtype)


def errors_of(model_dir, prompts: list[list[int]], outs, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """|log p - fp32 log p| of every token pdserve chose (`outs`: token_ids and logprobs per prompt):
    pdserve's, and transformers' forward in `dtype`."""
    import transformers

    load = transformers.AutoModelForCausalLM.from_pretrained
    exact, low = load(model_dir, torch_dtype=torch.float32), load(model_dir, torch_dtype=getattr(torch, dtype))
    ours, theirs = [], []
    for prompt, out in zip(prompts, outs):
        chosen = torch.tensor(out.token_ids)
        at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(chosen))  # the positions that predicted them
        with torch.inference_mode():
            seq = torch.tensor([prompt + out.token_ids])
            ref = torch.log_softmax(exact(seq).logits[0].float(), -1)[at, chosen]
            same_dtype = torch.log_softmax(low(seq).logits[0].float(), -1)[at, chosen]
        assert len(out.logprobs) == len(out.token_ids)
        ours.append((torch.tensor([lp["logprob"] for lp in out.logprobs]) - ref).abs())
        theirs.append((same_dtype - ref).abs())
    return torch.cat(ours), torch.cat(theirs)


def assert_as_accurate(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert len(ours) == len(theirs) > 0
    assert ours.mean() <= 1.5 * theirs.mean(), (ours.mean(), theirs.mean())
    assert ours.max() <= 2.0 * theirs.max(), (ours.max(), theirs.max())
