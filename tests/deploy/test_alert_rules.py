"""The chart's alert rules: `promtool check rules` accepts them, and `promtool test rules` shows each alert fires
on the series that should fire it and stays quiet on the ones that should not. Needs Debian's prometheus
package (scripts/setup installs it where apt-get exists); skipped without promtool."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.deploy.helpers import NAMESPACE, RELEASE, by_kind, render

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")

TARGET = f'namespace="{NAMESPACE}",service="{RELEASE}-pagedserve"'  # the labels a ServiceMonitor target has
OTHER = f'namespace="{NAMESPACE}",service="someone-else"'          # another release's series: never alerts


def series(name: str, labels: str, values: str) -> dict:
    return {"series": f"{name}{{{labels}}}", "values": values}


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory):
    rule = by_kind(render())["PrometheusRule"]
    path = tmp_path_factory.mktemp("rules") / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def test_promtool_check_rules(rules_file):
    proc = promtool("check", "rules", str(rules_file))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 5 rules found" in proc.stdout


def test_alerts_fire_on_the_right_series(rules_file, tmp_path):
    p1, p2 = f"{TARGET},pod=\"p1\"", f"{TARGET},pod=\"p2\""
    ttft = "vllm:time_to_first_token_seconds_bucket"
    input_series = [
        # p1 waits 10 requests (above 8) and fills 95% of its KV cache; p2 stays under both thresholds.
        series("vllm:num_requests_waiting", p1, "10x20"), series("vllm:num_requests_waiting", p2, "8x20"),
        series("vllm:kv_cache_usage_perc", p1, "0.95x20"), series("vllm:kv_cache_usage_perc", p2, "0.9x20"),
        series("vllm:kv_cache_usage_perc", f'{OTHER},pod="x"', "1x20"),
        # 10 first tokens a minute, all between 1 s and 2.5 s: p99 interpolates to 2.485 s, above the 2 s SLO.
        series(ttft, f'{p1},le="1"', "0x20"), series(ttft, f'{p1},le="2.5"', "0+10x20"),
        series(ttft, f'{p1},le="+Inf"', "0+10x20"),
        # 1 of 10 API responses is a 5xx: 10%, above 5%; the probes' 2xx on /health do not dilute it.
        series("http_requests_total", f'{p1},handler="/v1/completions",status="5xx"', "0+1x20"),
        series("http_requests_total", f'{p1},handler="/v1/chat/completions",status="2xx"', "0+9x20"),
        series("http_requests_total", f'{p1},handler="/health",status="2xx"', "0+100x20"),
        # 12 preemptions a minute on p1 (0.2/s, above 0.1/s); 3 a minute on p2 (0.05/s).
        series("vllm:num_preemptions_total", p1, "0+12x20"), series("vllm:num_preemptions_total", p2, "0+3x20"),
    ]
    base = {"namespace": NAMESPACE}
    svc = {**base, "service": f"{RELEASE}-pagedserve"}
    alerts = [
        ("PagedserveQueueBacklog", 4, []),  # `for: 5m` has not passed yet
        ("PagedserveQueueBacklog", 6, [({**base, "pod": "p1", "severity": "warning"},
                                        "p1: 10 requests waiting for over 5 minutes")]),
        ("PagedserveKVCacheNearlyFull", 6, [({**base, "pod": "p1", "severity": "warning"},
                                             "p1: KV cache 95% full")]),
        ("PagedserveTTFTAboveSLO", 15, [({**svc, "severity": "critical"},
                                         "p99 time to first token 2.485s is above the 2s SLO")]),
        ("PagedserveHighErrorRate", 7, [({**svc, "severity": "critical"}, "10% of responses are 5xx")]),
        ("PagedservePreempting", 15, [({**base, "pod": "p1", "severity": "warning"},
                                       "p1: 0.20 preemptions per second")]),
    ]
    test = {"rule_files": [str(rules_file)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": input_series,
        "alert_rule_test": [{"eval_time": f"{minute}m", "alertname": name,
                             "exp_alerts": [{"exp_labels": labels, "exp_annotations": {"summary": summary}}
                                            for labels, summary in expected]}
                            for name, minute, expected in alerts]}]}
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(test))
    proc = promtool("test", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
