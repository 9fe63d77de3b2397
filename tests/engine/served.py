"""A model directory served as users serve it: `pdserve serve DIR` in its own process, asked through the
official OpenAI client."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from pdserve.host import free_port
from pdserve.testing.servers import wait_for_health
from pdserve.tokenizer import Tokenizer


@contextlib.contextmanager
def pdserve_serve(model_dir: Path, *flags: str):
    """The server's base URL while `pdserve serve model_dir *flags` runs (killed on exit)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "serve", str(model_dir),
                             "--port", str(port), *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, proc, proc.stdout.read)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=30)


def assert_greedy_completions(url: str, model_dir: Path, prompts: list[list[int]], ref: list[list[int]],
                              max_tokens: int) -> None:
    """Every prompt (token ids) sent at once; each greedy completion's text is the decoded `ref` tokens."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    def complete(prompt):
        return client.completions.create(model=model_dir.name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(complete, prompts))
    tokenizer = Tokenizer.from_dir(model_dir)
    assert texts == [tokenizer.decode(r) for r in ref]
