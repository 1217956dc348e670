"""benchmarks/serving.py with peers only (--servers, no engine started): --also LABEL=URL parsing, peer
rows and ratios in the report, the vLLM command line it would start."""
from __future__ import annotations

import json
import os
import sys

import pytest

from tests.bench.fake_server import FakeServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "serving.py")


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import serving as module
    finally:
        sys.path.pop(0)
    return module


def test_peers_measured_in_one_run(script, tmp_path, monkeypatch):
    fast, slow = FakeServer(ttft_s=0.02, itl_s=0.005), FakeServer(ttft_s=0.2, itl_s=0.02)
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", [
        SCRIPT, "--servers", "--also", f"vllm={fast.url}", "--also", f"llama.cpp={slow.url}/v1", "--num-prompts",
        "4", "--input-len", "8", "--output-len", "6", "--concurrency", "4", "--sweep-rates", "--warmup", "0",
        "--no-progress", "--out", str(out)])
    try:
        assert script.main() == 0  # in this process: no second torch import
    finally:
        fast.close()
        slow.close()
    report = json.loads(out.read_text())
    assert [run["endpoint"] for run in report["runs"]] == ["vllm", "llama.cpp"]
    assert all(run["metrics"]["num_completed"] == 4 and run["metrics"]["total_output_tokens"] == 24
               for run in report["runs"])
    assert report["servers"]["vllm"] == {"base_url": fast.url, "started": "outside this script", "version": "fake-1.0"}
    (cmp,) = report["comparisons"]
    assert cmp["baseline"] == "vllm"
    fast_ttft, slow_ttft = (run["metrics"]["ttft"]["p50"] for run in report["runs"])
    assert slow_ttft >= 0.2 and fast_ttft >= 0.02  # the scripted first-token delays (noise only adds)
    assert cmp["ratios"]["llama.cpp"]["TTFT p50"] == pytest.approx(slow_ttft / fast_ttft)
    assert len(report["machine"]["load_avg_1_5_15"]) == 3 and len(report["machine"]["load_avg_1_5_15_at_end"]) == 3
    assert len(fast.bodies) == 4 and fast.bodies[0]["ignore_eos"] is True


def test_also_parsing(script):
    assert script.parse_also(["vllm=http://127.0.0.1:8001", " llama.cpp = http://h:1/v1"]) == [
        ("vllm", "http://127.0.0.1:8001"), ("llama.cpp", "http://h:1/v1")]
    for bad in ["vllm", "vllm=", "=http://127.0.0.1:1", "vllm=127.0.0.1:8001"]:
        with pytest.raises(ValueError, match="--also takes LABEL=URL"):
            script.parse_also([bad])


def test_bad_also_is_a_usage_error(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--servers", "--also", "vllm"])
    with pytest.raises(SystemExit) as e:
        script.main()
    assert e.value.code == 2 and "--also takes LABEL=URL" in capsys.readouterr().err


def test_vllm_command_line(script):
    args = script.argparse.Namespace(vllm_python="/venv/bin/python", vllm_model="/tmp/m", vllm_dtype="float32",
                                     max_model_len=2048, kv_cache_memory=3 << 30, vllm_arg=["--max-num-seqs=16"])
    cmd = script.vllm_command(args)
    assert cmd[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/tmp/m"]
    assert cmd[cmd.index("--dtype") + 1] == "float32" and cmd[-1] == "--max-num-seqs=16"
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(3 << 30)
