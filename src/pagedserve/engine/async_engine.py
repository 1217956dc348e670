"""LLMEngine behind one background thread, so asyncio code (the HTTP server) can add, stream and abort.

Thread confinement: the LLMEngine, its tokenizer included, is touched only by the engine thread. Other threads
submit commands (closures) to a queue that the engine thread runs between steps, and receive outputs through
per-stream asyncio queues fed with call_soon_threadsafe.

    event loop thread                         engine thread
    add_requests() --command--> queue ----->  run commands, step(), step(), ...
    async for out in stream  <--call_soon_threadsafe--  dispatch outputs
    stream.close() --abort command--> queue   (idle: sleep on an Event until a command arrives)
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar

from pagedserve.core.scheduler_output import SchedulerStats
from pagedserve.engine.processor import PromptInput
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
# A callable prompt is rendered on the engine thread (chat templates and encoding need the tokenizer).
Prompt = PromptInput | Callable[[Any], PromptInput]


class EngineError(RuntimeError):
    """A request failed inside the engine (a step raised); the engine itself keeps serving."""


class EngineClosedError(RuntimeError):
    """The engine was shut down."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    # Taken by the engine thread after each step or command batch, so exporters never read live engine state.
    scheduler: SchedulerStats | None
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    finished_by_reason: dict[str, int]
    num_aborted: int


@dataclass(slots=True)
class _Failure:
    request_id: str
    error: BaseException


@dataclass(slots=True, eq=False)
class OutputStream:
    """Cumulative RequestOutputs of one or more requests added together (a completion with several prompts).

    Outputs are cumulative, so when the consumer falls behind only the newest output per request is kept.
    Leaving the iteration early (break, cancellation, client disconnect) or close() aborts what is unfinished.
    """
    owner: AsyncLLMEngine
    request_ids: list[str]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.unfinished = set(self.request_ids)

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def _put(self, item: RequestOutput | _Failure) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody will read this request
            self.owner.abort(item.request_id)

    def close(self) -> None:
        if self.unfinished:
            self.owner.abort(sorted(self.unfinished))
            self.unfinished.clear()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while self.unfinished:
                items = [await self.queue.get()]
                while not self.queue.empty():
                    items.append(self.queue.get_nowait())
                latest: dict[str, RequestOutput] = {}
                for item in items:
                    if isinstance(item, _Failure):
                        self.unfinished.discard(item.request_id)  # the engine already dropped it
                        raise item.error
                    latest[item.request_id] = item
                for out in latest.values():
                    if out.finished:
                        self.unfinished.discard(out.request_id)
                    yield out
        finally:
            self.close()


class AsyncLLMEngine:
    def __init__(self, engine: Any = None, start: bool = True, *, factory: Callable[[], Any] | None = None) -> None:
        # Either a built engine, or a factory that builds it on the engine thread (see from_config).
        if (engine is None) == (factory is None):
            raise ValueError("pass exactly one of engine and factory")
        self._factory = factory
        self.engine = engine
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        if self.engine is not None:
            self._set_facts()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # orders _closed against command submission
        self._closed = False
        self._streams: dict[str, OutputStream] = {}  # engine thread only
        # Heartbeat: when the engine thread entered its current step or command batch; None while idle.
        self._busy_since: float | None = None
        self.snapshot: EngineSnapshot = EngineSnapshot(None, 0, 0, {}, 0)
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
        from pagedserve.engine.llm_engine import LLMEngine

        return cls.from_factory(lambda: LLMEngine(config))

    @classmethod
    def from_factory(cls, factory: Callable[[], Any]) -> AsyncLLMEngine:
        # Builds the engine on the engine thread and waits for it; a construction error is raised here.
        async_engine = cls(factory=factory)
        async_engine._ready.wait()
        if async_engine._init_error is not None:
            raise async_engine._init_error
        return async_engine

    def _set_facts(self) -> None:
        # Facts fixed at load time, safe to read from any thread.
        engine = self.engine
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.num_kv_blocks: int = engine.num_kv_blocks
        self.block_size: int = engine.config.cache.block_size

    # ---- any thread -------------------------------------------------------------------------------------

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def is_healthy(self, max_stall_s: float) -> bool:
        # False once the engine thread is gone, or stuck in one step or command batch for over max_stall_s.
        busy_since = self._busy_since
        return self.is_running and (busy_since is None or time.monotonic() - busy_since <= max_stall_s)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        with self._lock:
            self._closed = True
        self._wakeup.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def abort(self, request_ids: str | Sequence[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        try:
            self._submit(lambda: self._abort(ids))
        except EngineClosedError:
            pass  # shutdown fails every stream anyway

    def add_finished_callback(self, fn: Callable[[Any], None]) -> None:
        # Registered through the queue so the engine's callback list changes only on its own thread; fn is
        # called there with each finished sequence's RequestStats.
        self._submit(lambda: self.engine.stats.on_finished.append(fn))

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run fn(engine) on the engine thread between steps and return its result (or raise its error)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(self.engine))
            except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                fut.set_exception(exc)

        self._submit(command)
        return await asyncio.wrap_future(fut)

    async def add_requests(self, requests: Sequence[tuple[str, Prompt, SamplingParams]]) -> OutputStream:
        """Add all requests or none; a ValueError from validation (prompt too long, ...) reaches the caller."""
        stream = OutputStream(self, [rid for rid, _, _ in requests], asyncio.get_running_loop())

        def add(engine: Any) -> None:
            added: list[str] = []
            try:
                for rid, prompt, params in requests:
                    engine.add_request(rid, prompt(engine) if callable(prompt) else prompt, params)
                    added.append(rid)
            except BaseException:
                engine.abort_request(added)
                raise
            for rid in added:
                self._streams[rid] = stream

        try:
            await self.call(add)
        except asyncio.CancelledError:
            stream.close()  # the add may still run after we are gone; this abort is queued behind it
            raise
        except BaseException:
            stream.unfinished.clear()
            raise
        return stream

    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> OutputStream:
        return await self.add_requests([(request_id, prompt, params)])

    async def generate(self, prompt: Prompt, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _submit(self, command: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is shut down")
            self._commands.put(command)
        self._wakeup.set()

    # ---- engine thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        if self._factory is not None:
            try:
                self.engine = self._factory()
                self._set_facts()
            except BaseException as exc:  # noqa: BLE001 (raised by from_config on the caller's thread)
                self._init_error = exc
                with self._lock:
                    self._closed = True
                return
            finally:
                self._ready.set()
        try:
            self._loop()
        finally:
            # Normal shutdown, or a bug that escaped the loop: either way nobody may wait forever.
            with self._lock:
                self._closed = True
            self._run_commands()
            self._fail_all("the engine stopped", closed=True)
            try:
                self._take_snapshot()
            except Exception:  # noqa: BLE001
                logger.exception("final stats snapshot failed")

    def _loop(self) -> None:
        engine = self.engine
        while True:
            # Clear before draining: a command queued after the drain sets the event again, so the waits
            # below cannot sleep through it.
            self._wakeup.clear()
            self._busy_since = time.monotonic()
            self._run_commands()
            self._busy_since = None
            if self._closed:
                return
            if not engine.has_unfinished_requests():
                self._take_snapshot()
                self._wakeup.wait()
                continue
            try:
                self._busy_since = time.monotonic()
                outputs = engine.step()
                # Snapshot first: a client that has its final output and then scrapes /metrics finds it counted.
                self._take_snapshot()
                self._dispatch(outputs)
            except Exception as exc:  # noqa: BLE001 (fail the requests, keep serving)
                logger.exception("engine step failed; failing %d in-flight requests", len(self._streams))
                self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                continue
            finally:
                self._busy_since = None
            if not outputs:
                # A prefill chunk yields nothing; this short wait only guards against a spinning empty plan.
                self._wakeup.wait(0.0005)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:  # noqa: BLE001 (a broken command must not kill the loop)
                logger.exception("engine command failed")

    def _abort(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)
        for rid in request_ids:
            self._streams.pop(rid, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream._put(out)

    def _fail_all(self, message: str, closed: bool = False) -> None:
        streams, self._streams = self._streams, {}
        try:
            self.engine.abort_request(list(streams))  # frees their blocks; every request has a stream
        except Exception:  # noqa: BLE001
            logger.exception("aborting after a failure failed")
        for rid, stream in streams.items():
            error = EngineClosedError(message) if closed else EngineError(message)
            stream._put(_Failure(rid, error))

    def _take_snapshot(self) -> None:
        engine = self.engine
        stats = engine.stats
        self.snapshot = EngineSnapshot(engine.scheduler.stats(), stats.num_prompt_tokens_total,
                                       stats.num_generation_tokens_total, dict(stats.finished_by_reason),
                                       stats.num_aborted)
