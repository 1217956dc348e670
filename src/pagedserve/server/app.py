"""The FastAPI app: routes, OpenAI-style errors, API keys, and the uvicorn runner.

Handlers only add, stream and abort on the AsyncLLMEngine; tokenizer work runs on its tokenizer thread and
model work on its engine thread, never in a handler.
"""
from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve import __version__
from pagedserve.engine.async_engine import AsyncLLMEngine, EngineClosedError, EngineError
from pagedserve.metrics.prometheus import PrometheusMetrics
from pagedserve.server.context import ServerContext
from pagedserve.server.errors import OpenAIError
from pagedserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                        DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                                        TokenizeResponse)
from pagedserve.server.serving_chat import OpenAIServingChat
from pagedserve.server.serving_completion import OpenAIServingCompletion
from pagedserve.server.streaming import ClientDisconnected, json_response

logger = logging.getLogger(__name__)

# Probes and scrapers carry no key.
OPEN_PATHS = frozenset({"/health", "/metrics"})


class APIKeyMiddleware:
    # Plain ASGI (not BaseHTTPMiddleware) so it neither buffers streams nor gets in the way of disconnects,
    # and it runs before body parsing: a keyless request with a broken body gets 401, not 400.
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = Headers(scope=scope).get("authorization", "").encode("latin-1", "replace")
            # compare_digest takes time independent of where the bytes differ.
            if not hmac.compare_digest(given, self.expected):
                err = OpenAIError("Incorrect or missing API key; send 'Authorization: Bearer <key>'.", 401,
                                  code="invalid_api_key")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    # param names the top-level field, as OpenAI does; the message keeps the full path.
    parts, param = [], None
    for e in exc.errors():
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")
            continue
        param = param or (loc[0] if loc else None)
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        where = ".".join(loc)
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request", param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        # Malformed JSON arrives here too (type json_invalid). OpenAI answers 400, never FastAPI's 422.
        message, param = _validation_message(exc)
        return OpenAIError(message, 400, param=param).response()

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> Response:
        return OpenAIError(str(exc), 400).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return OpenAIError(str(exc.detail), exc.status_code).response()

    @app.exception_handler(EngineClosedError)
    async def _closed(_: Request, exc: EngineClosedError) -> Response:
        return OpenAIError(str(exc), 503).response()

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> Response:
        return OpenAIError(str(exc), 500).response()

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


def build_app(engine: AsyncLLMEngine, args: Any) -> FastAPI:
    model_path = getattr(args, "model", None)
    names = list(getattr(args, "served_model_name", None) or []) or [model_path or engine.model_name]
    ctx = ServerContext(engine, names, model_path)
    metrics = PrometheusMetrics(engine, ctx.model_name, getattr(args, "metrics_prefix", "pagedserve"))
    app = FastAPI(title="pagedserve", version=__version__)
    app.state.ctx = ctx
    app.state.metrics = metrics
    _install_error_handlers(app)
    api_key = getattr(args, "api_key", None)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    completion = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create(req, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create(req, raw_request)

    @app.get("/v1/models")
    async def list_models() -> Response:
        cards = [ModelCard(id=name, root=model_path or engine.model_name, max_model_len=engine.max_model_len)
                 for name in names]
        return json_response(ModelList(data=cards))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Response:
        ctx.check_model(req.model)

        def run(proc: Any) -> list[int]:
            if req.messages is not None:
                prompt = proc.chat_prompt([m.to_template_dict() for m in req.messages], None,
                                          req.add_generation_prompt)
                return prompt["prompt_token_ids"]
            proc.check_text_length(req.prompt)
            return proc.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)

        ids = list(await engine.run_processor(run))
        return json_response(TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        ctx.check_model(req.model)

        def run(proc: Any) -> str:
            bad = [t for t in req.tokens if not 0 <= t < proc.vocab_size]
            if bad:
                raise ValueError(f"token ids must be in [0, {proc.vocab_size}), got {bad[:5]}")
            return proc.tokenizer.decode(req.tokens)

        return json_response(DetokenizeResponse(prompt=await engine.run_processor(run)))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app


# On SIGINT/SIGTERM open responses get this long to finish; then the engine stops, which ends every stream
# with an error event and [DONE] (503 for non-streaming), so uvicorn never has to cancel a handler mid-await.
DRAIN_S = 5.0


def run_server(engine: AsyncLLMEngine, args: Any) -> None:
    """Serve until SIGINT/SIGTERM, drain (DRAIN_S), then stop the engine."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            stop = asyncio.get_running_loop().call_later(DRAIN_S, engine.shutdown, 0.0)
            try:
                await super().shutdown(sockets)
            finally:
                stop.cancel()

    app = build_app(engine, args)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=getattr(args, "uvicorn_log_level", "info"),
                            timeout_graceful_shutdown=int(DRAIN_S) + 5)
    try:
        Server(config).run()
    finally:
        engine.shutdown()
        logger.info("engine stopped")
