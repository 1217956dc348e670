"""OpenAI request and response bodies (pydantic), with OpenAI's field names plus vLLM's sampling extras."""
from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from pagedserve.sampling_params import MAX_SEED, MIN_SEED, SamplingParams, StructuredOutputsParams
from pagedserve.structured_output.schema import check_json_value

# vLLM's default --max-logprobs; OpenAI allows at most 5 (completions) and 20 (chat).
MAX_LOGPROBS = 20


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored, as OpenAI and vLLM do, so newer clients keep working.
    model_config = ConfigDict(extra="ignore")


class OpenAIRequestModel(OpenAIBaseModel):
    # JSON has no inf or nan, but Python's parser reads Infinity, NaN and 1e999; no request field wants them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def _check_text(value: Any) -> Any:
    # JSON may escape a lone surrogate ("\ud800"); such a str cannot be encoded to UTF-8, so the tokenizer
    # (and any error message quoting it) would fail far from here. Lists of token ids are not walked.
    items = value if isinstance(value, list) and value and isinstance(value[0], str) else [value]
    for item in items:
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"text must be valid Unicode; a lone surrogate is at position {e.start}") from e
    return value


# A string (or a union holding strings) refused when it holds a lone surrogate.
Text = Annotated[str, AfterValidator(_check_text)]
# A tool's parameters (a JSON schema): every key and string valid Unicode, nesting bounded.
ToolParameters = Annotated[dict[str, Any], AfterValidator(lambda v: check_json_value(v, "a tool's parameters"))]


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIRequestModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIRequestModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    # "schema" shadows a BaseModel attribute, so the field has another name and takes "schema" as its alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIRequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> Any:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class StructuredOutputsRequest(OpenAIRequestModel):
    # vLLM's `structured_outputs` extra body field.
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


# vLLM's older fields for the same constraints (guided_json, ...): older clients still send them.
LEGACY_STRUCTURED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                            "guided_grammar": "grammar"}


class _SamplingRequest(OpenAIRequestModel):
    model: Text | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    # What torch.Generator accepts; SamplingParams also checks seed + n - 1 (one seed per sample).
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: Annotated[str | list[str] | None, AfterValidator(_check_text)] = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI: token id (as a string key) -> bias in [-100, 100] added to its logit. vLLM extra: allowed_token_ids.
    logit_bias: dict[Text, float] | None = None
    allowed_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # vLLM extra: top-k logprobs of every prompt token, returned as `prompt_logprobs` (non-streamed only).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM extra: requests share prefix-cache blocks only with requests that carry the same salt.
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM extra: lower is served first under --scheduling-policy priority (anything but 0 is a 400 otherwise).
    priority: int = Field(0, ge=-(1 << 31), lt=1 << 31)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    # vLLM picked its grammar library by this; here xgrammar enforces every constraint, whichever is named.
    guided_decoding_backend: Text | None = None

    @model_validator(mode="after")
    def _fold_legacy_structured_outputs(self) -> Any:
        legacy = {new: getattr(self, old) for old, new in LEGACY_STRUCTURED_FIELDS.items()
                  if getattr(self, old) is not None}
        if legacy:
            if self.structured_outputs is not None:
                raise ValueError(f"give either structured_outputs or the legacy "
                                 f"{', '.join(k for k in LEGACY_STRUCTURED_FIELDS if getattr(self, k) is not None)}"
                                 ", not both")
            self.structured_outputs = StructuredOutputsRequest.model_validate(legacy)
        return self

    @model_validator(mode="after")
    def _check_prompt_logprobs(self) -> Any:
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not available with stream=true")  # as in vLLM
        return self

    @model_validator(mode="after")
    def _check_common(self) -> Any:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        for token, bias in (self.logit_bias or {}).items():
            if not token.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        # ValueError (a 400) for a malformed spec; the schema itself is checked when its grammar compiles.
        so, fmt = self.structured_outputs, self.response_format
        if so is not None and fmt is not None and fmt.type != "text":
            raise ValueError("give either response_format or structured_outputs, not both")
        if so is not None:
            return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                           json_object=so.json_object)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=fmt.json_schema.json_schema)

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None, best_of: int | None = None,
                           prompt_logprobs: int | None = None) -> SamplingParams:
        # Absent fields take SamplingParams' defaults (vLLM's), not OpenAI's null.
        def given(**kwargs: Any) -> dict[str, Any]:
            return {k: v for k, v in kwargs.items() if v is not None}

        return SamplingParams(
            n=self.n, max_tokens=max_tokens, logprobs=logprobs, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, stop=self.stop, stop_token_ids=self.stop_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, best_of=best_of,
            prompt_logprobs=prompt_logprobs,
            logit_bias=self.logit_bias or None, allowed_token_ids=self.allowed_token_ids,
            structured_outputs=self.structured_outputs_params(),
            **given(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    seed=self.seed, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty))


class CompletionRequest(_SamplingRequest):
    # Smart-mode union: a list of ints is token ids, a list of lists is a batch of token-id prompts.
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], AfterValidator(_check_text)]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: Text | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be greater than or equal to n, got best_of={self.best_of}, n={self.n}")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            # The best n are known only once all best_of samples finish, so there is nothing to stream early.
            raise ValueError("best_of greater than n is not supported with stream=true")
        return self

    @property
    def num_prompt_logprobs(self) -> int | None:
        # echo with logprobs covers the prompt tokens too, so the engine scores them with the larger k.
        ks = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(ks) if ks else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        return list(p)


class TextContentPart(OpenAIRequestModel):
    type: Literal["text"]
    text: Text


class FunctionCall(OpenAIBaseModel):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(OpenAIBaseModel):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIRequestModel):
    role: Text
    content: Annotated[str | list[TextContentPart] | None, AfterValidator(_check_text)] = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: Text | None = None           # a tool turn: which call this result answers

    def to_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        msg: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": c.type,
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


def _arguments(text: str) -> dict[str, Any]:
    # A past call's arguments as the chat templates take them (transformers' documented form, as vLLM passes
    # them): a dict, which Llama 3.x, Qwen2.5 and Mistral render with `| tojson` (the JSON text would come out
    # quoted). Text that is not a JSON object becomes {}, as in vLLM: the history must stay renderable.
    try:
        value = json.loads(text) if text else {}
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
        return {}
    return value if isinstance(value, dict) else {}


class FunctionDefinition(OpenAIRequestModel):
    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    parameters: ToolParameters | None = None
    strict: bool | None = None


class ChatTool(OpenAIRequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIRequestModel):
    name: Text


class NamedToolChoice(OpenAIRequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


# What the server itself passes to the chat template (or to apply_chat_template around it).
_TEMPLATE_ARGUMENTS = {"messages", "conversation", "tools", "documents", "add_generation_prompt", "chat_template",
                       "tokenize", "return_dict", "continue_final_message", "tokenizer_kwargs"}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    documents: list[dict[str, Any]] | None = None  # passed to the chat template, as tools are (RAG templates)
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables, e.g. {"enable_thinking": false}

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        reserved = sorted(set(self.chat_template_kwargs or ()) & _TEMPLATE_ARGUMENTS)
        if reserved:
            raise ValueError(f"chat_template_kwargs must not set {', '.join(reserved)} (the request sets them)")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not "
                                 f"in tools ({', '.join(names)})")
        return self

    @property
    def tool_mode(self) -> str:
        # "none", "auto", "required" or "named"; tools without tool_choice mean "auto", as in OpenAI.
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"


# ---- responses ---------------------------------------------------------------------------------------------

class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs field: None for the first prompt token, then {token id: logprob} for each other one.
PromptLogprobsField = list[dict[int, PromptLogprob] | None]


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsField | None = None  # vLLM puts them on each completion choice


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    pass


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobEntry] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # the <think> part, with --reasoning-parser
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsField | None = None  # vLLM puts them at the top level for chat


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    # The first delta of a call carries its id, type and name; later ones append to its arguments.
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenizer -------------------------------------------------------------------------------------

class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIRequestModel):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIRequestModel):
    model: Text | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
