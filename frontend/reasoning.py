"""Reasoning split for `separate_reasoning`: a reasoning model's output is its thinking between
markers, then its answer. The model families and their markers are SGLang's (`--reasoning-parser`
names); the split follows the same rules (see `split_reasoning`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkFormat:
    start: str
    end: str
    # the model thinks from its first token, with or without the start marker (DeepSeek-R1)
    always_thinks: bool = False
    # the model's output lacks the start marker, which belongs in front of the answer text
    prepend_start: bool = False


_THINK = ("<think>", "</think>")
FORMATS: dict[str, ThinkFormat] = {
    "deepseek-r1": ThinkFormat(*_THINK, always_thinks=True),
    "deepseek-v3": ThinkFormat(*_THINK),
    "glm45": ThinkFormat(*_THINK),
    "kimi": ThinkFormat("◁think▷", "◁/think▷"),
    "kimi_k2": ThinkFormat(*_THINK, always_thinks=True),
    "qwen3": ThinkFormat(*_THINK),
    "qwen3-thinking": ThinkFormat(*_THINK, always_thinks=True),
    "minimax": ThinkFormat(*_THINK, always_thinks=True),
    "minimax-append-think": ThinkFormat(*_THINK, prepend_start=True),
    "step3": ThinkFormat(*_THINK, always_thinks=True),
}
# Formats SGLang knows that are not a pair of markers: named, so the error says what is missing.
UNSUPPORTED = {"gpt-oss": "the Harmony channel format (gpt-oss) is not parsed by plait"}


def think_format(model_type: str | None) -> ThinkFormat:
    """The markers of `model_type` (case-insensitive); ValueError / NotImplementedError otherwise."""
    if not model_type:
        raise ValueError("separate_reasoning needs model_type= (e.g. 'deepseek-r1', 'qwen3')")
    key = model_type.lower()
    if key in UNSUPPORTED:
        raise NotImplementedError(f"separate_reasoning(model_type={model_type!r}): {UNSUPPORTED[key]}")
    if key not in FORMATS:
        raise ValueError(f"unknown reasoning model_type {model_type!r}; known: {sorted(FORMATS)}")
    return FORMATS[key]


def split_reasoning(text: str, fmt: ThinkFormat) -> tuple[str, str]:
    """(reasoning, answer) of one output. Not thinking (no start marker, not an always-thinking
    family): all answer. Thinking without an end marker (cut short): all reasoning. Otherwise the
    text before the end marker is the reasoning and the stripped text after it is the answer."""
    if fmt.prepend_start:
        return "", fmt.start + text
    if not (fmt.always_thinks or fmt.start in text):
        return "", text
    body = text.replace(fmt.start, "").strip()
    if fmt.end not in body:
        return body, ""
    reasoning, answer = body.split(fmt.end, 1)
    return reasoning, answer.strip()
