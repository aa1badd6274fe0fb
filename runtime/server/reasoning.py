"""Reasoning sections split from chat answers into `reasoning_content` (`--reasoning-parser`),
whole (`split_reasoning`) or as they stream (`ReasoningStream`).

Both families write `<think>` ... `</think>` before the answer. qwen3: a section only when the
output opens with `<think>` (with `enable_thinking: false` the template writes an empty one into
the prompt, and the answer is all content). deepseek-r1: the template's generation prompt has
already opened the section, so the output is reasoning from its first token (a `<think>` the model
writes again is dropped). Once open, everything up to `</think>` is reasoning, also when the
answer is cut before it closes; the text after it is the content (whitespace around each trimmed).
"""

from __future__ import annotations

from ..server_args import REASONING_PARSERS

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back while streaming)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


class ReasoningStream:
    """One choice's cumulative text -> reasoning deltas and the content so far."""

    def __init__(self, parser: str):
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
        self.parser = parser
        self.sent = 0  # characters of the reasoning sent

    def _body(self, text: str, final: bool) -> str | None:
        """The text after an opening `<think>`; None when this output has no reasoning section, or
        (not final) when it may still be starting one."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_OPEN):
            return stripped[len(THINK_OPEN) :]
        if not final and THINK_OPEN.startswith(stripped):
            return None if self.parser == "qwen3" else ""  # may be the tag: wait for more text
        return text if self.parser == "deepseek-r1" else None

    def update(self, text: str, final: bool = False) -> tuple[str, str | None]:
        """(the reasoning not sent yet, the content so far or None while reasoning goes on). Until
        `final`, text that may be the start of a tag is held back."""
        body = self._body(text, final)
        if body is None:
            stripped = text.lstrip()
            undecided = not final and self.parser == "qwen3" and THINK_OPEN.startswith(stripped)
            return "", (None if undecided else text)
        body = body.lstrip()  # the reasoning without the whitespace around it, streamed or not
        end = body.find(THINK_CLOSE)
        if end >= 0:
            reasoning, content = body[:end].rstrip(), body[end + len(THINK_CLOSE) :].lstrip()
        elif final:
            reasoning, content = body.rstrip(), None
        else:
            reasoning, content = body[: len(body) - _partial_suffix(body, THINK_CLOSE)].rstrip(), None
        delta = reasoning[self.sent :]
        self.sent = max(self.sent, len(reasoning))
        return delta, content


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """A finished answer -> (its reasoning or None, its content)."""
    reasoning, content = ReasoningStream(parser).update(text, final=True)
    if content == text and not reasoning:
        return None, text
    return reasoning or None, content or ""


def reasoning_gate(parser: str, prompt_tail: str) -> dict[str, str]:
    """The sampling params that bind a constrained chat request's grammar only after its reasoning
    section, from the end of its rendered prompt: none when the prompt already closed the section
    (Qwen3 with `enable_thinking: false`), the end marker when it opened it (DeepSeek-R1's
    generation prompt), both markers when the model may open one itself (Qwen3)."""
    tail = prompt_tail.rstrip()
    if tail.endswith(THINK_CLOSE):
        return {}
    if parser == "deepseek-r1" or tail.endswith(THINK_OPEN):
        return {"reasoning_end": THINK_CLOSE}
    return {"reasoning_start": THINK_OPEN, "reasoning_end": THINK_CLOSE}
