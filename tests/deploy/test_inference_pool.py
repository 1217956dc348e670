"""The chart's InferencePool, endpoint picker and KV events: every name, port, label and block size that must
agree between the pods, the pool and the picker's configuration does; metricsPrefix reaches the ScaledObject,
the alerts and the dashboard; values that cannot work are refused with the reason."""
from __future__ import annotations

import pytest
import yaml

from pagedserve.config import KVEventsConfig
from pagedserve.core.kv_events import MEDIUM_DISK, MEDIUM_GPU
from tests.deploy.helpers import NAMESPACE, by_kind, container, env_file_vars, render, run_entrypoint
from tests.deploy.test_chart import CASES
from tests.deploy.test_metric_names import queried_names

EPP = "endpoint-picker"


def pool_objects(values: dict) -> tuple[dict, dict, dict]:
    objects = render(values)
    return by_kind(objects), by_kind(objects, EPP), objects


def picker_config(epp: dict) -> dict:
    return yaml.safe_load(epp["ConfigMap"]["data"]["config.yaml"])


def test_pool_selects_the_model_servers_and_names_the_picker():
    kinds, epp, objects = pool_objects(CASES["inference-pool"])
    pool = kinds["InferencePool"]["spec"]
    pod = kinds["Deployment"]["spec"]["template"]
    epp_pod = epp["Deployment"]["spec"]["template"]
    labels, epp_labels = pod["metadata"]["labels"], epp_pod["metadata"]["labels"]
    assert labels["llm-d.ai/inference-serving"] == "true" and labels["llm-d.ai/engine-type"] == "vllm"
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    # Neither the pool nor the model server's Service, PDB and ServiceMonitor take the picker's pod.
    assert not pool["selector"]["matchLabels"].items() <= epp_labels.items()
    assert not kinds["Service"]["spec"]["selector"].items() <= epp_labels.items()
    ports = {p["name"]: p["containerPort"] for p in container(objects)["ports"]}
    assert pool["targetPorts"] == [{"number": ports["http"]}]
    ref, svc = pool["endpointPickerRef"], epp["Service"]
    assert ref["name"] == svc["metadata"]["name"] and ref["failureMode"] == "FailClose"
    svc_ports = {p["port"]: p["targetPort"] for p in svc["spec"]["ports"]}
    epp_ports = {p["name"]: p["containerPort"] for p in epp_pod["spec"]["containers"][0]["ports"]}
    assert epp_ports[svc_ports[ref["port"]["number"]]] == ref["port"]["number"] == 9002
    assert svc["spec"]["selector"].items() <= epp_labels.items()
    # The picker reads its pool and pods with its own account, and its configuration from the ConfigMap.
    assert epp["RoleBinding"]["subjects"][0]["name"] == epp_pod["spec"]["serviceAccountName"]
    assert epp["RoleBinding"]["roleRef"]["name"] == epp["Role"]["metadata"]["name"]
    resources = {r for rule in epp["Role"]["rules"] for r in rule["resources"]}
    assert {"pods", "inferencepools"} <= resources
    args = epp_pod["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == kinds["InferencePool"]["metadata"]["name"]
    assert args[args.index("--pool-namespace") + 1] == NAMESPACE
    mount = epp_pod["spec"]["containers"][0]["volumeMounts"][0]
    assert args[args.index("--config-file") + 1] == f"{mount['mountPath']}/config.yaml"
    assert epp_pod["spec"]["volumes"][0]["configMap"]["name"] == epp["ConfigMap"]["metadata"]["name"]


def test_precise_scorer_agrees_with_what_the_pods_publish(tmp_path):
    kinds, epp, objects = pool_objects(CASES["inference-pool"])
    c = container(objects)
    args = run_entrypoint(tmp_path, c["args"], {})
    events = KVEventsConfig.parse(args["kv_events_config"])     # the server's own parser
    assert events.active and events.endpoint == "tcp://*:5557"
    assert env_file_vars(c)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert events.topic == "kv@$(POD_IP):8000@smol"              # Kubernetes expands $(POD_IP)
    config = picker_config(epp)
    plugins = {p.get("name", p["type"]): p.get("parameters", {}) for p in config["plugins"]}
    producer = plugins["precise-prefix-cache-producer"]
    kv = producer["kvEventsConfig"]
    assert events.topic.startswith(kv["topicFilter"]) and kv["discoverPods"] is True
    assert kv["podDiscoveryConfig"]["socketPort"] == {p["name"]: p["containerPort"] for p in c["ports"]}["kv-events"]
    assert producer["tokenProcessorConfig"]["blockSize"] == args["block_size"] == 32
    # A weight for every medium the pods publish, under the lowercased name the picker looks it up by.
    tiers = {t["name"]: t["weight"] for t in producer["indexerConfig"]["kvCacheBackendConfigs"]}
    assert set(tiers) == {MEDIUM_GPU.lower(), MEDIUM_DISK.lower()} and 0 < tiers["disk"] < tiers["gpu"] == 1.0
    # Prompts are tokenized by the pool's own render endpoint, under the name clients use.
    tokens = plugins["token-producer"]
    svc = kinds["Service"]
    assert tokens["vllm"]["url"] == f"http://{svc['metadata']['name']}.{NAMESPACE}.svc:{svc['spec']['ports'][0]['port']}"
    assert tokens["modelName"] == args["served_model_name"][0] == events.topic.rsplit("@", 1)[1]
    assert plugins["prefix-cache-scorer"]["prefixMatchInfoProducerName"] == "precise-prefix-cache-producer"
    refs = [p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]]
    refs += [s["pluginRef"] for s in config["dataLayer"]["sources"]]
    refs += [e["pluginRef"] for s in config["dataLayer"]["sources"] for e in s["extractors"]]
    assert set(refs) <= set(plugins), set(refs) - set(plugins)


def test_approximate_scorer_needs_no_kv_events(tmp_path):
    values = {**CASES["inference-pool"], "inferencePool": {"enabled": True, "prefixScorer": "approximate"}}
    kinds, epp, objects = pool_objects(values)
    c = container(objects)
    assert "--kv-events-config" not in c["args"] and "kv-events" not in {p["name"] for p in c["ports"]}
    config = picker_config(epp)
    assert [p["type"] for p in config["plugins"]][0] == "prefix-cache-scorer" and "dataLayer" not in config
    assert {p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]} <= \
        {p["type"] for p in config["plugins"]}
    # KV events alone (an external picker), without the pool.
    c = container(render({"kvEvents": {"enabled": True, "port": 6000, "topic": "kv@$(POD_IP)@smol"},
                          "model": {"servedModelName": ["smol"]}}))
    events = KVEventsConfig.parse(run_entrypoint(tmp_path, c["args"], {})["kv_events_config"])
    assert (events.endpoint, events.topic) == ("tcp://*:6000", "kv@$(POD_IP)@smol")


def test_metrics_prefix_reaches_the_scaler_the_alerts_and_the_dashboard():
    vllm, ours = queried_names(), queried_names(CASES["metrics-prefix-pagedserve"])
    for where in vllm:
        assert ours[where].metrics, where
        assert not any(m.startswith("vllm:") for m in ours[where].metrics), (where, ours[where].metrics)
        # The same series as the vllm: names checked against a live server (test_metric_names.py).
        assert {m.replace("pagedserve:", "vllm:") for m in ours[where].metrics} == vllm[where].metrics, where
    assert ours["scaledobject"].metrics == {"pagedserve:num_requests_waiting"}
    labels = by_kind(render(CASES["metrics-prefix-pagedserve"]))["Deployment"]["spec"]["template"]["metadata"]
    assert labels["labels"]["llm-d.ai/engine-type"] == "pagedserve"


@pytest.mark.parametrize("values, reason", [
    ({"autoscaling": {"minReplicas": 0}}, "minReplicas must be at least 1"),
    ({"autoscaling": {"engine": "hpa", "minReplicas": 0}}, "never leaves 0"),
    ({"inferencePool": {"enabled": True}, "model": {"servedModelName": ["smol"]},
      "server": {"metricsPrefix": "pagedserve"}}, "needs server.metricsPrefix vllm"),
    ({"inferencePool": {"enabled": True}}, "need model.servedModelName"),
    ({"inferencePool": {"enabled": True, "prefixScorer": "exact"}, "model": {"servedModelName": ["smol"]}},
     "prefixScorer"),
])
def test_values_that_cannot_work_are_refused(values, reason):
    with pytest.raises(RuntimeError, match=reason):
        render(values)
    # Without autoscaling a fixed replica count of 0 is still allowed (a parked release).
    assert by_kind(render({"autoscaling": {"enabled": False, "minReplicas": 0}, "replicaCount": 0}))
