"""GET /debug/kv (a snapshot of the paged KV cache) and GET /dashboard (a live page that draws it).

The snapshot is built on the engine thread between two steps (AsyncLLMEngine.call), only when a client asks,
and at most once per KV_SNAPSHOT_INTERVAL_S however many clients poll: an unwatched server pays nothing, a
watched one a few pool walks per second. The page's files ship in the package (server/static/) and load
nothing from the internet. They hold no data, so they are served without the API key (a browser cannot send
one when it opens a URL); the page sends the key (from ?key= or a prompt) on its /debug/kv requests, which
the API key middleware checks like any other route.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from collections import deque
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from pagedserve.core.kv_snapshot import build_kv_snapshot
from pagedserve.metrics.stats import RequestStats

KV_SNAPSHOT_INTERVAL_S = 0.25   # at most 4 pool walks per second
TTFT_WINDOW_S = 60.0            # the page's TTFT percentiles cover the requests finished this recently
MAX_TTFT_SAMPLES = 4096
STATIC_DIR = Path(__file__).parent / "static"
# URL path -> (file, content type). Kept in step with middleware.OPEN_PATHS.
DASHBOARD_FILES = {
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard/app.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/style.css": ("dashboard.css", "text/css; charset=utf-8"),
}
_NO_STORE = {"Cache-Control": "no-store"}


class RollingTTFT:
    # Appended on the engine thread (a finished-request callback), read on the event loop: deque appends and
    # copies are atomic.
    def __init__(self, window_s: float = TTFT_WINDOW_S) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, float]] = deque(maxlen=MAX_TTFT_SAMPLES)

    def on_finished(self, rs: RequestStats) -> None:
        if rs.ttft is not None:
            self.samples.append((time.monotonic(), rs.ttft))

    def summary(self, now: float) -> dict[str, Any]:
        values = sorted(ttft for t, ttft in list(self.samples) if now - t <= self.window_s)
        return {"ttft_p50_s": percentile(values, 0.50), "ttft_p99_s": percentile(values, 0.99),
                "num_ttft_samples": len(values), "ttft_window_s": self.window_s}


def percentile(sorted_values: list[float], q: float) -> float | None:
    # Nearest rank: an observed value, never an interpolation between two.
    if not sorted_values:
        return None
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def _take_snapshot(core: Any) -> dict[str, Any]:  # engine thread
    snap = build_kv_snapshot(core.kv, core.scheduler)
    snap["engine"] = {"num_steps": core.stats.num_steps,
                      "prompt_tokens_total": core.stats.num_prompt_tokens_total,
                      "generation_tokens_total": core.stats.num_generation_tokens_total}
    return snap


class KVSnapshotSource:
    """The latest /debug/kv body, renewed on demand at most once per interval; concurrent polls share it."""

    def __init__(self, engine: Any, interval_s: float = KV_SNAPSHOT_INTERVAL_S) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.ttft = RollingTTFT()
        self.num_snapshots = 0
        self._body = b""
        self._taken_at = float("-inf")
        self._lock = asyncio.Lock()
        engine.add_finished_callback(self.ttft.on_finished)

    async def get(self) -> bytes:
        async with self._lock:
            if time.monotonic() - self._taken_at >= self.interval_s:
                snap = await self.engine.call(_take_snapshot)
                self._taken_at = now = time.monotonic()
                self.num_snapshots += 1
                snap["seq"] = self.num_snapshots
                snap["time"] = time.time()
                snap["model"] = self.engine.model_name
                snap["engine"].update(self.ttft.summary(now))
                self._body = json.dumps(snap, separators=(",", ":")).encode()
            return self._body


def register_debug_routes(app: FastAPI, engine: Any) -> None:
    source = KVSnapshotSource(engine)
    app.state.kv_snapshots = source
    files = {path: ((STATIC_DIR / name).read_bytes(), media) for path, (name, media) in DASHBOARD_FILES.items()}

    @app.get("/debug/kv")
    async def debug_kv() -> Response:
        return Response(await source.get(), media_type="application/json", headers=_NO_STORE)

    def serve(path: str) -> None:
        body, media = files[path]

        async def static_file() -> Response:
            return Response(body, media_type=media, headers=_NO_STORE)

        app.add_api_route(path, static_file, methods=["GET"], include_in_schema=False)

    for path in files:
        serve(path)
