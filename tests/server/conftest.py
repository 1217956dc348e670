from __future__ import annotations

import gc

import openai
import pytest

from tests.server.helpers import ENGINE_KWARGS, ServerProcess

API_KEY = "test-secret-key"


@pytest.fixture(scope="session")
def server():
    srv = ServerProcess()
    yield srv
    srv.close()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def keyed_server():
    # API key on, vLLM metric names and a custom served name: the switches a vLLM user would carry over.
    srv = ServerProcess("--api-key", API_KEY, "--metrics-prefix", "vllm", "--served-model-name", "smol", "alias")
    yield srv
    srv.close()


# Greedy cases the server must answer exactly as the offline LLM does. Prompts stay under one KV block
# (16 tokens) so neither side's answer depends on prefix-cache hits left by earlier requests.
GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
TOKEN_ID_PROMPT = [504, 2988, 314]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You answer in one short sentence."},
          {"role": "user", "content": "Name a primary color."}]]
GREEDY_MAX_TOKENS = 24
# echo with logprobs: prompt logprobs then generated ones, compared with the offline LLM's.
ECHO_PROMPT = "The capital of France is"
ECHO_MAX_TOKENS = 6
ECHO_LOGPROBS = 2


@pytest.fixture(scope="session")
def expected():
    """Offline greedy outputs, one request at a time as the tests send them; the LLM is freed afterwards."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(**ENGINE_KWARGS)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_MAX_TOKENS)
    out = {"completion": {}, "chat": []}
    try:
        for p in GREEDY_PROMPTS:
            out["completion"][p] = llm.generate(p, params, use_tqdm=False)[0]
        out["token_ids"] = llm.generate({"prompt_token_ids": TOKEN_ID_PROMPT}, params, use_tqdm=False)[0]
        out["token_ids_text"] = llm.get_tokenizer().decode(TOKEN_ID_PROMPT)
        for conv in CHATS:
            out["chat"].append(llm.chat(conv, params, use_tqdm=False)[0])
        echo_params = SamplingParams(temperature=0.0, max_tokens=ECHO_MAX_TOKENS, ignore_eos=True,
                                     logprobs=ECHO_LOGPROBS, prompt_logprobs=ECHO_LOGPROBS)
        out["echo"] = llm.generate(ECHO_PROMPT, echo_params, use_tqdm=False)[0]
    finally:
        del llm
        gc.collect()
    return out
