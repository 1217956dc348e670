"""The asyncio front-end (vLLM's AsyncLLM) over an EngineCore stepped by one background thread.

Text never reaches the engine thread. Prompts are tokenized and validated on a tokenizer thread, outputs are
detokenized on the event loop, and only token ids cross to and from the core:

    event loop                      tokenizer thread               engine thread (EngineCore only)
    add_requests() ----prompt---->  Processor.process
                   <--core reqs---                      ----add command---->  add_requests, step, step, ...
    OutputProcessor (detokenize, stop strings)  <--EngineCoreOutputs (call_soon_threadsafe)--
      -> per-request OutputStream (deltas merged while the client lags: memory stays O(output))
    stop string / close() / disconnect  ------------------finish command---->  free the blocks

The engine thread runs the commands queued between steps; the core is touched by nothing else. Inside a step the
core may take the added requests between its layers (EngineCore.arrivals, whose flag tells the model that some
are queued: an urgent request runs its own step there); every other command still waits for the step's end,
in order.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, TypeVar

from pagedserve.core.request import RequestStatus
from pagedserve.core.scheduler_output import SchedulerStats
from pagedserve.engine.output_processor import OutputProcessor, ProcessedOutputs
from pagedserve.malloc import release_free_memory
from pagedserve.niceness import yield_cpu_to_the_engine
from pagedserve.metrics.stats import SpecDecodingStats
from pagedserve.engine.output_stream import OutputStream
from pagedserve.messages import (AddFinishedHook, AddRequests, Arrivals, ClearWarmup, EngineClosedError,
                                 EngineCommand, EngineDeadError, EngineError, FinishRequests, RequestConstraintError,
                                 TakeKVSnapshot, describe_error)
from pagedserve.core.kv_snapshot import KVState, capture_kv_state
from pagedserve.engine.processor import ChatPrompt, Processor, PromptInput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
__all__ = ["AsyncLLMEngine", "EngineSnapshot", "OutputStream"]


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    # Taken by the engine thread after each step, before its outputs are handed over, so /metrics never
    # lags a response the client already has.
    scheduler: SchedulerStats | None
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    finished_by_reason: dict[str, int]
    num_aborted: int
    spec: SpecDecodingStats | None = None  # a copy; None when speculative decoding is off


# The engine hands freed heap back to the OS (malloc.py) when it goes idle, and, since under continuous load it
# never does, also after a step once BUSY_TRIM_INTERVAL_S has passed since the last time (1-10 ms a trim).
# memory_soak.py, 8 clients without a pause: RSS read between requests ~25 MB above the idle figure without it.
BUSY_TRIM_INTERVAL_S = 2.0

# Tokenizer work runs at a low priority (niceness.py), which starves it while steps run back to back: a burst of
# requests (a wave of 8 chat turns over a 1,000-token system prompt, ~5 ms of tokenizing each) took up to 2 s to
# reach the engine, one or two per step. So before a step the engine waits for requests still being tokenized (not
# for grammars compiling), sleeping so that the tokenizer thread gets the CPU: for up to ADMISSION_WAIT_S when it
# was idle, and otherwise at most as long as its last step took (the running requests then wait at most one step's
# time). They join that step together.
# Under the priority policy a request that outranks one in flight is tokenized on a second thread, at normal
# priority: it is to preempt the work that starves the niced thread. (priority.py, AVX2 EPYC under a full load:
# an urgent request's TTFT p50 was 1.60x an idle server's with its tokenizing niced, 1.02x with it not.)
ADMISSION_WAIT_S = 0.05


@dataclass(slots=True)
class _Admission:
    # n requests on their way to the engine (tokenizing, then queued): the engine waits for them before a step.
    engine: AsyncLLMEngine
    n: int
    done: bool = False

    def end(self) -> None:  # idempotent: when the engine thread takes them, or when they fail before that
        with self.engine._lock:
            if not self.done:
                self.done = True
                self.engine._admitting -= self.n
        self.engine._wakeup.set()


@dataclass(slots=True)
class _TokenizerLane:
    pool: concurrent.futures.ThreadPoolExecutor  # one thread
    busy_since: float | None = None  # set while it runs a job


@dataclass(frozen=True, slots=True)
class _Queued:
    command: EngineCommand
    reply: concurrent.futures.Future | None = None
    admission: _Admission | None = None  # ended when the engine thread takes the command


class AsyncLLMEngine:
    def __init__(self, core: Any = None, start: bool = True, *, factory: Callable[[], Any] | None = None) -> None:
        # Either a built EngineCore, or a factory that builds it on the engine thread (see from_config).
        if (core is None) == (factory is None):
            raise ValueError("pass exactly one of core and factory")
        self._factory = factory
        self.core = core
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        if self.core is not None:
            self._set_facts()
        self._commands: queue.SimpleQueue[_Queued] = queue.SimpleQueue()
        self._deferred: deque[_Queued] = deque()  # taken inside a step, run after it (engine thread only)
        self._pending = bytearray(8)  # Arrivals.pending: 1 once added requests are queued
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # orders _closed against command submission
        self._closed = False
        self._busy_since: float | None = None  # set while the engine thread is inside a step or command
        self._admitting = 0  # requests in add_requests that have not reached the engine yet (under _lock)
        self._last_step_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, OutputStream] = {}  # event loop only
        self._tokenizer = _TokenizerLane(concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pagedserve-tokenizer", initializer=yield_cpu_to_the_engine))
        self._urgent_tokenizer = _TokenizerLane(concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pagedserve-urgent-tokenizer"))
        self.snapshot = EngineSnapshot(None, 0, 0, {}, 0)
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        if start:
            self.start()

    @classmethod
    def from_config(cls, config: Any) -> AsyncLLMEngine:
        # The model is loaded, warmed up and run on one thread, the engine thread. libgomp cuts its
        # spin-waiting to almost nothing once it manages more threads than there are CPUs, which a second
        # thread's OpenMP team (load on the main thread, steps on the engine thread) causes; every parallel
        # region then pays a futex wake-up. Measured single-stream decode, 2 threads: 11.7 ms per token with
        # everything on one thread, 24.4 ms when the steps run on a second one.
        from pagedserve.engine.core import EngineCore

        return cls.from_factory(lambda: EngineCore(config))

    @classmethod
    def from_factory(cls, factory: Callable[[], Any]) -> AsyncLLMEngine:
        # Builds the core on the engine thread and waits for it; a construction error is raised here.
        async_engine = cls(factory=factory)
        async_engine._ready.wait()
        if async_engine._init_error is not None:
            raise async_engine._init_error
        return async_engine

    def _set_facts(self) -> None:
        # Fixed at load time, safe to read from any thread. The front-end halves live off the engine thread.
        core = self.core
        self.model_name: str = core.model_name
        self.max_model_len: int = core.max_model_len
        self.num_kv_blocks: int = core.num_kv_blocks
        self.block_size: int = core.config.cache.block_size
        self.kv_cache_dtype: str = core.config.cache.cache_dtype
        self.kv_bytes_per_token: int = core.kv_bytes_per_token
        self.processor = Processor(core.loaded, core.config.model, core.max_model_len,
                                   core.config.structured_outputs, core.config.scheduler)
        self.tokenizer = self.processor.tokenizer
        self._priority_policy = core.config.scheduler.scheduling_policy == "priority"
        self.output_processor = OutputProcessor(self.tokenizer)

    # ---- any thread -------------------------------------------------------------------------------------

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def is_healthy(self, max_stall_s: float) -> bool:
        # Alive, and not stuck: no step or command, and no tokenizer job (every request passes through a
        # tokenizer thread), has been running for longer than max_stall_s.
        now = time.monotonic()
        busy = (self._busy_since, self._tokenizer.busy_since, self._urgent_tokenizer.busy_since)
        return self.is_running and all(since is None or now - since <= max_stall_s for since in busy)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        with self._lock:
            self._closed = True
        self._wakeup.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        for lane in (self._tokenizer, self._urgent_tokenizer):
            lane.pool.shutdown(wait=False, cancel_futures=True)
        if getattr(self, "processor", None) is not None:
            self.processor.grammars.shutdown()

    def add_finished_callback(self, fn: Callable[[Any], None]) -> None:
        # Called on the engine thread with each finished sequence's RequestStats.
        self._submit(_Queued(AddFinishedHook(fn)))

    async def kv_snapshot(self) -> tuple[KVState, dict[str, Any]]:
        """The KV pool's state (core/kv_snapshot.py) and the engine's counters, taken between steps."""
        return await self._call(TakeKVSnapshot())

    async def clear_warmup(self) -> None:
        """Forgets the start-up warm-up's blocks and counts (engine/warmup.py); nothing else may have run."""
        await self._call(ClearWarmup())

    async def render_chat(self, chat: ChatPrompt, priority: int = 0) -> dict[str, Any]:
        """{"prompt": text, "prompt_token_ids": ids} (and the cache salt) of a conversation, rendered and checked.

        `priority`: the request's, which picks the tokenizer thread (see the note above ADMISSION_WAIT_S)."""
        return await self._on_tokenizer_thread(self._lane(priority), Processor.render_chat, chat)

    async def tokenize(self, prompts: Sequence[PromptInput], priority: int = 0) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) of each prompt, each checked and tokenized once (text None for token ids)."""
        return await self._on_tokenizer_thread(self._lane(priority), Processor.tokenize_all, prompts)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of a text (its length checked first), as /tokenize reports them."""
        return await self._on_tokenizer_thread(self._tokenizer, Processor.encode, text, add_special_tokens)

    async def detokenize(self, token_ids: Sequence[int], priority: int = 0) -> str:
        """The text of token ids; ValueError for an id outside the vocabulary."""
        return await self._on_tokenizer_thread(self._lane(priority), Processor.detokenize, token_ids)

    async def _call(self, command: EngineCommand, admission: _Admission | None = None) -> Any:
        # Runs the command on the engine thread between steps and returns its answer (or raises its error).
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Queued(command, reply, admission))
        return await asyncio.wrap_future(reply)

    def _lane(self, priority: int) -> _TokenizerLane:  # event loop
        # The normal-priority thread for a request that outranks one in flight under the priority policy.
        if self._priority_policy and any(priority < s.priority for s in self._streams.values()):
            return self._urgent_tokenizer
        return self._tokenizer

    async def _on_tokenizer_thread(self, lane: _TokenizerLane, method: Callable[..., T], *args: Any) -> T:
        # Runs a Processor method on a tokenizer thread: tokenize, render templates, decode.
        return await asyncio.get_running_loop().run_in_executor(lane.pool, self._tokenizer_job, lane, method, args)

    def _tokenizer_job(self, lane: _TokenizerLane, method: Callable[..., T], args: tuple) -> T:  # tokenizer thread
        lane.busy_since = time.monotonic()
        try:
            return method(self.processor, *args)
        finally:
            lane.busy_since = None

    # ---- event loop ---------------------------------------------------------------------------------------

    def abort(self, request_ids: str | Sequence[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self._streams.pop(rid, None)
        self._finish_in_core(self.output_processor.abort_requests(ids), RequestStatus.FINISHED_ABORTED)

    async def add_requests(self, requests: Sequence[tuple[str, PromptInput, SamplingParams]],
                           priority: int = 0) -> OutputStream:
        """Add all requests or none; a ValueError from validation (prompt too long, ...) reaches the caller.

        They are one client request: the scheduler interleaves their sequences with other client requests'."""
        if self._closed:
            raise EngineClosedError("the engine is shut down")
        loop = asyncio.get_running_loop()
        self._loop = loop
        with self._lock:
            self._admitting += len(requests)
        admission = _Admission(self, len(requests))
        try:
            return await self._add_requests(requests, admission, priority)
        finally:
            admission.end()  # tokenizing failed, or the caller went away before the engine took them

    async def _add_requests(self, requests: Sequence[tuple[str, PromptInput, SamplingParams]],
                            admission: _Admission, priority: int) -> OutputStream:
        processed = await self._on_tokenizer_thread(self._lane(priority), Processor.process_all, requests, priority)
        if any(p.grammar_future is not None for p in processed):
            # Grammars compile on their own threads; waiting here (not on the tokenizer thread) holds up
            # nobody else's request, nor the engine (which waits only for tokenizing: a compile may take seconds).
            admission.end()
            grammars = self.processor.grammars
            compiled = await asyncio.gather(*(grammars.wait_async(p.grammar_future) for p in processed
                                              if p.grammar_future is not None))
            it = iter(compiled)
            processed = [p if p.grammar_future is None else p.with_grammar(next(it)) for p in processed]
        ids = [p.request_id for p in processed]
        if len(set(ids)) != len(ids) or any(rid in self._streams for rid in ids):
            raise ValueError(f"request ids {ids} are already in use")
        delta_ids = {p.request_id for p in processed if p.params.output_kind is RequestOutputKind.DELTA}
        stream = OutputStream(self, ids, delta_ids, priority=priority)
        for p in processed:
            self.output_processor.add_request(p)
            self._streams[p.request_id] = stream
        core_reqs = [r for p in processed for r in p.core_requests]
        try:
            await self._call(AddRequests(core_reqs), admission)
        except BaseException:
            # Not added (validation in the core), or the caller went away: forget them here and in the core.
            self.abort(ids)
            stream.unfinished.clear()
            raise
        return stream

    async def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                          priority: int = 0) -> OutputStream:
        return await self.add_requests([(request_id, prompt, params)], priority)

    async def generate(self, prompt: PromptInput, params: SamplingParams, request_id: str):
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _process_outputs(self, core_outputs: list) -> None:
        processed: ProcessedOutputs = self.output_processor.process_outputs(core_outputs)
        for out in processed.request_outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.put(out)
        for rid, message in processed.failures.items():
            stream = self._streams.pop(rid, None)
            if stream is not None:
                error = RequestConstraintError if message.startswith(RequestConstraintError.PREFIX) else EngineError
                stream.fail(rid, error(f"request {rid} failed: {message}"))
        self._finish_in_core(processed.stopped_core_ids, RequestStatus.FINISHED_STOPPED)
        self._finish_in_core(processed.aborted_core_ids, RequestStatus.FINISHED_ABORTED)

    def _fail_streams(self, message: str, closed: bool) -> None:
        streams, self._streams = self._streams, {}
        self.output_processor.abort_requests(list(streams))
        for rid, stream in streams.items():
            stream.fail(rid, EngineClosedError(message) if closed else EngineError(message))

    def _finish_in_core(self, core_ids: list[str], status: RequestStatus) -> None:
        if core_ids:
            try:
                self._submit(_Queued(FinishRequests(core_ids, status)))
            except EngineClosedError:
                pass  # shutdown frees everything anyway

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:  # engine thread
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody reads these requests any more
            pass

    def _submit(self, command: _Queued) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is shut down")
            self._commands.put(command)
        if isinstance(command.command, AddRequests):
            self._pending[0] = 1  # after the put: the engine clears it before it takes commands
        self._wakeup.set()

    # ---- engine thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        if self._factory is not None:
            try:
                self.core = self._factory()
                self._set_facts()
            except BaseException as exc:  # noqa: BLE001 (raised by from_config on the caller's thread)
                self._init_error = exc
                with self._lock:
                    self._closed = True
                return
            finally:
                self._ready.set()
        try:
            self._engine_loop()
        finally:
            # Normal shutdown, or a bug that escaped the loop: either way nobody may wait forever.
            with self._lock:
                self._closed = True
            self._run_commands()
            try:
                self.core.finish_requests(list(self.core.scheduler.requests))  # frees their blocks
            except Exception:  # noqa: BLE001
                logger.exception("freeing the requests in flight failed")
            self._to_loop(self._fail_streams, "the engine stopped", True)
            try:
                self._take_snapshot()
            except Exception:  # noqa: BLE001
                logger.exception("final stats snapshot failed")
            shutdown = getattr(self.core, "shutdown", None)
            if shutdown is not None:
                shutdown()  # stops tensor-parallel workers

    def _engine_loop(self) -> None:
        core = self.core
        if hasattr(core, "arrivals"):  # urgent steps (engine/urgent_steps.py)
            core.arrivals = Arrivals(self._take_arrivals, self._emit, self._pending)
        trimmed = False  # the heap freed since the last step has been handed back
        last_trim = time.monotonic()
        idle = True  # no request since the last step (or ever): nobody waits while the engine waits
        while True:
            # Clear before draining: a command queued after the drain sets the event again, so the waits
            # below cannot sleep through it.
            self._wakeup.clear()
            self._run_commands()
            if self._closed:
                return
            if not core.has_unfinished_requests():
                self._take_snapshot()
                if not trimmed:
                    # Going idle: the steps' freed buffers (prefill activations, logits) leave the heap
                    # (about 12 MB after a 256-token prompt on the embedded model; 1-10 ms, only when idle).
                    release_free_memory()
                    trimmed, last_trim = True, time.monotonic()
                self._wakeup.wait()
                idle = True
                continue
            trimmed = False
            self._wait_for_admissions(ADMISSION_WAIT_S if idle else min(ADMISSION_WAIT_S, self._last_step_s))
            idle = False
            if self._closed:
                return
            self._busy_since = time.monotonic()
            try:
                outputs = core.step()
            except EngineDeadError as exc:
                # A tensor-parallel rank is gone: fail what is in flight with the reason, and stop (the
                # engine is no longer running, so /health turns unhealthy).
                logger.error("engine dead, stopping: %s", exc)
                self._to_loop(self._fail_streams, f"the engine died: {exc}", True)
                return
            except Exception as exc:  # noqa: BLE001 (a bug outside any one request: fail them, keep serving)
                logger.exception("engine step failed; failing every request in flight")
                core.finish_requests(list(core.scheduler.requests))
                self._to_loop(self._fail_streams, f"engine step failed: {describe_error(exc)}", False)
                continue
            finally:
                self._last_step_s = time.monotonic() - self._busy_since
                self._busy_since = None
            self._take_snapshot()
            if outputs:
                self._to_loop(self._process_outputs, outputs)
            else:
                # A prefill chunk yields nothing; this short wait only guards against a spinning empty plan.
                self._wakeup.wait(0.0005)
            if time.monotonic() - last_trim >= BUSY_TRIM_INTERVAL_S:
                release_free_memory()
                last_trim = time.monotonic()

    def _wait_for_admissions(self, budget_s: float) -> None:
        # Sleeps until no request is on its way in (tokenizing), for at most budget_s; adds those that arrive.
        deadline = time.monotonic() + budget_s
        while self._admitting > 0 and not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wakeup.wait(left)
            self._wakeup.clear()
            self._run_commands()

    def _queued(self) -> Iterator[_Queued]:
        # The commands queued so far, in order; clears the flag that says requests were added first.
        self._pending[0] = 0
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_commands(self) -> None:
        while self._deferred:
            self._run_queued(self._deferred.popleft())
        for queued in self._queued():
            self._run_queued(queued)

    def _take_arrivals(self) -> None:
        # Inside a step (EngineCore.arrivals): added requests enter the core now, other commands wait for the
        # step's end (a finish must not free blocks the step is writing).
        for queued in self._queued():
            if isinstance(queued.command, AddRequests):
                self._run_queued(queued)
            else:
                self._deferred.append(queued)

    def _emit(self, outputs: list) -> None:  # an urgent step's outputs, from inside a step
        self._to_loop(self._process_outputs, outputs)

    def _run_queued(self, queued: _Queued) -> None:
        if queued.reply is not None and not queued.reply.set_running_or_notify_cancel():
            return  # the caller went away (its add_requests aborts the ids)
        if queued.admission is not None:
            queued.admission.end()
        busy = self._busy_since  # inside a step: the step's start stays
        self._busy_since = busy or time.monotonic()
        try:
            answer = self._run_command(queued.command)
        except Exception as exc:  # noqa: BLE001 (the caller's error, or logged: the loop goes on)
            if queued.reply is None:
                logger.exception("engine command %s failed", type(queued.command).__name__)
            else:
                queued.reply.set_exception(exc)
        else:
            if queued.reply is not None:
                queued.reply.set_result(answer)
        finally:
            self._busy_since = busy

    def _run_command(self, command: EngineCommand) -> Any:
        core = self.core
        match command:
            case AddRequests(requests):
                core.add_requests(requests)
            case FinishRequests(req_ids, status):
                core.finish_requests(req_ids, status)
            case TakeKVSnapshot():
                stats = core.stats
                return capture_kv_state(core.scheduler), {
                    "time": time.time(), "num_steps": stats.num_steps,
                    "prompt_tokens_total": stats.num_prompt_tokens_total,
                    "generation_tokens_total": stats.num_generation_tokens_total,
                    "step_time_total_s": stats.step_time_total}
            case AddFinishedHook(hook):
                core.stats.on_finished.append(hook)
            case ClearWarmup():
                core.clear_warmup()
                self._take_snapshot()  # /metrics reads the snapshot
            case _:
                raise TypeError(f"not an engine command: {command!r}")
        return None

    def _take_snapshot(self) -> None:
        stats = self.core.stats
        self.snapshot = EngineSnapshot(self.core.scheduler.stats(), stats.num_prompt_tokens_total,
                                       stats.num_generation_tokens_total, dict(stats.finished_by_reason),
                                       stats.num_aborted, _copy_spec(stats.spec) if self.core.config.speculative is not None else None)


def _copy_spec(spec: SpecDecodingStats) -> SpecDecodingStats:
    return SpecDecodingStats(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                             list(spec.num_accepted_tokens_per_pos))
