"""The OpenAI wire protocol (pydantic): request bodies of /v1/completions and /v1/chat/completions,
and the response, stream-chunk, model-list and usage objects, field for field as OpenAI names them.

Requests are validated strictly (a string where a number belongs is a 400, not a silent coercion)
and unknown fields are ignored, as OpenAI clients send extras (the server warns once per field
name: `unknown_fields`). `logit_bias` (token id string ->
bias in [-100, 100]) follows OpenAI. vLLM/SGLang extensions are accepted
where dsv4 implements them: `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`,
`skip_special_tokens`, `chat_template_kwargs`, structured output (`response_format`, SGLang's
`regex` / `ebnf`, vLLM's `guided_regex` / `guided_choice` / `guided_json`: server/structured.py),
and SGLang's RL options `return_routed_experts` /
`return_indexer_topk` (each choice then carries `routed_experts` / `indexer_topk` as a
`RoutingArray`; see routing.py). Under speculative decoding, `usage.completion_tokens_details`
reports the drafts accepted and rejected (`accepted_prediction_tokens` /
`rejected_prediction_tokens`, the fields OpenAI uses for predicted outputs). Numeric sampling
fields may be null (= the default); their ranges are checked by SamplingParams, whose ValueError
names the field. The body of SGLang's admin endpoint `/update_weights_from_disk` is here too.

Test: `pytest tests/server/test_errors.py`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer


class RequestBody(BaseModel):
    # unknown fields are kept aside (model_extra), so the server can name them in a warning
    model_config = ConfigDict(strict=True, extra="allow")


def unknown_fields(body: BaseModel) -> list[str]:
    """The body's top-level fields that the protocol does not define (sorted)."""
    return sorted(body.model_extra or {})


class StreamOptions(RequestBody):
    include_usage: bool = False


class SamplingKnobs(RequestBody):
    """The sampling fields that the OpenAI endpoints and SGLang's /generate `sampling_params`
    (native.py) name alike."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # structured output (server/structured.py): SGLang's names
    regex: str | None = None
    ebnf: str | None = None


class SamplingFields(SamplingKnobs):
    """Fields shared by both OpenAI endpoints."""

    model: str | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_routed_experts: bool = False
    return_indexer_topk: bool = False
    logit_bias: dict[str, float] | None = None
    # structured output: vLLM's names
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_json: dict[str, Any] | str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(RequestBody):
    type: str
    text: str | None = None


class ChatMessage(RequestBody):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None      # assistant turns (OpenAI's shape)
    tool_call_id: str | None = None                     # tool results
    reasoning_content: str | None = None                # assistant turns in thinking mode


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None


# ---- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    """Speculative decoding's drafts, in OpenAI's predicted-outputs fields: drafts the target
    accepted, and drafts it verified and rejected."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(BaseModel):
    """`completion_tokens_details` is present only when the server speculates
    (`--speculative-num-steps`)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _without_absent_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("completion_tokens_details") is None:
            out.pop("completion_tokens_details", None)
        return out


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class RoutingArray(BaseModel):
    """An int32 array: `data` is base64 of its little-endian bytes (row-major), `shape` its
    shape [tokens, layers, k]; -1 marks "no route"."""

    data: str
    shape: list[int]


class RoutingFields(BaseModel):
    """`routed_experts` / `indexer_topk` of a choice, present only when the request asked."""

    routed_experts: RoutingArray | None = None
    indexer_topk: RoutingArray | None = None

    @model_serializer(mode="wrap")
    def _without_absent_routing(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        for name in ("routed_experts", "indexer_topk"):     # last, and only when present
            value = out.pop(name, None)
            if value is not None:
                out[name] = value
        return out


class CompletionChoice(RoutingFields):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCall):
    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(RoutingFields):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dsv4"
    root: str
    max_model_len: int
    random_weights: bool
    """True for the generated default model: its output is meaningless text."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class UpdateWeightsFromDiskRequest(RequestBody):
    """SGLang's `/update_weights_from_disk` body: a checkpoint directory of the served
    architecture."""

    model_path: str
    weight_version: str | None = None     # the label /generate reports (None: the update count)


class UpdateWeightsFromDiskResponse(BaseModel):
    success: bool
    message: str
    num_tensors: int
    weight_version: int


# ---- /tokenize, /detokenize (vLLM) ------------------------------------------------------------

class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
