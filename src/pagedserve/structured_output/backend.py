"""Grammar compilation with xgrammar, off the engine thread: spec -> CompiledGrammar, cached, with a timeout.

    front-end thread                      grammar thread(s)                 engine thread
    compile(params) -> Future  ------->   xgrammar compile (GIL released)
    wait / wait_async (timeout) <-------  CompiledGrammar
    EngineCoreRequest(grammar=...) ------------------------------------->  matcher per sequence (manager.py)

xgrammar cannot cancel a compile: one that runs past the timeout fails its request at once but finishes (or
not) on its grammar thread. Its future stays cached, so the same spec sent again waits on that compile
instead of starting another one.
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
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured_output.schema import check_schema, load_schema

NUM_COMPILE_THREADS = 2
# xgrammar prefixes its errors with a timestamp and a C++ source location; the user needs only the message.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


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
        self._compiler: Any = None  # built on first use: the tokenizer info takes about a second
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[GrammarSpec, concurrent.futures.Future] = collections.OrderedDict()
        # Daemon threads, not a ThreadPoolExecutor: the interpreter joins executor threads at exit, so a
        # runaway compile would hold up the server's shutdown. At most NUM_COMPILE_THREADS compile at once.
        self._slots = threading.BoundedSemaphore(NUM_COMPILE_THREADS)
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
            threading.Thread(target=self._run, args=(spec, fut), name="pagedserve-grammar", daemon=True).start()
            if self.config.cache_size:
                self._cache[spec] = fut
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
        return fut

    def wait(self, fut: concurrent.futures.Future) -> Any:
        try:
            return fut.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(self._timeout_message()) from None

    async def wait_async(self, fut: concurrent.futures.Future) -> Any:
        # shield: a timed-out or cancelled waiter must not cancel the compile others may share.
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout_s)
        except asyncio.TimeoutError:
            raise ValueError(self._timeout_message()) from None

    def _timeout_message(self) -> str:
        return (f"the grammar did not compile within {self.timeout_s:g}s "
                "(--structured-outputs-compile-timeout); simplify the schema")

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._eos)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _run(self, spec: GrammarSpec, fut: concurrent.futures.Future) -> None:
        _low_priority()
        with self._slots:
            if self._closed or not fut.set_running_or_notify_cancel():
                fut.cancel()
                return
            try:
                fut.set_result(self._compile(spec))
            except BaseException as exc:  # noqa: BLE001 (delivered to every waiter)
                fut.set_exception(exc)

    def _compile(self, spec: GrammarSpec) -> Any:
        compiler = self._get_compiler()
        try:
            if spec.kind == "json":
                check_schema(json.loads(spec.text), spec.text, self.timeout_s)
                # Compact separators, no free whitespace: a small model left free whitespace can pad forever.
                return compiler.compile_json_schema(spec.text, any_whitespace=False, strict_mode=True)
            if spec.kind == "json_object":
                # Any object (OpenAI's json_object), not any JSON value; properties are free.
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            return compiler.compile_grammar(spec.text)
        except RuntimeError as e:
            what = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex"}.get(spec.kind, "grammar")
            raise ValueError(f"the {what} cannot be compiled: {_CPP_PREFIX.sub('', str(e)).strip()}") from None

    def shutdown(self) -> None:
        self._closed = True  # compiles not started yet are cancelled; a running one is left to its thread


def _low_priority() -> None:
    # Compiles run on the cycles the engine leaves, like the tokenizer thread.
    from pagedserve.engine.async_engine import _yield_cpu_to_the_engine

    _yield_cpu_to_the_engine()
