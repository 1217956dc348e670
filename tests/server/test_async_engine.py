"""AsyncLLMEngine against a model-free fake engine: threading, aborts and failures, in milliseconds."""
from __future__ import annotations

import asyncio
import threading

import pytest

from pagedserve.engine.async_engine import AsyncLLMEngine, EngineClosedError, EngineError
from pagedserve.sampling_params import SamplingParams
from tests.server.fake_engine import FakeEngine


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


def test_heartbeat_reports_a_stuck_step():
    engine = FakeEngine()
    engine.step_gate = threading.Event()
    async_engine = AsyncLLMEngine(engine)
    try:
        assert async_engine.is_healthy(0.05)  # idle is healthy

        async def main():
            stream = await async_engine.add_request("r", "p", SamplingParams(max_tokens=2))
            await asyncio.sleep(0.2)  # the first step now waits on the gate
            stuck = async_engine.is_healthy(0.05), async_engine.is_healthy(60.0)
            engine.step_gate.set()
            outs = [o async for o in stream]
            return stuck, outs

        (stuck_short, stuck_long), outs = asyncio.run(asyncio.wait_for(main(), 10))
        assert (stuck_short, stuck_long) == (False, True)
        assert outs[-1].finished and async_engine.is_healthy(0.05)
    finally:
        engine.step_gate.set()
        async_engine.shutdown()
    assert not async_engine.is_healthy(60.0)  # a stopped engine is never healthy


def test_snapshot_counts_a_request_before_its_final_output_arrives():
    # /metrics reads the snapshot; a client that has its final output must find it counted. A slow stats read
    # widens the window in which dispatching first would show the old snapshot.
    engine = FakeEngine()
    engine.stats_delay_s = 0.05
    async_engine = AsyncLLMEngine(engine)
    try:
        async def main():
            seen = []
            for i in range(3):
                async for out in async_engine.generate("p", SamplingParams(max_tokens=2), f"r{i}"):
                    if out.finished:
                        seen.append(async_engine.snapshot.finished_by_reason.get("length", 0))
            return seen

        assert asyncio.run(asyncio.wait_for(main(), 10)) == [1, 2, 3]
    finally:
        async_engine.shutdown()
