"""The FastAPI app: routes, OpenAI-style errors, API keys, and the uvicorn runner.

Handlers only add, stream and abort on the AsyncLLMEngine; tokenizer work runs on its tokenizer thread and
model work on its engine thread, never in a handler.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve import __version__
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.processor import ChatPrompt
from pagedserve.messages import EngineClosedError, EngineError
from pagedserve.metrics.prometheus import PrometheusMetrics
from pagedserve.server.limits import (HEALTH_MAX_STALL_S, MAX_REQUEST_BODY_SIZE, MAX_SAMPLES_PER_REQUEST,
                                     MAX_SEQUENCES_PER_REQUEST, SHUTDOWN_TIMEOUT_S)
from pagedserve.server.context import RequestLimits, ServerContext
from pagedserve.server.debug import register_debug_routes
from pagedserve.server.errors import OpenAIError
from pagedserve.server.middleware import (APIKeyMiddleware, BodySizeLimitMiddleware, HTTPMetricsMiddleware,
                                          UnhandledErrorMiddleware, internal_error)
from pagedserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                        DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                                        TokenizeResponse)
from pagedserve.server.serving_chat import OpenAIServingChat
from pagedserve.server.serving_completion import OpenAIServingCompletion
from pagedserve.server.serving_render import register_render_routes
from pagedserve.server.streaming import ClientDisconnected, json_response

logger = logging.getLogger(__name__)


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

    @app.exception_handler(TemplateError)
    async def _template(_: Request, exc: TemplateError) -> Response:
        # A chat template's raise_exception(...) refuses the conversation (roles out of order, ...).
        return OpenAIError(f"chat template error: {exc}", 400).response()

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def _unhandled(_: Request, exc: Exception) -> Response:
        # Starlette's last resort, for an error in a middleware outside UnhandledErrorMiddleware: without this a
        # bug answers a plain-text 500 that OpenAI clients cannot parse. (Starlette re-raises afterwards.)
        return internal_error(exc).response()


def build_app(engine: AsyncLLMEngine, args: Any) -> FastAPI:
    model_path = getattr(args, "model", None)
    names = list(getattr(args, "served_model_name", None) or []) or [model_path or engine.model_name]
    parser = getattr(args, "tool_call_parser", None) if getattr(args, "enable_auto_tool_choice", False) else None
    limits = RequestLimits(getattr(args, "max_samples_per_request", MAX_SAMPLES_PER_REQUEST),
                           getattr(args, "max_sequences_per_request", MAX_SEQUENCES_PER_REQUEST),
                           getattr(args, "max_tokens_per_request", None))
    ctx = ServerContext(engine, names, model_path, parser, getattr(args, "reasoning_parser", None), limits)
    metrics = PrometheusMetrics(engine, ctx.model_name, getattr(args, "metrics_prefix", "pagedserve"))
    app = FastAPI(title="pagedserve", version=__version__)
    app.state.ctx = ctx
    app.state.metrics = metrics
    _install_error_handlers(app)
    app.add_middleware(UnhandledErrorMiddleware)  # added first: innermost, inside the counter and the limits
    max_stall_s = getattr(args, "health_max_stall_s", HEALTH_MAX_STALL_S)
    # Added last is outermost: the key is checked before any body byte is read.
    app.add_middleware(BodySizeLimitMiddleware,
                       max_bytes=getattr(args, "max_request_body_size", MAX_REQUEST_BODY_SIZE))
    api_key = getattr(args, "api_key", None)
    debug_routes = not getattr(args, "disable_debug_routes", False)
    if api_key is not None:
        if not api_key:  # "" must not silently mean "no auth"
            raise ValueError("--api-key must not be empty")
        app.add_middleware(APIKeyMiddleware, api_key=api_key, dashboard=debug_routes)
    completion = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create(req, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create(req, raw_request)

    register_render_routes(app, completion, chat)

    @app.get("/v1/models")
    async def list_models() -> Response:
        cards = [ModelCard(id=name, root=model_path or engine.model_name, max_model_len=engine.max_model_len)
                 for name in names]
        return json_response(ModelList(data=cards))

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy(max_stall_s):
            return Response(status_code=200)
        return OpenAIError(f"the engine is stopped, or its engine or tokenizer thread has been stuck in one step "
                           f"for over {max_stall_s:g}s", 503).response()

    @app.get("/ready")
    async def ready() -> Response:
        # Readiness (the Helm chart's probe, so the Service and the gateway's endpoint picker route here): the
        # model is loaded and the engine takes requests. Once a shutdown starts, new connections are refused.
        if engine.is_healthy(max_stall_s):
            return JSONResponse({"status": "ready"})
        return OpenAIError("not ready: the engine is stopped or stuck", 503).response()

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Response:
        ctx.check_model(req.model)
        if req.messages is not None:
            rendered = await engine.render_chat(ChatPrompt([m.to_template_dict() for m in req.messages],
                                                           req.add_generation_prompt))
            ids = rendered["prompt_token_ids"]
        else:
            ids = await engine.encode(req.prompt, req.add_special_tokens)
        return json_response(TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        ctx.check_model(req.model)
        return json_response(DetokenizeResponse(prompt=await engine.detokenize(req.tokens)))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    if debug_routes:
        register_debug_routes(app, engine, api_key)  # /debug/kv and /dashboard
    # Outermost, so the 401s and 413s of the middlewares above are counted too.
    app.add_middleware(HTTPMetricsMiddleware, count=metrics.count_http,
                       routes=frozenset(getattr(r, "path", "") for r in app.routes))
    return app


# On SIGINT/SIGTERM open responses get --shutdown-timeout seconds to finish; then the engine stops, which ends
# every stream with an error event and [DONE] (503 for non-streaming), so uvicorn never has to cancel a handler
# mid-await. A second signal stops the engine at once, and the process then exits with FORCED_EXIT_CODE.
DRAIN_S = SHUTDOWN_TIMEOUT_S
FORCED_EXIT_CODE = 1


def run_server(engine: AsyncLLMEngine, args: Any) -> int:
    """Serve until SIGINT/SIGTERM, drain (--shutdown-timeout), then stop the engine. Returns the exit code."""
    import asyncio

    import uvicorn

    drain_s = float(getattr(args, "shutdown_timeout", DRAIN_S))

    class Server(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        forced = False

        async def serve(self, sockets: Any = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn's own second SIGINT (force_exit) stops waiting for connections and lets asyncio cancel
            # the open streams mid-write: no error event, no [DONE]. Instead stop the engine now, which ends
            # every stream properly; the connections then close by themselves. A third signal forces.
            if self.should_exit and not self.forced and self.loop is not None:
                self.forced = True
                # Runs inside a signal handler: the engine's lock may be held by this very thread, so the
                # shutdown itself is left to the event loop.
                self.loop.call_soon_threadsafe(engine.shutdown, 0.0)
                return
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            stop = asyncio.get_running_loop().call_later(drain_s, engine.shutdown, 0.0)
            try:
                await super().shutdown(sockets)
            finally:
                stop.cancel()

    app = build_app(engine, args)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=getattr(args, "uvicorn_log_level", "info"),
                            timeout_graceful_shutdown=int(drain_s) + 5)
    server = Server(config)
    try:
        server.run()
    except BaseException:
        # uvicorn re-raises the signals it caught once it has stopped; after a forced stop the exit code
        # reports it instead.
        if not server.forced:
            raise
    finally:
        engine.shutdown()
        logger.info("engine stopped")
    if server.forced:
        logger.error("stopped by a second signal: open streams were ended with an error")
        return FORCED_EXIT_CODE
    return 0
