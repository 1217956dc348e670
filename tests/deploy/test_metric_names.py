"""Every metric (and label) the dashboard, the alert rules and the KEDA ScaledObject query is exported by a live
`pagedserve serve --metrics-prefix vllm` after a few requests; the server takes its API key from
PAGEDSERVE_API_KEY, as the chart gives it, and drains open streams for --shutdown-timeout on SIGTERM."""
from __future__ import annotations

import json
import signal
import time

import httpx
import openai
import pytest

from tests.deploy.helpers import DASHBOARD, by_kind, render
from tests.deploy.promql import Names, names
from tests.server.helpers import ServerProcess, metric, scrape

KEY = "deploy-test-key"
# Added by Prometheus to every series of a ServiceMonitor target, not by the server.
TARGET_LABELS = {"namespace", "service", "pod", "job", "instance", "endpoint", "container"}
# A shared prefix longer than one KV block (16 tokens) so the second request hits the prefix cache.
SHARED = "The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden fence. "
DRAIN_S = 1.0  # shorter than the default 5 s, so the test sees the flag at work


@pytest.fixture(scope="module")
def server():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_API_KEY", KEY)
        srv = ServerProcess("--metrics-prefix", "vllm", "--shutdown-timeout", str(DRAIN_S))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def live_metrics(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    for suffix in ("Once", "Twice"):
        client.completions.create(model=model, prompt=SHARED + suffix, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401  # no key
    return scrape(server.url)


def queried_names(values: dict | None = None) -> dict[str, Names]:
    objects = by_kind(render(values))
    found = {"dashboard": Names(), "alerts": Names(), "scaledobject": Names()}
    # The dashboard as the chart ships it (its ConfigMap puts the chosen metrics prefix in).
    dash = json.loads(objects["ConfigMap"]["data"][DASHBOARD.name])
    for panel in dash["panels"]:
        for target in panel["targets"]:
            names(target["expr"], found["dashboard"])
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            names(var["query"]["query"], found["dashboard"])
    for group in objects["PrometheusRule"]["spec"]["groups"]:
        for rule in group["rules"]:
            names(rule["expr"], found["alerts"])
    for trigger in objects["ScaledObject"]["spec"]["triggers"]:
        names(trigger["metadata"]["query"], found["scaledobject"])
    return found


def test_every_queried_metric_and_label_is_exported(live_metrics):
    exported = {name for name, _ in live_metrics}
    exported_labels = {label for _, labels in live_metrics for label, _ in labels}
    for where, found in queried_names().items():
        assert found.metrics, where
        assert found.metrics <= exported, (where, sorted(found.metrics - exported))
        assert found.labels <= exported_labels | TARGET_LABELS, (where, sorted(found.labels - exported_labels))
    assert queried_names()["scaledobject"].metrics == {"vllm:num_requests_waiting"}


def test_the_series_behind_the_panels_count_what_happened(live_metrics):
    s = live_metrics
    # Three finished requests, each with 4 tokens (3 gaps): one TPOT observation each.
    assert metric(s, "vllm:e2e_request_latency_seconds_count") == 3
    assert metric(s, "vllm:request_time_per_output_token_seconds_count") == 3
    assert metric(s, "vllm:inter_token_latency_seconds_count") == 9
    assert metric(s, "vllm:generation_tokens_total") == 12
    assert metric(s, "vllm:prefix_cache_hits_total") >= 16  # the second prompt reused the first one's block
    assert metric(s, "http_requests_total", handler="/v1/completions", status="2xx") == 2
    assert metric(s, "http_requests_total", handler="/v1/chat/completions", status="2xx") == 1
    assert metric(s, "http_requests_total", handler="/v1/models", status="4xx") == 1  # the keyless request


def test_sigterm_drains_open_streams_for_the_shutdown_timeout(server):
    # Runs last in this module: the server is gone afterwards. A long stream keeps streaming after SIGTERM
    # (the drain a Kubernetes preStop + grace period is sized for), then ends with an error event and [DONE]
    # once --shutdown-timeout has passed, and the server exits 0.
    body = {"prompt": "Tell a story", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(line for line in lines if line)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
        elapsed = time.monotonic() - t0
    assert server.proc.wait(30) == 0, server.read_log()
    assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2], rest[-3:]
    assert len(rest) > 2  # tokens kept coming during the drain
    # Not cut at once (the drain lasted the shutdown timeout), and ended by it: a stream left to run would
    # have finished its 2,000 tokens without the error event.
    assert elapsed >= DRAIN_S, elapsed
