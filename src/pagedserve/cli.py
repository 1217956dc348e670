"""`pagedserve generate | chat | serve | ...`, with vLLM's flag names where vLLM has them."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from pagedserve.engine.arg_utils import EngineArgs


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed,
                          stop=args.stop, ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve.llm import LLM

    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    params = sampling_params(args)
    if args.command == "chat":
        outs = llm.chat([{"role": "user", "content": p} for p in args.prompts][:1], params, use_tqdm=False)
    else:
        outs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1)
    for out in outs:
        for c in out.outputs:
            print(c.text if args.command == "chat" else (out.prompt or "") + c.text)
            print(f"[finish_reason={c.finish_reason}, tokens={len(c.token_ids)}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="PagedAttention LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("generate", "complete prompts offline"), ("chat", "answer one chat message")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("prompts", nargs="+")
        EngineArgs.add_cli_args(p)
        add_sampling_args(p)
        p.set_defaults(func=cmd_generate)
    try:
        from pagedserve.server.cli_args import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub, EngineArgs.add_cli_args)
    try:
        from pagedserve.bench.cli import add_bench_parser
        from pagedserve.plan import add_plan_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
        add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
