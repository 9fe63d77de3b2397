"""The sampling values a checkpoint recommends, from its generation_config.json (as vLLM applies them
with `--generation-config auto`): a request that leaves a field out gets the model's value, then
OpenAI's. Only the fields below are read; a value SamplingParams would refuse is dropped with a warning
at start-up, not turned into a 400 for every request."""

from __future__ import annotations

import logging
from pathlib import Path

from pdserve.engine.sampling_params import SamplingParams
from pdserve.weights.hf_dir import GENERATION_CONFIG_FILE, read_json

log = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_sampling_defaults(model_dir: str | Path, mode: str) -> dict:
    """SamplingParams field -> the checkpoint's recommended value; {} with mode "none" or no file."""
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    if mode == "none" or not path.is_file():
        return {}
    raw = read_json(path)
    defaults = {}
    for key, name in FIELDS.items():
        value = raw.get(key)
        if value is None or isinstance(value, bool):
            continue
        if key == "top_k" and value == 0:  # transformers' "off" is pdserve's -1
            value = -1
        try:
            SamplingParams(**{name: value})
        except (TypeError, ValueError) as e:
            log.warning("%s: ignoring %s=%r (%s)", path, key, value, e)
            continue
        defaults[name] = value
    return defaults


def describe(defaults: dict) -> str:
    """One start-up line: which defaults a request that leaves sampling fields out gets."""
    if not defaults:
        return ("sampling defaults: OpenAI's (temperature 1, top_p 1); the checkpoint's generation_config.json "
                "recommends none (or generation_config: none)")
    values = ", ".join(f"{k}={v}" for k, v in defaults.items())
    return (f"sampling defaults from the checkpoint's generation_config.json: {values} (a request's own values "
            "win; generation_config: none turns these off)")
