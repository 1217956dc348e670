"""`pagedserve serve`: the OpenAI-compatible server, with `vllm serve`'s flag names."""
from __future__ import annotations

import argparse
import logging
import signal
from typing import Callable

logger = logging.getLogger("pagedserve.serve")


class _ShutdownSignal(Exception):
    pass


def add_serve_parser(subparsers, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint except /health and /metrics")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients send; the first is used in responses (default: --model)")
    g.add_argument("--metrics-prefix", choices=["pagedserve", "vllm"], default="pagedserve",
                   help="'vllm' exports the metrics as vllm:* for existing vLLM dashboards")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.set_defaults(func=cmd_serve)


def _raise_shutdown(signum: int, _frame) -> None:
    raise _ShutdownSignal(signal.Signals(signum).name)


def cmd_serve(args: argparse.Namespace) -> int:
    # Until uvicorn installs its own handlers (and after it restores these and re-raises the signal it
    # caught), SIGTERM behaves like Ctrl-C: unwind, stop the engine thread, exit 0.
    signal.signal(signal.SIGTERM, _raise_shutdown)
    signal.signal(signal.SIGINT, _raise_shutdown)
    engine = None
    try:
        from pagedserve.engine.arg_utils import EngineArgs
        from pagedserve.engine.async_engine import AsyncLLMEngine
        from pagedserve.server.app import run_server

        config = EngineArgs.from_cli_args(args).create_engine_config()
        engine = AsyncLLMEngine.from_config(config)
        name = (args.served_model_name or [args.model or engine.model_name])[0]
        logger.info("model: %s (served as %r, max_model_len %d)", args.model or engine.model_name, name,
                    engine.max_model_len)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens", engine.num_kv_blocks, engine.block_size,
                    engine.num_kv_blocks * engine.block_size)
        logger.info("serving at http://%s:%d  (OpenAI base_url http://%s:%d/v1)%s", args.host, args.port,
                    args.host, args.port, "; API key required" if args.api_key else "")
        run_server(engine, args)
    except (_ShutdownSignal, KeyboardInterrupt) as sig:
        logger.info("received %s", sig or "SIGINT")
    finally:
        if engine is not None:
            engine.shutdown()
    logger.info("shut down cleanly")
    return 0
