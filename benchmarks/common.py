"""Shared by the benchmark scripts: synthetic workloads, machine description, JSON output."""
from __future__ import annotations

import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class SyntheticRequest:
    prompt_token_ids: list[int]
    max_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def allowed_token_ids(tokenizer, vocab_size: int) -> list[int]:
    # Random ids from the vocab minus special tokens (BOS/EOS/chat markers), so prompt lengths are exact
    # and no prompt contains an end-of-text marker.
    special = set(tokenizer.all_special_ids)
    return [t for t in range(min(vocab_size, len(tokenizer))) if t not in special]


def synthetic_requests(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                       token_ids: list[int], seed: int) -> list[SyntheticRequest]:
    # Lengths are uniform over the inclusive ranges; one seeded RNG makes the workload reproducible.
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_prompts):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        reqs.append(SyntheticRequest([rng.choice(token_ids) for _ in range(n_in)], n_out))
    return reqs


def describe_workload(reqs: list[SyntheticRequest], **extra) -> dict:
    n_in = [r.num_prompt_tokens for r in reqs]
    n_out = [r.max_tokens for r in reqs]
    return {"num_prompts": len(reqs), "total_prompt_tokens": sum(n_in), "total_output_tokens": sum(n_out),
            "mean_prompt_len": sum(n_in) / len(reqs), "mean_output_len": sum(n_out) / len(reqs), **extra}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    import torch
    import transformers

    import pagedserve

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_avg_1_5_15": list(os.getloadavg()),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "transformers": transformers.__version__,
        "pagedserve": pagedserve.__version__,
    }


def memory_bandwidth(num_bytes: int = 1 << 30, num_threads: int = 2, repeats: int = 5) -> dict:
    """STREAM's copy kernel with torch: the best of `repeats` copies of a num_bytes float32 array into another,
    counted as STREAM counts it (bytes read + bytes written, no write-allocate traffic). The roofline of a decode
    step is the bytes it must read (weights, KV) divided by this rate."""
    import torch

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        src = torch.ones(num_bytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault every page in before timing
        best_s = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best_s = min(best_s, time.perf_counter() - start)
    finally:
        torch.set_num_threads(saved_threads)
    return {"copy_gb_per_s": 2 * src.nbytes / best_s / 1e9, "array_bytes": src.nbytes, "num_threads": num_threads,
            "repeats": repeats}


def roofline_ms(bytes_per_step: int, bandwidth: dict) -> float:
    # The shortest a step reading bytes_per_step can take at the measured copy bandwidth.
    return bytes_per_step / (bandwidth["copy_gb_per_s"] * 1e9) * 1e3


def engine_config_dict(engine) -> dict:
    cfg = asdict(engine.config)
    cfg["resolved"] = {"max_model_len": engine.max_model_len, "num_kv_blocks": engine.kv.num_blocks,
                       "block_size": engine.kv.block_size,
                       "kv_capacity_tokens": engine.kv.num_blocks * engine.kv.block_size}
    return cfg


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def stop_process(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM (a server's graceful shutdown), then SIGKILL if it has not exited within timeout_s."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def child_run(script: str, *extra_args: str, env: dict | None = None) -> dict:
    # Runs `script` again with this process's arguments plus extra_args (one setting per process, A/B in turns);
    # returns the JSON dict its last stdout line prints.
    out = subprocess.run([sys.executable, script, *sys.argv[1:], *extra_args], env=env, check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return json.loads(out)


def int8_child_run(script: str, value: str) -> dict:
    # child_run with --child and PAGEDSERVE_GGUF_INT8=value (the dispatcher reads it once per process), int8=value.
    return dict(child_run(script, "--child", env=dict(os.environ, PAGEDSERVE_GGUF_INT8=value)), int8=value)
