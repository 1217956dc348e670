"""benchmarks/serving.py with peers only (--servers, no engine started): --also LABEL=URL parsing, peer
rows and ratios in the report, the vLLM command line it would start."""
from __future__ import annotations

import json
import os
import sys

import pytest

from tests.bench.conftest import BENCHMARKS, import_benchmark
from tests.bench.fake_server import FakeServer

SCRIPT = os.path.join(BENCHMARKS, "serving.py")


@pytest.fixture(scope="module")
def script():
    return import_benchmark("serving")


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


def test_llama_command_line(script):
    args = script.argparse.Namespace(llama_server="/bin/llama-server", num_threads=2, max_model_len=2048,
                                     llama_arg=["--no-cache-prompt"])
    cmd = script.llama_command(args, "/m/x.gguf")
    assert cmd[:3] == ["/bin/llama-server", "-m", "/m/x.gguf"] and cmd[-1] == "--no-cache-prompt"
    assert (cmd[cmd.index("-t") + 1], cmd[cmd.index("-tb") + 1]) == ("2", "2")
    assert (cmd[cmd.index("-np") + 1], cmd[cmd.index("-c") + 1]) == ("16", str(16 * 2048))


def test_peer_specs_from_the_shared_flags(script, monkeypatch):
    # The flags serving.py and real_models.py share: only the peers asked for, llama.cpp on --llama-gguf
    # or else the caller's GGUF, vLLM with the VLLM_CPU_* / OMP_* environment and its long start-up timeout.
    p = script.argparse.ArgumentParser()
    script.add_peer_args(p, "--gguf")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-memory", type=int, default=2 << 30)
    assert script.peer_specs(p.parse_args([]), lambda: pytest.fail("no GGUF needed without llama.cpp")) == {}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    args = p.parse_args(["--llama-server", "/bin/ls", "--vllm-model", "/m/hf", "--vllm-python", "/v/python"])
    specs = script.peer_specs(args, lambda: "/m/q4.gguf")
    assert list(specs) == ["llama.cpp", "vllm"]
    (llama, llama_env, _), (vllm, vllm_env, vllm_timeout) = specs["llama.cpp"], specs["vllm"]
    assert llama[:3] == ["/bin/ls", "-m", "/m/q4.gguf"] and llama[llama.index("-c") + 1] == str(16 * 4096)
    assert llama_env == {} and vllm_timeout == 900.0
    assert vllm_env == {"VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": "2"}
    assert vllm[:2] == ["/v/python", "-m"] and vllm[vllm.index("--max-model-len") + 1] == "4096"
    args = p.parse_args(["--llama-server", "/bin/ls", "--llama-gguf", "/m/other.gguf"])
    assert script.peer_specs(args, lambda: "/m/q4.gguf")["llama.cpp"][0][2] == "/m/other.gguf"
