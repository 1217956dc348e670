"""The grammar compile service's limits: a bounded cache (by memory), a fixed number of compile threads, and
queued compiles dropped once their request has timed out. A word-level tokenizer keeps compiles fast."""
from __future__ import annotations

import asyncio
import threading
import time

import psutil
import pytest

from pagedserve.config import StructuredOutputsConfig
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured_output.backend import NUM_COMPILE_THREADS, GrammarCompileService, grammar_spec
from tests.server.fake_engine import VOCAB, word_tokenizer


PROCESS_TIMEOUT_S = 3.0  # a compile process starts within it (the killed ones' successors)


def service(**config) -> GrammarCompileService:
    return GrammarCompileService(word_tokenizer(), len(VOCAB), [0], StructuredOutputsConfig(**config))


def choices(num: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(choice=[f"t{i}" for i in range(1, num + 1)])


def test_cache_is_bounded_by_memory():
    sizes = {}
    probe = service()
    for num in (10, 20, 30, 40):
        sizes[num] = probe.wait(probe.compile(choices(num))).memory_size_bytes
    limit = sizes[30] + sizes[40]  # holds the last two, not the last three
    svc = service(cache_memory_bytes=limit)
    futures = {num: svc.compile(choices(num)) for num in sizes}
    for num, fut in futures.items():
        svc.wait(fut)
        assert svc.num_cached_bytes() <= limit
    assert svc.num_cached_bytes() == limit
    assert svc.compile(choices(40)) is futures[40] and svc.compile(choices(30)) is futures[30]
    assert svc.compile(choices(10)) is not futures[10]  # evicted: compiled again
    probe.shutdown()
    svc.shutdown()


def test_a_grammar_larger_than_the_bound_stays_until_the_next():
    svc = service(cache_memory_bytes=1)  # every grammar is larger
    big = svc.compile(choices(40))
    grammar = svc.wait(big)
    assert svc.num_cached_bytes() == grammar.memory_size_bytes > 1
    assert svc.compile(choices(40)) is big  # sent again: not compiled again
    other = svc.compile(choices(10))
    svc.wait(other)
    assert svc.num_cached_bytes() == other.result().memory_size_bytes  # the big one is out
    again = svc.compile(choices(40))
    assert again is not big and svc.wait(again).memory_size_bytes == grammar.memory_size_bytes
    svc.shutdown()


def test_a_burst_of_compiles_takes_a_fixed_number_of_threads():
    def num_grammar_threads() -> int:
        return sum(t.name == "pagedserve-grammar" for t in threading.enumerate())

    svc = service()
    before = num_grammar_threads()
    futures = [svc.compile(StructuredOutputsParams(regex=f"t{i}+")) for i in range(40)]
    assert num_grammar_threads() - before <= NUM_COMPILE_THREADS
    for fut in futures:
        svc.wait(fut)
    svc.shutdown()


@pytest.mark.parametrize("compile_process", [True, False])
def test_a_queued_compile_is_dropped_when_its_request_times_out(compile_process):
    svc = service(compile_timeout_s=0.3, compile_process=compile_process)
    gate, compile_now = threading.Event(), svc._compile

    def held(spec, *args):  # the first compiles take both threads until the gate opens
        gate.wait(30)
        return compile_now(spec, *args)

    svc._compile = held
    busy = [svc.compile(choices(num)) for num in range(1, NUM_COMPILE_THREADS + 1)]
    queued = svc.compile(choices(50))
    with pytest.raises(ValueError, match="did not compile within"):
        svc.wait(queued)
    assert queued.cancelled()  # never started, and it holds no thread
    gate.set()
    for fut in busy:
        svc.wait(fut)
    again = svc.compile(choices(50))  # the spec is compiled afresh when sent again
    assert again is not queued and svc.wait(again) is not None
    svc.shutdown()


def test_without_processes_a_compile_past_its_timeout_frees_its_slot():
    svc = service(compile_timeout_s=0.3, compile_process=False)
    gate, compile_now = threading.Event(), svc._compile
    slow = {grammar_spec(choices(num)) for num in range(1, NUM_COMPILE_THREADS + 1)}

    def held(spec, *args):  # the slow compiles run until the gate opens, far past the timeout
        if spec in slow:
            gate.wait(30)
        return compile_now(spec, *args)

    svc._compile = held
    busy = [svc.compile(choices(num)) for num in range(1, NUM_COMPILE_THREADS + 1)]
    for fut in busy:
        with pytest.raises(ValueError, match="did not compile within"):
            svc.wait(fut)
    assert all(fut.running() for fut in busy)
    assert svc.wait(svc.compile(choices(50))) is not None  # compiled while the slow ones still run
    gate.set()
    assert all(fut.result(30) is not None for fut in busy)  # their results still reach the cache
    svc.shutdown()


def test_an_overrunning_compile_is_killed_with_its_process():
    # xgrammar cannot cancel a compile: each grammar thread compiles in a process, killed at the timeout. Two
    # pathological choice lists hold both slots; both are killed, and a small regex compiles right after.
    svc = service(compile_timeout_s=PROCESS_TIMEOUT_S)
    slow = [svc.compile(choices(200_000 + k)) for k in range(NUM_COMPILE_THREADS)]
    deadline = time.monotonic() + 60
    while len(svc.process_ids()) < NUM_COMPILE_THREADS and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = svc.process_ids()
    assert len(killed) == NUM_COMPILE_THREADS
    for fut in slow:
        with pytest.raises(ValueError, match="did not compile within"):
            svc.wait(fut)
    assert _gone(killed)
    regex = svc.compile(StructuredOutputsParams(regex="t1+"))
    assert svc.wait(regex).memory_size_bytes > 0
    assert svc.compile(StructuredOutputsParams(regex="t1+")) is regex  # cached
    with pytest.raises(ValueError, match="did not compile within"):  # the timed-out spec's error is cached
        svc.wait(svc.compile(choices(200_000)))
    alive = svc.process_ids()
    assert alive and not set(alive) & set(killed)
    svc.shutdown()
    assert _gone(alive)  # no process outlives the service


def _gone(pids: list[int]) -> bool:
    # Killed (a zombie until its thread reaps it, within moments), or reaped.
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 30
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(running(pid) for pid in pids)


@pytest.mark.parametrize("waiter", ["thread", "asyncio"])
def test_the_one_time_tokenizer_tables_do_not_count_against_the_timeout(waiter, monkeypatch):
    # On a busy machine the tables can take longer than the timeout; the first request must not get a 400.
    import xgrammar as xgr

    build = xgr.TokenizerInfo.from_huggingface

    def slow_build(*args, **kwargs):
        threading.Event().wait(2.0)
        return build(*args, **kwargs)

    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", slow_build)
    svc = service(compile_timeout_s=1.5)  # the compile itself (a process forked, 3 choices) well within it
    fut = svc.compile(choices(3))
    grammar = svc.wait(fut) if waiter == "thread" else asyncio.run(svc.wait_async(fut))
    assert grammar is not None and fut.result() is grammar
    svc.shutdown()


def test_compiles_go_on_after_the_zygote_dies():
    # The zygote (and with it every idle compile process) killed from outside: the next compile starts another
    # zygote instead of failing every later structured request.
    svc = service()
    assert svc.wait(svc.compile(StructuredOutputsParams(regex="t1+"))).memory_size_bytes > 0
    zygote = svc._compiler.result().zygote.proc
    idle = svc.process_ids()
    zygote.kill()
    zygote.wait()
    assert _gone(idle)  # the compile processes die with it
    grammar = svc.wait(svc.compile(StructuredOutputsParams(regex="t2+")))
    assert grammar.memory_size_bytes > 0
    assert svc._compiler.result().zygote.proc.pid != zygote.pid
    svc.shutdown()
