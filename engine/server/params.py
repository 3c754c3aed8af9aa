"""Turning an OpenAI request into prompt token ids and SamplingParams, and logprobs back into JSON.

Tokenization happens here, on the event loop, not on the engine thread (as vLLM
does it in its API server): the engine thread only runs steps, and the server
knows every prompt's length before queueing it, for usage and the context check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from engine.errors import InvalidRequestError
from engine.request import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.server.errors import APIError
from engine.server.protocol import (
    ChatChoiceLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    CompletionLogprobs,
    SamplingFields,
    TopLogprob,
)
from engine.server.tools import hermes_preamble, history_message, template_renders_tools
from engine.structured.spec import GrammarSpec
from engine.tokenizer import encode_prompt


@dataclass
class ModelInfo:
    """What the server needs to know about the model besides the engine thread."""

    name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # the server's own copy: the engine thread decodes with the engine's one
    # LoRA adapters the engine has loaded (name -> folder): requests name one as `model` or `lora_path`;
    # None: LoRA is off. Kept up to date by the load and unload endpoints.
    lora_adapters: dict[str, str] | None = None


class Tokens:
    """Token id -> text and raw bytes for logprobs, cached (the same ids recur all the time)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self.raw_bytes = lru_cache(maxsize=65536)(self._raw_bytes)

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _raw_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: a character split over tokens shows up as its parts, as in OpenAI's `bytes`."""
        if self.tokenizer is None:
            return self._text(token_id).encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return self._text(token_id).encode()
        if piece in getattr(self.tokenizer, "all_special_tokens", ()):
            return piece.encode()
        return piece_bytes(piece) or self._text(token_id).encode("utf-8", errors="replace")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed (printable stand-ins for the 256 byte values)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


def piece_bytes(piece: str) -> bytes | None:
    """Bytes of a vocabulary piece: byte-level BPE (GPT-2, Llama 3, Qwen), SentencePiece byte fallback
    (<0xE2>) or SentencePiece text (with its U+2581 for a space); None if it is neither."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    decoder = _byte_decoder()
    if all(char in decoder for char in piece):
        return bytes(decoder[char] for char in piece)
    if "\u2581" in piece:
        return piece.replace("\u2581", " ").encode()
    return None


class TokenTextJoiner:
    """Per-token text that joins to the output text: a character split over several tokens belongs
    to the token that completes it (the earlier ones get ""), never a U+FFFD per part."""

    def __init__(self, tokens: Tokens, skip_special_tokens: bool = True) -> None:
        self.tokens = tokens
        self.pending = b""
        special = getattr(tokens.tokenizer, "all_special_ids", None) if skip_special_tokens else None
        self.skipped_ids = frozenset(special or ())  # not in the text, so "" in the joined form (EOS)

    def piece(self, token_id: int) -> str:
        if self.tokens.tokenizer is None:
            return self.tokens.text(token_id)
        if token_id in self.skipped_ids:
            return ""
        self.pending += self.tokens.raw_bytes(token_id)
        for end in range(len(self.pending), max(-1, len(self.pending) - 4), -1):
            try:
                text = self.pending[:end].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self.pending = self.pending[end:]
            return text
        # Not a UTF-8 prefix at all (invalid bytes): give up on joining them, as the decoder does.
        return self.flush()

    def flush(self) -> str:
        """What is left of a character cut off by the end of the output, as the detokenizer renders it."""
        text, self.pending = self.pending.decode("utf-8", errors="replace"), b""
        return text


# ---- prompts ------------------------------------------------------------------------------------

# A token is rarely more than a few characters, so a text prompt longer than this many characters
# per token of context cannot fit: refused before it costs any tokenizing.
MAX_CHARS_PER_TOKEN = 32
# Keys of apply_chat_template a request may not set through chat_template_kwargs: the template
# itself (unless the operator trusts requests with it) and the arguments the server decides.
RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "tokenize",
    "add_generation_prompt",
    "return_dict",
    "return_tensors",
    "tokenizer_kwargs",
    "continue_final_message",
    "padding",
    "truncation",
    "max_length",
}
TEMPLATE_KWARGS = {"chat_template"}


def check_prompt_size(model: ModelInfo, text: str, param: str) -> None:
    """Text that cannot fit the context is refused before tokenizing it; so is unencodable text."""
    limit = model.max_model_len * MAX_CHARS_PER_TOKEN
    if len(text) > limit:
        raise APIError(
            f"{param} has {len(text)} characters; at most {limit} fit the context of {model.max_model_len} tokens",
            param=param,
        )
    check_encodable(text, param)


def check_encodable(text: str, param: str) -> None:
    """A lone surrogate (JSON "\\ud800") is not text: refuse it, naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(
            f"{param} is not valid Unicode text ({exc.reason} at character {exc.start})", param=param
        ) from exc


def check_chat_template_kwargs(
    kwargs: dict[str, Any] | None, trust_request_chat_template: bool
) -> dict[str, Any] | None:
    """vLLM's and SGLang's rule: a request-supplied template only where the operator allows it."""
    if not kwargs:
        return kwargs
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise APIError(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
    if not trust_request_chat_template and set(kwargs) & TEMPLATE_KWARGS:
        raise APIError(
            "request-supplied chat templates are refused (the operator can allow them with "
            "--trust-request-chat-template)",
            param="chat_template_kwargs",
        )
    return kwargs


def completion_prompts(
    model: ModelInfo, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[tuple[str | None, list[int]]]:
    """(text if given as text, token ids) of each prompt of a /v1/completions request."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise APIError("prompt must not be empty", param="prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            check_prompt_size(model, item, "prompt")
        try:
            ids = encode_prompt(model.tokenizer, item)
        except InvalidRequestError as exc:
            raise APIError(str(exc), param="prompt") from exc
        check_token_ids(model, ids, "prompt")
        prompts.append((item if isinstance(item, str) else None, ids))
    return prompts


def chat_prompt(
    model: ModelInfo,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    kwargs: dict | None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a conversation through the model's chat template; `tools` shown to the model (the
    template's own `tools` where it renders them, else a Hermes-format system preamble: engine/server/tools.py)."""
    tokenizer = model.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template; use /v1/completions", param="messages")
    native = template_renders_tools(tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None)
    kwargs = dict(kwargs or {})
    conversation: list[dict[str, Any]] = []
    total = 0
    for index, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            # Text parts only (this is a text model); vLLM joins them with newlines too.
            content = "\n".join(part.text for part in content)
        total += len(content or "")
        check_encodable(content or "", f"messages[{index}].content")
        try:
            conversation.append(
                history_message(
                    message.role,
                    content or "",
                    message.tool_calls,
                    message.tool_call_id if message.role == "tool" else None,
                    native,
                )
            )
        except InvalidRequestError as exc:
            raise APIError(f"messages[{index}].tool_calls: {exc}", param=f"messages[{index}].tool_calls") from exc
    if tools and native:
        kwargs["tools"] = tools
    elif tools:
        preamble = hermes_preamble(tools)
        if conversation and conversation[0]["role"] == "system":
            conversation[0] = {**conversation[0], "content": f"{conversation[0]['content']}\n\n{preamble}"}
        else:
            conversation.insert(0, {"role": "system", "content": preamble})
    if total > model.max_model_len * MAX_CHARS_PER_TOKEN:
        raise APIError(
            f"the messages have {total} characters; at most {model.max_model_len * MAX_CHARS_PER_TOKEN} "
            f"fit the context of {model.max_model_len} tokens",
            param="messages",
        )
    try:
        ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
        )
    except Exception as exc:
        raise APIError(f"cannot apply the chat template: {exc}", param="messages") from exc
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    if not ids:
        raise APIError("the conversation renders to an empty prompt", param="messages")
    return ids


def check_token_ids(model: ModelInfo, ids: Sequence[int], param: str) -> None:
    bad = [t for t in ids if not 0 <= t < model.vocab_size]
    if bad:
        raise APIError(f"token id {bad[0]} is outside the vocabulary (size {model.vocab_size})", param=param)


def resolve_max_tokens(model: ModelInfo, prompt_len: int, requested: int | None, param: str = "max_tokens") -> int:
    """The completion budget; over-long requests are a 400, as in vLLM, not a silent cut."""
    if prompt_len >= model.max_model_len:
        raise APIError(
            f"This model's maximum context length is {model.max_model_len} tokens. However, your prompt has "
            f"{prompt_len} tokens, leaving no room for a completion.",
            param="prompt" if param == "max_tokens" else "messages",
        )
    if requested is None:
        return model.max_model_len - prompt_len
    if requested < 1:
        raise APIError(f"{param} must be at least 1, got {requested}", param=param)
    if prompt_len + requested > model.max_model_len:
        raise APIError(
            f"This model's maximum context length is {model.max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion). "
            f"Please reduce the length of the prompt or {param}.",
            param=param,
        )
    return requested


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's JSON keys are token ids as text."""
    if not bias:
        return None
    parsed = {}
    for key, value in bias.items():
        if not key.isdigit():
            raise APIError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        parsed[int(key)] = value
    return parsed  # ids past the vocabulary: the engine's add_request refuses them


def derived_seed(seed: int | None, choice: int) -> int | None:
    """Choice i of n gets seed + i (wrapped to 64 bits): reproducible, yet the choices differ."""
    if seed is None:
        return None
    value = seed + choice
    return value if value < 2**64 else value - 2**64


def sampling_params(
    req: SamplingFields,
    max_tokens: int,
    seed: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    grammar: GrammarSpec | None = None,
    group: str | None = None,
    lora_name: str | None = None,
) -> SamplingParams:
    """The engine's parameters of one choice; `group`: the API call it belongs to (fair admission)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            seed=seed,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            skip_special_tokens=req.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            grammar=grammar,
            logit_bias=_logit_bias(req.logit_bias),
            min_tokens=req.min_tokens or 0,
            allowed_token_ids=req.allowed_token_ids,
            cache_salt=req.cache_salt,
            group=group,
            lora_name=lora_name,
        )
    except InvalidRequestError as exc:
        raise APIError(str(exc), param=_first_field(str(exc))) from exc


def _first_field(message: str) -> str | None:
    """The field SamplingParams.validate names first ('invalid sampling parameters: top_p must ...')."""
    problem = message.split(": ", 1)[-1]
    name = problem.split(" ", 1)[0]
    return name if name.isidentifier() else None


# ---- logprobs --------------------------------------------------------------------------------


def completion_logprobs(
    tokens: Tokens,
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    offset: int,
    joiner: TokenTextJoiner | None = None,
    final: bool = True,
) -> tuple[CompletionLogprobs, int]:
    """The legacy shape for these tokens; text offsets start at `offset`. Returns it and the next offset.

    `joiner` carries a split character across calls (streaming); the tokens' texts join to the text.
    `final`: these tokens end the output, so a character they leave cut off is rendered now.
    """
    joiner = joiner or TokenTextJoiner(tokens)
    out = CompletionLogprobs()
    for index, (token_id, entry) in enumerate(zip(token_ids, entries)):
        text = joiner.piece(token_id)
        if final and index == len(token_ids) - 1:
            text += joiner.flush()
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(entry.logprob)
        top = {tokens.text(t): lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)  # the sampled token is always listed, as in vLLM
        out.top_logprobs.append(top)
    return out, offset


def chat_logprobs(
    tokens: Tokens,
    entries: Sequence[TokenLogprob],
    top_k: int,
    joiner: TokenTextJoiner | None = None,
    final: bool = True,
) -> ChatChoiceLogprobs:
    """OpenAI's chat shape: `bytes` are each token's own bytes; `token` texts join to the content."""
    joiner = joiner or TokenTextJoiner(tokens)
    content = []
    for index, entry in enumerate(entries):
        text = joiner.piece(entry.token_id)
        if final and index == len(entries) - 1:
            text += joiner.flush()
        top = [
            TopLogprob(token=tokens.text(t), logprob=lp, bytes=list(tokens.raw_bytes(t))) for t, lp in entry.top[:top_k]
        ]
        raw = b"" if entry.token_id in joiner.skipped_ids else tokens.raw_bytes(entry.token_id)  # a skipped EOS: ""
        content.append(ChatTokenLogprob(token=text, logprob=entry.logprob, bytes=list(raw), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)
