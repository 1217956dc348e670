"""A tensor-parallel rank killed or stopped (SIGSTOP) mid-generation: the requests in flight fail with an error,
/health turns 503 and new requests are refused; nothing hangs (a real server, the official openai client). A
script without a main guard starts its ranks without running itself again."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import openai
import psutil
import pytest

from tests.distributed.conftest import make_tiny_dir
from tests.server.helpers import ServerProcess


def spawned_workers(pid: int) -> list[psutil.Process]:
    # multiprocessing's spawned children (the tensor-parallel ranks), not its resource tracker.
    return [p for p in psutil.Process(pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_killed_rank_fails_requests_in_flight_and_turns_health_unhealthy(tokenizer, tmp_path, how) -> None:
    # 2048 positions and up to 2000 new tokens: generation lasts well beyond the kill. A stopped rank stays
    # alive and silent: without the heartbeat, rank 0 would wait out the collective timeout (60 s here).
    model = make_tiny_dir(tokenizer, tmp_path / "tiny-llama", 2048)
    srv = ServerProcess("--model", model, "--tensor-parallel-size", "2", "--distributed-timeout", "60")
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
        workers[0].kill() if how == "kill" else workers[0].send_signal(signal.SIGSTOP)
        # The cause in the error shows how the peer's loss was noticed: its exit (or its end of the pipe closing),
        # or its missing heartbeat; a rank 0 left to wait out the collective timeout would say "did not answer".
        match = "engine died.*rank 1" + (".*stopped responding: no heartbeat" if how == "stop"
                                         else r" (\(pid \d+\) exited with code -9|closed its pipe)")
        for s in streams:
            with pytest.raises(openai.APIError, match=match):
                for _ in s:
                    pass
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 503
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=name, prompt="Hi", max_tokens=2)
        assert refused.value.status_code == 503
        assert srv.proc.poll() is None  # the server answers; an orchestrator restarts it on the failed probe
    finally:
        srv.close()


def test_script_without_main_guard_starts_its_ranks(tiny_tp_dir, tmp_path) -> None:
    # spawn re-imports the parent's main script in every child: this one would build a second LLM in rank 1
    # (and fail "1/2 clients joined" after a minute). It must print its text once and exit 0.
    script = tmp_path / "no_guard.py"
    script.write_text(
        "from pagedserve import LLM, SamplingParams\n"
        f"llm = LLM(model={tiny_tp_dir!r}, tensor_parallel_size=2, num_threads=1, kv_cache_memory_bytes=1 << 22,\n"
        "          distributed_timeout=20)\n"
        "out = llm.generate(['Hello'], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)\n"
        "print('GENERATED', len(out[0].outputs[0].token_ids))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("GENERATED 3") == 1, done.stdout
