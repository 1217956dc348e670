"""`pagedserve bench serve`: the same streamed workload against one or more OpenAI-compatible servers."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import signal
import sys

from pagedserve.bench.client import Endpoint, Unreachable, list_models, normalize_base_url, send_request
from pagedserve.bench.dataset import BenchRequest, load_dataset, parse_range, random_requests
from pagedserve.bench.metrics import SLO
from pagedserve.bench.plot import load_point_label, plot_sweep
from pagedserve.bench.report import format_comparison, format_run, load_label, ratios, run_to_dict, write_json
from pagedserve.bench.runner import make_client, run_measured
from pagedserve.bench.sweep import run_sweeps


def _rate(text: str) -> float:
    rate = math.inf if text.lower() in ("inf", "infinity") else float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or 'inf', got {text!r}")
    return rate


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def add_bench_args(p: argparse.ArgumentParser, require_url: bool = True) -> None:
    g = p.add_argument_group("endpoints")
    g.add_argument("--base-url", action="append", required=require_url, metavar="URL",
                   help="OpenAI-compatible server, e.g. http://127.0.0.1:8000 (/v1 is added); repeat to compare")
    g.add_argument("--label", action="append", default=None, help="a name per --base-url for the report")
    g.add_argument("--model", action="append", default=None,
                   help="model name sent (one for all URLs, or one per URL); default: the first of /v1/models")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    g.add_argument("--endpoint-type", choices=["completions", "chat"], default="completions")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="random",
                   help="'random', 'prefix_repetition' (vLLM's), 'generated-shared-prefix' (SGLang's), "
                        "FILE.jsonl ({prompt, output_len?}) or a ShareGPT .json")
    g.add_argument("--num-prompts", type=_positive_int, default=None, help="default: 100 random, or all of a file")
    g.add_argument("--input-len", type=parse_range, default=(64, 256), metavar="N|LO-HI",
                   help="random prompt length in words, ~1 token each (default 64-256)")
    g.add_argument("--output-len", type=parse_range, default=None, metavar="N|LO-HI",
                   help="max_tokens per request (default 32-128; a file's own lengths win)")
    g.add_argument("--shared-prefix-len", type=int, default=0, metavar="N",
                   help="a common prefix of N words before every prompt (a long system prompt); for the "
                        "shared-prefix workloads, each prefix's length (default 256)")
    g.add_argument("--num-prefixes", type=_positive_int, default=10, metavar="N",
                   help="prefix_repetition: distinct prefixes; generated-shared-prefix: groups, each with its "
                        "own system prompt (default 10)")
    g.add_argument("--num-turns", type=_positive_int, default=1, metavar="N",
                   help="generated-shared-prefix: turns per conversation, each prompt extending the last")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--words-variant", type=int, default=0, metavar="N",
                   help="draw the random prompts' words (not their lengths or the shared prefix) from stream N: "
                        "warm a server up with another N and only the shared prefix is cached for the run")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=_rate, nargs="+", default=[math.inf], metavar="R",
                   help="Poisson arrival rate(s) in req/s, or inf; several values sweep")
    g.add_argument("--concurrency", type=_positive_int, nargs="+", default=None, metavar="C",
                   help="cap on requests in flight; several values sweep")
    g.add_argument("--burstiness", type=_positive_float, default=1.0, metavar="B",
                   help="arrival gaps drawn from a gamma distribution of shape B and the rate's mean (vLLM's "
                        "flag): 1 is Poisson, below 1 burstier, above 1 more regular")
    g.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed requests per endpoint first")
    g.add_argument("--cooldown", type=float, default=0.0, metavar="S",
                   help="seconds of quiet before each measured run, so that work an endpoint (or another server on "
                        "the machine) still does after the previous run ends is not counted against this one")
    g.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per-read timeout")
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly max_tokens (vLLM, llama.cpp and pagedserve honor it)")
    g.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON", help="more request fields")
    g = p.add_argument_group("targets and cost")
    g.add_argument("--slo-ttft", type=float, default=None, metavar="S", help="time-to-first-token target, seconds")
    g.add_argument("--slo-tpot", type=float, default=None, metavar="S", help="time-per-output-token target, seconds")
    g.add_argument("--slo-e2e", type=float, default=None, metavar="S", help="end-to-end latency target, seconds")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="vLLM's form of the targets, in milliseconds: ttft:MS tpot:MS e2el:MS")
    g.add_argument("--sweep", action="store_true",
                   help="find the highest request rate at which --sweep-attainment of the requests meet the SLO "
                        "(open loop; starts at the first finite --request-rate, else 1 req/s)")
    g.add_argument("--sweep-attainment", type=float, default=0.9, metavar="F",
                   help="share of requests that must meet the SLO (default 0.9)")
    g.add_argument("--sweep-steps", type=int, default=4, metavar="N", help="bisection steps after bracketing")
    g.add_argument("--sweep-max-rate", type=_positive_float, default=None, metavar="R",
                   help="highest rate the sweep tries (req/s)")
    g.add_argument("--price-per-hour", type=float, default=None, metavar="USD", help="hourly price of the deployment")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, metavar="FILE.json", help="JSON report, rewritten after every run")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="latency-vs-throughput curves of the sweep")
    g.add_argument("--save-detailed", action="store_true", help="per-request timings in the JSON report")
    g.add_argument("--no-progress", action="store_true")


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark OpenAI-compatible servers")
    sub = p.add_subparsers(dest="bench_command", required=True)
    s = sub.add_parser("serve", help="streamed latency, throughput, goodput and cost per query")
    add_bench_args(s)
    s.set_defaults(func=cmd_bench_serve)


def _per_url(values: list[str] | None, n: int, flag: str) -> list[str | None]:
    if not values:
        return [None] * n
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ValueError(f"give {flag} once or once per --base-url ({n}), got {len(values)}")
    return values


def workload(args: argparse.Namespace, point: int = 0) -> list[BenchRequest]:
    # point: the sweep point; each gets fresh words, as does each --words-variant (1000 points apart)
    output_len = args.output_len or (32, 128)
    return load_dataset(args.dataset, args.num_prompts, args.input_len, output_len, args.shared_prefix_len,
                        args.seed, output_len_given=args.output_len is not None,
                        variant=1000 * args.words_variant + point, num_prefixes=args.num_prefixes,
                        num_turns=args.num_turns)


def slo_of(args: argparse.Namespace) -> SLO:
    # --slo-* in seconds and --goodput in milliseconds name the same targets; a target given twice is an error.
    slo = SLO(args.slo_ttft, args.slo_tpot, args.slo_e2e)
    if not args.goodput:
        return slo
    g = SLO.parse_goodput(args.goodput)
    keys = ("ttft_s", "tpot_s", "e2el_s")
    both = [k for k in keys if getattr(slo, k) is not None and getattr(g, k) is not None]
    if both:
        raise ValueError(f"{', '.join(k.removesuffix('_s') for k in both)} given by both --goodput and --slo-*")
    return SLO(*(getattr(g, k) if getattr(g, k) is not None else getattr(slo, k) for k in keys))


def cmd_bench_serve(args: argparse.Namespace) -> int:
    return run_benchmark(args)


def run_benchmark(args: argparse.Namespace, meta: dict | None = None,
                  points: list[tuple[float, int | None]] | None = None) -> int:
    """points: (request rate, concurrency) pairs to run in order; default every --request-rate with every
    --concurrency."""
    points = points or [(rate, c) for c in (args.concurrency or [None]) for rate in args.request_rate]
    requests = workload(args)  # dataset problems raise ValueError before any request is sent
    if args.sweep and slo_of(args).is_empty:  # a bad --goodput raises here too
        raise ValueError("--sweep needs latency targets: --goodput ttft:MS tpot:MS (or --slo-ttft / --slo-tpot)")
    if args.sweep and args.concurrency:
        raise ValueError("--sweep sends open-loop arrivals; a --concurrency cap would hide the server's queueing")
    if not 0 < args.sweep_attainment <= 1:
        raise ValueError(f"--sweep-attainment must be in (0, 1], got {args.sweep_attainment}")
    urls = [normalize_base_url(u) for u in args.base_url]
    labels = _per_url(args.label, len(urls), "--label")
    labels = [lb or u.split("://", 1)[1].removesuffix("/v1") for lb, u in zip(labels, urls)]
    if len(set(labels)) != len(labels):
        raise ValueError(f"endpoint labels must differ, got {labels}; use --label")
    models = _per_url(args.model, len(urls), "--model")
    return asyncio.run(_run(args, requests, list(zip(urls, labels, models)), meta or {}, points))


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def _resolve(args, specs) -> tuple[list[Endpoint], dict[str, str]]:
    endpoints, unreachable = [], {}
    async with make_client(None, 30.0) as client:
        for url, label, model in specs:
            try:
                served = await list_models(client, url, args.api_key)
            except ConnectionError as e:
                if isinstance(e, Unreachable) or model is None:
                    unreachable[label] = str(e)
                    _say(f"error: {label}: {e}; skipping this endpoint")
                    continue
                served = []
            if model is None and not served:
                unreachable[label] = f"{url}/models lists no model; pass --model"
                _say(f"error: {label}: {unreachable[label]}; skipping this endpoint")
                continue
            endpoints.append(Endpoint(url, model or served[0], label, args.endpoint_type, args.api_key))
    return endpoints, unreachable


async def _run(args, requests: list[BenchRequest], specs, meta: dict, points) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        _say("\nstopping: cancelling requests in flight and reporting what finished (Ctrl-C again to abort)")
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)  # the next Ctrl-C raises KeyboardInterrupt as usual

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):
        pass  # not the main thread, or no signal support: Ctrl-C then aborts without a report
    slo = slo_of(args)
    sampling = {"temperature": args.temperature, **({"ignore_eos": True} if args.ignore_eos else {}),
                **(args.extra_body or {})}
    endpoints, unreachable = await _resolve(args, specs)
    report = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **meta,
              "config": {"dataset": args.dataset, "num_prompts": len(requests), "input_len": args.input_len,
                         "output_len": args.output_len, "shared_prefix_len": args.shared_prefix_len,
                         "seed": args.seed, "endpoint_type": args.endpoint_type, "sampling": sampling,
                         "warmup": args.warmup, "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s,
                                                        "e2el_s": slo.e2el_s},
                         "price_per_hour": args.price_per_hour, "burstiness": args.burstiness,
                         "num_prefixes": args.num_prefixes, "num_turns": args.num_turns,
                         "load_points": [{"request_rate": "inf" if math.isinf(r) else r, "concurrency": c}
                                         for r, c in points]},
              "workload": {"estimated_prompt_tokens": sum(r.prompt_len for r in requests),
                           "requested_output_tokens": sum(r.output_len for r in requests)},
              "unreachable": unreachable, "runs": [], "comparisons": [], "sweeps": [], "interrupted": False}
    if not endpoints:
        _say("error: no endpoint could be reached")
        if args.out:
            write_json(args.out, report)
        return 1
    for ep in endpoints:
        if args.warmup > 0 and not stop.is_set():
            await _warmup(ep, args.warmup, sampling, args.seed, args.timeout)
    if args.sweep:
        await run_sweeps(args, endpoints, sampling, slo, stop, report, lambda i: workload(args, point=i),
                         lambda: args.out and write_json(args.out, report))
        if args.out:
            _say(f"report written to {args.out}")
        return 130 if report["interrupted"] else (1 if unreachable else 0)
    curves: dict[str, list] = {ep.label: [] for ep in endpoints}
    ok = True
    for i, (rate, conc) in enumerate(points):
        point_metrics = []
        # Fresh random words at each point (same lengths), so no point is served from another's prefix cache.
        reqs = workload(args, point=i) if i else requests
        for ep in endpoints:  # endpoints take turns at each point, so slow drift in machine load hits both
            if stop.is_set():
                break
            run, m = await run_measured(ep, reqs, sampling, rate, conc, stop, args, slo,
                                        f"{ep.label} {load_label(rate, conc)}")
            print(format_run(run, m, slo), flush=True)
            ok = ok and m.num_completed > 0
            report["runs"].append(run_to_dict(run, m, args.save_detailed))
            report["interrupted"] = report["interrupted"] or run.interrupted
            point_metrics.append((ep.label, m))
            curves[ep.label].append((load_point_label(rate, conc), m))
            if args.out:
                write_json(args.out, report)
        if len(point_metrics) > 1:
            labels, ms = [x[0] for x in point_metrics], [x[1] for x in point_metrics]
            print(f"\n-- side by side | {load_label(rate, conc)} --\n{format_comparison(labels, ms)}\n", flush=True)
            report["comparisons"].append({"request_rate": "inf" if math.isinf(rate) else rate, "concurrency": conc,
                                          "baseline": labels[0],
                                          "ratios": {lb: ratios(ms[0], m) for lb, m in point_metrics[1:]}})
        if args.out:
            write_json(args.out, report)
    if args.plot and any(curves.values()):
        plot_sweep({k: v for k, v in curves.items() if v}, slo, args.plot,
                   title=f"{args.dataset}, {len(requests)} prompts, {args.endpoint_type}")
        _say(f"plot written to {args.plot}")
    if args.out:
        _say(f"report written to {args.out}")
    if report["interrupted"]:
        return 130
    return 0 if ok and not unreachable else 1


async def _warmup(ep: Endpoint, n: int, sampling: dict, seed: int, timeout_s: float) -> None:
    # The first requests pay one-time costs (connections, lazy initialization). Their prompts are drawn
    # apart from the workload's, so no timed request finds its prompt already in a prefix cache.
    async with make_client(None, timeout_s) as client:
        for req in random_requests(n, (32, 32), (8, 8), seed=seed + 1_000_003):
            r = await send_request(client, ep, req, sampling)
            if not r.success:
                _say(f"warning: {ep.label}: warmup request failed: {r.error}")
