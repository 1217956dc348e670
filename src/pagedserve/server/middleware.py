"""Plain ASGI middlewares: API keys, the request body limit, the HTTP response counter, and bugs' 500s.

Plain ASGI (not BaseHTTPMiddleware) so they neither buffer streams nor get in the way of disconnects, and they
run before FastAPI parses the body.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import time
from http.cookies import CookieError, SimpleCookie
from typing import Callable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import RedirectResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.messages import describe_error
from pagedserve.server.errors import OpenAIError

logger = logging.getLogger(__name__)

# Probes and scrapers carry no key; the dashboard's login form is how a browser gets one in.
DASHBOARD_LOGIN_PATH = "/dashboard/login"
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", DASHBOARD_LOGIN_PATH})
# A browser opening a URL cannot send an Authorization header, so the dashboard's read-only GETs also take a
# session token from the cookie the login form sets (HttpOnly, SameSite=Strict: other sites can neither read
# nor send it; Secure behind TLS). The token is "<expiry>.<HMAC of the expiry under the key>": it expires, and
# neither it nor a stolen copy reveals the key. The cookie opens nothing else: the API still needs the header.
DASHBOARD_COOKIE = "pagedserve_session"
DASHBOARD_SESSION_S = 12 * 3600
COOKIE_PATHS = frozenset({"/dashboard", "/dashboard/app.js", "/dashboard/style.css", "/debug/kv"})


def _session_mac(api_key: bytes, expires: str) -> str:
    return hmac.new(api_key, b"pagedserve dashboard session " + expires.encode(), hashlib.sha256).hexdigest()


def make_session_token(api_key: str, now: float | None = None) -> str:
    expires = str(int(now if now is not None else time.time()) + DASHBOARD_SESSION_S)
    return f"{expires}.{_session_mac(api_key.encode(), expires)}"


def session_token_valid(api_key: bytes, token: str, now: float | None = None) -> bool:
    expires, _, mac = token.partition(".")
    if not expires.isdigit() or not hmac.compare_digest(mac.encode(), _session_mac(api_key, expires).encode()):
        return False
    return int(expires) > (now if now is not None else time.time())


class APIKeyMiddleware:
    # Runs before body parsing: a keyless request with a broken body gets 401, not 400.
    def __init__(self, app: ASGIApp, api_key: str, dashboard: bool = True) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.dashboard = dashboard  # False with --disable-debug-routes: no cookie, no login redirect

    def _authorized(self, scope: Scope) -> bool:
        headers = Headers(scope=scope)
        given = headers.get("authorization", "").encode("latin-1", "replace")
        scheme, _, token = given.strip().partition(b" ")
        # The scheme is case-insensitive (RFC 9110); compare_digest takes time independent of where the
        # key's bytes differ.
        if hmac.compare_digest(token.strip(), self.expected) and scheme.lower() == b"bearer":
            return True
        if self.dashboard and scope["path"] in COOKIE_PATHS and scope["method"] == "GET":
            cookie = SimpleCookie()
            try:
                cookie.load(headers.get("cookie", ""))
            except CookieError:
                return False
            morsel = cookie.get(DASHBOARD_COOKIE)
            return morsel is not None and session_token_valid(self.expected, morsel.value)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            if self.dashboard and scope["path"] == "/dashboard":  # a person with a browser: to the form that asks for the key
                await RedirectResponse(DASHBOARD_LOGIN_PATH, 303)(scope, receive, send)
                return
            err = OpenAIError("Incorrect or missing API key; send 'Authorization: Bearer <key>'.", 401,
                              code="invalid_api_key")
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for a body over max_bytes: at once from Content-Length, or as soon as a chunked upload passes it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error_message(self) -> str:
        return f"the request body exceeds {self.max_bytes} bytes (--max-request-body-size)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await OpenAIError(self._error_message(), 413).response()(scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI re-raises an HTTPException met while reading the body; the app's handler turns
                    # it into the OpenAI error body. Nothing more of the body is read.
                    raise HTTPException(413, self._error_message())
            return message

        await self.app(scope, counted_receive, send)


class HTTPMetricsMiddleware:
    """Counts every response (401 and 413 from the middlewares inside it too) by route, method and status."""

    def __init__(self, app: ASGIApp, count: Callable[[str, str, int], None], routes: frozenset[str]) -> None:
        self.app = app
        self.count = count
        self.routes = routes  # unknown paths share one label, so scanners cannot grow the series without bound

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        handler = scope["path"] if scope["path"] in self.routes else "none"

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.count(handler, scope["method"], message["status"])
            await send(message)

        await self.app(scope, receive, counted_send)


def internal_error(exc: BaseException) -> OpenAIError:
    return OpenAIError(f"internal server error: {describe_error(exc)}", 500)


class UnhandledErrorMiddleware:
    """A bug's OpenAI 500, answered inside the other middlewares (so it is counted) and not re-raised.

    Starlette's outermost error middleware answers an unhandled error and then re-raises it, and uvicorn closes
    the connection when an error escapes after the response started: a client's next request on that keep-alive
    connection was reset. Here the traceback is logged and the connection serves on. A response already under
    way (a stream: those end in-band with an error event) cannot get a second one, so its error goes on up."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as exc:
            if started:
                raise
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            await internal_error(exc).response()(scope, receive, send)
