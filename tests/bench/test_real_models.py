"""benchmarks/real_models.py's workload runner against scripted servers: every server in one bench run, the
--goodput targets passed on, --warm-requests sending the workload's shape with other words first, and --cooldown."""
from __future__ import annotations

import os

from tests.bench.conftest import BENCHMARKS, import_benchmark
from tests.bench.fake_server import FakeServer


def test_shared_workload_warmed_then_measured(tmp_path, monkeypatch):
    real_models = import_benchmark("real_models")
    # The child bench runs import this checkout's package.
    src = os.path.join(os.path.dirname(BENCHMARKS), "src")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    monkeypatch.setitem(real_models.WORKLOADS, "tiny_shared", [
        "--num-prompts", "3", "--input-len", "4-8", "--output-len", "5", "--shared-prefix-len", "20",
        "--concurrency", "2"])
    a, b = FakeServer(ttft_s=0.01, itl_s=0.002), FakeServer(ttft_s=0.05, itl_s=0.002)
    args = real_models.argparse.Namespace(goodput=["ttft:30", "tpot:100"], warm_requests=2, num_prompts=None,
                                          cooldown=0.5)
    try:
        report = real_models.run_workload("tiny_shared", [a.url, b.url], ["pagedserve", "vllm"], str(tmp_path),
                                          args)
    finally:
        a.close()
        b.close()
    assert [run["endpoint"] for run in report["runs"]] == ["pagedserve", "vllm"]
    assert all(run["metrics"]["num_completed"] == 3 for run in report["runs"])
    assert report["config"]["slo"] == {"ttft_s": 0.03, "tpot_s": 0.1, "e2el_s": None}
    # on each server: the 2 warm requests, the measured run's 2 short warm-up requests, its 3 requests
    for srv in (a, b):
        prompts = [body["prompt"] for body in srv.bodies]
        assert len(prompts) == 2 + 2 + 3
        warm, measured = prompts[:2], prompts[4:]  # (2 in flight: in either order within each run)
        system = {" ".join(p.split()[:20]) for p in warm + measured}
        assert len(system) == 1  # the same 20-word system prompt before every question
        questions = [" ".join(p.split()[20:]) for p in warm + measured]
        assert len(set(questions)) == 5  # the warm ones have other words than the measured ones
    assert sorted(x["prompt"] for x in a.bodies) == sorted(x["prompt"] for x in b.bodies)  # the same workload
    # --cooldown: each measured run starts after that many quiet seconds (the first after b's short warm-up)
    assert all(srv.received[4] - srv.received[3] >= 0.5 for srv in (a, b))


def test_per_byte_relative_to_q4_k_m():
    # Several --gguf files: each server's single-stream TPOT p50 per weight byte read, over the Q4_K_M file's.
    real_models = import_benchmark("real_models")

    def file_report(weight_bytes: int, tpots: dict) -> dict:
        runs = [{"endpoint": s, "metrics": {"tpot": {"p50": t}}} for s, t in tpots.items()]
        return {"roofline_single": {"weight_bytes": weight_bytes}, "workloads": {"single": {"runs": runs}}}

    files = {"m-Q8_0.gguf": file_report(2_000_000_000, {"pagedserve": 0.050, "llama.cpp": 0.030}),
             "m-Q4_K_M.gguf": file_report(1_000_000_000, {"pagedserve": 0.020, "llama.cpp": 0.020})}
    out = real_models.per_byte(files)
    assert out["reference"] == "m-Q4_K_M.gguf"
    assert out["pagedserve"]["m-Q8_0.gguf"] == {"tpot_p50_ms": 50.0, "weight_bytes": 2_000_000_000,
                                                "ms_per_gb": 25.0, "vs_reference": 1.25}
    assert out["llama.cpp"]["m-Q8_0.gguf"]["vs_reference"] == 0.75
    assert out["pagedserve"]["m-Q4_K_M.gguf"]["vs_reference"] == 1.0
