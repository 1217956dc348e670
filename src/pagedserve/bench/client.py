"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Timing (all perf_counter, relative to the moment the request is sent):
    ttft   first chunk that carries non-empty text (role-only and empty chunks are not tokens)
    itl    gaps between consecutive non-empty text chunks (a chunk holding several tokens is one gap)
    e2el   the end of the stream ([DONE], or the connection closing after a finish_reason)
Output tokens come from the usage chunk (stream_options.include_usage) when the server sends one, else they
are the number of non-empty text chunks, exact for servers that stream one token per chunk.

SSE is parsed by hand and defensively: lines that are not `data:` payloads, or payloads that are not JSON,
are counted as malformed and skipped rather than ending the request.

HTTP goes through aiohttp, as in vLLM's benchmark client: the client usually runs on the machine it measures,
and its CPU per streamed event is taken from the server. Client process CPU per streamed token, 32 requests x
128 tokens at 16 streams against a fake server in its own process, A/B turns on a 2-core EPYC at load 15-19:
aiohttp median 80 us (8 turns, 50-93), the hand-written HTTP/1.1 reader it replaced 77 us (63-83); httpx ~165.
Against `pagedserve serve` (embedded model, 16 x 64 tokens at 16 streams, 6 turns each, load 16-18): aiohttp
median 106 us (89-113), the hand-written reader 119 us (118-130).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import aiohttp

from pagedserve.bench.dataset import BenchRequest


@dataclass(frozen=True, slots=True)
class Endpoint:
    base_url: str                     # normalized to end in /v1
    model: str
    label: str
    api: str = "completions"          # "completions" or "chat"
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"{self.base_url}/{'chat/completions' if self.api == 'chat' else 'completions'}"


@dataclass(slots=True)
class RequestResult:
    prompt_len: int                   # the server's usage count when sent, else the dataset estimate
    max_tokens: int
    success: bool = False
    error: str | None = None
    start: float = 0.0                # perf_counter when sent
    ttft: float | None = None
    e2el: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # non-empty text chunks, seconds after start
    output_tokens: int = 0
    output_tokens_source: str = "chunks"  # "usage" when the server reported completion_tokens
    finish_reason: str | None = None
    malformed_lines: int = 0

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        # Decode time per token after the first; undefined for one-token answers.
        if self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def normalize_base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {url!r}")
    return url if url.endswith("/v1") else f"{url}/v1"


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_message(body: bytes) -> str:
    # OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, or whatever text the server sent.
    text = body.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return text[:300] or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return str(err)[:300]
    return text[:300]


def build_body(ep: Endpoint, req: BenchRequest, sampling: dict) -> dict:
    body = {"model": ep.model, "max_tokens": req.output_len, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}
    if ep.api == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def chunk_text(obj: dict, api: str) -> tuple[str, str | None]:
    # (text of choice 0, its finish_reason) from a completions or chat chunk; reasoning text counts as output.
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return "", None
    c = choices[0]
    if api == "chat":
        delta = c.get("delta") if isinstance(c.get("delta"), dict) else {}
        parts = [delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning")]
        text = "".join(p for p in parts if isinstance(p, str))
    else:
        text = c.get("text") if isinstance(c.get("text"), str) else ""
    return text, c.get("finish_reason")


def _stream_error(obj: dict) -> str | None:
    err = obj.get("error")
    if err is None:
        return None
    return str(err.get("message", err) if isinstance(err, dict) else err)[:300]


async def lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    # The body's lines however the bytes arrive (a line may span reads; no length limit), without \r\n.
    pending = b""
    async for data in chunks:
        pending += data
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line.rstrip(b"\r").decode("utf-8", errors="replace")
    if pending:
        yield pending.decode("utf-8", errors="replace")


async def send_request(client: aiohttp.ClientSession, ep: Endpoint, req: BenchRequest, sampling: dict
                       ) -> RequestResult:
    res = RequestResult(prompt_len=req.prompt_len, max_tokens=req.output_len)
    done = False
    res.start = start = time.perf_counter()
    try:
        async with client.post(ep.url, json=build_body(ep, req, sampling), headers=headers(ep.api_key)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {error_message(await resp.read())}"
                return res
            async for line in lines(resp.content.iter_any()):
                now = time.perf_counter() - start
                line = line.strip()
                if not line or line.startswith(":") or line.startswith(("event:", "id:", "retry:")):
                    continue  # event separators, comments (keep-alives) and fields we have no use for
                if not line.startswith("data:"):
                    res.malformed_lines += 1
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                try:
                    obj = json.loads(payload)
                except json.JSONDecodeError:
                    res.malformed_lines += 1
                    continue
                if not isinstance(obj, dict):
                    res.malformed_lines += 1
                    continue
                if (err := _stream_error(obj)) is not None:
                    res.error = f"server error in stream: {err}"
                    break
                text, finish = chunk_text(obj, ep.api)
                if text:
                    res.chunk_times.append(now)
                    if res.ttft is None:
                        res.ttft = now
                if finish:
                    res.finish_reason = finish
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    if isinstance(usage.get("completion_tokens"), int):
                        res.output_tokens, res.output_tokens_source = usage["completion_tokens"], "usage"
                    if isinstance(usage.get("prompt_tokens"), int):
                        res.prompt_len = usage["prompt_tokens"]
    except aiohttp.ClientConnectorError as e:
        res.error = f"cannot connect to {ep.url}: {e or type(e).__name__}"
    except TimeoutError as e:  # aiohttp's read and connect timeouts are TimeoutErrors
        res.error = f"timed out ({type(e).__name__}) after {time.perf_counter() - start:.1f}s"
    except aiohttp.ClientError as e:
        res.error = f"connection failed mid-stream: {type(e).__name__}: {e}"
    res.e2el = time.perf_counter() - start
    if res.output_tokens_source == "chunks":
        res.output_tokens = len(res.chunk_times)
    if res.error is None:
        if not (done or res.finish_reason):
            res.error = "stream ended without a finish_reason or [DONE]"
        elif res.ttft is None:
            skipped = f" ({res.malformed_lines} malformed SSE lines skipped)" if res.malformed_lines else ""
            res.error = f"stream carried no output text{skipped}"
    res.success = res.error is None
    return res


class Unreachable(ConnectionError):
    pass


async def list_models(client: aiohttp.ClientSession, base_url: str, api_key: str | None) -> list[str]:
    # Preflight: the served model ids. Raises Unreachable when nothing answers, ConnectionError when the
    # server answers with an error (some servers have no /v1/models; with --model given that is no obstacle).
    url = f"{base_url}/models"
    try:
        async with client.get(url, headers=headers(api_key), timeout=aiohttp.ClientTimeout(total=10.0)) as resp:
            status, body = resp.status, await resp.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise Unreachable(f"cannot reach {url}: {type(e).__name__}: {e or 'no response'}") from e
    if status != 200:
        raise ConnectionError(f"{url} answered HTTP {status}: {error_message(body)}")
    try:
        return [m["id"] for m in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ConnectionError(f"{url} did not return an OpenAI model list") from e
