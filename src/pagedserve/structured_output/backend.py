"""Grammar compilation with xgrammar, off the engine thread: spec -> CompiledGrammar, cached, with a timeout.

    front-end thread                      grammar thread(s)                 engine thread
    compile(params) -> Future  ------->   xgrammar compile (GIL released)
    wait / wait_async (timeout) <-------  CompiledGrammar
    EngineCoreRequest(grammar=...) ------------------------------------->  matcher per sequence (manager.py)

Compiles wait in one queue for NUM_COMPILE_THREADS grammar threads (a burst of 1,000 schemas makes no more
threads). A compile still queued when its request times out is dropped. xgrammar cannot cancel a running
compile, so each grammar thread compiles in a process of its own (compile_worker.py: forked from a zygote that
holds the tokenizer tables; StructuredOutputsConfig.compile_process): a compile past the timeout is killed with
its process, its slot free at once, and the thread's next compile forks a new one. The timed-out spec stays
cached with its error until evicted, so sending it again costs nothing. Without the processes (compile_process False) a
compile past the timeout fails its request and gives its slot to a new thread (up to MAX_OVERRUNNING_COMPILES
such), but runs on to its end on its own thread.
The cache holds at most cache_size grammars and cache_memory_bytes of their memory, least recently used out
(the most recent one stays even when larger than that).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import re
import threading
from dataclasses import dataclass
from typing import Any

from pagedserve.config import StructuredOutputsConfig
from pagedserve.niceness import yield_cpu_to_the_engine
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.structured_output.compile_worker import (CompileProcess, CompileProcessGone, CompileTimeout, CompileZygote,
                                                         compile_spec)
from pagedserve.structured_output.schema import check_schema, load_schema

NUM_COMPILE_THREADS = 2
# A compile past its timeout cannot be stopped, but it gives up its slot: a new thread takes the queue while it
# runs on, up to this many such overrunning compiles at once (beyond that they keep their slots).
MAX_OVERRUNNING_COMPILES = 4
# xgrammar prefixes its errors with a timestamp and a C++ source location; the user needs only the message.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@dataclass(frozen=True, slots=True)
class _Tables:
    # The one-time build: xgrammar's tokenizer tables, and the compiler (threads) or the compile processes' zygote.
    info: Any
    compiler: Any
    zygote: CompileZygote | None


@dataclass(slots=True)
class _Slot:
    process: CompileProcess | None = None  # a grammar thread's compile process, started with its first compile


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: str  # "json", "json_object", "regex", "grammar" (EBNF); a choice list becomes a "grammar"
    text: str  # the schema as canonical JSON text, the regex or the EBNF


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """The cache key of params' grammar; a schema that is not JSON raises ValueError here."""
    if params.json is not None:
        # Key order is kept: the properties' order is the order the model writes them in. The schema is
        # checked on the grammar thread, under the compile timeout: checking a huge schema takes seconds.
        schema = load_schema(params.json)
        return GrammarSpec("json", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
    if params.json_object:
        return GrammarSpec("json_object", "")
    if params.regex is not None:
        return GrammarSpec("regex", params.regex)
    if params.choice is not None:
        # An EBNF alternation of JSON-escaped string literals: exactly one of the choices, nothing else.
        return GrammarSpec("grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                               for c in params.choice))
    return GrammarSpec("grammar", params.grammar or "")


class GrammarCompileService:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int] | tuple[int, ...],
                 config: StructuredOutputsConfig | None = None) -> None:
        self.config = config or StructuredOutputsConfig()
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        # The compiler, built on first use by its own thread: its tokenizer tables take about a second, more on
        # a busy machine, and that one-time build does not count against a request's compile timeout.
        self._compiler: concurrent.futures.Future | None = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[GrammarSpec, concurrent.futures.Future] = collections.OrderedDict()
        self._cached_bytes: dict[GrammarSpec, int] = {}  # of the compiled grammars in _cache
        # Daemon threads, not a ThreadPoolExecutor: the interpreter joins executor threads at exit, so a
        # runaway compile would hold up the server's shutdown.
        self._queue: collections.deque[tuple[GrammarSpec, concurrent.futures.Future]] = collections.deque()
        self._queued = threading.Condition(self._lock)
        self._num_threads = 0  # threads taking compiles from the queue: at most NUM_COMPILE_THREADS
        self._overrunning: set[concurrent.futures.Future] = set()  # past the timeout, their threads given up
        self._processes: dict[concurrent.futures.Future, CompileProcess] = {}  # compiles running in a process
        self._idle_processes: set[CompileProcess] = set()  # the grammar threads' processes between compiles
        self._closed = False

    @property
    def timeout_s(self) -> float:
        return self.config.compile_timeout_s

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """Starts (or joins) the compile of params' grammar; its errors (ValueError) come from the future."""
        spec = grammar_spec(params)
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                return fut
            fut = concurrent.futures.Future()
            if self._closed:
                fut.cancel()
                return fut
            if self._compiler is None:
                self._compiler = concurrent.futures.Future()
                threading.Thread(target=self._build_compiler, name="pagedserve-grammar-tables", daemon=True).start()
            self._queue.append((spec, fut))
            self._start_thread()
            self._queued.notify()
            if self.config.cache_size:
                self._cache[spec] = fut
                self._evict()
        return fut

    def wait(self, fut: concurrent.futures.Future) -> Any:
        if self._compiler is not None:
            self._compiler.exception()  # the one-time tables first, untimed (a failure reaches fut too)
        try:
            return fut.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(self._timed_out(fut)) from None
        except concurrent.futures.CancelledError:  # another waiter timed out while it was queued
            raise ValueError(self._timeout_message()) from None

    async def wait_async(self, fut: concurrent.futures.Future) -> Any:
        # shield: a cancelled waiter must not cancel the compile others may share.
        if self._compiler is not None:
            await asyncio.shield(asyncio.wrap_future(self._compiler))  # the one-time tables first, untimed
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout_s)
        except asyncio.TimeoutError:
            raise ValueError(self._timed_out(fut)) from None
        except asyncio.CancelledError:
            if not fut.cancelled():
                raise  # the waiter itself was cancelled
            raise ValueError(self._timeout_message()) from None

    def _start_thread(self) -> None:  # under _lock
        if self._num_threads < NUM_COMPILE_THREADS:
            self._num_threads += 1
            threading.Thread(target=self._run, name="pagedserve-grammar", daemon=True).start()

    def _timed_out(self, fut: concurrent.futures.Future) -> str:
        # A compile that has not started yet is dropped, and forgotten so that the spec may be sent again.
        # A running one frees its slot for the queue (see MAX_OVERRUNNING_COMPILES).
        with self._lock:
            if fut.cancel():
                for spec, cached in list(self._cache.items()):
                    if cached is fut:
                        del self._cache[spec]
            elif fut in self._processes:
                self._processes[fut].stop()  # its grammar thread sees it die and takes the queue on
            elif (not self.config.compile_process and fut.running() and fut not in self._overrunning
                  and len(self._overrunning) < MAX_OVERRUNNING_COMPILES):
                self._overrunning.add(fut)
                self._num_threads -= 1
                if self._queue:
                    self._start_thread()
        return self._timeout_message()

    def _evict(self) -> None:  # under _lock
        # The most recently used grammar stays even past the memory bound, so that a grammar larger than the
        # whole bound, sent again and again, is not compiled every time.
        while len(self._cache) > 1 and (len(self._cache) > self.config.cache_size
                                        or sum(self._cached_bytes.values()) > self.config.cache_memory_bytes):
            spec, _ = self._cache.popitem(last=False)
            self._cached_bytes.pop(spec, None)

    def num_cached_bytes(self) -> int:
        with self._lock:
            return sum(self._cached_bytes.values())

    def _timeout_message(self) -> str:
        return (f"the grammar did not compile within {self.timeout_s:g}s "
                "(--structured-outputs-compile-timeout); simplify the schema")

    def _build_compiler(self) -> None:
        yield_cpu_to_the_engine()
        try:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                      stop_token_ids=self._eos)
            if self.config.compile_process:  # the tables travel to the compile processes' zygote as JSON
                zygote = CompileZygote(info.serialize_json())
                with self._lock:
                    if self._closed:  # shut down while the tables were built
                        zygote.close()
                self._compiler.set_result(_Tables(info, None, zygote))
            else:
                self._compiler.set_result(_Tables(info, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False),
                                                  None))
        except BaseException as exc:  # noqa: BLE001 (every compile reports it)
            self._compiler.set_exception(exc)

    def _run(self) -> None:
        yield_cpu_to_the_engine()  # compiles run on the cycles the engine leaves, like the tokenizer thread
        slot = _Slot()
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._queued.wait()
                if self._closed:
                    self._num_threads -= 1
                    self._idle_processes.discard(slot.process)
                    if slot.process is not None:
                        slot.process.stop()
                    return
                spec, fut = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue  # its requests timed out while it waited
            try:
                grammar = self._compile(spec, fut, slot)
                num_bytes = int(grammar.memory_size_bytes)  # xgrammar's estimate, a property
            except BaseException as exc:  # noqa: BLE001 (delivered to every waiter)
                grammar, num_bytes = exc, 0
            with self._lock:
                if self._cache.get(spec) is fut and not isinstance(grammar, BaseException):
                    self._cached_bytes[spec] = num_bytes
                    self._evict()
                overran = fut in self._overrunning
                self._overrunning.discard(fut)
            if isinstance(grammar, BaseException):
                fut.set_exception(grammar)
            else:
                fut.set_result(grammar)
            if overran:
                return  # its slot went to another thread when it passed the timeout

    def _compile(self, spec: GrammarSpec, fut: concurrent.futures.Future, slot: _Slot) -> Any:
        tables = self._compiler.result()
        if spec.kind == "json":
            check_schema(json.loads(spec.text), spec.text, self.timeout_s)
        try:
            if tables.compiler is not None:
                return compile_spec(tables.compiler, spec.kind, spec.text)
            return self._compile_in_process(spec, fut, slot, tables)
        except RuntimeError as e:
            what = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex"}.get(spec.kind, "grammar")
            raise ValueError(f"the {what} cannot be compiled: {_CPP_PREFIX.sub('', str(e)).strip()}") from None

    def _compile_in_process(self, spec: GrammarSpec, fut: concurrent.futures.Future, slot: _Slot,
                            tables: _Tables) -> Any:
        import xgrammar as xgr

        if slot.process is None:
            slot.process = tables.zygote.new_process()
        with self._lock:
            self._idle_processes.discard(slot.process)
            self._processes[fut] = slot.process
        try:
            try:
                text = slot.process.compile(spec.kind, spec.text, self.timeout_s)
            except CompileProcessGone:  # it died idle (with its zygote): the compile never started, so once more
                slot.process = tables.zygote.new_process()
                with self._lock:
                    self._processes[fut] = slot.process
                text = slot.process.compile(spec.kind, spec.text, self.timeout_s)
        except (CompileTimeout, CompileProcessGone, ValueError) as exc:  # killed (timeout, a waiter) or died
            slot.process = None
            raise ValueError(self._timeout_message() if isinstance(exc, CompileTimeout) else str(exc)) from None
        finally:
            with self._lock:
                del self._processes[fut]
                if slot.process is not None:
                    self._idle_processes.add(slot.process)
        return xgr.CompiledGrammar.deserialize_json(text, tables.info)

    def process_ids(self) -> list[int]:
        """The compile processes' pids."""
        with self._lock:
            return [p.pid for p in (*self._processes.values(), *self._idle_processes)]

    def shutdown(self) -> None:
        # Compiles not started yet are cancelled; the compile processes are killed (a running compile then
        # fails); a compile running on a thread (compile_process False) is left to it.
        with self._lock:
            self._closed = True
            for _, fut in self._queue:
                fut.cancel()
            self._queue.clear()
            self._queued.notify_all()
            processes = [*self._processes.values(), *self._idle_processes]
        for process in processes:
            process.stop()
        tables = self._compiler
        if tables is not None and tables.done() and tables.exception() is None and tables.result().zygote is not None:
            tables.result().zygote.close()


def check_first_token(grammar: Any, params: SamplingParams) -> None:
    """ValueError when no first token satisfies both the grammar and params (nothing could be sampled).

    Without this the step would sample from all -inf logits and the grammar would reject what came out.
    Runs on the event loop, so no torch op here touches the vocabulary: one over 32,768 elements or more runs a
    parallel region, which starts an OpenMP team on this thread (libgomp keeps it while the thread lives); libgomp
    then manages more threads than there are CPUs and throttles the spin-wait of every team, the engine's
    included, so each parallel region of every later step paid a futex wake-up (single-stream decode over HTTP
    slower after the first structured request, or after the start-up warm-up's schema request). The bitmask,
    ceil(vocab / 32) words, stays below that size; numpy unpacks it.
    """
    import numpy as np
    import xgrammar as xgr

    info = grammar.tokenizer_info
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    xgr.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask)
    # Bit t % 32 of word t // 32 allows token t (int32 words, little-endian).
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:info.vocab_size].astype(bool)
    allowed[list(info.stop_token_ids)] = False
    if not allowed.any():
        raise ValueError("the structured output constraint matches no text (or only the empty text)")
    so = params.structured_outputs
    if so is not None and so.choice is not None and params.min_tokens > max(len(c.encode()) for c in so.choice):
        # A token covers at least one byte, so no choice can be written in min_tokens tokens.
        raise ValueError(f"min_tokens ({params.min_tokens}) is more tokens than any of the choices can take")
    if params.allowed_token_ids is not None and not allowed[params.allowed_token_ids].any():
        raise ValueError("none of allowed_token_ids can begin text that the structured output constraint accepts")
