"""A tensor-parallel rank killed mid-generation: the requests in flight fail with an error, /health turns
503 and new requests are refused; nothing hangs (a real server, the official openai client)."""
from __future__ import annotations

import time

import httpx
import openai
import psutil
import pytest

from tests.distributed.conftest import make_tiny_dir
from tests.server.helpers import ServerProcess


def spawned_workers(pid: int) -> list[psutil.Process]:
    # multiprocessing's spawned children (the tensor-parallel ranks), not its resource tracker.
    return [p for p in psutil.Process(pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


def test_killed_rank_fails_requests_in_flight_and_turns_health_unhealthy(tokenizer, tmp_path) -> None:
    # 2048 positions and up to 2000 new tokens: generation lasts well beyond the kill.
    model = make_tiny_dir(tokenizer, tmp_path / "tiny-llama", 2048)
    srv = ServerProcess("--model", model, "--tensor-parallel-size", "2", "--distributed-timeout", "30")
    try:
        workers = spawned_workers(srv.proc.pid)
        assert len(workers) == 1
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        name = client.models.list().data[0].id
        streams = [iter(client.completions.create(model=name, prompt=p, max_tokens=2000, stream=True,
                                                   temperature=0.0, extra_body={"ignore_eos": True}))
                   for p in ("Hello", "The capital of France is")]
        for s in streams:
            next(s)  # both requests are generating
        workers[0].kill()
        t0 = time.monotonic()
        for s in streams:
            with pytest.raises(openai.APIError, match="engine died.*rank 1"):
                for _ in s:
                    pass
        assert time.monotonic() - t0 < 25  # the dead peer is noticed at once, not after the collective timeout
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 503
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=name, prompt="Hi", max_tokens=2)
        assert refused.value.status_code == 503
        assert srv.proc.poll() is None  # the server answers; an orchestrator restarts it on the failed probe
    finally:
        srv.close()
