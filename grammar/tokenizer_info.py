"""TokenizerInfo: what the grammar backends need to know about a tokenizer, built once per tokenizer.

- vocab_size: the MODEL's vocabulary size (the width of the logits / the bitmask), which may be
  larger than the tokenizer's (padded lm_head); ids past the tokenizer never are allowed.
- eos_token_ids: the stop tokens, allowed exactly where the grammar may end.
- special_token_ids: control tokens (`<|im_start|>` ...), never allowed inside constrained text.
- token_bytes: the bytes each token id stands for in the output (byte-level BPE, byte-fallback
  SentencePiece and raw vocabularies are decoded).
- backend_state(key, factory): per-backend objects built lazily from the above and cached here
  (xgrammar's TokenizerInfo, outlines' Vocabulary, llguidance's LLTokenizer).
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any, Callable, Iterable, Sequence

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _decoder_kinds(tokenizer) -> set[str]:
    """The types named in the fast tokenizer's decoder ('ByteLevel', 'ByteFallback', 'Metaspace' ...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        dec = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:  # noqa: BLE001 — an unusual tokenizer: fall back to the vocabulary's look
        return set()
    kinds: set[str] = set()

    def walk(d: Any) -> None:
        if isinstance(d, dict):
            if "type" in d:
                kinds.add(str(d["type"]))
            for v in d.values():
                walk(v)
        elif isinstance(d, list):
            for v in d:
                walk(v)

    walk(dec)
    return kinds


# Tool-call markers some tokenizers make special tokens (Mistral's [TOOL_CALLS], Llama 3's
# <|python_tag|>); a structural tag's trigger is text, so these match it as their text there.
MARKER_TOKENS = frozenset({"[TOOL_CALLS]", "<tool_call>", "</tool_call>", "<|python_tag|>"})


class TokenizerInfo:
    def __init__(
        self, tokenizer, vocab_size: int | None = None, eos_token_ids: Sequence[int] | int | None = None
    ) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self.tokenizer_vocab_size = max(len(vocab), max(vocab.values()) + 1) if vocab else len(tokenizer)
        self.vocab_size = int(vocab_size) if vocab_size else self.tokenizer_vocab_size
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_id
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        eos = tuple(dict.fromkeys(int(i) for i in (eos_token_ids or ()) if 0 <= int(i) < self.vocab_size))
        if not eos:
            raise ValueError("TokenizerInfo needs at least one EOS token id within the vocabulary")
        self.eos_token_ids: tuple[int, ...] = eos

        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special = {int(i) for i, t in added.items() if getattr(t, "special", False)}
        special.update(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []))
        self._vocab = vocab
        self._added = {int(i): (t.content if hasattr(t, "content") else str(t)) for i, t in added.items()}

        kinds = _decoder_kinds(tokenizer)
        if "ByteLevel" in kinds or (not kinds and "Ġ" in "".join(list(vocab)[:2000])):
            self.vocab_type = "byte_level"
        elif "ByteFallback" in kinds or "<0x0A>" in vocab:
            self.vocab_type = "byte_fallback"
        else:
            self.vocab_type = "raw"

        token_bytes: list[bytes] = [b""] * self.tokenizer_vocab_size
        known = [False] * self.tokenizer_vocab_size
        for token, i in vocab.items():
            if 0 <= i < self.tokenizer_vocab_size:
                token_bytes[i] = self._token_to_bytes(i, token)
                known[i] = True
        # ids without a token (holes in the vocabulary) never are allowed
        special.update(i for i, k in enumerate(known) if not k)
        self.special_token_ids: frozenset[int] = frozenset(i for i in special if i < self.vocab_size)
        # special tokens that spell a tool-call marker: a structural tag may write them as their text
        self.marker_token_ids: frozenset[int] = frozenset(
            i for i in self.special_token_ids if self._added.get(i) in MARKER_TOKENS
        )
        self.token_bytes: list[bytes] = token_bytes
        self._state: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self._key_locks: dict[Any, threading.Lock] = {}

    def _token_to_bytes(self, i: int, token: str) -> bytes:
        if i in self._added:  # added tokens are stored as their text
            return self._added[i].encode("utf-8")
        if self.vocab_type == "byte_level":
            try:
                return bytes(_BYTE_DECODER[c] for c in token)
            except KeyError:
                return token.encode("utf-8")
        if self.vocab_type == "byte_fallback":
            m = _BYTE_TOKEN.match(token)
            if m:
                return bytes([int(m.group(1), 16)])
            return token.replace("\u2581", " ").encode("utf-8")
        return token.encode("utf-8")

    def normal_tokens(self) -> Iterable[tuple[int, bytes]]:
        """(id, bytes) of the tokens a grammar may allow inside its text (not special, not EOS,
        within the model's vocabulary, not empty)."""
        limit = min(self.tokenizer_vocab_size, self.vocab_size)
        skip = self.special_token_ids
        eos = set(self.eos_token_ids)
        for i in range(limit):
            b = self.token_bytes[i]
            if b and i not in skip and i not in eos:
                yield i, b

    def backend_state(self, key: Any, factory: Callable[[], Any]) -> Any:
        """A per-backend object built once (thread-safe; concurrent callers wait for the first)."""
        with self._lock:
            if key in self._state:
                return self._state[key]
            klock = self._key_locks.setdefault(key, threading.Lock())
        with klock:
            with self._lock:
                if key in self._state:
                    return self._state[key]
            value = factory()
            with self._lock:
                self._state[key] = value
            return value

    def __repr__(self) -> str:
        return (
            f"TokenizerInfo(vocab_size={self.vocab_size}, tokenizer_vocab_size={self.tokenizer_vocab_size}, "
            f"type={self.vocab_type}, eos={list(self.eos_token_ids)}, special={len(self.special_token_ids)})"
        )
