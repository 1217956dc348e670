"""Serving benchmark: streamed requests against OpenAI-compatible servers, latency percentiles, goodput
and cost per query. `pagedserve bench serve --help`; docs/bench.md explains every number."""
from pagedserve.bench.client import Endpoint, RequestResult
from pagedserve.bench.dataset import BenchRequest, DatasetError, load_dataset
from pagedserve.bench.metrics import SLO, Metrics, compute_metrics
from pagedserve.bench.runner import RunResult, run_load

__all__ = ["BenchRequest", "DatasetError", "Endpoint", "Metrics", "RequestResult", "RunResult", "SLO",
           "compute_metrics", "load_dataset", "run_load"]
