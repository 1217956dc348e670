"""`pagedserve serve`: the OpenAI-compatible server, with `vllm serve`'s flag names."""
from __future__ import annotations

import argparse
import logging
import signal
from typing import Callable

from pagedserve.server.limits import (HEALTH_MAX_STALL_S, MAX_REQUEST_BODY_SIZE, MAX_SAMPLES_PER_REQUEST,
                                      MAX_SEQUENCES_PER_REQUEST, SHUTDOWN_TIMEOUT_S)

logger = logging.getLogger("pagedserve.serve")

# The formats server/tool_parsers.py and server/reasoning.py read (kept here so --help needs no server import).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "phi4_mini_json", "pythonic")
REASONING_PARSERS = ("deepseek_r1", "qwen3")

class _ShutdownSignal(Exception):
    pass


def _api_key(value: str) -> str:
    if not value:
        raise argparse.ArgumentTypeError("must not be empty (an empty key would turn authentication off)")
    return value


def _positive(kind: type) -> Callable[[str], object]:
    def parse(value: str) -> object:
        number = kind(value)
        if not number > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {value}")
        return number
    return parse


def _non_negative_float(value: str) -> float:
    number = float(value)
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return number


def add_serve_parser(subparsers, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, type=_api_key,
                   help="require 'Authorization: Bearer KEY' on every endpoint except /health and /metrics "
                        "(default: $PAGEDSERVE_API_KEY, which keeps the key out of the process list)")
    g.add_argument("--max-samples-per-request", type=_positive(int), default=MAX_SAMPLES_PER_REQUEST,
                   metavar="N", help="largest n and best_of a request may ask for (400 above it)")
    g.add_argument("--max-sequences-per-request", type=_positive(int), default=MAX_SEQUENCES_PER_REQUEST,
                   metavar="N", help="largest number of prompts x samples (n or best_of) in one request")
    g.add_argument("--max-tokens-per-request", type=_positive(int), default=None, metavar="TOKENS",
                   help="largest sum over a request's prompts of prompt tokens + samples x max_tokens (max_tokens "
                        "left out counts as the rest of the context); default: --max-samples-per-request x "
                        "max_model_len, what one prompt with the largest n may take")
    g.add_argument("--max-request-body-size", type=_positive(int), default=MAX_REQUEST_BODY_SIZE,
                   metavar="BYTES", help="larger request bodies are refused with 413")
    g.add_argument("--health-max-stall-s", type=_positive(float), default=HEALTH_MAX_STALL_S,
                   metavar="SECONDS", help="/health answers 503 once one engine step has run this long")
    g.add_argument("--shutdown-timeout", type=_non_negative_float, default=SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long open responses may take to finish before the engine stops")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="before listening, run a few requests through the engine (a prefill chunk, a decode batch, "
                        "a chat, a JSON schema) so that memory first touched by serving is in the start-up figure "
                        "(default on; --no-warmup starts sooner)")
    g.add_argument("--disable-debug-routes", action="store_true",
                   help="leave out /debug/kv (every request's id, length and blocks) and /dashboard")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients send; the first is used in responses (default: --model)")
    g.add_argument("--metrics-prefix", choices=["pagedserve", "vllm"], default="pagedserve",
                   help="'vllm' exports the metrics as vllm:* for existing vLLM dashboards")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser')
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="how tool calls are read from the model's text under tool_choice auto")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="put the model's <think>...</think> text in reasoning_content")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.set_defaults(func=cmd_serve)


def check_tool_args(args: argparse.Namespace) -> None:
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser (one of: "
                         f"{', '.join(TOOL_CALL_PARSERS)})")


def _raise_shutdown(signum: int, _frame) -> None:
    raise _ShutdownSignal(signal.Signals(signum).name)


def log_memory(engine, prefaulted: bool, device: str) -> None:
    # What a pod's memory request must hold from the start: with the pool prefaulted, the resident figure now
    # is model + runtime + the whole pool, and serving adds only what requests themselves hold.
    from pagedserve.worker.memory import resident_bytes

    rss = resident_bytes()
    pool = engine.num_kv_blocks * engine.block_size * engine.kv_bytes_per_token
    if rss is None:
        return
    mib = 1 << 20
    how = ("resident from the start" if prefaulted else
           "not prefaulted: resident memory grows toward it as requests first reach its pages")
    if device != "cpu":
        pool, how = 0, "on the device"
    logger.info("memory: model and runtime %d MiB + KV pool %d MiB (%s) = %d MiB resident in this process",
                rss // mib - pool // mib, pool // mib, how, rss // mib)  # the parts add up as printed


def cmd_serve(args: argparse.Namespace) -> int:
    # Until uvicorn installs its own handlers (and after it restores these and re-raises the signal it
    # caught), SIGTERM behaves like Ctrl-C: unwind, stop the engine thread, exit 0.
    signal.signal(signal.SIGTERM, _raise_shutdown)
    signal.signal(signal.SIGINT, _raise_shutdown)
    check_tool_args(args)
    engine = None
    exit_code = 0
    try:
        from pagedserve import envs

        if args.api_key is None:
            args.api_key = envs.api_key()  # checked before the slow imports: a bad key fails at once
        from pagedserve.engine.arg_utils import EngineArgs
        from pagedserve.engine.async_engine import AsyncLLMEngine
        from pagedserve.malloc import freeze_startup_heap, tune_for_serving
        from pagedserve.server.app import run_server

        tune_for_serving()  # before the engine thread and the weights (pagedserve/malloc.py)

        config = EngineArgs.from_cli_args(args).create_engine_config()
        if args.served_model_name:
            from pagedserve.engine.kv_event_publisher import with_served_model_topic

            config = with_served_model_topic(config, args.served_model_name[0])
        engine = AsyncLLMEngine.from_config(config)
        name = (args.served_model_name or [args.model or engine.model_name])[0]
        logger.info("model: %s (served as %r, max_model_len %d)", args.model or engine.model_name, name,
                    engine.max_model_len)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %s, %d bytes per token", engine.num_kv_blocks,
                    engine.block_size, engine.num_kv_blocks * engine.block_size, engine.kv_cache_dtype,
                    engine.kv_bytes_per_token)
        if args.warmup:
            from pagedserve.engine.warmup import warm_up

            warm_up(engine)
        freeze_startup_heap()  # pagedserve/malloc.py
        log_memory(engine, config.cache.prefault_kv_cache, config.device.resolve())
        logger.info("serving at http://%s:%d  (OpenAI base_url http://%s:%d/v1)%s", args.host, args.port,
                    args.host, args.port, "; API key required" if args.api_key else "")
        exit_code = run_server(engine, args)
    except (_ShutdownSignal, KeyboardInterrupt) as sig:
        logger.info("received %s", sig or "SIGINT")
    finally:
        if engine is not None:
            engine.shutdown()
    if exit_code == 0:
        logger.info("shut down cleanly")
    return exit_code
