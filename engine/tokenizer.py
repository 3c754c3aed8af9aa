"""Tokenizer loading (transformers) and prompt preparation."""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError, ModelLoadError


def load_tokenizer(tokenizer_dir: str | None) -> Any | None:
    if tokenizer_dir is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load tokenizer from {tokenizer_dir}: {exc}") from exc


def encode_prompt(tokenizer: Any | None, prompt: str | list[int], chat: bool = False) -> list[int]:
    """Token ids of a prompt: ids pass through; text is tokenized (through the chat template if asked)."""
    if isinstance(prompt, (list, tuple)):
        if not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
            raise InvalidRequestError("a token-id prompt must be a non-empty list of non-negative integers")
        return list(prompt)
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequestError("prompt must be a non-empty string or a list of token ids")
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer; pass prompts as token ids")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("--chat given but the model has no chat template")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer.encode(prompt))
