"""The synchronous engine: admit requests, step, report outputs.

One step reads as four calls:

    batch = scheduler.schedule()                  # which sequences, how many tokens each
    batch, sampled, reports = run(batch, kv.commands())   # every rank's forward step and KV commands
    scheduler.postprocess(batch, sampled)         # tokens, stops, finishes: the lifecycle (scheduler.py)
    kv.settle(batch, reports)                     # sends this step made possible; transfers every rank settled

Ranks other than 0 run in their own processes (see `worker.py`) and follow rank 0's steps.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from pdserve.config import EngineConfig
from pdserve.engine.block_manager import BlockManager, KVEvent
from pdserve.engine.guided import Grammars, GuidedError, Guides
from pdserve.engine.model_runner import ModelRunner, SeqStep, StepSpec
from pdserve.engine.output import OutputTracker, RequestOutput
from pdserve.engine.sampler import SampleResult, SampleSpec
from pdserve.engine.sampling_defaults import describe, read_sampling_defaults
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import GRAMMAR_FAILED, ScheduledSeq, Scheduler
from pdserve.engine.kv.exchange import KVExchange
from pdserve.engine.kv.wire import KVCommand
from pdserve.engine.sequence import DisaggInfo, RequestType, Resume, Sequence, choice_id
from pdserve.engine.step_budget import TpotBudget, attention_work
from pdserve.engine.worker import pick_device, set_threads, worker_main
from pdserve.host import free_port
from pdserve.models import config_memo
from pdserve.models.config import ModelConfig
from pdserve.parallel.shm_all_reduce import attach_shm_all_reduce
from pdserve.parallel.state import init_parallel
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.weights.hf_dir import read_config
from pdserve.weights.resolve import resolve_model

log = logging.getLogger(__name__)
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the OpenAI error code of the context-length rule


# Disaggregated request ids are below this (an int64, as they travel; peers' canary ids are above it)
MAX_DISAGG_ID = 1 << 63


class RequestError(ValueError):
    """A request the engine cannot take; the message says why (the HTTP layer answers 400), `param` which
    field of the request it blames, where one is to blame, and `code` the OpenAI error code, where there is
    one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class ConflictError(RequestError):
    """A second in-flight request with the same disaggregated request id (HTTP 409)."""


@dataclass(frozen=True)
class StepRecord:
    """What one forward step ran and how long it took (scheduling and bookkeeping included, the KV
    exchange's settling not): the server's step metrics read it."""

    seconds: float
    prefill_tokens: int  # prompt tokens computed (prefill chunks, and the tokens a resumed request recomputes)
    decode_rows: int  # requests that each decoded one token

    @property
    def kind(self) -> str:
        """"prefill", "decode" or "mixed" (both in one step)."""
        if self.prefill_tokens and self.decode_rows:
            return "mixed"
        return "prefill" if self.prefill_tokens else "decode"


class LLMEngine:
    def __init__(self, ecfg: EngineConfig, on_kv_event: Callable[[KVEvent], None] | None = None,
                 pool_allocator=None):
        self.ecfg = ecfg
        self.model_dir = Path(resolve_model(ecfg.model, cache_dir=ecfg.cache_dir))
        self.model_cfg = ModelConfig.from_hf(read_config(self.model_dir), remember_in=config_memo.default_dir())
        why = self.model_cfg.layout_problem(ecfg.tensor_parallel_size, ecfg.pipeline_parallel_size)
        if why is not None:
            raise ValueError(why)
        self.max_model_len = self._max_model_len()
        device = pick_device(ecfg, 0)
        # before any weight is read: a model that cannot fit fails in seconds, not hours
        from pdserve.engine.footprint import check_memory  # (it imports the models' classes)
        log.info(check_memory(self.model_cfg, ecfg, device.type, self.max_model_len))
        self.model_name = ecfg.served_model_name or _default_name(ecfg.model, self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.sampling_defaults = read_sampling_defaults(self.model_dir, ecfg.generation_config)
        log.info(describe(self.sampling_defaults))
        self.instance_name = ecfg.instance_name or f"pdserve-{uuid.uuid4().hex[:8]}"
        self._procs: list[mp.Process] = []
        self.runner = self._start_ranks(pool_allocator, device)
        prefix_caching = ecfg.enable_prefix_caching and not self.model_cfg.recurrent_layers
        if ecfg.enable_prefix_caching and not prefix_caching:
            log.info("prefix caching is off for this hybrid model: its recurrent layers' state is kept for the "
                     "whole sequence only, not at block boundaries, so a cached prefix could not resume it")
        self.blocks = BlockManager(self.runner.num_blocks, ecfg.tokens_per_block, prefix_caching, on_kv_event,
                                   num_state_slots=self.runner.num_state_slots)
        self.tpot_budget = (TpotBudget(ecfg.tpot_slo_ms, ecfg.max_num_tokens, ecfg.tokens_per_block)
                            if ecfg.tpot_slo_ms is not None else None)
        self.scheduler = Scheduler(self.blocks, ecfg.max_num_seqs, ecfg.max_num_tokens, ecfg.enable_chunked_prefill,
                                   self.eos_token_ids, self.max_model_len, self.tpot_budget)
        self.last_step: StepRecord | None = None  # the latest step that ran sequences (None: it ran none)
        self.seqs = self.scheduler.seqs  # every request in flight, by id (read-only here: the scheduler owns it)
        self._ids = itertools.count()
        self.kv = KVExchange(self.scheduler, self.runner.connector, ecfg, self.model_cfg.vocab_size)
        # structured outputs: grammars compiled once per instance, a matcher per guided sequence (engine/guided.py)
        self.guides = Guides(Grammars(self.tokenizer.backend.to_str(), max(self.model_cfg.vocab_size,
                                      self.tokenizer.vocab_size), sorted(self.eos_token_ids)))

    def _max_model_len(self) -> int:
        """The context window: the configured one, never past the model's positions."""
        asked, limit = self.ecfg.max_model_len, self.model_cfg.max_position_embeddings
        if asked and asked > limit:
            raise ValueError(f"max_model_len={asked} is longer than the model's max_position_embeddings ({limit}); "
                             f"set max_model_len <= {limit}")
        return asked or limit

    def _start_ranks(self, pool_allocator, device) -> ModelRunner:
        ecfg = self.ecfg
        set_threads(ecfg)
        port = ecfg.dist_port or free_port(ecfg.dist_host)
        if ecfg.world_size > 1:
            ctx = mp.get_context("spawn")
            for rank in range(1, ecfg.world_size):
                # the model's config goes whole: read again there, it would import transformers (~1-2 s a rank)
                p = ctx.Process(target=worker_main, args=(rank, ecfg, str(self.model_dir), self.model_cfg, port,
                                                          self.max_model_len, self.instance_name),
                                daemon=True, name=f"pdserve-rank{rank}")
                p.start()
                self._procs.append(p)
        try:
            ps = init_parallel(ecfg.tensor_parallel_size, ecfg.pipeline_parallel_size, 0, ecfg.dist_host, port,
                               device, ecfg.dist_timeout_s, self._procs)
            attach_shm_all_reduce(ps, device, ecfg.dist_timeout_s)
            return ModelRunner(ecfg, self.model_cfg, self.model_dir, ps, device, self.max_model_len,
                               self.instance_name, pool_allocator)
        except BaseException:
            self._kill_workers()
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            raise

    @property
    def kv_endpoint(self) -> str | None:
        """Rank 0's KV control endpoint (what generation instances are told), or None if disabled."""
        return self.runner.connector.endpoint if self.runner.connector is not None else None

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    request_type: RequestType = RequestType.CONTEXT_AND_GENERATION,
                    disagg: DisaggInfo | None = None, resume: Resume | None = None) -> str:
        request_id = request_id or f"req-{next(self._ids)}"
        if params.n > 1 and (resume is not None or (disagg is not None and disagg.generation_first)):
            raise RequestError("n > 1 is served from the start, aggregated or disaggregated with schedule_style "
                               "context_first: send it without resume and generation_first, or with n = 1", "n")
        if request_type is not RequestType.CONTEXT_AND_GENERATION:
            self._check_disagg(request_type, disagg, params)
        if any(choice_id(request_id, c) in self.seqs for c in range(params.n)):
            raise RequestError(f"request id {request_id!r} is already in flight")
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        if any(not 0 <= t < self.model_cfg.vocab_size for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be in [0, {self.model_cfg.vocab_size})", "prompt")
        if any(t >= self.model_cfg.vocab_size for t in params.logit_bias):
            raise RequestError(f"logit_bias token ids must be in [0, {self.model_cfg.vocab_size})", "logit_bias")
        if any(not 0 <= t < self.model_cfg.vocab_size for t in params.stop_token_ids):  # else it never stops
            raise RequestError(f"stop_token_ids must be in [0, {self.model_cfg.vocab_size})", "stop_token_ids")
        params = self._fit_context(n, params)
        need = self.blocks.blocks_needed(n + params.max_tokens)
        if need > self.blocks.num_blocks:
            raise RequestError(f"the request needs {need} KV blocks but the cache holds {self.blocks.num_blocks}; "
                               "raise kv_cache_memory_gb or lower max_tokens")
        seq = Sequence(request_id, list(prompt_token_ids), params, request_type, disagg=disagg)
        detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens,
                                       params.kept_special_token_ids)
        tracker = OutputTracker(seq, detok)
        if request_type is RequestType.CONTEXT_ONLY:
            disagg.pipelined = disagg.generation_first and self.ecfg.cache_transceiver_config.pipelined_transfer
        if request_type is RequestType.GENERATION_ONLY and not disagg.generation_first and params.n == 1:
            # Decode resumes after the context instance's first token, which is part of our output,
            # and so is its logprob entry when one was asked for (generation_first: it comes with the KV;
            # n > 1: each choice takes its own when the KV is in place, scheduler.kv_arrived).
            seq.output_token_ids = list(disagg.first_gen_tokens)
            if params.logprobs is not None:
                seq.output_logprobs = list(disagg.first_gen_logprobs)
            for t in seq.output_token_ids:
                tracker.on_token(t, False)
        if resume is not None:
            self._resume(seq, tracker, resume)
        if params.guided is not None:  # compiled (cached) and the output so far allowed, before any compute
            self._check_guided(seq, resume)
        self.scheduler.add(seq, tracker)
        return request_id

    def _check_guided(self, seq: Sequence, resume: Resume | None) -> None:
        """RequestError naming the field to blame when the request's grammar cannot be used, or when the output
        it starts with (a moved stream's tokens, a context instance's first token) is not allowed by it."""
        param = "resume.token_ids" if resume is not None else "disaggregated_params.first_gen_tokens"
        # n > 1 (generation_only): each choice starts from its own first token, taken when the KV arrives
        gen_n = seq.forks_now and seq.request_type is RequestType.GENERATION_ONLY
        starts = [[t] for t in seq.disagg.first_gen_tokens] if gen_n else [seq.output_token_ids]
        try:
            for output in starts:
                self.guides.check(seq.params.guided, output, param)
        except GuidedError as e:
            raise RequestError(str(e), e.param) from None

    def _allowed(self, seq: Sequence) -> bytes | None:
        """A guided sequence's mask for its next token (None: not guided). Output the grammar does not allow
        (a generation_first peer's first token), or a grammar that fails on its way (a row too wide for
        llguidance), gets an empty mask, which fails the request in the sampler as the grammar's fault."""
        if seq.params.guided is None:
            return None
        try:
            return self.guides.mask(seq.request_id, seq.params.guided, seq.output_token_ids)
        except GuidedError as e:
            log.warning("request %s: %s", seq.request_id, e)
            seq.refusal, seq.error_code = f"{e} ({e.param})", GRAMMAR_FAILED
            return bytes(self.guides.grammars.mask_bytes)

    def _fit_context(self, n: int, params: SamplingParams) -> SamplingParams:
        """The context-length rule, checked here only: a prompt of `n` tokens must leave room for a completion,
        and `max_tokens` must fit beside it; unset (None), it becomes what the window leaves, capped by the
        checkpoint's recommended max_tokens."""
        limit = self.max_model_len
        if n >= limit:
            raise RequestError(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                               f"{n} tokens, which leaves no room for a completion. Please shorten the prompt.",
                               "prompt", CONTEXT_LENGTH_EXCEEDED)
        if params.max_tokens is None:
            try:
                return replace(params, max_tokens=min(limit - n, self.sampling_defaults.get("max_tokens", limit)))
            except ValueError as e:  # min_tokens past what the window leaves
                raise RequestError(str(e), "min_tokens") from None
        if n + params.max_tokens > limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the completion). "
                "Please reduce the prompt or max_tokens.", "max_tokens", CONTEXT_LENGTH_EXCEEDED)
        return params

    def _resume(self, seq: Sequence, tracker: OutputTracker, resume: Resume) -> None:
        """Start `seq` with the output an earlier instance generated (see Resume); RequestError when that
        output could not have been a stream the request was still in."""
        p, ids = seq.params, list(resume.token_ids)
        if seq.request_type is not RequestType.CONTEXT_AND_GENERATION:
            raise RequestError("resume is for a request served whole: send it without disaggregated_params", "resume")
        if len(ids) >= p.max_tokens or len(seq.prompt_token_ids) + len(ids) >= self.max_model_len:
            raise RequestError(f"resume.token_ids holds {len(ids)} tokens: nothing is left to generate within "
                               f"max_tokens={p.max_tokens} and the context window", "resume.token_ids")
        if any(not 0 <= t < self.model_cfg.vocab_size for t in ids):
            raise RequestError(f"resume.token_ids must be in [0, {self.model_cfg.vocab_size})", "resume.token_ids")
        seq.output_token_ids = ids
        ending = self._ending(p)
        for i, t in enumerate(ids):  # as the earlier instance saw them, stop checks included
            tracker.on_token(t, t in ending, stop_strings=i + 1 >= p.min_tokens)
            if t in ending or seq.is_finished:
                raise RequestError(f"resume.token_ids ends the request at token {i}: there is nothing to resume",
                                   "resume.token_ids")
        if resume.sent_chars > len(tracker.text):
            raise RequestError(f"resume.sent_chars={resume.sent_chars} is more than the {len(tracker.text)} "
                               "characters resume.token_ids stand for", "resume.sent_chars")
        tracker.sent, tracker.sent_tokens = resume.sent_chars, len(ids)

    def _check_disagg(self, request_type: RequestType, disagg: DisaggInfo | None, params: SamplingParams) -> None:
        if self.runner.connector is None:
            raise RequestError(
                f"request_type {request_type.value!r} needs the KV transceiver, which is disabled on this worker: "
                "set cache_transceiver_config.backend (nixl or shm) in its config")
        if disagg is None or not 0 < disagg.disagg_request_id < MAX_DISAGG_ID:
            # (the id travels as a msgpack int64 between ranks and instances; above it a peer's canary ids)
            raise RequestError(f"request_type {request_type.value!r} needs disaggregated_params.disagg_request_id in "
                               f"[1, 2**63)", "disaggregated_params.disagg_request_id")
        if disagg.disagg_request_id in self.scheduler.by_disagg_id:
            raise ConflictError(f"disagg_request_id {disagg.disagg_request_id} is already in flight on this worker")
        if request_type is RequestType.GENERATION_ONLY:
            vocab = self.model_cfg.vocab_size
            if any(not 0 <= t < vocab for t in disagg.first_gen_tokens):
                raise RequestError(f"disaggregated_params.first_gen_tokens must be token ids in [0, {vocab})",
                                   "disaggregated_params.first_gen_tokens")
            entries = disagg.first_gen_logprobs
            if any(not 0 <= t < vocab for e in entries for t in [e["token_id"], *(t for t, _ in e["top"])]):
                raise RequestError(f"the logprobs in disaggregated_params.opaque_state must be of token ids in "
                                   f"[0, {vocab})", "disaggregated_params.opaque_state")
            if disagg.generation_first and disagg.first_gen_tokens:
                raise RequestError("generation_only with schedule_style generation_first gets its first token with "
                                   "the KV: send disaggregated_params.first_gen_tokens empty")
            if not disagg.generation_first and len(disagg.first_gen_tokens) != params.n:
                raise RequestError(f"generation_only with n = {params.n} needs exactly {params.n} token(s) in "
                                   f"disaggregated_params.first_gen_tokens (one per choice), got "
                                   f"{len(disagg.first_gen_tokens)}", "disaggregated_params.first_gen_tokens")
            if entries and [e["token_id"] for e in entries] != list(disagg.first_gen_tokens):
                raise RequestError("the logprob entries in disaggregated_params.opaque_state are not of the tokens in "
                                   "disaggregated_params.first_gen_tokens", "disaggregated_params.opaque_state")
            if not disagg.ctx_info_endpoint:
                raise RequestError("generation_only needs disaggregated_params.ctx_info_endpoint")

    def wake_on_kv_control(self, wake: Callable[[], None]) -> None:
        """Call `wake` (from another thread) when a KV control message arrives for rank 0, so that an idle
        step loop answers a peer at once rather than at its next poll."""
        if self.runner.connector is not None:
            self.runner.connector.tx.on_control_message(wake)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def release_kv(self, disagg_request_id: int) -> bool:
        """An answered context_only request whose KV nobody will pull (the orchestrator's client went
        away, or the generation side failed): free it now, not after kv_transfer_timeout_ms. False when
        this instance holds no such request (already pulled, never here, or its answer is still due:
        closing that HTTP request aborts it)."""
        return self.scheduler.release_kv(disagg_request_id)

    def take_abort_output(self, request_id: str) -> RequestOutput | None:
        return self.scheduler.take_abort_output(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.scheduler.parked) or self.kv.poll_due()

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        kv = self.kv.commands()
        self.last_step = None
        if batch or kv or self.scheduler.parked or self.kv.poll_due():
            shape = _step_shape(batch) if self.tpot_budget is not None and batch else None
            decode_rows = sum(_decodes(s) for s in batch)
            prefill_tokens = sum(s.num_new_tokens for s in batch) - decode_rows
            batch, sampled, reports = self._run(batch, kv)
            self.scheduler.postprocess(batch, sampled)
            self.guides.retire(self.seqs)
            seconds = time.perf_counter() - start  # before settle, which sleeps when the step ran nothing
            if shape is not None:
                self.tpot_budget.model.observe(*shape, seconds)
            if prefill_tokens or decode_rows:
                self.last_step = StepRecord(seconds, prefill_tokens, decode_rows)
            self.kv.settle(batch, reports)
        return self.scheduler.take_outputs()

    def _run(self, batch: list[ScheduledSeq],
             kv: list[KVCommand]) -> tuple[list[ScheduledSeq], SampleResult | None, list]:
        """Every rank's forward step of `batch`, with the KV commands. Returns the sequences that went
        through, their samples, and the ranks' KV reports (one list per runner step taken)."""
        spec = self._spec(batch)
        spec.kv = kv
        result = self.runner.step(spec)
        reports = [result.kv_reports]
        if result.failure is None:
            return batch, result.sampled, reports
        batch, sampled, reports[1:] = self._isolate_failure(batch, spec.seqs, result.failure)
        return batch, sampled, reports

    def _isolate_failure(self, batch: list[ScheduledSeq], steps: list[SeqStep],
                         failure: str) -> tuple[list[ScheduledSeq], SampleResult, list]:
        """The forward step failed (one process: nothing was committed). Run each sequence's part of it
        alone, so a request that makes the model fail takes down itself, not its batch. Returns the
        sequences that went through, their samples, and the KV reports of the extra steps."""
        kept: list[ScheduledSeq] = []
        sampled = SampleResult([], [], [], [])
        reports = []
        for s, step in zip(batch, steps):
            result = self.runner.step(StepSpec([step])) if len(batch) > 1 else None
            if result is not None:
                reports.append(result.kv_reports)
            if result is None or result.failure is not None:
                self.scheduler.fail(s.seq, f"the forward step failed: {result.failure if result else failure}")
                continue
            kept.append(s)
            if s.samples:
                one = result.sampled
                sampled.token_ids += one.token_ids
                sampled.logprobs += one.logprobs
                sampled.top_logprobs += one.top_logprobs
                sampled.errors += [one.error(i) for i in range(s.choices)]
        return kept, sampled, reports

    def _spec(self, batch: list[ScheduledSeq]) -> StepSpec:
        steps = []
        for s in batch:
            seq = s.seq
            start = seq.num_computed_tokens
            sample = None
            if s.samples:
                p = seq.params
                counted = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                sample = SampleSpec(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                                    repetition_penalty=p.repetition_penalty, seed=p.seed,
                                    step=len(seq.output_token_ids), logprobs=p.logprobs,
                                    history=seq.all_token_ids if p.repetition_penalty != 1.0 else None,
                                    presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                                    output=seq.output_token_ids if counted else None,
                                    logit_bias=list(p.logit_bias.items()) or None, allowed=self._allowed(seq),
                                    banned=self._banned(p) if len(seq.output_token_ids) < p.min_tokens else None,
                                    choice=seq.choice, choices=s.choices)
            steps.append(SeqStep(seq.all_token_ids[start:start + s.num_new_tokens], start, seq.block_ids, sample,
                                 seq.state_slot))
        block_copies, state_copies = self.scheduler.take_copies()
        return StepSpec(steps, block_copies=block_copies, state_copies=state_copies)

    def _ending(self, p: SamplingParams) -> frozenset[int]:
        """The tokens that end a request's output: its stop token ids, and EOS unless it ignores EOS."""
        return p.stop_token_set if p.ignore_eos else p.stop_token_set | self.eos_token_ids

    def _banned(self, p: SamplingParams) -> list[int] | None:
        """Tokens that would end the output, which min_tokens keeps from being sampled."""
        return sorted(t for t in self._ending(p) if 0 <= t < self.model_cfg.vocab_size) or None

    # -- shutdown --------------------------------------------------------------------------------

    def shutdown(self, graceful: bool = True) -> None:
        """`graceful`: tell the other ranks to stop and wait for them; else (a step failed, so they may be
        dead or stuck in a collective) kill them first."""
        if not graceful:
            self._kill_workers()
        self.kv.close()
        self.guides.grammars.close()
        if self.runner is not None:
            self.runner.shutdown() if graceful else self.runner.close()
        for p in self._procs:
            p.join(timeout=10)
        self._kill_workers()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self.runner = None

    def _kill_workers(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        self._procs.clear()

    def stats(self) -> dict:
        return {
            "parked": len(self.scheduler.parked),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_free": self.blocks.num_free_blocks,
            "state_slots_total": self.blocks.num_state_slots,
            "state_slots_free": self.blocks.num_free_state_slots,
        }


def _decodes(s: ScheduledSeq) -> bool:
    """`s` decodes one token (as opposed to computing prompt tokens)."""
    return s.num_new_tokens == 1 and s.samples and bool(s.seq.output_token_ids)


def _step_shape(batch: list[ScheduledSeq]) -> tuple[int, float, bool]:
    """What StepTimeModel times a step by: its rows, its attention work, and whether it prefilled."""
    decode = [s for s in batch if _decodes(s)]
    chunks = [(s.num_new_tokens, s.start) for s in batch if s not in decode]
    rows = sum(s.num_new_tokens for s in batch)
    return rows, attention_work(chunks, [s.start + 1 for s in decode]), bool(chunks)


def _default_name(spec: str | None, model_dir: Path) -> str:
    if spec is None:
        return "SmolLM2-135M-Instruct"
    return Path(spec).stem if spec.endswith(".gguf") else Path(spec).name
