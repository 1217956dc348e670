"""A naive transformers-based OpenAI-compatible server: the baseline a team would run without an engine.

Static batching: the worker takes every request waiting (up to --max-batch-size), left-pads the prompts
into one batch and runs a greedy/temperature loop with transformers' KV cache until every request in the
batch has finished; requests that arrive meanwhile wait for the next batch, and rows that finished early
keep being computed. There is no paging, no continuous batching and no prefix cache, which is the point.

    python benchmarks/hf_server.py --port 8001 [--max-batch-size 8] [--num-threads 1]

Speaks /v1/completions and /v1/chat/completions (streamed or not, stream_options.include_usage,
max_tokens, temperature, ignore_eos), /v1/models and /health; enough for `pagedserve bench serve`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer


@dataclass(slots=True)
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    temperature: float
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # (text delta, finish_reason | None)
    cancelled: bool = False


class Generator:
    def __init__(self, path: str, max_batch_size: int) -> None:
        folder, name = os.path.split(path)
        kw = {"gguf_file": name} if name.endswith(".gguf") else {}
        self.model = AutoModelForCausalLM.from_pretrained(folder if kw else path, dtype=torch.float32, **kw).eval()
        self.tok = AutoTokenizer.from_pretrained(folder if kw else path, **kw)
        self.model_name = os.path.splitext(name)[0]
        self.max_len = int(self.model.config.max_position_embeddings)
        gen_eos = self.model.generation_config.eos_token_id
        self.eos_ids = {self.tok.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])} - {None}
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else min(self.eos_ids)
        self.max_batch_size = max_batch_size
        self.waiting: queue.Queue[GenRequest] = queue.Queue()
        threading.Thread(target=self._loop, daemon=True).start()

    def _emit(self, r: GenRequest, delta: str, finish: str | None) -> None:
        r.loop.call_soon_threadsafe(r.events.put_nowait, (delta, finish))

    def _loop(self) -> None:
        while True:
            batch = [self.waiting.get()]
            while len(batch) < self.max_batch_size:
                try:
                    batch.append(self.waiting.get_nowait())
                except queue.Empty:
                    break
            batch = [r for r in batch if not r.cancelled]
            if batch:
                try:
                    with torch.inference_mode():
                        self._run_batch(batch)
                except Exception as e:  # noqa: BLE001 - fail this batch, keep serving
                    for r in batch:
                        self._emit(r, f"[error: {e}]", "error")

    def _pick(self, logits: torch.Tensor, batch: list[GenRequest]) -> torch.Tensor:
        nxt = logits.argmax(-1)
        for i, r in enumerate(batch):
            if r.temperature > 0:
                probs = torch.softmax(logits[i].float() / r.temperature, -1)
                nxt[i] = torch.multinomial(probs, 1)[0]
        return nxt

    def _run_batch(self, batch: list[GenRequest]) -> None:
        # Left padding keeps every row's last prompt token in the last column; positions skip the pads.
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        generated: list[list[int]] = [[] for _ in batch]
        texts = [""] * len(batch)
        active = [True] * len(batch)
        while True:
            nxt = self._pick(out.logits[:, -1], batch)
            for i, r in enumerate(batch):
                if not active[i]:
                    continue
                if r.cancelled:
                    active[i] = False
                    continue
                t = int(nxt[i])
                if t in self.eos_ids and not r.ignore_eos:
                    active[i] = False
                    self._emit(r, "", "stop")
                    continue
                generated[i].append(t)
                text = self.tok.decode(generated[i], skip_special_tokens=True)
                delta = "" if text.endswith("\ufffd") else text[len(texts[i]):]  # wait for the whole character
                texts[i] += delta
                done = len(generated[i]) >= r.max_tokens
                active[i] = not done
                self._emit(r, delta, "length" if done else None)
            if not any(active):
                return
            mask = torch.cat([mask, torch.ones((len(batch), 1), dtype=mask.dtype)], 1)
            pos = pos[:, -1:] + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, cache=out.cache,
                             use_cache=True)


def build_app(gen: Generator) -> FastAPI:
    app = FastAPI()

    def error(msg: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"error": {"message": msg, "type": "invalid_request_error", "code": status}}, status)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": gen.model_name, "object": "model", "max_model_len": gen.max_len}]}

    async def handle(request: Request, chat: bool):
        try:
            body = await request.json()
            if chat:
                text = gen.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
                prompt_ids = gen.tok(text, add_special_tokens=False).input_ids
            else:
                p = body["prompt"]
                prompt_ids = list(p) if isinstance(p, list) else gen.tok(p).input_ids
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        except (ValueError, KeyError, TypeError) as e:
            return error(f"bad request: {e!r}")
        if not prompt_ids or len(prompt_ids) + max_tokens > gen.max_len:
            return error(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds {gen.max_len}")
        r = GenRequest(prompt_ids, max_tokens, bool(body.get("ignore_eos")), float(body.get("temperature") or 0.0),
                       asyncio.get_running_loop())
        gen.waiting.put(r)
        rid, created, n_prompt = f"cmpl-{uuid.uuid4().hex[:16]}", int(time.time()), len(prompt_ids)
        kind = "chat.completion" if chat else "text_completion"

        def choice(delta: str, finish: str | None, stream: bool) -> dict:
            if not chat:
                return {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
            key = "delta" if stream else "message"
            return {"index": 0, key: {"role": "assistant", "content": delta} if not stream else {"content": delta},
                    "finish_reason": finish}

        async def events():
            n = 0
            while True:
                delta, finish = await r.events.get()
                n += finish != "stop"  # an EOS that ends the answer is not an output token here
                yield delta, finish, n
                if finish:
                    return

        if not body.get("stream"):
            parts, finish, n = [], None, 0
            async for delta, finish, n in events():
                parts.append(delta)
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
            return {"id": rid, "object": kind, "created": created, "model": gen.model_name,
                    "choices": [choice("".join(parts), finish, False)], "usage": usage}

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def sse():
            def chunk(ch: list, **extra) -> str:
                obj = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created,
                       "model": gen.model_name, "choices": ch, **extra}
                return f"data: {json.dumps(obj)}\n\n"
            try:
                if chat:
                    yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
                n = 0
                async for delta, finish, n in events():
                    if delta or finish:
                        yield chunk([choice(delta, finish, True)])
                if include_usage:
                    yield chunk([], usage={"prompt_tokens": n_prompt, "completion_tokens": n,
                                           "total_tokens": n_prompt + n})
                yield "data: [DONE]\n\n"
            finally:
                r.cancelled = True  # a client that left frees its row at the next step

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.model is None:
        from pagedserve.model.loader import default_model_path

        args.model = default_model_path()
    gen = Generator(os.path.abspath(args.model), args.max_batch_size)
    print(f"transformers baseline serving {gen.model_name} at http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(build_app(gen), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
