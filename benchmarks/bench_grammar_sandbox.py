"""What compiling a request's grammar in the sandbox first (engine/grammar_sandbox.py) adds, on the embedded
SmolLM2 tokenizer (49,152 tokens).

    python benchmarks/bench_grammar_sandbox.py [--model DIR] [--repeat 9]

For each grammar (bench_grammar.py's nested JSON schema and regex, a 200-value choice) it prints, in
milliseconds (median of --repeat distinct grammars of that shape, each new to the instance):
  - in-process: compile_matcher alone, the path before the sandbox (the reference),
  - new grammar: Grammars.compile of a grammar the instance has not seen: the child's compile and probe, the
    frames both ways, then the same in-process compile,
  - cached: Grammars.compile of a grammar already compiled (every later request of that schema),
and once per instance, the first guided request's wait for its child to start (Python, llguidance, the
tokenizer view). None of it is on the decode path: a request's grammar is compiled before it is admitted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench_grammar import REGEX, SCHEMA, default_model

from pdserve.engine.guided import Grammars, compile_matcher
from pdserve.engine.sampling_params import GuidedSpec
from pdserve.tokenizer import Tokenizer


def shapes(i: int) -> list[tuple[str, GuidedSpec]]:
    """Grammars of each shape, distinct for each `i` (so none is cached)."""
    schema = dict(SCHEMA, description=f"variant {i}")
    choice = "start: " + " | ".join(json.dumps(f"option {i} {k}") for k in range(200))
    return [("json_schema", GuidedSpec("json", json.dumps(schema), "response_format")),
            ("regex", GuidedSpec("regex", f"{REGEX}( #{i})?", "structured_outputs.regex")),
            ("choice_200", GuidedSpec("grammar", choice, "structured_outputs.choice"))]


def _ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    model_dir = args.model or default_model()
    tok = Tokenizer.from_dir(model_dir)
    grammars = Grammars(tok.backend.to_str(), tok.vocab_size, sorted(tok.eos_token_ids or [0]))
    try:
        t = time.perf_counter()
        grammars.compile(GuidedSpec("regex", "[0-9]{3}", "warm-up"))  # both tokenizer views, the child's start
        first = time.perf_counter() - t
        tokenizer = grammars._ll_tokenizer()
        times: dict[str, dict[str, list[float]]] = {}
        for i in range(args.repeat):
            for name, spec in shapes(i):
                row = times.setdefault(name, {"in-process": [], "new": [], "cached": []})
                t = time.perf_counter()
                compile_matcher(spec, tokenizer)
                row["in-process"].append(time.perf_counter() - t)
                t = time.perf_counter()
                grammars.compile(spec)
                row["new"].append(time.perf_counter() - t)
                t = time.perf_counter()
                grammars.compile(spec)
                row["cached"].append(time.perf_counter() - t)
    finally:
        grammars.close()
    print(f"first guided request of an instance (child start, tokenizer views): {first * 1e3:.0f} ms\n")
    print("| grammar | in-process ms | new grammar, sandboxed ms | new / in-process | cached ms |")
    print("|---|---|---|---|---|")
    for name, row in times.items():
        old, new, hit = _ms(row["in-process"]), _ms(row["new"]), _ms(row["cached"])
        print(f"| {name} | {old:.2f} | {new:.2f} | {new / old:.2f}x | {hit:.4f} |")


if __name__ == "__main__":
    main()
