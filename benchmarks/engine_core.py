"""Engine core v2 targets (issue 10), measured in one run on one machine:

1. HTTP vs offline: output tokens/s of `pagedserve serve` at 16 concurrent streams (client in this process, on
   the same machine, so its cost counts) against offline `LLM.generate` with the same max_num_seqs, on the
   64-request workload of throughput.py. Target: HTTP >= 0.9x offline.
2. Tokenizer isolation: decode TPOT p50 of 16 streams, alone and while 200 /tokenize calls (long texts) arrive
   at once. Target: < 10% change.

    python benchmarks/engine_core.py --out benchmarks/results/engine_core.json
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time

import httpx

from common import allowed_token_ids, describe_workload, machine_info, synthetic_requests, write_json
from serving import Server, free_port


async def stream_one(client: httpx.AsyncClient, prompt_ids: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    arrivals = []  # perf_counter of each chunk with text
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
                first = first or arrivals[-1]
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - t0, "e2e": end - t0, "tokens": tokens, "arrivals": arrivals,
            "tpot": (end - first) / (tokens - 1) if tokens > 1 else None}


async def run_streams(url: str, reqs, concurrency: int) -> tuple[float, list[dict]]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        async def one(r):
            async with sem:
                return await stream_one(client, r.prompt_token_ids, r.max_tokens)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in reqs))
        return time.perf_counter() - t0, results


async def tokenize_burst(url: str, texts: list[str], delay_s: float) -> dict:
    await asyncio.sleep(delay_s)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        t0 = time.perf_counter()
        resps = await asyncio.gather(*(client.post("/tokenize", json={"prompt": t}) for t in texts))
        t1 = time.perf_counter()
    assert all(r.status_code == 200 for r in resps), [r.text for r in resps if r.status_code != 200][:1]
    return {"num_calls": len(texts), "wall_s": t1 - t0, "tokens_each": resps[0].json()["count"],
            "window": (t0, t1)}


def gaps(results: list[dict], window: tuple[float, float] | None = None) -> list[float]:
    # Inter-token gaps of every stream (after its first token), optionally only those ending in the window.
    out = []
    for r in results:
        a = r["arrivals"]
        out += [b - x for x, b in zip(a, a[1:]) if window is None or window[0] <= b <= window[1]]
    return out


def p50(values) -> float:
    return statistics.median([v for v in values if v is not None])


def offline(args) -> tuple[dict, list]:
    from pagedserve import LLM, SamplingParams

    llm = LLM(max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory,
              max_num_seqs=args.max_num_seqs)
    tok = llm.get_tokenizer()
    ids = allowed_token_ids(tok, llm.llm_engine.hf_config.vocab_size)
    # throughput.py's workload: prompts of 64-512 random tokens, outputs of 16-256, greedy, eos ignored.
    reqs = synthetic_requests(args.num_prompts, (64, 512), (16, 256), ids, seed=0)
    llm.generate([{"prompt_token_ids": reqs[0].prompt_token_ids}], SamplingParams(max_tokens=4, temperature=0),
                 use_tqdm=False)  # warm-up
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    words = [tok.decode([t]).strip() or "x" for t in ids[:2000]]
    del llm, outs
    gc.collect()
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_per_s": tokens / wall}, (reqs, words, ids)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    p.add_argument("--burst", type=int, default=200, help="/tokenize calls in the burst")
    p.add_argument("--burst-words", type=int, default=1500, help="words per /tokenize text")
    p.add_argument("--decode-streams", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=160)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    info = machine_info()

    off, (reqs, words, ids) = offline(args)
    print(f"offline: {off['output_tok_per_s']:.1f} output tok/s", file=sys.stderr)
    port = free_port()
    server = Server("pagedserve", [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(port),
                                   "--max-model-len", str(args.max_model_len), "--kv-cache-memory",
                                   str(args.kv_cache_memory), "--max-num-seqs", str(args.max_num_seqs),
                                   "--uvicorn-log-level", "warning"], port)
    try:
        asyncio.run(run_streams(server.url, reqs[:2], 2))  # warm-up
        wall, results = asyncio.run(run_streams(server.url, reqs, args.max_num_seqs))
        tokens = sum(r["tokens"] for r in results)
        http = {"wall_s": wall, "output_tokens": tokens, "output_tok_per_s": tokens / wall,
                "ttft_p50_s": p50(r["ttft"] for r in results), "tpot_p50_s": p50(r["tpot"] for r in results)}
        print(f"http: {http['output_tok_per_s']:.1f} output tok/s", file=sys.stderr)

        # Decode-only load: short prompts, long outputs, all streams admitted at once.
        decode_reqs = synthetic_requests(args.decode_streams, (32, 32), (args.decode_tokens, args.decode_tokens),
                                         ids, seed=1)
        # Distinct texts (no tokenizer cache helps), each about --burst-words words.
        texts = [" ".join(words[(i * 31 + j) % len(words)] for j in range(args.burst_words))
                 for i in range(args.burst)]

        async def with_burst():
            streams = asyncio.create_task(run_streams(server.url, decode_reqs, args.decode_streams))
            burst = await tokenize_burst(server.url, texts, delay_s=2.0)
            return await streams, burst

        _, alone = asyncio.run(run_streams(server.url, decode_reqs, args.decode_streams))
        (_, during), burst = asyncio.run(with_burst())
        _, alone2 = asyncio.run(run_streams(server.url, decode_reqs, args.decode_streams))
    finally:
        server.stop()
    tpot_alone = p50([r["tpot"] for r in alone + alone2])
    tpot_burst = p50(r["tpot"] for r in during)
    window = burst.pop("window")
    gap_alone = p50(gaps(alone + alone2))
    gap_burst = p50(gaps(during, window))
    for r in results + alone + during + alone2:
        r.pop("arrivals")
    data = {
        "machine": info, "command": " ".join(sys.argv),
        "config": {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
                   "kv_cache_memory_bytes": args.kv_cache_memory},
        "workload": describe_workload(reqs, input_len="64-512", output_len="16-256", greedy=True, ignore_eos=True),
        "offline": off, "http_16_streams": http,
        "ratio_http_over_offline": http["output_tok_per_s"] / off["output_tok_per_s"],
        "tokenize_burst": {**burst, "decode_streams": args.decode_streams, "decode_tokens": args.decode_tokens,
                           "tpot_p50_alone_s": tpot_alone, "tpot_p50_during_burst_s": tpot_burst,
                           "tpot_change": tpot_burst / tpot_alone - 1,
                           "inter_token_p50_alone_s": gap_alone, "inter_token_p50_in_burst_window_s": gap_burst,
                           "inter_token_change_in_window": gap_burst / gap_alone - 1},
        "load_average_end": list(__import__("os").getloadavg()),
    }
    print(json.dumps({k: data[k] for k in ("ratio_http_over_offline", "tokenize_burst")}, indent=1))
    if args.out:
        write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
