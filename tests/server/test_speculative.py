"""`pagedserve serve --speculative-config`: streamed answers equal the plain ones, and vLLM's spec_decode_*
metrics (under --metrics-prefix vllm) count drafts and accepted tokens."""
from __future__ import annotations

import json

import openai
import pytest

from tests.server.helpers import ServerProcess, metric, scrape, wait_pool_free

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = ("Stock:\nbolts | 41 | 3.27 EUR\ngears | 17 | 8.90 EUR\nhoses | 63 | 1.45 EUR\n\n"
          "Copy the row for gears:\ngears |")


@pytest.fixture(scope="module")
def spec_server():
    srv = ServerProcess("--speculative-config", json.dumps(SPEC), "--metrics-prefix", "vllm")
    yield srv
    srv.close()


def test_streamed_speculative_answer_and_metrics(spec_server):
    client = openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    before = scrape(spec_server.url)
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                     logprobs=1)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, logprobs=1))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    streamed_tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed_tokens == full.choices[0].logprobs.tokens and len(streamed_tokens) == 12
    # Several tokens arrive in one chunk when drafts are accepted.
    assert len([c for c in chunks if c.choices and c.choices[0].text]) < 12
    wait_pool_free(spec_server.url, prefix="vllm")
    after = scrape(spec_server.url)

    drafts = metric(after, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric(after, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(after, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts >= 2 and draft_tokens >= drafts and 0 < accepted <= draft_tokens
    per_pos = [metric(after, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(3)]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2]
    # Each emitted token counts once, whether it came from an accepted draft or was sampled.
    generated = metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total")
    assert generated == 24
