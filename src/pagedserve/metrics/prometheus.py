"""Prometheus export with vLLM's metric names, under the prefix "pagedserve:" or "vllm:".

With --metrics-prefix vllm the series are named exactly as vLLM's, so existing dashboards and autoscalers
read them unchanged. Each server gets its own CollectorRegistry (no global state: tests run several servers).

Where the numbers come from:
- Gauges and counters are read at scrape time from the async engine's snapshot, which the engine thread takes
  after every step and command batch. Totals therefore live in one place (EngineStats / SchedulerStats).
- Everything counts user requests, as vLLM does: a request with n samples finishes (or is aborted) once, with
  sample 0's finish reason, and observes its latencies once.
- Histograms are observed when a request finishes (EngineStats.on_finished, on the engine thread). Aborted
  requests are counted in request_success_total{finished_reason="abort"} but observe no latencies.
- request_queue_time_seconds: arrival until the scheduler first admitted the request (before its prefill).
- *_by_priority_seconds{priority}: queue time, TTFT and end-to-end latency per priority class (the request's
  `priority`, clamped to -8..8 so a client cannot create series without bound).
- http_requests_total{handler,method,status="2xx"|"4xx"|"5xx"} counts responses (status class as sent at the
  start of the response: a stream that fails later still counts as 2xx; its error shows in the engine's series).
- inter_token_latency_seconds: the engine keeps only first/last token times, so a finished request observes
  its mean gap once per gap. For n=1 _sum and _count equal what per-token observation gives; only the spread
  across buckets within one request is flattened (for n>1 the gap is approximated from the request's span).
- kv_block_lifetime_seconds, kv_block_idle_before_evict_seconds, kv_block_reuse_gap_seconds: vLLM's sampled
  residency histograms. The block pool follows one allocation in RESIDENCY_SAMPLE_EVERY (core/kv_residency.py)
  and queues an event when a followed block is handed out again; the events are drained and observed at
  scrape time, so the engine thread never calls into prometheus_client for them.
"""
from __future__ import annotations

from typing import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedserve.metrics.stats import RequestStats

PREFIXES = ("pagedserve", "vllm")

# vLLM's buckets, so histogram_quantile() panels look the same.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]
_RESIDENCY_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                      1800.0, 3600.0]
_FINISH_REASONS = ("stop", "length", "abort")
PRIORITY_LABEL_RANGE = 8  # priority labels are clamped to -8..8


class _SnapshotCollector:
    def __init__(self, engine, model_name: str, prefix: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.prefix = prefix

    def collect(self) -> Iterable[Metric]:
        p, model = self.prefix, [self.model_name]
        snap = self.engine.snapshot
        sched = snap.scheduler

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
            g.add_metric(model, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
            c.add_metric(model, value)
            return c

        yield gauge("num_requests_running", "Number of sequences in the running batch.",
                    sched.num_running if sched else 0)
        yield gauge("num_requests_waiting", "Number of sequences waiting to be scheduled.",
                    sched.num_waiting if sched else 0)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    sched.kv_cache_usage if sched else 0.0)
        yield counter("num_preemptions_total", "Cumulative number of preemptions.",
                      sched.num_preemptions_total if sched else 0)
        yield counter("prompt_tokens_total", "Number of prefill tokens computed (prefix-cache hits excluded).",
                      snap.num_prompt_tokens_total)
        yield counter("generation_tokens_total", "Number of generated tokens.",
                      snap.num_generation_tokens_total)
        yield counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                      sched.prefix_cache_queries if sched else 0)
        yield counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
                      sched.prefix_cache_hits if sched else 0)
        # Sharing and preemption (pagedserve's own series; vLLM has no equivalents for most of them).
        yield gauge("kv_shared_blocks", "KV blocks currently referenced by more than one sequence.",
                    sched.num_shared_blocks if sched else 0)
        yield counter("kv_copy_on_write_total", "Blocks copied because a sequence wrote to a shared block.",
                      sched.num_cow_copies_total if sched else 0)
        yield counter("kv_swapped_out_blocks_total", "KV blocks swapped out to the host pool.",
                      sched.num_swapped_out_blocks_total if sched else 0)
        yield counter("kv_swapped_in_blocks_total", "KV blocks swapped back in from the host pool.",
                      sched.num_swapped_in_blocks_total if sched else 0)
        yield gauge("num_requests_swapped", "Requests whose KV blocks sit in the host swap pool.",
                    sched.num_swapped if sched else 0)
        preempt = CounterMetricFamily(f"{p}:preemptions_by_mode_total", "Preemptions by mode.",
                                      labels=["model_name", "mode"])
        swaps = sched.num_preemptions_swap_total if sched else 0
        preempt.add_metric([self.model_name, "swap"], swaps)
        preempt.add_metric([self.model_name, "recompute"], (sched.num_preemptions_total if sched else 0) - swaps)
        yield preempt
        success = CounterMetricFamily(f"{p}:request_success_total", "Count of finished requests by reason.",
                                      labels=["model_name", "finished_reason"])
        for reason in _FINISH_REASONS:
            value = snap.num_aborted if reason == "abort" else snap.finished_by_reason.get(reason, 0)
            success.add_metric([self.model_name, reason], value)
        yield success
        if snap.spec is not None:
            yield from _spec_decode_metrics(p, self.model_name, snap.spec)
        if sched is not None and sched.kv_offload is not None:
            yield from _kv_offload_metrics(gauge, counter, sched.kv_offload)
        info = GaugeMetricFamily(f"{p}:cache_config_info", "Information of the KV cache configuration.",
                                 labels=["block_size", "num_gpu_blocks", "cache_dtype", "kv_bytes_per_token"])
        info.add_metric([str(self.engine.block_size), str(self.engine.num_kv_blocks), self.engine.kv_cache_dtype,
                         str(self.engine.kv_bytes_per_token)], 1)
        yield info


def _spec_decode_metrics(p: str, model_name: str, spec) -> Iterable[Metric]:
    # vLLM V1's speculative decoding counters (only when speculation is configured).
    for name, doc, value in (
            ("spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts),
            ("spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens)):
        c = CounterMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
        c.add_metric([model_name], value)
        yield c
    per_pos = CounterMetricFamily(f"{p}:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft position.", labels=["model_name", "position"])
    for pos, value in enumerate(spec.num_accepted_tokens_per_pos):
        per_pos.add_metric([model_name, str(pos)], value)
    yield per_pos


def _kv_offload_metrics(gauge, counter, s) -> Iterable[Metric]:
    # The prefix cache's disk tier (--kv-offload-dir, core/kv_disk.py); prefix_cache_hits_total includes
    # its hits, kv_offload_hit_tokens_total is their disk part.
    yield counter("kv_offload_stored_blocks_total", "KV blocks written to the disk tier.", s.num_stored_blocks)
    yield counter("kv_offload_loaded_blocks_total", "KV blocks loaded from the disk tier.", s.num_loaded_blocks)
    yield counter("kv_offload_stored_bytes_total", "Bytes of K/V written to the disk tier.", s.stored_bytes)
    yield counter("kv_offload_loaded_bytes_total", "Bytes of K/V loaded from the disk tier.", s.loaded_bytes)
    yield counter("kv_offload_hit_tokens_total", "Prompt tokens loaded from the disk tier instead of computed.",
                  s.num_hit_tokens)
    yield counter("kv_offload_evicted_blocks_total", "Block files removed to keep the disk tier under its bound.",
                  s.num_evicted_blocks)
    yield counter("kv_offload_corrupt_blocks_total", "Block files that failed their checks (recomputed).",
                  s.num_corrupt_blocks)
    yield counter("kv_offload_dropped_stores_total", "Blocks not written because the writer fell behind.",
                  s.num_dropped_stores)
    yield gauge("kv_offload_disk_bytes", "Bytes of block files in the disk tier's directory.", s.disk_bytes)
    yield counter("kv_offload_writer_cpu_seconds_total", "CPU time of the disk tier's writer thread.",
                  s.writer_cpu_seconds)


def priority_label(priority: int) -> str:
    return str(max(-PRIORITY_LABEL_RANGE, min(PRIORITY_LABEL_RANGE, priority)))


class PrometheusMetrics:
    def __init__(self, engine, model_name: str, prefix: str = "pagedserve") -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {PREFIXES}, got {prefix!r}")
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(engine, model_name, prefix))

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            h = Histogram(f"{prefix}:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry)
            return h.labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _ITL_BUCKETS)
        # TPOT: one observation per request (its mean gap), so percentiles are over requests, not tokens.
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of time per output token per request in seconds.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent waiting to be scheduled, in seconds.",
                                    _LATENCY_BUCKETS)
        def by_priority(name: str, doc: str, buckets: list[float]):
            h = Histogram(f"{prefix}:{name}", doc, ["model_name", "priority"], buckets=buckets,
                          registry=self.registry)
            return lambda priority: h.labels(model_name, priority_label(priority))

        self.queue_time_by_priority = by_priority("request_queue_time_by_priority_seconds",
                                                  "Time spent waiting to be scheduled, by priority class.",
                                                  _LATENCY_BUCKETS)
        self.ttft_by_priority = by_priority("time_to_first_token_by_priority_seconds",
                                            "Time to first token, by priority class.", _TTFT_BUCKETS)
        self.e2e_by_priority = by_priority("e2e_request_latency_by_priority_seconds",
                                           "End to end request latency, by priority class.", _LATENCY_BUCKETS)
        # HTTP responses by route, method and status class, unprefixed and labelled as vLLM's (its FastAPI
        # instrumentator), so error-rate alerts written for vLLM work: 5xx / all.
        self.http_requests = Counter("http_requests", "Total number of HTTP responses by handler and status.",
                                     ["handler", "method", "status"], registry=self.registry)
        self.block_lifetime = histogram("kv_block_lifetime_seconds",
                                        "Sampled KV block lifetime, from allocation to eviction, in seconds.",
                                        _RESIDENCY_BUCKETS)
        self.block_idle = histogram("kv_block_idle_before_evict_seconds",
                                    "Sampled time from a KV block's last access to its eviction, in seconds.",
                                    _RESIDENCY_BUCKETS)
        self.block_reuse_gap = histogram("kv_block_reuse_gap_seconds",
                                         "Sampled time between consecutive accesses of a KV block, in seconds.",
                                         _RESIDENCY_BUCKETS)
        # A model-free engine (tests) has no block pool; its residency series stay empty.
        kv = getattr(getattr(engine, "core", None), "kv", None)
        self.residency = getattr(getattr(kv, "pool", None), "residency", None)
        engine.add_finished_callback(self.on_finished)

    def count_http(self, handler: str, method: str, status: int) -> None:
        self.http_requests.labels(handler, method, f"{status // 100}xx").inc()

    def on_finished(self, rs: RequestStats) -> None:  # engine thread; prometheus_client is thread-safe
        if rs.ttft is not None:
            self.ttft.observe(rs.ttft)
            self.ttft_by_priority(rs.priority).observe(rs.ttft)
        if rs.queue_time is not None:
            self.queue_time.observe(rs.queue_time)
            self.queue_time_by_priority(rs.priority).observe(rs.queue_time)
        if rs.e2e_latency is not None:
            self.e2e.observe(rs.e2e_latency)
            self.e2e_by_priority(rs.priority).observe(rs.e2e_latency)
        itl = rs.mean_inter_token_latency
        if itl is not None:
            self.tpot.observe(itl)
            for _ in range(rs.num_token_gaps):
                self.itl.observe(itl)

    def observe_residency(self) -> None:
        if self.residency is None:
            return
        for event in self.residency.drain():
            self.block_lifetime.observe(event.lifetime_s)
            self.block_idle.observe(event.idle_s)
            for gap in event.reuse_gaps_s:
                self.block_reuse_gap.observe(gap)

    def render(self) -> tuple[bytes, str]:
        self.observe_residency()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
