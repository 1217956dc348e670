"""What every endpoint needs: the async engine, the served model names and the request checks."""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.outputs import RequestOutput
from pagedserve.server.errors import OpenAIError
from pagedserve.server.protocol import UsageInfo


@dataclass(slots=True)
class ServerContext:
    engine: AsyncLLMEngine
    served_model_names: list[str]  # the first is the name responses carry
    model_path: str | None          # --model as given; None for the embedded model
    tool_call_parser: str | None = None  # --tool-call-parser, set with --enable-auto-tool-choice
    reasoning_parser: str | None = None  # --reasoning-parser

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        # No model given means the only one served (vLLM does the same).
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, param="model",
                              code="model_not_found")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    # The prompt counts once per request, however many samples (n) share it.
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
