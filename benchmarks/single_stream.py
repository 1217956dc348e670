"""Single-stream decode TPOT through AsyncLLMEngine in this process: the server's threads, without HTTP.

`pagedserve serve` steps the engine on its engine thread and detokenizes on the event loop; this script runs
that same pair with a consumer that only timestamps each output, so a TPOT gap between it and serving.py
(same GGUF, same window) is what HTTP costs, and a gap between it and `profile_step.py --single` is what the
engine thread and the event loop cost:

    python benchmarks/single_stream.py --num-requests 6 --output-len 128 [--model FILE.gguf]

It also prints the weight-bandwidth floor: resident weight bytes (every decode step reads them all) over the
machine's copy bandwidth measured in the same run (common.memory_bandwidth).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import memory_bandwidth, roofline_ms  # noqa: E402

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.malloc import tune_for_serving
from pagedserve.model.weight_quant import _weight_bytes
from pagedserve.sampling_params import RequestOutputKind, SamplingParams


async def tpot_ms(engine: AsyncLLMEngine, request_id: str, prompt_len: int, output_len: int) -> float:
    # From the first output to the last, per token after the first, as serving.py's TPOT.
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    params.output_kind = RequestOutputKind.DELTA
    prompt = {"prompt_token_ids": list(range(1000, 1000 + prompt_len))}
    first = last = 0.0
    num_tokens = 0
    async for out in engine.generate(prompt, params, request_id):
        last = time.perf_counter()
        if not num_tokens:
            first = last
        num_tokens += len(out.outputs[0].token_ids)
    return (last - first) / (num_tokens - 1) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: the embedded model)")
    args = p.parse_args()
    bandwidth = memory_bandwidth(num_threads=args.num_threads)  # before the weights take the memory
    tune_for_serving()  # as `pagedserve serve` does, before the engine thread and the weights
    config = EngineArgs(model=args.model, num_threads=args.num_threads,
                        kv_cache_memory_bytes=2 << 30).create_engine_config()
    engine = AsyncLLMEngine.from_config(config)

    async def run() -> list[float]:
        await tpot_ms(engine, "warmup", args.prompt_len, 8)
        return [await tpot_ms(engine, f"r{i}", args.prompt_len, args.output_len) for i in range(args.num_requests)]

    try:
        tpots = asyncio.run(run())
        weight_bytes = _weight_bytes(engine.core.loaded.model)
    finally:
        engine.shutdown()
    floor_ms = roofline_ms(weight_bytes, bandwidth)
    print(f"single-stream TPOT through AsyncLLMEngine: p50 {statistics.median(tpots):.2f} ms "
          f"(per request: {', '.join(f'{t:.2f}' for t in tpots)})")
    print(f"weight-bandwidth floor: {weight_bytes / 1e6:.0f} MB at {bandwidth['copy_gb_per_s']:.1f} GB/s copy = "
          f"{floor_ms:.2f} ms per token ({floor_ms / statistics.median(tpots):.0%} of it reached)")


if __name__ == "__main__":
    main()
