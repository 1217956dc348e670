"""AsyncLLMEngine against a model-free fake engine: threading, aborts and failures, in milliseconds."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from pagedserve.core.scheduler_output import SchedulerStats
from pagedserve.engine.async_engine import AsyncLLMEngine, EngineClosedError, EngineError
from pagedserve.metrics.stats import EngineStats
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams


class FakeEngine:
    """One token per step per request; records which threads touch it."""

    def __init__(self, step_s: float = 0.002) -> None:
        self.model_name, self.max_model_len, self.num_kv_blocks = "fake", 128, 8
        self.config = SimpleNamespace(cache=SimpleNamespace(block_size=16))
        self.stats = EngineStats()
        self.requests: dict[str, tuple[SamplingParams, list[int]]] = {}
        self.aborted: list[str] = []
        self.threads: set[int] = set()
        self.fail_next_step = False
        self.step_s = step_s
        self.scheduler = SimpleNamespace(stats=self._sched_stats)

    def _touch(self) -> None:
        self.threads.add(threading.get_ident())

    def _sched_stats(self) -> SchedulerStats:
        self._touch()
        used = len(self.requests)
        return SchedulerStats(used, 0, used / self.num_kv_blocks, 0, 0, 0, self.num_kv_blocks - used,
                              self.num_kv_blocks)

    def add_request(self, request_id, prompt, params) -> None:
        self._touch()
        if prompt == "too long":
            raise ValueError("the prompt is too long")
        if request_id in self.requests:
            raise ValueError("duplicate id")
        self.requests[request_id] = (params, [])

    def abort_request(self, ids) -> None:
        self._touch()
        for rid in [ids] if isinstance(ids, str) else ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        self._touch()
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self._touch()
        time.sleep(self.step_s)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outs = []
        for rid, (params, tokens) in list(self.requests.items()):
            tokens.append(len(tokens))
            done = len(tokens) >= params.max_tokens
            text = "".join(f"t{t} " for t in tokens)
            comp = CompletionOutput(0, text, list(tokens), None, None, "length" if done else None)
            outs.append(RequestOutput(rid, None, [1], [comp], done))
            if done:
                del self.requests[rid]
        return outs


@pytest.fixture
def fake():
    engine = FakeEngine()
    async_engine = AsyncLLMEngine(engine)
    yield engine, async_engine
    async_engine.shutdown()


def test_generate_streams_cumulative_outputs_on_the_engine_thread(fake):
    engine, async_engine = fake

    async def main():
        async def one(i):
            outs = [o async for o in async_engine.generate("p", SamplingParams(max_tokens=5 + i), f"r{i}")]
            return outs
        return await asyncio.gather(*(one(i) for i in range(10)))

    results = asyncio.run(main())
    for i, outs in enumerate(results):
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == list(range(5 + i))
        assert all(not o.finished for o in outs[:-1])
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths)
    assert engine.threads == {async_engine._thread.ident}
    assert not engine.requests and not async_engine._streams


def test_add_error_reaches_the_caller_as_value_error(fake):
    engine, async_engine = fake

    async def main():
        with pytest.raises(ValueError, match="too long"):
            async for _ in async_engine.generate("too long", SamplingParams(), "bad"):
                pass
        # All-or-nothing: the first prompt of a failing batch is rolled back.
        with pytest.raises(ValueError):
            await async_engine.add_requests([("ok", "p", SamplingParams()), ("bad2", "too long", SamplingParams())])
        return [o async for o in async_engine.generate("p", SamplingParams(max_tokens=3), "good")]

    outs = asyncio.run(main())
    assert outs[-1].finished
    assert not engine.requests and "ok" in engine.aborted


def test_step_failure_fails_requests_and_the_loop_keeps_serving(fake):
    engine, async_engine = fake

    async def main():
        async def long(i):
            return [o async for o in async_engine.generate("p", SamplingParams(max_tokens=10_000), f"long{i}")]
        tasks = [asyncio.create_task(long(i)) for i in range(3)]
        await asyncio.sleep(0.05)
        engine.fail_next_step = True
        results = await asyncio.gather(*tasks, return_exceptions=True)
        after = [o async for o in async_engine.generate("p", SamplingParams(max_tokens=4), "after")]
        return results, after

    results, after = asyncio.run(asyncio.wait_for(main(), 10))
    assert all(isinstance(r, EngineError) and "boom" in str(r) for r in results)
    assert after[-1].finished
    assert not engine.requests  # the failed requests were aborted, freeing their blocks


def test_leaving_early_or_cancelling_aborts(fake):
    engine, async_engine = fake

    async def main():
        async for out in async_engine.generate("p", SamplingParams(max_tokens=10_000), "left"):
            if len(out.outputs[0].token_ids) >= 3:
                break

        async def consume():
            async for _ in async_engine.generate("p", SamplingParams(max_tokens=10_000), "cancelled"):
                pass
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if not engine.requests:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert not engine.requests
    assert {"left", "cancelled"} <= set(engine.aborted)
    assert async_engine.snapshot.scheduler.num_running == 0


def test_shutdown_fails_in_flight_and_refuses_new_work():
    engine = FakeEngine()
    async_engine = AsyncLLMEngine(engine)

    async def main():
        async def long():
            return [o async for o in async_engine.generate("p", SamplingParams(max_tokens=10_000), "x")]
        task = asyncio.create_task(long())
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)
        with pytest.raises(EngineClosedError):
            await task
        with pytest.raises(EngineClosedError):
            await async_engine.add_request("y", "p", SamplingParams())

    asyncio.run(main())
    assert not async_engine.is_running and not engine.requests


def test_from_factory_builds_and_steps_on_one_thread():
    # Loading and stepping on different threads costs ~2x decode speed on CPU (two OpenMP teams), so the
    # engine must be constructed on the thread that steps it.
    built_on: list[int] = []

    def factory():
        built_on.append(threading.get_ident())
        return FakeEngine()

    async_engine = AsyncLLMEngine.from_factory(factory)
    try:
        assert async_engine.model_name == "fake" and async_engine.block_size == 16

        async def main():
            return [o async for o in async_engine.generate("p", SamplingParams(max_tokens=3), "r")]

        assert asyncio.run(main())[-1].finished
        assert built_on == [async_engine._thread.ident] and async_engine.engine.threads == set(built_on)
    finally:
        async_engine.shutdown()


def test_from_factory_raises_the_construction_error():
    def factory():
        raise ValueError("model path /nope does not exist")

    with pytest.raises(ValueError, match="does not exist"):
        AsyncLLMEngine.from_factory(factory)
