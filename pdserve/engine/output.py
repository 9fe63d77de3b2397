"""What the engine reports per request per step, and the per-request text/stop bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.kv.wire import FirstToken
from pdserve.engine.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class ContextResult:
    """What a finished context_only request hands on for its generation half (the server turns it
    into the HTTP `disaggregated_params`, adding this instance's KV endpoint)."""

    disagg_request_id: int
    first_token: FirstToken  # choice 0's
    other_choices: tuple[FirstToken, ...] = ()  # n > 1: choices 1..n-1's first tokens, drawn from the same logits


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    new_logprobs: list[dict] = field(default_factory=list)  # {"token_id", "logprob", "top": [(id, lp)]}
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None  # the error's kind, when the client is told one (Sequence.error_code)
    context: ContextResult | None = None  # a finished context_only request's hand-off
    index: int = 0  # which choice of a request with n > 1 (`finished` is this choice's)


class OutputTracker:
    """Detokenizes one request incrementally and applies stop strings.

    Text that could still be the start of a stop string is held back, so a stream never shows
    characters that a later stop match would retract.
    """

    def __init__(self, seq: Sequence, detokenizer):
        self.seq = seq
        self.detok = detokenizer
        self.text = ""  # all decoded output text so far
        self.sent = 0  # characters already emitted
        self.sent_tokens = 0
        self.sent_logprobs = 0
        stops = seq.params.stop
        self.holdback = max((len(s) for s in stops), default=1) - 1

    def fork(self, seq: Sequence) -> "OutputTracker":
        """A tracker for `seq`, another choice of this tracker's request, before either has output."""
        return OutputTracker(seq, None if self.detok is None else self.detok.fork(seq.prompt_token_ids))

    def on_token(self, token_id: int, is_stop_token: bool, stop_strings: bool = True) -> None:
        """`stop_strings`: whether a stop string may end the output yet (not before min_tokens)."""
        if self.detok is None or is_stop_token:
            return
        self.text += self.detok.step(token_id)
        seq = self.seq
        if not seq.params.stop or not stop_strings:
            return
        # Only the tail can hold a new match: search from where the last token could begin one.
        window_start = max(0, self.sent - self.holdback - 1)
        for stop in seq.params.stop:
            at = self.text.find(stop, window_start)
            if at != -1:
                end = at + len(stop) if seq.params.include_stop_str_in_output else at
                self.text = self.text[:end]
                seq.finish(FinishReason.STOP, stop)
                return

    def flush(self) -> RequestOutput:
        seq = self.seq
        final = seq.is_finished
        if self.detok is not None and final:
            if not isinstance(seq.stop_reason, str):
                self.text += self.detok.flush()
        limit = len(self.text) if final else max(self.sent, len(self.text) - self.holdback)
        new_text = self.text[self.sent:limit]
        self.sent = limit
        new_ids = seq.output_token_ids[self.sent_tokens:]
        self.sent_tokens = len(seq.output_token_ids)
        new_lps = seq.output_logprobs[self.sent_logprobs:]
        self.sent_logprobs = len(seq.output_logprobs)
        return RequestOutput(
            request_id=seq.client_id,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=final,
            finish_reason=seq.finish_reason.value if final and seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            new_logprobs=new_lps,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            error=seq.error,
            error_code=seq.error_code,
            index=seq.choice,
        )
