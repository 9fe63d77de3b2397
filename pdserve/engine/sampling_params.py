"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

# Temperatures below this sample greedily (vLLM's threshold): logits divided by 1e-300 overflow to inf,
# and the distribution they approach is the argmax anyway.
GREEDY_BELOW = 1e-5

MAX_CHOICES = 128  # OpenAI's limit on `n`


@dataclass(frozen=True)
class GuidedSpec:
    """What the output must match (structured outputs; engine/guided.py compiles it): `kind` "json" (a JSON
    schema, as text), "regex" or "grammar" (Lark, llguidance's dialect). `param` is the request field it came
    from, which an error about it names."""

    kind: str
    text: str
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in ("json", "regex", "grammar"):
            raise ValueError(f"guided kind must be json, regex or grammar, got {self.kind!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature == 0 (or below GREEDY_BELOW) means greedy. Every invalid value raises ValueError naming the
    field, so the HTTP layer can turn it into a 400 without knowing the rules.
    """

    max_tokens: int | None = 16  # None: as many as the context window leaves (the engine decides)
    min_tokens: int = 0  # tokens to generate before EOS, a stop token id or a stop string may end the output
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages every token of the prompt and the output so far
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time the output holds the token
    logit_bias: dict[int, float] = field(default_factory=dict, hash=False)  # token id -> added to its logit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return beside the chosen token
    include_stop_str_in_output: bool = False
    guided: GuidedSpec | None = None  # structured outputs: every output token is one the grammar allows
    n: int = 1  # choices: the prompt is computed once and each choice samples on from its own draws
    skip_special_tokens: bool = True  # leave special tokens out of the text (vLLM's field)
    # special tokens that stay in the text even so: a tool-call syntax's markers, whose calls are read out of it
    kept_special_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        # distinct and sorted: a request may repeat an id millions of times, and each step looks its token up
        object.__setattr__(self, "stop_token_ids", tuple(sorted({int(t) for t in self.stop_token_ids})))
        object.__setattr__(self, "kept_special_token_ids", tuple(sorted({int(t) for t in self.kept_special_token_ids})))
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be true or false, got {self.skip_special_tokens!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        most = self.min_tokens if self.max_tokens is None else self.max_tokens
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= most:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        object.__setattr__(self, "logit_bias", {int(t): float(b) for t, b in self.logit_bias.items()})
        if any(t < 0 for t in self.logit_bias):
            raise ValueError("logit_bias token ids must be >= 0")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {self.n!r}")
        if self.guided is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with structured outputs: the output ends where the "
                             "grammar does, with an EOS; send ignore_eos=false")
        if self.guided is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured outputs: the grammar decides where the "
                             "output may end; send min_tokens=0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if len(self.stop) > 16:
            raise ValueError(f"at most 16 stop strings are allowed, got {len(self.stop)}")

    @cached_property
    def stop_token_set(self) -> frozenset[int]:
        """stop_token_ids, for the lookup of every sampled token."""
        return frozenset(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
