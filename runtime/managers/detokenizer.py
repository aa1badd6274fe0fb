"""Incremental detokenization: text grows token by token without splitting a UTF-8 character
and without the drift that decoding single tokens gives; stop strings are trimmed and, while
streaming, a possible stop-string prefix at the end is held back.

IncrementalDetokenizer runs in the detokenizer process (`detokenizer_process.py`); the stop-string
helpers run in the engine's process, on each request's accumulated text."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Per-request decoder: `add(ids)` appends tokens, `text` is the stable text so far.

    Each step decodes the previous chunk together with the new tokens and keeps the difference,
    so byte-level merges across the boundary come out as a full decode would give them."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.kwargs = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            self.kwargs["spaces_between_special_tokens"] = False
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0  # tokens already turned into text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.kwargs)

    def add(self, ids: list[int], final: bool = False) -> str:
        """Append tokens; return the new stable text. With `final`, flush even an incomplete character."""
        self.ids += ids
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            delta = after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += delta
            return delta
        return ""


def trim_stop(text: str, stops: list[str]) -> str:
    """Cut text at the earliest occurrence of any stop string."""
    cut = len(text)
    for s in stops:
        i = text.find(s)
        if 0 <= i < cut:
            cut = i
    return text[:cut]


def stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that could begin a stop string (held back while streaming)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-k:]):
                best = k
                break
    return best
