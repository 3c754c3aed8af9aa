"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Fields beyond these models are sorted by engine/server/fields.py: harmless metadata
(user, metadata, ...) ignored, unimplemented features (response_format, tools,
logit_bias, ...) and unknown fields refused with a 400 naming them. vLLM's extra
sampling fields (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids, ...) are real.
Types are strict, as OpenAI's are: `true` or `1.0` is not a token id, "5" is not a count.
Text with a lone surrogate ("\\ud800" in JSON) is refused naming its field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MAX_CHOICES = 128  # n x prompts per request: a cap so one request cannot flood the queue
# Validation context key: the body's bytes hold no surrogate (engine/server/bodies.py looked), so the walk for
# lone surrogates, a Python call per item of the body, is skipped (it cost 0.2 s for 1.6 million token ids).
NO_SURROGATES = "no_surrogates"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any, info: ValidationInfo) -> Any:
        if info.context and info.context.get(NO_SURROGATES):
            return data
        where = _first_lone_surrogate(data, "")
        if where is not None:
            raise ValueError(f"{where or 'the body'} is not valid Unicode text (a lone surrogate)")
        return data


def _first_lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (key or value) that UTF-8 cannot encode, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and _first_lone_surrogate(key, "") is not None:
                return f"a field name in {path}" if path else "a field name"
            found = _first_lone_surrogate(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            # Only text can hold a surrogate: a million token ids are passed over without a call each.
            if isinstance(item, (str, dict, list)):
                found = _first_lone_surrogate(item, f"{path}[{index}]")
                if found is not None:
                    return found
    return None


class StreamOptions(OpenAIBase):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIBase):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None  # token id (as text, OpenAI's JSON) -> bias in [-100, 100]
    min_tokens: int | None = None  # vLLM's: no EOS / stop before this many tokens
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    # vLLM's: prefix-cache pages are shared only between requests with the same salt (docs/server.md).
    cache_salt: str | None = None
    # SGLang's: the LoRA adapter to run with, by its loaded name (vLLM's way: the adapter's name as `model`).
    lora_path: str | None = None

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("cache_salt must be a non-empty string")  # vLLM's rule: "" would salt nothing
        return value


class CompletionRequest(SamplingFields):
    # Left to right, token ids before texts: in pydantic's smart mode each member is tried, and list[str] on a
    # million token ids made a million errors (0.45 s) before list[int] took them.
    prompt: str | list[int] | list[str] | list[list[int]] = Field(union_mode="left_to_right")
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    return_token_ids: bool = False  # vLLM extension: token ids of prompt and completion per choice


class TextContentPart(OpenAIBase):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBase):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (engine/server/tools.py)
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        # OpenAI answers 400 for a message without content (an assistant's may be empty only beside
        # its tool_calls): generating from nothing would not be what was asked.
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context length, as vLLM
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(OpenAIBase):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBase):
    model: str | None = None
    tokens: list[int]


# ---- responses ------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "graph-engine"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
