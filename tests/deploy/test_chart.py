"""The Helm chart renders (Helm's engine, offline) in several values combinations, every object validates
against the Kubernetes schemas or the vendored CRD schemas, and the pod's command line parses with the project's
own argument parser."""
from __future__ import annotations

import jsonschema
import pytest

from tests.deploy.helpers import (RELEASE, by_kind, container, env_file_vars, load_schema, render,
                                  run_entrypoint)

# The chart's kubeVersion floor (Chart.yaml) and the newest schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.25", "1.37")
FULLNAME = f"{RELEASE}-pagedserve"
CRD_SCHEMAS = {"ScaledObject": "keda_scaledobject_schema.json", "ServiceMonitor": "servicemonitor_schema.json",
               "PrometheusRule": "prometheusrule_schema.json", "InferencePool": "inferencepool_schema.json"}

CASES = {
    "defaults": {},
    "keda-off-hpa": {"autoscaling": {"engine": "hpa", "hpa": {"queueMetricName": "vllm_num_requests_waiting"}}},
    "no-autoscaling": {"autoscaling": {"enabled": False}, "replicaCount": 3, "serviceMonitor": {"enabled": False},
                       "prometheusRule": {"enabled": False}, "dashboard": {"enabled": False},
                       "podDisruptionBudget": {"enabled": False}},
    "api-key-value": {"apiKey": {"value": "s3cret"}},
    "api-key-existing-secret": {"apiKey": {"existingSecret": "llm-keys", "secretKey": "openai"}},
    "tp3-model-volume": {"server": {"tensorParallelSize": 3, "maxNumSeqs": 64, "kvCacheMemory": 1 << 30,
                                    "extraArgs": ["--enable-prefix-caching"]},
                         "model": {"path": "/models/qwen2.5-7b", "servedModelName": ["qwen", "default"],
                                   "volume": {"persistentVolumeClaim": {"claimName": "models"}}}},
    # The InferencePool, the endpoint picker and KV events (tests/deploy/test_inference_pool.py), with the
    # pagedserve:* metric names through the ScaledObject, the alerts and the dashboard.
    "inference-pool": {"inferencePool": {"enabled": True}, "model": {"servedModelName": ["smol"]},
                       "server": {"blockSize": 32}},
    "metrics-prefix-pagedserve": {"server": {"metricsPrefix": "pagedserve"}},
    # The prefix cache's disk tier on a volume the replicas share (docs/replicas.md).
    "kv-offload": {"kvOffload": {"volume": {"persistentVolumeClaim": {"claimName": "kv-cache"}},
                                 "maxBytes": 20_000_000_000}},
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    return request.param, render(CASES[request.param])


def test_every_object_validates(case):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    name, objects = case
    assert objects
    for obj in objects:
        if obj["kind"] in CRD_SCHEMAS:
            jsonschema.validate(obj, load_schema(CRD_SCHEMAS[obj["kind"]]))
        else:
            # strict: unknown fields (a typo, a field at the wrong level) are errors, as kubectl's are.
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)
        assert obj["metadata"]["name"].startswith(FULLNAME), obj["metadata"]["name"]


def test_exactly_one_autoscaler(case):
    name, objects = case
    kinds = by_kind(objects)
    want = {"defaults": "ScaledObject", "keda-off-hpa": "HorizontalPodAutoscaler"}.get(name, "ScaledObject")
    if name == "no-autoscaling":
        assert "ScaledObject" not in kinds and "HorizontalPodAutoscaler" not in kinds
        assert kinds["Deployment"]["spec"]["replicas"] == 3
        return
    other = {"ScaledObject": "HorizontalPodAutoscaler", "HorizontalPodAutoscaler": "ScaledObject"}[want]
    assert want in kinds and other not in kinds
    # The autoscaler owns the replica count; a fixed one would fight it on every `helm upgrade`.
    assert "replicas" not in kinds["Deployment"]["spec"]
    target = kinds[want]["spec"]["scaleTargetRef"]["name"]
    assert target == kinds["Deployment"]["metadata"]["name"]


def test_scaledobject_scales_on_the_vllm_queue():
    so = by_kind(render())["ScaledObject"]
    [trigger] = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    required = load_schema("keda_scaledobject_schema.json")["x-prometheus-trigger-required-metadata"]
    assert set(required) <= set(meta)
    assert meta["query"] == f'sum(vllm:num_requests_waiting{{namespace="llm",service="{FULLNAME}"}})'
    assert float(meta["threshold"]) > 0


def test_hpa_alternative_uses_cpu_and_the_adapter_queue_metric():
    hpa = by_kind(render(CASES["keda-off-hpa"]))["HorizontalPodAutoscaler"]
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    assert metrics["Pods"]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"


def test_probes_service_and_monitor_point_at_the_server():
    kinds = by_kind(render())
    c = container(list(kinds.values()))
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    # The first start may compile kernels: the startup probe must allow minutes before liveness counts.
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 120
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    svc = kinds["Service"]["spec"]
    assert svc["ports"][0]["targetPort"] == "http" and svc["selector"].items() <= \
        kinds["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    endpoint = kinds["ServiceMonitor"]["spec"]["endpoints"][0]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert kinds["ServiceMonitor"]["spec"]["selector"]["matchLabels"] == svc["selector"]
    pdb = kinds["PodDisruptionBudget"]["spec"]
    assert pdb["selector"]["matchLabels"] == svc["selector"] and pdb["maxUnavailable"] == 1
    assert port == 8000


def test_default_memory_request_holds_the_prefaulted_pool(tmp_path):
    # The pool is resident from the start: the request must hold it + the model and runtime (~0.5 GiB measured
    # for the embedded model, 1 GiB allowed).
    c = container(render())
    args = run_entrypoint(tmp_path, c["args"], {})
    request = c["resources"]["requests"]["memory"]
    assert request.endswith("Gi")
    assert args["kv_cache_memory_bytes"] == 2 << 30 and args["prefault_kv_cache"] is True
    assert args["kv_cache_memory_bytes"] + (1 << 30) <= int(request[:-2]) << 30


def test_termination_outlasts_the_drain(tmp_path):
    values = {"termination": {"preStopSleepSeconds": 15, "shutdownTimeoutSeconds": 300}}
    objects = render(values)
    pod = by_kind(objects)["Deployment"]["spec"]["template"]["spec"]
    c = container(objects)
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    args = run_entrypoint(tmp_path, c["args"], {})
    # Kubernetes counts the grace period from the start of preStop; SIGTERM comes after it, then the server
    # drains for --shutdown-timeout and stops the engine. SIGKILL must come later than all of that.
    assert sleep == 15 and args["shutdown_timeout"] == 300
    assert pod["terminationGracePeriodSeconds"] >= sleep + args["shutdown_timeout"] + 5


def test_pod_command_line_parses_with_the_project_parser(case, tmp_path):
    name, objects = case
    c = container(objects)
    values = CASES[name]
    if values.get("server", {}).get("tensorParallelSize", 1) > 1:
        assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "3"
        volumes = {v["name"]: v for v in by_kind(objects)["Deployment"]["spec"]["template"]["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    else:
        assert "--tensor-parallel-size" not in c["args"]
    args = run_entrypoint(tmp_path, c["args"], {})
    assert args["command"] == "serve"
    assert args["tensor_parallel_size"] == values.get("server", {}).get("tensorParallelSize", 1)
    prefix = values.get("server", {}).get("metricsPrefix", "vllm")
    assert (args["host"], args["port"], args["metrics_prefix"]) == ("0.0.0.0", 8000, prefix)
    assert args["api_key"] is None  # never on the command line
    if name == "tp3-model-volume":
        assert args["model"] == "/models/qwen2.5-7b" and args["served_model_name"] == ["qwen", "default"]
        assert (args["max_num_seqs"], args["kv_cache_memory_bytes"]) == (64, 1 << 30)
        assert args["enable_prefix_caching"] is True
        mount = c["volumeMounts"][0]
        assert mount["mountPath"] == "/models" and mount["readOnly"] is True
    else:
        assert args["model"] is None  # the embedded model
    if name == "kv-offload":
        assert (args["kv_offload_dir"], args["kv_offload_max_bytes"]) == ("/kv-offload", 20_000_000_000)
        pod = by_kind(objects)["Deployment"]["spec"]["template"]["spec"]
        assert c["volumeMounts"] == [{"name": "kv-offload", "mountPath": "/kv-offload"}]  # writable
        assert pod["volumes"] == [{"name": "kv-offload", "persistentVolumeClaim": {"claimName": "kv-cache"}}]
    else:
        assert "--kv-offload-dir" not in c["args"]


@pytest.mark.parametrize("name", ["api-key-value", "api-key-existing-secret", "defaults"])
def test_api_key_comes_from_a_secret(name):
    objects = render(CASES[name])
    kinds = by_kind(objects)
    env = env_file_vars(container(objects))
    if name == "defaults":
        assert "PAGEDSERVE_API_KEY" not in env and "Secret" not in kinds
        return
    ref = env["PAGEDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    if name == "api-key-existing-secret":
        assert ref == {"name": "llm-keys", "key": "openai"} and "Secret" not in kinds
    else:
        import base64

        secret = kinds["Secret"]
        assert ref == {"name": secret["metadata"]["name"], "key": "api-key"}
        assert base64.b64decode(secret["data"]["api-key"]).decode() == "s3cret"
        assert "s3cret" not in str(kinds["Deployment"])  # a checksum annotation rolls pods, not the value


@pytest.mark.parametrize("values, where", [
    ({"autoscaling": {"engine": "kedaa"}}, "engine"),
    ({"server": {"tensorParallelSize": 0}}, "tensorParallelSize"),
    ({"server": {"metricsPrefix": "vlm"}}, "metricsPrefix"),
    ({"prometheusRule": {"kvCacheUsage": 90}}, "kvCacheUsage"),
])
def test_values_schema_refuses_typos(values, where):
    # Without values.schema.json engine "kedaa" would render no autoscaler at all, silently.
    with pytest.raises(RuntimeError, match=where):
        render(values)
