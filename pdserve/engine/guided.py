"""Structured outputs: a grammar per distinct request spec, a matcher per sequence, a token mask per step.

The grammar engine is llguidance (docs/benchmarks.md#structured-outputs says why). What lives where:

    Grammars (one per instance)      GuidedSpec text -> a pristine matcher, compiled once and cached;
                                     the instance's tokenizer view is built on first use (~0.3 s)
    Guides (rank 0, the scheduler's  request id -> Guide: a copy of the pristine matcher, advanced by the
            side of the engine)      sequence's output tokens; its mask each step rides in the step spec
    sampler.py (the sampling rank)   SampleSpec.allowed: the mask as bytes, applied with the other logit
                                     processors (after logit_bias, penalties and min_tokens, before
                                     temperature, top-k and top-p)

A Guide is a function of the sequence's output tokens alone: before each step it consumes the tokens it has
not seen (the context instance's first token, a moved stream's `resume` tokens, a forked choice's first
token) and starts again from the pristine matcher when the output is shorter than what it consumed. So
preemption and recompute, disaggregation and stream migration need nothing of their own: the matcher
follows the tokens. Only rank 0 holds matchers; the step spec carries bytes, never a matcher.

The mask lets EOS through only where the grammar may end (llguidance's tokenizer knows the model's EOS ids).
It is filled on rank 0 before the step is sent (~6 us median per sequence on SmolLM2's 49152 tokens, against
a decode step of ~14 ms): the sampling rank may be another process, which must have it before its forward
pass ends.
"""

from __future__ import annotations

import json
import threading

import numpy as np

from pdserve.engine.grammar_sandbox import GrammarSandbox, SandboxBusy, on_stack
from pdserve.engine.sampling_params import GuidedSpec

# Bounds on what one request may make this instance compile: the text, and llguidance's own limits on the
# grammar's size and its lexer's work (a schema past them is refused with the engine's message, not compiled
# for minutes).
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_GRAMMAR_SIZE = 200_000  # llguidance's grammar-size units (its default: 500_000)
# JSON is written as json.dumps writes it ({"a": 1, "b": [2, 3]}): whitespace the model may choose freely lets
# a small model pad forever, and this layout is the one most training text has. A schema's own "x-guidance"
# options override it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CACHED = 256  # distinct grammars kept per instance (least recently used dropped first)
# A grammar whose compile (in the sandbox) takes longer is refused; the compiler child is killed.
COMPILE_TIMEOUT_S = 10.0
# The stack of the thread that compiles in the server: four times the sandbox child's (grammar_sandbox.py),
# so a grammar that compiled there cannot overflow here.
COMPILE_STACK_BYTES = 32 * 1024 * 1024
WHAT = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}


class GuidedError(ValueError):
    """A grammar that cannot be used (it does not parse, uses an unsupported keyword, matches nothing, is too
    large), or output tokens it does not allow; `param` is the request field to blame."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class CompilersBusy(GuidedError):
    """The grammar could not be tried: the instance's sandbox compilers were all busy (the service's state, not
    the grammar's fault: an HTTP 503)."""


def first_line(message: str) -> str:
    """llguidance's error without the parser state dump it appends."""
    return message.split("\n<state>", 1)[0].strip()


class Grammars:
    """An instance's compiled grammars, by spec. Thread-safe: the HTTP layer compiles (a 400 before the
    request reaches the engine) and the step thread takes copies. A spec is compiled here only after it
    compiled in the sandbox (grammar_sandbox.py), where a crash of the native compiler is a refusal."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 timeout_s: float = COMPILE_TIMEOUT_S):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size  # the model's logits width (the mask covers every logit)
        self._eos = sorted(eos_token_ids)
        self._tokenizer = None
        self._cache: dict[tuple[str, str], object] = {}  # (kind, text) -> pristine matcher, least recent first
        self._lock = threading.Lock()
        self.sandbox = GrammarSandbox(tokenizer_json, vocab_size, self._eos, timeout_s)

    @property
    def mask_bytes(self) -> int:
        return (self.vocab_size + 31) // 32 * 4

    def _ll_tokenizer(self):
        import llguidance

        if self._tokenizer is None:
            if not self._eos:
                raise GuidedError("structured outputs need the model's EOS token (its tokenizer names none)",
                                  "response_format")
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                     eos_token=self._eos)
        return self._tokenizer

    def compile(self, spec: GuidedSpec):
        """The pristine matcher of `spec`, compiled on first use; GuidedError says what is wrong with it."""
        key = (spec.kind, spec.text)
        with self._lock:
            hit = self._cache.pop(key, None)
            if hit is not None:
                self._cache[key] = hit
                return hit
            tokenizer = self._ll_tokenizer()
        # outside the lock: llguidance drops the GIL while it compiles
        try:
            problem = self.sandbox.check(spec, WHAT[spec.kind])
        except SandboxBusy as e:
            raise CompilersBusy(f"the {WHAT[spec.kind]} could not be compiled now: {e}; retry", spec.param) from None
        if problem is not None:
            raise GuidedError(problem, spec.param)
        matcher = on_stack(COMPILE_STACK_BYTES, compile_matcher, spec, tokenizer)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > MAX_CACHED:
                self._cache.pop(next(iter(self._cache)))
        return matcher

    def close(self) -> None:
        self.sandbox.close()

    def guide(self, spec: GuidedSpec) -> "Guide":
        pristine = self.compile(spec)
        with self._lock:
            return Guide(spec, pristine, pristine.deep_copy(), self.mask_bytes)


def _grammar_text(spec: GuidedSpec) -> str:
    import llguidance

    if len(spec.text) > MAX_GRAMMAR_CHARS:
        raise GuidedError(f"the {spec.kind} is {len(spec.text)} characters; at most {MAX_GRAMMAR_CHARS} are "
                          "compiled", spec.param)
    if spec.kind == "json":
        try:
            schema = json.loads(spec.text)
        except ValueError as e:
            raise GuidedError(f"the JSON schema is not JSON: {e}", spec.param) from None
        if not isinstance(schema, (dict, bool)):
            raise GuidedError("a JSON schema is an object (or true/false)", spec.param)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    text = spec.text
    if "::=" in text:  # GBNF (llama.cpp's): llguidance converts it to its Lark dialect
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # its parser raises several kinds
            raise GuidedError(f"the grammar (GBNF) does not parse: {e}", spec.param) from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def compile_matcher(spec: GuidedSpec, tokenizer):
    """The pristine matcher of `spec` on llguidance's `tokenizer`; GuidedError says what is wrong with it."""
    try:
        return _compile(spec, tokenizer)
    except GuidedError:
        raise
    except Exception as e:  # llguidance's own refusals (ValueError, RuntimeError) of what it cannot take
        raise GuidedError(f"the {WHAT[spec.kind]} cannot be used: {first_line(str(e))}", spec.param) from None


def _compile(spec: GuidedSpec, tokenizer):
    import llguidance

    grammar = _grammar_text(spec)
    limits = llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SIZE)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=limits)
    what = WHAT[spec.kind]
    if failed:
        raise GuidedError(f"the {what} cannot be used: {first_line(messages[0])}", spec.param)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        raise GuidedError(f"the {what} cannot be used: {first_line(matcher.get_error())}", spec.param)
    probe = matcher.deep_copy()  # a grammar whose language is empty fails at its first mask
    probe.compute_bitmask()
    if probe.is_error() or (probe.is_stopped() and not probe.is_accepting()):
        raise GuidedError(f"the {what} matches no output at all", spec.param)
    return matcher


class Guide:
    """One sequence's matcher, kept in step with its output tokens (`sync`)."""

    def __init__(self, spec: GuidedSpec, pristine, matcher, mask_bytes: int):
        self.spec = spec
        self._pristine = pristine
        self.matcher = matcher
        self.consumed = 0  # output tokens the matcher has taken
        self._mask = np.zeros(mask_bytes // 4, dtype=np.int32)

    def sync(self, output_ids: list[int]) -> None:
        """Advance the matcher to the end of `output_ids`; GuidedError when the grammar does not allow them."""
        if len(output_ids) < self.consumed:  # the output was cut back: replay it from the grammar's start
            self.matcher, self.consumed = self._pristine.deep_copy(), 0
        for t in output_ids[self.consumed:]:
            if not self.matcher.consume_token(t):
                raise GuidedError(f"output token {self.consumed} ({t}) is not allowed by the request's "
                                  f"{WHAT[self.spec.kind]}: {first_line(self.matcher.get_error())}", self.spec.param)
            self.consumed += 1

    def mask(self) -> bytes:
        """The tokens allowed next, one bit each (bit t % 32 of int32 word t // 32), as the sampler reads them."""
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        if self.matcher.is_error():
            raise GuidedError(f"the request's {WHAT[self.spec.kind]} failed at output token {self.consumed}: "
                              f"{first_line(self.matcher.get_error())}", self.spec.param)
        return self._mask.tobytes()


class Guides:
    """Rank 0's matchers, one per guided sequence in flight, keyed by the sequence's request id."""

    def __init__(self, grammars: Grammars):
        self.grammars = grammars
        self._by_id: dict[str, Guide] = {}

    def check(self, spec: GuidedSpec, output_ids: list[int], param: str) -> None:
        """A request's spec compiles and its output so far (a first token from a context instance, a moved
        stream's tokens) is allowed by it; GuidedError otherwise (the output's fault blames `param`)."""
        guide = self.grammars.guide(spec)
        try:
            guide.sync(output_ids)
        except GuidedError as e:
            raise GuidedError(str(e), param) from None

    def mask(self, request_id: str, spec: GuidedSpec, output_ids: list[int]) -> bytes:
        """The mask of the sequence's next token, its matcher first brought up to `output_ids`."""
        guide = self._by_id.get(request_id)
        if guide is None or guide.spec != spec:
            guide = self._by_id[request_id] = self.grammars.guide(spec)
        guide.sync(output_ids)
        return guide.mask()

    def retire(self, live: dict) -> None:
        """Drop the matchers of sequences no longer in `live` (the scheduler's sequences in flight)."""
        if self._by_id:
            for rid in [r for r in self._by_id if r not in live]:
                del self._by_id[rid]

    def __len__(self) -> int:
        return len(self._by_id)
