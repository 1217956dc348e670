"""Render the Helm chart (Helm's own Go engine through helm-python-sdk, offline) and run the image's entrypoint
with the project's argument parser behind it."""
from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "pagedserve"
DASHBOARD = CHART / "dashboards" / "pagedserve.json"
ENTRYPOINT = ROOT / "deploy" / "docker" / "entrypoint.sh"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
SCHEMAS = Path(__file__).resolve().parent
RELEASE, NAMESPACE = "demo", "llm"


# Rendered in a child process: helm-python-sdk loads Helm's Go runtime into the process, and the rest of the
# suite forks workers and handles signals in the pytest process, which should not host a second runtime.
_RENDER = """
import json, sys
import helm_python as helm
with helm.Chart.load(sys.argv[1]) as chart:
    print(json.dumps(chart.render(json.load(sys.stdin), name=sys.argv[2], namespace=sys.argv[3])))
"""


@functools.lru_cache(maxsize=None)
def _render_json(values_json: str) -> str:
    proc = subprocess.run([sys.executable, "-c", _RENDER, str(CHART), RELEASE, NAMESPACE], input=values_json,
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"helm render failed:\n{proc.stderr}")
    return proc.stdout


def render(values: dict | None = None) -> list[dict]:
    if importlib.util.find_spec("helm_python") is None:
        pytest.skip("helm-python-sdk (the test extra) renders the chart")
    manifests = json.loads(_render_json(json.dumps(values or {}, sort_keys=True)))
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def by_kind(objects: list[dict], component: str | None = None) -> dict[str, dict]:
    # The model server's objects (component None) or the endpoint picker's ("endpoint-picker"): each set holds at
    # most one object of each kind.
    picked = [o for o in objects if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component]
    kinds = [o["kind"] for o in picked]
    assert len(kinds) == len(set(kinds)), kinds
    return {o["kind"]: o for o in picked}


def load_schema(name: str) -> dict:
    return json.loads((SCHEMAS / name).read_text())


# Stands in for the `pagedserve` console script on PATH and prints the argv it was given; the test then parses
# it with the real parser, so it sees exactly what `pagedserve serve` would have been started with.
_PRINT_ARGV = "#!/bin/sh\nexec {python} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n"


def run_entrypoint(tmp_path: Path, args: list[str], env: dict[str, str]) -> dict:
    """The image's entrypoint with `args` and `env` (plus the image's ENV); returns the parsed serve flags."""
    from pagedserve.cli import build_parser

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "pagedserve"
    fake.write_text(_PRINT_ARGV.format(python=sys.executable))
    fake.chmod(0o755)
    full_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **image_env(), **env}
    proc = subprocess.run(["sh", str(ENTRYPOINT), *args], env=full_env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    parsed = build_parser().parse_args(json.loads(proc.stdout))
    return {k: v for k, v in vars(parsed).items() if k != "func"}


def dockerfile_commands() -> list:
    # BuildKit's own parser (the `dockerfile` wheel wraps it): a syntax error fails here as in `docker build`.
    dockerfile = pytest.importorskip("dockerfile", reason="the dockerfile package (test extra) parses the image")
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def image_env() -> dict[str, str]:
    """The Dockerfile's ENV settings (the PAGEDSERVE_* ones the entrypoint reads)."""
    env = {}
    for c in dockerfile_commands():
        if c.cmd == "ENV":
            env.update(zip(c.value[::2], c.value[1::2]))
    return {k: v for k, v in env.items() if k.startswith("PAGEDSERVE_")}


def container(objects: list[dict]) -> dict:
    return by_kind(objects)["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def env_file_vars(c: dict) -> dict:
    return {e["name"]: e for e in c.get("env", [])}


