"""A tiny OpenAI-compatible streaming server with scripted timings and faults, run in a thread.

Every request streams max_tokens chunks of one token ("tok "): the first after `ttft_s`, the next ones
`itl_s` apart, so a client's measurements can be checked against known numbers. A prompt containing "slow"
waits `slow_ttft_s` instead; one containing "fail" gets HTTP 500. `mode` switches the whole server to a
fault: "http_error", "malformed" (garbage lines mixed into a good stream), "only_malformed", "error_event"
(an error event after two tokens), "truncated" (the stream stops without finish_reason or [DONE]).

What the server saw, for checks that need no timing slack: `timings` holds (received, first token written,
last token written) per streamed request in perf_counter seconds (a client in this process measures on the
same clock, so its TTFT can only be longer than first - received), `max_in_flight` the most requests open at
once. `hold_until=n` holds every first token until n requests have arrived: an open-loop client gets there, a
client that waits for each answer before sending the next never does (the hold gives up after 10 s and sets
`hold_timed_out`).
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, StreamingResponse


class FakeServer:
    def __init__(self, ttft_s: float = 0.05, itl_s: float = 0.01, slow_ttft_s: float = 0.5, usage: bool = True,
                 model: str = "fake-model", hold_until: int | None = None) -> None:
        self.ttft_s, self.itl_s, self.slow_ttft_s, self.usage, self.model = ttft_s, itl_s, slow_ttft_s, usage, model
        self.mode = "ok"
        self.num_finished = 0
        self.bodies: list[dict] = []
        self.received: list[float] = []  # perf_counter() at each request's arrival
        self.timings: list[tuple[float, float, float]] = []
        self.in_flight = self.max_in_flight = 0
        self.hold_until, self.hold_timed_out = hold_until, False
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model, "object": "model"}]}

        @app.get("/version")
        async def version():  # as vLLM's server answers it
            return {"version": "fake-1.0"}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._complete(await request.json(), chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._complete(await request.json(), chat=True)

        return app

    async def _complete(self, body: dict, chat: bool):
        received = time.perf_counter()
        self.bodies.append(body)
        self.received.append(received)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if self.mode == "http_error" or "fail" in prompt:
            return JSONResponse({"error": {"message": "boom", "type": "server_error", "code": 500}}, status_code=500)
        n = int(body.get("max_tokens", 16))
        ttft = self.slow_ttft_s if "slow" in prompt else self.ttft_s
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return StreamingResponse(self._stream(n, ttft, chat, len(prompt.split()), received),
                                 media_type="text/event-stream")

    def _chunk(self, text: str | None, finish: str | None, chat: bool) -> str:
        choice = ({"index": 0, "delta": {"content": text} if text is not None else {}, "finish_reason": finish}
                  if chat else {"index": 0, "text": text or "", "finish_reason": finish})
        return f"data: {json.dumps({'id': 'x', 'object': 'chunk', 'choices': [choice]})}\n\n"

    async def _stream(self, n: int, ttft: float, chat: bool, prompt_tokens: int, received: float):
        written = []
        try:
            if chat:
                yield self._chunk("", None, chat)  # the role chunk: no text, so not the first token
            await self._hold()
            await asyncio.sleep(ttft)
            for i in range(n):
                if i:
                    await asyncio.sleep(self.itl_s)
                if self.mode in ("malformed", "only_malformed"):
                    yield "data: {not json\n\nthis is not sse\n\n"
                    if self.mode == "only_malformed":
                        continue
                if self.mode == "error_event" and i == 2:
                    yield f"data: {json.dumps({'error': {'message': 'engine failed', 'code': 500}})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if self.mode == "truncated" and i == 2:
                    return
                written.append(time.perf_counter())
                yield self._chunk("tok ", "length" if i == n - 1 else None, chat)
            if self.usage:
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
                yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1
            self.num_finished += 1
            if written:
                self.timings.append((received, written[0], written[-1]))

    async def _hold(self) -> None:
        deadline = time.monotonic() + 10
        while self.hold_until is not None and len(self.bodies) < self.hold_until:
            if time.monotonic() > deadline:
                self.hold_timed_out = True
                return
            await asyncio.sleep(0.005)
