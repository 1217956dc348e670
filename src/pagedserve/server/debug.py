"""GET /debug/kv (a snapshot of the paged KV cache) and GET /dashboard (a live page that draws it).

The snapshot costs the engine nothing until someone asks, and little when someone does:

    handler --(at most once per KV_SNAPSHOT_INTERVAL_S, shared by all pollers)--> AsyncLLMEngine.call:
      engine thread, between two steps: capture_kv_state (a plain copy, ~0.1 ms per thousand blocks)
    <-- KVState -- the JSON is written on a worker thread, never on the engine thread or the event loop

The handler never reads engine state itself. The page's files ship in the package (server/static/) and load
nothing from the internet. With --api-key the page and /debug/kv need the key like every route; a browser
gets in through /dashboard/login, which sets an expiring session cookie, never the key (server/middleware.py).
--disable-debug-routes leaves all of them out.
"""
from __future__ import annotations

import asyncio
import hmac
import math
import time
from collections import deque
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from pagedserve.core.kv_snapshot import kv_snapshot_json
from pagedserve.metrics.stats import RequestStats
from pagedserve.server.middleware import (DASHBOARD_COOKIE, DASHBOARD_LOGIN_PATH, DASHBOARD_SESSION_S,
                                         make_session_token)

KV_SNAPSHOT_INTERVAL_S = 0.5    # at most 2 snapshots per second, however many pages poll
TTFT_WINDOW_S = 60.0            # the page's TTFT percentiles cover the requests finished this recently
MAX_TTFT_SAMPLES = 4096
STATIC_DIR = Path(__file__).parent / "static"
# URL path -> (file, content type); middleware.COOKIE_PATHS lists the same paths.
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
                state, engine_stats = await self.engine.kv_snapshot()
                self._taken_at = now = time.monotonic()
                self.num_snapshots += 1
                engine_stats.update(self.ttft.summary(now))
                extra = {"seq": self.num_snapshots, "time": engine_stats.pop("time"),
                         "model": self.engine.model_name, "engine": engine_stats}
                self._body = await asyncio.to_thread(kv_snapshot_json, state, extra)
            return self._body


def _login_page(message: str = "") -> bytes:
    page = (STATIC_DIR / "login.html").read_text("utf-8")
    return page.replace("<!--message-->", message).encode()


def _register_login(app: FastAPI, api_key: str) -> None:
    expected = api_key.encode()

    @app.get(DASHBOARD_LOGIN_PATH, include_in_schema=False)
    async def login_form() -> Response:
        return HTMLResponse(_login_page(), headers=_NO_STORE)

    @app.post(DASHBOARD_LOGIN_PATH, include_in_schema=False)
    async def login(request: Request) -> Response:
        # A plain HTML form post (no multipart parser needed); the body size limit applies as everywhere.
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        given = form.get("key", [""])[0].encode()
        if not hmac.compare_digest(given, expected):
            return HTMLResponse(_login_page("<p class=\"error\">That key was refused.</p>"), 401,
                                headers=_NO_STORE)
        resp = RedirectResponse("/dashboard", 303)
        # request.url.scheme is https behind TLS, or behind a trusted proxy that says so (X-Forwarded-Proto).
        resp.set_cookie(DASHBOARD_COOKIE, make_session_token(api_key), max_age=DASHBOARD_SESSION_S, httponly=True,
                        samesite="strict", path="/", secure=request.url.scheme == "https")
        return resp


def register_debug_routes(app: FastAPI, engine: Any, api_key: str | None = None) -> None:
    source = KVSnapshotSource(engine)
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
    if api_key:
        _register_login(app, api_key)
