"""LLMEngine: one model on one device, driven one step at a time.

`step()` is three calls: `scheduler.schedule() -> SchedulerOutput`, `runner.execute(...) ->
RunnerOutput`, `scheduler.update(...) -> requests that changed`; then each changed request's new
tokens are detokenized (stop strings applied) into a `RequestDelta`. `generate()` drives
`step()` to completion for offline use.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from sluice.grammar.compiler import GrammarCompiler
from sluice.protocol import (
    FinishReason,
    KvEvents,
    PositionLogprobs,
    Priority,
    RequestDelta,
    SamplingParams,
    WorkerCapacity,
)
from sluice.workers.config import EngineConfig, SchedulerConfig
from sluice.workers.detokenizer import IncrementalDetokenizer
from sluice.workers.model.config import ModelConfig, ModelLoadError
from sluice.workers.model.tokenizer import load_tokenizer
from sluice.workers.request import Request, RequestStatus
from sluice.workers.runner import ModelRunner
from sluice.workers.scheduler import Scheduler
from sluice.workers.scheduler_output import RunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)

# What a client is told when its request raised inside the engine (details stay in the worker's log).
REQUEST_FAILED_MESSAGE = "the model worker could not process this request (other requests are unaffected)"
MAX_FAILED_STEPS = 3
# The settings only the scheduler reads (`LLMEngine.reschedule`): the runner, its KV memory and its
# CUDA graphs are sized by the others.
SCHEDULING_FIELDS = frozenset({"policy", "max_num_batched_tokens", "max_prefill_chunk", "enable_prefix_caching",
                               "chunk_policy", "min_prefill_chunk", "itl_slow_share"})


@dataclass(slots=True)
class GenerationResult:
    """A finished request, as `generate()` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)


def _eos_token_ids(model_dir: Path, model_config: ModelConfig, tokenizer) -> frozenset[int]:
    ids = set(model_config.eos_token_ids)
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        try:
            eos = json.loads(gen_path.read_text(encoding="utf-8")).get("eos_token_id")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise ModelLoadError(f"{gen_path}: not valid JSON ({exc})") from None
        ids.update(eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else []))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = Path(config.model)
        ModelConfig.from_dir(model_dir)  # fail fast on a broken config before loading a tokenizer
        self._tokenizer = load_tokenizer(model_dir)
        self.runner = ModelRunner(config)
        self.eos_token_ids = _eos_token_ids(model_dir, self.runner.model_config, self._tokenizer)
        self.scheduler = self._new_scheduler()
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the Rust tokenizer directly: far cheaper per call
            self._decode = lambda ids: backend.decode(list(ids), skip_special_tokens=True)
        else:
            self._decode = lambda ids: self._tokenizer.decode(list(ids), skip_special_tokens=True)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._num_reported: dict[str, int] = {}
        self._pending: list[RequestDelta] = []  # abort deltas, returned by the next step()
        self._ids = itertools.count()
        self._failed_steps = 0  # consecutive steps in which every chunk raised (see _execute_isolating)
        self._grammar_compiler: GrammarCompiler | None = None  # built for the first structured request
        # Structured requests whose grammar is compiling, with when they were submitted: not yet
        # the scheduler's (not scheduled until it is ready; the engine keeps stepping the others).
        self._compiling: dict[str, tuple[Request, concurrent.futures.Future, float]] = {}

    def reschedule(self, **scheduling: Any) -> None:
        """A fresh scheduler (empty queues and prefix cache, a cold cost model) under these
        `SCHEDULING_FIELDS` of the config, keeping the loaded model and its KV memory: experiments
        that compare scheduling policies on one model (`sluice bench slo`) load it once, not once
        per arm (an 8B model takes longer to load than an arm takes to run). Only while idle."""
        unknown = set(scheduling) - SCHEDULING_FIELDS
        if unknown:
            raise ValueError(f"not scheduling settings: {sorted(unknown)}")
        if self.has_work:
            raise RuntimeError("reschedule needs an idle engine")
        self.config = dataclasses.replace(self.config, **scheduling)
        self.scheduler = self._new_scheduler()

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(
            SchedulerConfig.from_engine_config(self.config, self.runner.num_kv_blocks, self.runner.max_model_len)
        )

    # ---- properties ----------------------------------------------------------------------------

    @property
    def tokenizer(self):  # -> transformers PreTrainedTokenizerBase
        return self._tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.runner.model_config

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work or bool(self._compiling)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Structured outputs' compiler for this model's tokenizer (its token table is built on first use)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(
                self._tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                tokenizer_id=f"{self.config.model}:{self.model_config.vocab_size}",
                cache_size=self.config.grammar_cache_size)
        return self._grammar_compiler

    def capacity(self, worker_id: str) -> WorkerCapacity:
        cost = self.scheduler.cost_model
        return WorkerCapacity(
            worker_id=worker_id,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + len(self._compiling),
            free_kv_blocks=self.scheduler.num_free_blocks,
            total_kv_blocks=self.scheduler.num_total_blocks,
            max_num_seqs=self.config.max_num_seqs,
            sent_at=time.time(),
            step_cost=cost.coefficients if cost.ready else (),
            step_cost_error=cost.prediction_error(),
            prefill_backlog=self.scheduler.prefill_backlog(),
            decode_context_tokens=self.scheduler.decode_context(),
            max_num_batched_tokens=self.config.max_num_batched_tokens,
        )

    # ---- KV events -----------------------------------------------------------------------------

    def enable_kv_events(self, enabled: bool = True) -> None:
        """Note each prefix block cached and evicted, for `take_kv_events` (off by default: an
        engine nobody routes by, e.g. offline `generate`, keeps no log)."""
        self.scheduler.block_manager.record_events = enabled

    def take_kv_events(self) -> KvEvents | None:
        """The prefix-cache changes since the last call (one batch per step), None when none."""
        stored, evicted, cleared = self.scheduler.block_manager.take_events()
        if not (stored or evicted or cleared):
            return None
        return KvEvents(block_size=self.scheduler.config.block_size, stored=tuple(stored),
                        evicted=tuple(evicted), cleared=cleared)

    # ---- requests ------------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self._tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def add_request(self, request_id: str, prompt: str | Sequence[int], sampling: SamplingParams,
                    priority: int = Priority.STANDARD, cache_salt: str = "",
                    arrival_time: float | None = None, resume_token_ids: Sequence[int] = (),
                    itl_target_s: float | None = None, ttft_target_s: float | None = None) -> None:
        """Queues a request. `resume_token_ids`: output an earlier attempt produced and delivered
        (worker failover): it is recomputed with the prompt, and the request goes on from there as
        if undisturbed (same budget, stop checks, text and, for a seeded request, tokens)."""
        sampling.validate()
        if request_id in self._detokenizers:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str) and not prompt:
            raise ValueError("the prompt is empty")
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be between 0 and {vocab - 1}")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; this model accepts at most "
                f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})"
            )
        if any(t < 0 or t >= vocab for t, _ in sampling.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids between 0 and {vocab - 1}")
        resumed = self._check_resume(token_ids, [int(t) for t in resume_token_ids], sampling)
        request = Request(request_id, token_ids, sampling,
                          arrival_time=time.time() if arrival_time is None else arrival_time,
                          priority=priority, cache_salt=cache_salt, eos_token_ids=self.eos_token_ids,
                          resume_token_ids=resumed, itl_target_s=itl_target_s, ttft_target_s=ttft_target_s)
        detokenizer = IncrementalDetokenizer(self._decode, token_ids, sampling.stop, resumed)
        if sampling.structured is not None:
            future = self.grammar_compiler.submit(sampling.structured)
            self._compiling[request_id] = (request, future, time.monotonic())
        else:
            self.scheduler.add_request(request)
        self._detokenizers[request_id] = detokenizer
        self._num_reported[request_id] = len(resumed)  # delivered by the earlier attempt

    def _check_resume(self, prompt: list[int], resumed: list[int], sampling: SamplingParams) -> list[int]:
        """Resumed output is validated like a prompt, and must not already have ended the request
        (`Request` checks that it leaves some of max_tokens to generate)."""
        if not resumed:
            return resumed
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in resumed):
            raise ValueError(f"resume token ids must be between 0 and {vocab - 1}")
        if len(prompt) + len(resumed) >= self.max_model_len:
            raise ValueError(
                f"the prompt and resumed output have {len(prompt) + len(resumed)} tokens; this model "
                f"accepts at most {self.max_model_len - 1} (max_model_len {self.max_model_len})"
            )
        stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos_token_ids))
        if any(t in stops for t in resumed):
            raise ValueError("the resumed output tokens contain a stop token: that request has ended")
        return resumed

    def abort(self, request_id: str) -> bool:
        """Aborts a live request; its final delta (finish_reason abort) comes from the next step()."""
        compiling = self._compiling.pop(request_id, None)
        request = compiling[0] if compiling is not None else self.scheduler.abort(request_id)
        if request is None or request_id not in self._detokenizers:
            return False
        self._pending.append(self._delta(request, (), "", (), FinishReason.ABORT))
        self._forget(request_id)
        return True

    # ---- stepping ------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        deltas, self._pending = self._pending, []
        if self._compiling:
            self._admit_compiled(deltas)
        if not self.scheduler.has_work:
            if self._compiling and not deltas:  # nothing to step: wait a little for a compile
                futures = [future for _, future, _ in self._compiling.values()]
                concurrent.futures.wait(futures, timeout=0.005, return_when=concurrent.futures.FIRST_COMPLETED)
            return deltas
        started = time.perf_counter()
        scheduled = self.scheduler.schedule(time.time())
        failed = False
        try:
            runner_output = self.runner.execute(scheduled)
        except Exception:
            failed = True
            runner_output = self._execute_isolating(scheduled, deltas)
        changed = self.scheduler.update(scheduled, runner_output, time.time())
        for request in changed:
            deltas.append(self._process(request, runner_output.logprobs.get(request.request_id, ())))
        if not failed and scheduled.chunks:  # the whole step, as a decoding stream waits for it
            self.scheduler.observe_step_time(scheduled, time.perf_counter() - started)
        return deltas

    def _admit_compiled(self, deltas: list[RequestDelta]) -> None:
        """Hand the requests whose grammar is ready to the scheduler; end those whose grammar failed or
        took longer than `grammar_compile_timeout_s` with an error (the engine goes on)."""
        now = time.monotonic()
        ready_at = self.grammar_compiler.ready_at
        for rid, (request, future, submitted) in list(self._compiling.items()):
            error: str | None = None
            if future.done():
                try:
                    request.grammar = self.grammar_compiler.matcher(future.result(), request.output_token_ids)
                except ValueError as exc:  # GrammarError included: a spec the gateway did not check
                    error = f"the structured output cannot be enforced: {exc}"
                except Exception:  # the library failed on its own
                    log.warning("request %s: grammar compile failed", rid, exc_info=True)
                    error = "the structured output's grammar failed to compile"
            elif ready_at is not None and now > max(submitted, ready_at) + self.config.grammar_compile_timeout_s:
                error = (f"the structured output's grammar did not compile within "
                         f"{self.config.grammar_compile_timeout_s:g} s")
            else:
                continue
            del self._compiling[rid]
            if error is None:
                self.scheduler.add_request(request)
                continue
            delta = self._delta(request, (), "", (), FinishReason.ERROR)
            deltas.append(msgspec.structs.replace(delta, error=error))
            self._forget(rid)

    def _execute_isolating(self, scheduled: SchedulerOutput, deltas: list[RequestDelta]) -> RunnerOutput:
        """A step raised: run its chunks one by one, so a request that raises on its own ends with an
        error (its delta goes to `deltas`) and the others go on. Re-running a chunk recomputes the same
        KV entries and draws the same random number (it depends on the output position alone). When
        every one of several chunks fails, in several steps in a row, the engine itself is broken:
        raise (the worker exits and is restarted)."""
        log.warning("an engine step failed; running its %d chunk(s) one by one", len(scheduled.chunks),
                    exc_info=True)
        sampled: dict[str, tuple[int, ...]] = {}
        logprobs: dict[str, tuple[PositionLogprobs, ...]] = {}
        failed = 0
        for chunk in scheduled.chunks:
            try:
                out = self.runner.execute(SchedulerOutput((chunk,), (), chunk.num_tokens))
            except Exception:
                failed += 1
                rid = chunk.request.request_id
                log.warning("request %s raises in the engine on its own; it is ended with an error", rid,
                            exc_info=True)
                request = self.scheduler.abort(rid)
                if request is not None and rid in self._detokenizers:
                    delta = self._delta(request, (), "", (), FinishReason.ERROR)
                    deltas.append(msgspec.structs.replace(delta, error=REQUEST_FAILED_MESSAGE))
                    self._forget(rid)
                continue
            sampled.update(out.sampled_token_ids)
            logprobs.update(out.logprobs)
        # Several requests all failing points at the engine; one request failing alone, at the request.
        if failed < len(scheduled.chunks):
            self._failed_steps = 0
        elif failed > 1:
            self._failed_steps += 1
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise RuntimeError(f"{MAX_FAILED_STEPS} engine steps in a row failed for every request")
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _process(self, request: Request, logprobs: tuple[PositionLogprobs, ...]) -> RequestDelta:
        """The delta of a request's new tokens (one, or several when it kept draft tokens);
        `logprobs`: those of the step's sampled tokens, where asked."""
        rid = request.request_id
        detok = self._detokenizers[rid]
        start = self._num_reported[rid]
        new_ids = tuple(request.output_token_ids[start:])
        result = detok.add_tokens(new_ids)
        text = result.text
        finish: FinishReason | None = None
        if result.stopped:
            if result.num_tokens < len(new_ids):  # kept drafts ran past the stop string
                new_ids = new_ids[:result.num_tokens]
                request.truncate_output(start + result.num_tokens)
            if not request.is_finished:
                self.scheduler.finish(rid, RequestStatus.FINISHED_STOPPED)
            finish = FinishReason.STOP
        elif request.is_finished:
            text += detok.flush()
            finish = request.finish_reason
        self._num_reported[rid] = request.num_output_tokens
        # The times of the tokens made here (a resumed request has none for its resumed tokens).
        times = tuple(request.token_times[-len(new_ids):]) if new_ids else ()
        delta = self._delta(request, new_ids, text, logprobs[:len(new_ids)], finish, times)
        if finish is FinishReason.ERROR:  # ended by the scheduler for this request alone
            delta = msgspec.structs.replace(delta, error=REQUEST_FAILED_MESSAGE)
        if finish is not None:
            self._forget(rid)
        return delta

    def _delta(self, request: Request, token_ids: tuple[int, ...], text: str,
               logprobs: tuple[PositionLogprobs, ...], finish: FinishReason | None,
               token_times: tuple[float, ...] = ()) -> RequestDelta:
        return RequestDelta(
            request_id=request.request_id,
            token_ids=token_ids,
            text=text,
            logprobs=logprobs,
            finish_reason=finish,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            token_times=token_times,
        )

    def _forget(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self._num_reported.pop(request_id, None)
        self.runner.release(request_id)

    # ---- offline -------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams],
                 request_ids: Sequence[str] | None = None, progress=None,
                 itl_target_s: float | None = None) -> list[GenerationResult]:
        """Runs every prompt to completion; results in input order. `progress`: tqdm-like or None;
        `itl_target_s`: every request's inter-token latency target (the adaptive chunk policy's input)."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling settings for {len(prompts)} prompts")
        ids = list(request_ids) if request_ids is not None else [f"gen-{next(self._ids)}" for _ in prompts]
        results: dict[str, GenerationResult] = {}
        now = time.time()
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            self.add_request(rid, prompt, p, arrival_time=now, itl_target_s=itl_target_s)
            results[rid] = GenerationResult(rid, self.tokenize(prompt), arrival_time=now)
        self.run_to_completion(results, progress)
        return [results[rid] for rid in ids]

    def run_to_completion(self, results: dict[str, GenerationResult], progress=None) -> None:
        """Steps until no work is left, folding every delta into `results[request_id]`."""
        while self.has_work:
            for delta in self.step():
                result = results.get(delta.request_id)
                if result is None:
                    continue  # a request added by someone else; not ours to collect
                accumulate(result, delta)
                if delta.finish_reason is not None and progress is not None:
                    progress.update(1)


def accumulate(result: GenerationResult, delta: RequestDelta) -> None:
    """Folds one step's delta into a request's result."""
    result.token_ids.extend(delta.token_ids)
    result.text += delta.text
    result.logprobs.extend(delta.logprobs)
    result.token_times.extend(delta.token_times)
    result.num_cached_tokens = delta.num_cached_tokens
    result.first_scheduled_time = delta.first_scheduled_time
    result.first_token_time = delta.first_token_time
    if delta.finish_reason is not None:
        result.finish_reason = delta.finish_reason
        result.finished_time = time.time()
