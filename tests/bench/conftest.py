from __future__ import annotations

import json

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
