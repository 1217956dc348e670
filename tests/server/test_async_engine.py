"""AsyncLLMEngine against a model-free fake core: threading, aborts, failures and memory, in milliseconds."""
from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.processor import ChatPrompt
from pagedserve.messages import EngineClosedError, EngineError
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from tests.server.fake_engine import PROMPT, TOO_LONG, FakeCore


@pytest.fixture
def fake():
    engine = FakeCore()
    async_engine = AsyncLLMEngine(engine)
    yield engine, async_engine
    async_engine.shutdown()


def test_generate_streams_cumulative_outputs_on_the_engine_thread(fake):
    engine, async_engine = fake

    async def main():
        async def one(i):
            outs = [o async for o in async_engine.generate(PROMPT, SamplingParams(max_tokens=5 + i), f"r{i}")]
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
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in async_engine.generate(TOO_LONG, SamplingParams(), "bad"):
                pass
        # All-or-nothing: the first prompt of a failing batch is rolled back.
        with pytest.raises(ValueError):
            await async_engine.add_requests([("ok", PROMPT, SamplingParams()), ("bad2", TOO_LONG, SamplingParams())])
        return [o async for o in async_engine.generate(PROMPT, SamplingParams(max_tokens=3), "good")]

    outs = asyncio.run(main())
    assert outs[-1].finished
    # Validation runs before anything reaches the core: the batch's valid first prompt never got there.
    assert not engine.requests and "ok" not in engine.aborted and not async_engine._streams


def test_step_failure_fails_requests_and_the_loop_keeps_serving(fake):
    engine, async_engine = fake

    async def main():
        async def long(i):
            return [o async for o in async_engine.generate(PROMPT, SamplingParams(max_tokens=10_000), f"long{i}")]
        tasks = [asyncio.create_task(long(i)) for i in range(3)]
        await asyncio.sleep(0.05)
        engine.fail_next_step = True
        results = await asyncio.gather(*tasks, return_exceptions=True)
        after = [o async for o in async_engine.generate(PROMPT, SamplingParams(max_tokens=4), "after")]
        return results, after

    results, after = asyncio.run(asyncio.wait_for(main(), 10))
    assert all(isinstance(r, EngineError) and "boom" in str(r) for r in results)
    assert after[-1].finished
    assert not engine.requests  # the failed requests were aborted, freeing their blocks


def test_leaving_early_or_cancelling_aborts(fake):
    engine, async_engine = fake

    async def main():
        async for out in async_engine.generate(PROMPT, SamplingParams(max_tokens=10_000), "left"):
            if len(out.outputs[0].token_ids) >= 3:
                break

        async def consume():
            async for _ in async_engine.generate(PROMPT, SamplingParams(max_tokens=10_000), "cancelled"):
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


def test_requests_added_during_a_step_enter_it_and_other_commands_wait_for_its_end(fake):
    # Urgent steps (engine/urgent_steps.py): between the layers of a step the core takes the added requests (an urgent
    # one may run there), while a finish queued before them waits for the step's end: it must not free blocks
    # the step is writing.
    engine, async_engine = fake
    engine.step_gate = threading.Event()
    engine.take_mid_step = True

    async def main():
        await async_engine.add_request("a", PROMPT, SamplingParams(max_tokens=10_000))
        while not engine.entered.wait(0):  # the engine thread is inside a step, at the gate
            await asyncio.sleep(0.005)
        async_engine.abort("a")
        add_b = asyncio.create_task(async_engine.add_request("b", PROMPT, SamplingParams(max_tokens=1)))
        while async_engine._commands.qsize() < 2:  # the finish, then the add
            await asyncio.sleep(0.005)
        assert async_engine._pending[0] == 1  # the flag the model reads between its layers
        engine.step_gate.set()
        outs = [o async for o in await add_b]
        return outs

    outs = asyncio.run(main())
    assert engine.mid_step_requests == {"a", "b"}  # b entered the step in flight; a's finish had to wait
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [0]
    assert "a" in engine.aborted and not engine.requests and async_engine._pending[0] == 0


def test_shutdown_fails_in_flight_and_refuses_new_work():
    engine = FakeCore()
    async_engine = AsyncLLMEngine(engine)

    async def main():
        async def long():
            return [o async for o in async_engine.generate(PROMPT, SamplingParams(max_tokens=10_000), "x")]
        task = asyncio.create_task(long())
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)
        with pytest.raises(EngineClosedError):
            await task
        with pytest.raises(EngineClosedError):
            await async_engine.add_request("y", PROMPT, SamplingParams())

    asyncio.run(main())
    assert not async_engine.is_running and not engine.requests


def test_from_factory_builds_and_steps_on_one_thread():
    # Loading and stepping on different threads costs ~2x decode speed on CPU (two OpenMP teams), so the
    # engine must be constructed on the thread that steps it.
    built_on: list[int] = []

    def factory():
        built_on.append(threading.get_ident())
        return FakeCore()

    async_engine = AsyncLLMEngine.from_factory(factory)
    try:
        assert async_engine.model_name == "fake" and async_engine.block_size == 16

        async def main():
            return [o async for o in async_engine.generate(PROMPT, SamplingParams(max_tokens=3), "r")]

        assert asyncio.run(main())[-1].finished
        assert built_on == [async_engine._thread.ident] and async_engine.core.threads == set(built_on)
    finally:
        async_engine.shutdown()


def test_from_factory_raises_the_construction_error():
    def factory():
        raise ValueError("model path /nope does not exist")

    with pytest.raises(ValueError, match="does not exist"):
        AsyncLLMEngine.from_factory(factory)


def test_core_never_sees_text_and_prompts_are_tokenized_off_the_engine_thread(fake):
    engine, async_engine = fake

    async def main():
        return [o async for o in async_engine.generate("t5 t6 t7", SamplingParams(max_tokens=3), "r")]

    outs = asyncio.run(main())
    assert outs[-1].prompt_token_ids == [5, 6, 7] and outs[-1].outputs[0].text.split() == ["t0", "t1", "t2"]
    assert engine.threads == {async_engine._thread.ident}


def test_a_request_failing_inside_a_step_fails_alone(fake):
    engine, async_engine = fake

    async def main():
        async def run(rid):
            return [o async for o in async_engine.generate(PROMPT, SamplingParams(max_tokens=20), rid)]
        tasks = [asyncio.create_task(run(f"r{i}")) for i in range(4)]
        await asyncio.sleep(0.01)
        engine.poisoned.add("r2")
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(main(), 10))
    assert isinstance(results[2], EngineError) and "poisoned row" in str(results[2])
    for i in (0, 1, 3):
        assert results[i][-1].finished and results[i][-1].outputs[0].token_ids == list(range(20))


def test_delta_outputs_of_a_stalled_reader_merge_into_one(fake):
    # A client that stops reading holds one pending output, whose text and tokens are the concatenation.
    engine, async_engine = fake
    params = SamplingParams(max_tokens=50, output_kind=RequestOutputKind.DELTA)

    async def main():
        stream = await async_engine.add_request("r", PROMPT, params)
        reader = stream.__aiter__()
        first = await reader.__anext__()  # one output read, then the reader stalls
        while stream.unfinished and not any(o.finished for o in stream.pending.values()):
            await asyncio.sleep(0.01)
        assert len(stream.pending) == 1
        rest = [o async for o in reader]
        return first, rest

    first, rest = asyncio.run(asyncio.wait_for(main(), 10))
    assert len(rest) == 1 and rest[0].finished
    tokens = first.outputs[0].token_ids + rest[0].outputs[0].token_ids
    assert tokens == list(range(50))
    assert (first.outputs[0].text + rest[0].outputs[0].text).split() == [f"t{i}" for i in range(50)]


def test_health_follows_the_step_heartbeat(fake):
    engine, async_engine = fake

    async def main():
        engine.step_gate = threading.Event()  # the next step hangs
        task = asyncio.create_task(async_engine.add_request("r", PROMPT, SamplingParams(max_tokens=3)))
        stream = await task
        await asyncio.sleep(0.3)
        stuck = async_engine.is_healthy(max_stall_s=0.1)
        engine.step_gate.set()
        outs = [o async for o in stream]
        return stuck, outs

    stuck, outs = asyncio.run(asyncio.wait_for(main(), 10))
    assert not stuck and outs[-1].finished
    assert async_engine.is_healthy(max_stall_s=0.1)


def test_snapshot_counts_a_request_before_its_final_output_arrives():
    # /metrics reads the snapshot; a client that has its final output must find it counted. A slow stats read
    # widens the window in which handing outputs over first would show the old snapshot.
    engine = FakeCore()
    engine.stats_delay_s = 0.05
    async_engine = AsyncLLMEngine(engine)
    try:
        async def main():
            seen = []
            for i in range(3):
                async for out in async_engine.generate(PROMPT, SamplingParams(max_tokens=2), f"r{i}"):
                    if out.finished:
                        seen.append(async_engine.snapshot.finished_by_reason.get("length", 0))
            return seen

        assert asyncio.run(asyncio.wait_for(main(), 10)) == [1, 2, 3]
    finally:
        async_engine.shutdown()


def test_a_huge_prompt_is_refused_before_tokenizing(fake, monkeypatch):
    # Every token covers at most max_chars_per_token characters, so a text longer than max_model_len times
    # that is refused without running the tokenizer over it (a 30 MB prompt used to be tokenized first).
    engine, async_engine = fake
    proc = async_engine.processor
    calls = []
    encode = proc.tokenizer.encode
    monkeypatch.setattr(proc.tokenizer, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    huge = "t1 " * (proc.max_model_len * proc.max_chars_per_token // 3 + 1)

    async def main():
        with pytest.raises(ValueError, match="characters"):
            await async_engine.add_request("huge", huge, SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="characters"):
            await async_engine.add_request("huge-chat", ChatPrompt([{"role": "user", "content": huge}]),
                                           SamplingParams(max_tokens=2))
        return [o async for o in async_engine.generate(PROMPT, SamplingParams(max_tokens=2), "ok")]

    assert asyncio.run(main())[-1].finished
    assert len(calls) == 1  # only the small prompt was tokenized


def slow_tokenizer(async_engine, monkeypatch, seconds):
    # Every prompt takes `seconds` to tokenize (as a long prompt does, or any prompt on a starved thread).
    tok = async_engine.processor.tokenizer
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **k: time.sleep(seconds) or encode(*a, **k))


def test_a_burst_of_requests_joins_one_step(fake, monkeypatch):
    # Requests arriving together at an idle engine reach the same step although each takes 4 ms to tokenize:
    # the engine waits for those on their way in (up to ADMISSION_WAIT_S) instead of starting with the first.
    engine, async_engine = fake
    slow_tokenizer(async_engine, monkeypatch, 0.004)

    async def main():
        async def one(i):
            return [o async for o in async_engine.generate(PROMPT, SamplingParams(max_tokens=3), f"r{i}")]
        return await asyncio.gather(*(one(i) for i in range(6)))

    results = asyncio.run(asyncio.wait_for(main(), 10))
    assert all(r[-1].finished for r in results)
    assert engine.batches[0] == {f"r{i}" for i in range(6)}


def test_a_slow_admission_stalls_running_requests_at_most_a_step_per_step(fake, monkeypatch):
    # While a request tokenizes for 0.3 s, a running one keeps stepping: the engine waits at most as long as its
    # last step took (2 ms here) before each step, not ADMISSION_WAIT_S (which would allow ~6 steps) or longer.
    engine, async_engine = fake

    async def main():
        stream = await async_engine.add_request("running", PROMPT, SamplingParams(max_tokens=10_000))
        await asyncio.sleep(0.05)
        slow_tokenizer(async_engine, monkeypatch, 0.3)
        before = len(engine.batches)
        await async_engine.add_request("slow", PROMPT, SamplingParams(max_tokens=2))
        steps = len(engine.batches) - before
        async_engine.abort(["running", "slow"])
        stream.close()
        return steps

    assert asyncio.run(asyncio.wait_for(main(), 10)) >= 20


def test_freed_heap_is_handed_back_while_busy_not_only_when_idle(fake, monkeypatch):
    # Under continuous load the engine never goes idle; with the interval at 0 every step trims.
    import pagedserve.engine.async_engine as module

    engine, async_engine = fake
    calls = []
    monkeypatch.setattr(module, "release_free_memory", lambda: calls.append(threading.current_thread().ident))
    monkeypatch.setattr(module, "BUSY_TRIM_INTERVAL_S", 0.0)

    async def main():
        return [o async for o in async_engine.generate(PROMPT, SamplingParams(max_tokens=8), "busy")]

    outs = asyncio.run(main())
    assert len(outs[-1].outputs[0].token_ids) == 8
    # one per step (8 tokens: 8 steps), plus the idle trims; without the busy trim only the idle ones (1-2).
    # The last step's trim runs on the engine thread after its output reached the stream: wait for it.
    deadline = time.monotonic() + 10.0
    while len(calls) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) >= 8
    assert set(calls) == {async_engine._thread.ident}


def test_a_request_outranking_one_in_flight_is_tokenized_at_normal_priority(monkeypatch):
    # Under the priority policy: the niced tokenizer thread waits for the cycles the engine leaves, which an urgent
    # request must not; a request that outranks none in flight, and /tokenize, stay on the niced thread.
    from pagedserve.config import SchedulerConfig

    engine = FakeCore()
    engine.config.scheduler = SchedulerConfig(scheduling_policy="priority")
    async_engine = AsyncLLMEngine(engine)
    tok = async_engine.processor.tokenizer
    encode, niceness = tok.encode, {}

    def recording_encode(text, *args, **kwargs):
        niceness[text] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", recording_encode)

    async def main():
        low = await async_engine.add_request("low", "t1", SamplingParams(max_tokens=10_000), priority=5)
        outs = [[o async for o in async_engine.generate(p, SamplingParams(max_tokens=2), p)] for p in ("t2",)]
        same = await async_engine.add_request("same", "t3", SamplingParams(max_tokens=2), priority=5)
        urgent = await async_engine.add_request("urgent", "t4", SamplingParams(max_tokens=2), priority=-1)
        await async_engine.encode("t5")
        for stream in (same, urgent):
            outs.append([o async for o in stream])
        low.close()
        return outs

    try:
        outs = asyncio.run(asyncio.wait_for(main(), 10))
    finally:
        async_engine.shutdown()
    assert all(o[-1].finished for o in outs)
    assert niceness == {"t1": 19, "t2": 0, "t3": 19, "t4": 0, "t5": 19}
