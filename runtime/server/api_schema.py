"""The published OpenAPI description of the HTTP API (`/openapi.json`).

The handlers parse bodies themselves (so that every error is OpenAI-shaped, 400 not 422), so
these pydantic models are documentation, not parsers: they describe the same fields, types
and ranges the handlers and `SamplingParams.validate` enforce. Anything the schema rejects
the server rejects too (the fuzz test checks it); the server may reject more (a prompt past
the context length, a grammar that does not compile). Unknown fields are allowed and ignored,
as OpenAI's API does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling_params import (
    MAX_INT,
    MAX_N,
    MAX_STOP_STR_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on logprobs / top_logprobs
MAX_NATIVE_TOP_LOGPROBS = 1000

# Constrained scalar types shared by the models.
NonNegInt = Annotated[int, Field(ge=0, le=MAX_INT)]
AnyInt = Annotated[int, Field(ge=-MAX_INT - 1, le=MAX_INT)]
Temperature = Annotated[float, Field(ge=0)]
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = Annotated[int, Field(ge=-1, le=MAX_INT)]
MinP = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
RepetitionPenalty = Annotated[float, Field(gt=0)]
N = Annotated[int, Field(ge=1, le=MAX_N)]
StopStr = Annotated[str, Field(max_length=MAX_STOP_STR_LEN)]
Stop = StopStr | Annotated[list[StopStr], Field(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[NonNegInt], Field(max_length=MAX_STOP_TOKEN_IDS)]
TokenIds = list[NonNegInt]


class _Open(BaseModel):
    """Unknown fields are allowed (and ignored)."""

    model_config = ConfigDict(extra="allow")


# --- native (SGLang) API ----------------------------------------------------------------------
class SamplingParamsBody(_Open):
    """`sampling_params` of /generate (SGLang's names)."""

    max_new_tokens: NonNegInt | None = 128
    min_new_tokens: NonNegInt | None = 0
    temperature: Temperature | None = 1.0
    top_p: TopP | None = 1.0
    top_k: TopK | None = -1
    min_p: MinP | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    presence_penalty: Penalty | None = 0.0
    repetition_penalty: RepetitionPenalty | None = 1.0
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    n: N | None = 1
    seed: AnyInt | None = None
    no_stop_trim: bool | None = False
    regex: str | None = None
    json_schema: str | None = Field(None, description="a JSON schema, as JSON text")
    ebnf: str | None = None
    choices: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None


class GenerateRequest(_Open):
    """POST /generate: exactly one of `text` and `input_ids`; a list of prompts is a batch."""

    text: str | Annotated[list[str], Field(min_length=1)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)] | None = None
    sampling_params: SamplingParamsBody | list[SamplingParamsBody | None] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | None = False
    logprob_start_len: Annotated[int, Field(ge=-1, le=MAX_INT)] | None = -1
    top_logprobs_num: Annotated[int, Field(ge=0, le=MAX_NATIVE_TOP_LOGPROBS)] | None = 0
    return_text_in_logprobs: bool | None = False
    stream: bool | None = False


class AbortRequest(_Open):
    """POST /abort_request: one request (`rid`) or all (`abort_all: true`)."""

    rid: str | None = None
    abort_all: bool | None = None


class MetaInfo(_Open):
    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int


class GenerateResult(_Open):
    """One result of /generate (a list of them for a batch or n > 1)."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo


# --- OpenAI-compatible API --------------------------------------------------------------------
class ContentPart(_Open):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Open):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Open):
    function: ToolCallFunction
    type: Literal["function"] | None = None
    id: str | None = None


class ChatMessage(_Open):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDef(_Open):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"] | None = "function"
    function: FunctionDef


class NamedToolChoiceFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"]
    function: NamedToolChoiceFunction


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # with json_object (llama.cpp's form)
    format: dict[str, Any] | None = None  # structural_tag: xgrammar's format
    structures: list[dict[str, Any]] | None = None  # structural_tag, the older form: begin / schema / end
    triggers: list[str] | None = None


class StructuredOutputs(_Open):
    """vLLM's structured_outputs: one of its constraints."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None


class StreamOptions(_Open):
    include_usage: bool | None = None


class _OpenAICommon(_Open):
    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: N | None = 1
    stop: Stop | None = None
    seed: AnyInt | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: NonNegInt | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    # extensions (SGLang / vLLM)
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: NonNegInt | None = None
    ignore_eos: bool | None = None
    stop_token_ids: StopTokenIds | None = None
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    json_max_number_digits: NonNegInt | None = None
    json_max_string_length: NonNegInt | None = None
    regex: Annotated[str, Field(min_length=1)] | None = None
    ebnf: Annotated[str, Field(min_length=1)] | None = None
    json_schema: str | dict[str, Any] | bool | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    structural_tag: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(_OpenAICommon):
    """POST /v1/completions."""

    prompt: (
        Annotated[str, Field()]
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[NonNegInt], Field(min_length=1)]
        | Annotated[list[Annotated[list[NonNegInt], Field(min_length=1)]], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


class ChatCompletionRequest(_OpenAICommon):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: NonNegInt | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    separate_reasoning: bool | None = None  # with --reasoning-parser: false keeps <think> in the content
    chat_template_kwargs: dict[str, Any] | None = None  # the chat template's own variables (enable_thinking, ...)


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Open):
    index: int
    text: str
    finish_reason: str | None


class CompletionResponse(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatChoice(_Open):
    index: int
    message: dict[str, Any]
    finish_reason: str | None


class ChatCompletionResponse(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ErrorBody(_Open):
    message: str
    type: str
    code: str | None


class ErrorResponse(_Open):
    """Every non-200 answer."""

    error: ErrorBody


class AnthropicErrorBody(_Open):
    type: str
    message: str


class AnthropicErrorResponse(_Open):
    """Every non-200 answer of the Messages API (Anthropic's shape)."""

    type: Literal["error"]
    error: AnthropicErrorBody


MODELS = (
    GenerateRequest,
    GenerateResult,
    AbortRequest,
    CompletionRequest,
    ChatCompletionRequest,
    CompletionResponse,
    ChatCompletionResponse,
    ErrorResponse,
    AnthropicErrorResponse,
)
ERROR_STATUSES = (400, 401, 404, 405, 413, 415, 503, 504)


def ref(model: type[BaseModel]) -> dict[str, str]:
    """A `$ref` to one of MODELS in the OpenAPI components."""
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a route whose body is `model` (the handler reads the body itself)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref(model)}}}}


def responses(
    ok: dict[str, Any] | None = None, stream: bool = False, error: type[BaseModel] = ErrorResponse
) -> dict[int | str, Any]:
    """`responses` of a route: 200 (`ok` as JSON, plus SSE when it streams) and the errors (`error`'s shape)."""
    content: dict[str, Any] = {"application/json": {"schema": ok or {}}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    out: dict[int | str, Any] = {200: {"description": "OK", "content": content}}
    for status in ERROR_STATUSES:
        out[status] = {"description": "error", "content": {"application/json": {"schema": ref(error)}}}
    return out


def add_components(openapi: dict[str, Any]) -> dict[str, Any]:
    """Put the JSON schemas of MODELS (and their parts) into `openapi["components"]["schemas"]`."""
    from pydantic.json_schema import models_json_schema

    _, defs = models_json_schema([(m, "validation") for m in MODELS], ref_template="#/components/schemas/{model}")
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    return openapi
