"""A request inside the engine: its prompt, outputs, blocks and lifecycle state.

The states and the calls that move a request between them are listed once, in scheduler.py, the
module that makes every transition. SeqState is ordered from least to most advanced, so that a MIN
across ranks would give the most cautious common state; no code reduces it today, since only rank 0
holds request state (the other ranks follow its step specs).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams


class RequestType(enum.Enum):
    CONTEXT_AND_GENERATION = "context_and_generation"
    CONTEXT_ONLY = "context_only"
    GENERATION_ONLY = "generation_only"


class SeqState(enum.IntEnum):
    WAITING = 0
    GEN_AWAITING_KV = 1
    RUNNING = 2
    CTX_TRANSMITTING = 3
    FINISHED = 4


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class Resume:
    """What an earlier instance generated for a request before it was lost mid-stream: the request starts
    with these output tokens (their KV recomputed with the prompt's), so that it goes on as it would have
    there (max_tokens, min_tokens, penalties and a seed's draws count them), and the first `sent_chars`
    characters of their text are not sent again."""

    token_ids: tuple[int, ...]
    sent_chars: int


@dataclass
class DisaggInfo:
    """Where a disaggregated request's KV comes from or goes to."""

    disagg_request_id: int  # the transfer's key on both instances
    ctx_info_endpoint: str | None = None  # generation_only: the context instance's control endpoint
    ctx_dp_rank: int = 0
    # generation_only (context_first): the context instance's first token, one per choice with n > 1;
    # context_only with n > 1: choices 1..n-1's first draws, for its answer (forks.py)
    first_gen_tokens: tuple[int, ...] = ()
    first_gen_logprobs: tuple[dict, ...] = ()  # context_first: first_gen_tokens' logprob entries, when asked for
    schedule_style: str = "context_first"  # generation_first: the receiver asks before prefill ends
    pipelined: bool = False  # context side: offer each prefill chunk as it is computed
    transfer_started: bool = False
    kv_deadline: float | None = None  # generation_only: monotonic time by which the KV must have arrived
    transfer_settled: bool = False  # every rank reported the transfer done: no write can land any more
    cancelling: bool = False  # abort requested while a transfer may still write
    cancelled_while: str | None = None  # the transfer stage a cancel hit, for the log

    @property
    def may_still_write(self) -> bool:
        return self.transfer_started and not self.transfer_settled

    @property
    def generation_first(self) -> bool:
        return self.schedule_style == "generation_first"


def choice_id(request_id: str, choice: int) -> str:
    """The engine's id of choice `choice` of a request with n > 1 (choice 0 has the request's own id)."""
    return request_id if choice == 0 else f"{request_id}/choice{choice}"


def num_answers(request_type: RequestType, n: int) -> int:
    """How many finished outputs a request of `n` choices has: one per choice, but one for a context_only
    request, whose answer carries every choice's first token (its hand-off)."""
    return 1 if request_type is RequestType.CONTEXT_ONLY else n


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    request_type: RequestType = RequestType.CONTEXT_AND_GENERATION
    state: SeqState = SeqState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    state_slot: int = -1  # its recurrent-state slot (hybrid models), held with its blocks
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_code: str | None = None  # the error's kind, when the client is told one (scheduler.KV_NOT_FOUND)
    refusal: str | None = None  # why its own input failed it mid-flight (scheduler.GRAMMAR_FAILED)
    disagg: "DisaggInfo | None" = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    # A request with n > 1 choices: its first sequence (choice 0, `request_id` the request's) computes the
    # prompt once, and its first sampling step forks the others (forks.py), which share its KV.
    choice: int = 0
    group_id: str | None = None  # choices 1..n-1: the request's id (their own ids are choice_id's)
    forked: bool = False

    @property
    def client_id(self) -> str:
        """The request id its outputs are reported under: the request's, for every choice."""
        return self.group_id or self.request_id

    @property
    def forks_now(self) -> bool:
        """Its next sampled token is its first and it has choices to fork (choice 0 of an n > 1 request; a
        context_only one draws them all and forks none, a generation_only one forks when its KV arrived)."""
        return self.params.n > 1 and self.choice == 0 and not self.forked

    @property
    def pinned(self) -> bool:
        """A pipelined context_only prefill: its finished blocks are offered to a peer as it goes, so it is
        never preempted."""
        d = self.disagg
        return d is not None and d.pipelined and self.request_type is RequestType.CONTEXT_ONLY

    @property
    def transfer_stage(self) -> str:
        """Where its transfer stands, in words, for a log line about it."""
        if self.request_type is RequestType.GENERATION_ONLY:
            if self.state is SeqState.GEN_AWAITING_KV:
                return f"waiting for its KV from {self.disagg.ctx_info_endpoint}"
            return "decoding (its KV had arrived)"
        if self.state is SeqState.RUNNING:
            return "prefilling, its KV leaving chunk by chunk"
        return "prefilled, its KV waiting for the generation instance to pull it"

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state == SeqState.FINISHED

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.state = SeqState.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
