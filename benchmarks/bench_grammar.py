"""Grammar engines on the engine loop's terms: xgrammar against llguidance on the embedded SmolLM2 tokenizer.

    python benchmarks/bench_grammar.py [--model DIR] [--repeat 5]

For each engine and each grammar (a nested JSON schema, any JSON object, a regex) it prints:
  - tokenizer: building the engine's tokenizer view (once per instance),
  - compile: a grammar from its text, on a cold cache (once per distinct grammar; pdserve caches it;
    llguidance's is its validation plus its first matcher),
  - matcher: a fresh per-sequence matcher from the compiled grammar (once per request; llguidance compiles
    in its matcher's constructor, so its row is a deep copy of a pristine matcher, as pdserve does),
  - mask: filling one step's token bitmask (every step, on the step's critical path unless overlapped),
  - accept: advancing the matcher by the sampled token (every step),
over the tokens of a valid document (the JSON made with json.dumps, tokenized by the model's tokenizer),
median and 95th percentile per step in microseconds.

xgrammar is not a pdserve dependency (it pulls in transformers and triton); install it beside pdserve to run
its rows: `pip install --no-deps --target /tmp/xg xgrammar==0.2.9 apache-tvm-ffi` and PYTHONPATH=/tmp/xg.
Without it the script prints llguidance's rows only.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "role", "tags", "address", "active", "score"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@engine.org", "role": "admin",
       "tags": ["math", "poetry", "engines"], "address": {"street": "12 St James's Square", "city": "London",
                                                          "zip": "10001"}, "active": True, "score": 99.5}
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4} \((home|work|mobile)\)"
REGEX_DOC = "555-123-4567 (mobile)"


def default_model() -> Path:
    from pdserve.weights.resolve import resolve_model

    return Path(resolve_model(None))


def _us(samples: list[float]) -> str:
    s = sorted(samples)
    return f"{statistics.median(s) * 1e6:8.1f} {s[int(0.95 * (len(s) - 1))] * 1e6:8.1f}"


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def cases() -> list[tuple[str, str, str, str]]:
    """(name, kind, grammar text, a valid document)"""
    doc = json.dumps(DOC)
    return [("json_schema", "json_schema", json.dumps(SCHEMA), doc),
            ("json_object", "json_object", "", doc),
            ("regex", "regex", REGEX, REGEX_DOC)]


def bench_llguidance(tok_json: str, vocab: int, eos: list[int], ids_of, repeat: int) -> list[tuple]:
    import llguidance
    import torch

    tokenizer, t_tok = _timed(lambda: llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos))
    rows = []
    for name, kind, text, doc in cases():
        if kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        compiles = []
        for _ in range(repeat):  # a fresh tokenizer copy each time: nothing of the grammar cached
            fresh = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
            _, t = _timed(lambda: llguidance.LLMatcher.validate_grammar(grammar, fresh))
            m, t2 = _timed(lambda: llguidance.LLMatcher(fresh, grammar))
            compiles.append(t + t2)
        masks, accepts, matchers = [], [], []
        bitmask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        ids = ids_of(doc) + eos[:1]
        pristine = llguidance.LLMatcher(tokenizer, grammar)  # compiled once; each sequence gets a copy
        for _ in range(repeat):
            m, t = _timed(pristine.deep_copy)
            matchers.append(t)
            for tid in ids:
                _, t = _timed(lambda: m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4))
                masks.append(t)
                ok, t = _timed(lambda: m.consume_token(tid))
                accepts.append(t)
                assert ok, f"llguidance refused token {tid} of {doc!r}: {m.get_error()}"
        rows.append((f"llguidance {llguidance.__version__}", name, t_tok,
                     statistics.median(compiles), statistics.median(matchers), masks, accepts, len(ids)))
    return rows


def bench_xgrammar(model_dir: Path, vocab: int, eos: list[int], ids_of, repeat: int) -> list[tuple]:
    import transformers
    import xgrammar as xgr

    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    info, t_tok = _timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos))
    rows = []
    for name, kind, text, doc in cases():
        def compile_once(compiler):
            if kind == "json_schema":
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            return compiler.compile_regex(text)

        compiles = []
        for _ in range(repeat):
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            compiled, t = _timed(lambda: compile_once(compiler))
            compiles.append(t)
        masks, accepts, matchers = [], [], []
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        ids = ids_of(doc) + eos[:1]
        for _ in range(repeat):
            m, t = _timed(lambda: xgr.GrammarMatcher(compiled))
            matchers.append(t)
            for tid in ids:
                _, t = _timed(lambda: m.fill_next_token_bitmask(bitmask))
                masks.append(t)
                ok, t = _timed(lambda: m.accept_token(tid))
                accepts.append(t)
                assert ok, f"xgrammar refused token {tid} of {doc!r}"
        rows.append((f"xgrammar {importlib.metadata.version('xgrammar')}", name, t_tok, statistics.median(compiles),
                     statistics.median(matchers), masks, accepts, len(ids)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="an HF model directory (default: embedded SmolLM2)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from pdserve.tokenizer import Tokenizer

    model_dir = args.model or default_model()
    tok = Tokenizer.from_dir(model_dir)
    tok_json = (model_dir / "tokenizer.json").read_text()
    eos = sorted(tok.eos_token_ids)
    vocab = tok.vocab_size

    def ids_of(doc: str) -> list[int]:
        return tok.backend.encode(doc, add_special_tokens=False).ids

    rows = bench_llguidance(tok_json, vocab, eos, ids_of, args.repeat)
    try:
        rows += bench_xgrammar(model_dir, vocab, eos, ids_of, args.repeat)
    except ImportError as e:
        print(f"(xgrammar rows skipped: {e})")
    print(f"model {model_dir.name}, vocab {vocab}, eos {eos}; medians of {args.repeat} runs; per step: "
          "median and p95 in us")
    print(f"{'engine':18} {'grammar':12} {'tokenizer ms':>12} {'compile ms':>10} {'matcher us':>10} "
          f"{'mask us p50/p95':>17} {'accept us p50/p95':>17} {'steps':>5}")
    for engine, name, t_tok, t_comp, t_match, masks, accepts, steps in rows:
        print(f"{engine:18} {name:12} {t_tok * 1e3:12.1f} {t_comp * 1e3:10.2f} {t_match * 1e6:10.1f} "
              f"{_us(masks):>17} {_us(accepts):>17} {steps:5d}")


if __name__ == "__main__":
    main()
