from __future__ import annotations

import importlib
import json
import os
import sys

import pytest

from tests.bench.fake_server import FakeServer


@pytest.fixture(scope="module")
def fake():
    srv = FakeServer(ttft_s=0.1, itl_s=0.02)
    yield srv
    srv.close()


@pytest.fixture(autouse=True)
def _reset_fake(request):
    # Faults set by one test must not leak into the next.
    yield
    if "fake" in request.fixturenames:
        request.getfixturevalue("fake").mode = "ok"


def bench(*args: str) -> list[str]:
    return ["bench", "serve", "--warmup", "0", "--no-progress", *args]


def read_report(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_jsonl(path, prompts: list[str], output_len: int) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "output_len": output_len}) + "\n" for p in prompts))
    return str(path)


BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def import_benchmark(name: str):
    # A script of benchmarks/ as a module (they import their neighbours, e.g. `from common import ...`).
    sys.path.insert(0, BENCHMARKS)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
