"""`reasoning_content` split from `content` for models that think between <think> and </think>.

`engine serve --reasoning-parser NAME`, as vLLM and SGLang name it:
- `deepseek_r1`: the template opens the thought (DeepSeek-R1 puts `<think>\\n` in the prompt), so the
  output is reasoning up to `</think>` and content after it; an output that never closes it is all
  reasoning (cut off while thinking). A `<think>` the model writes itself is dropped.
- `qwen3`: the model opens the thought itself (`<think>` first, Qwen3 and QwQ), and with
  `chat_template_kwargs: {"enable_thinking": false}` the template closes an empty one in the prompt
  so the output is all content. Output not starting with `<think>` is content; a thought never
  closed is reasoning, as for deepseek_r1.

The split of a stream is the split of its text: streaming emits, chunk by chunk, exactly the
reasoning and content the finished text splits into (a tag cut between two chunks is held back
until it is whole), so the deltas always join to the non-streamed answer.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(parser: str, text: str, finished: bool = True) -> tuple[str, str]:
    """(reasoning, content) of the text so far. Not finished: a tag's first characters at the end are
    held back from both (they may be a tag once the next chunk comes)."""
    if parser == "qwen3":
        stripped = text.lstrip()
        if not stripped.startswith(OPEN):
            if not finished and OPEN.startswith(stripped):
                return "", ""  # the output may still open a thought
            return "", text
        text = stripped[len(OPEN) :]
    elif text.lstrip().startswith(OPEN):
        text = text.lstrip()[len(OPEN) :]
    elif not finished and OPEN.startswith(text.lstrip()):
        return "", ""
    end = text.find(CLOSE)
    if end == -1:
        return (text if finished else _without_partial_tag(text)), ""
    return text[:end], text[end + len(CLOSE) :]  # raw, as vLLM's parsers give them


def _without_partial_tag(text: str) -> str:
    for keep in range(min(len(CLOSE) - 1, len(text)), 0, -1):
        if CLOSE.startswith(text[-keep:]):
            return text[:-keep]
    return text


@dataclass
class ReasoningStream:
    """Per streamed choice: what of the split has gone out."""

    parser: str
    text: str = ""
    sent_reasoning: int = 0
    sent_content: int = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        """(reasoning delta, content delta) for the text's next piece."""
        self.text += delta
        reasoning, content = split_reasoning(self.parser, self.text, finished)
        new = reasoning[self.sent_reasoning :], content[self.sent_content :]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return new
