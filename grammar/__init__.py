"""plait.grammar — constrained decoding: JSON schema / regex / EBNF / choice specs compiled
through interchangeable backends (xgrammar, llguidance, outlines-core; "auto" by default picks per
spec kind with fallback, see auto_backend.py), per-request
matchers that fill packed vocabulary bitmasks, jump-forward text, and a compile cache.

    backend = make_backend("auto", hf_tokenizer, vocab_size=model_vocab)
    cache = GrammarCache(backend)
    grammar = cache.submit(GrammarSpec.from_json_schema(schema)).result()   # Future: never blocks the caller
    m = grammar.matcher()
    bitmask = allocate_token_bitmask(batch, vocab_size)
    m.fill_mask(bitmask, row); apply_token_bitmask_(logits, bitmask); m.accept(token)

This package never imports plait.runtime or plait.frontend (runtime uses grammar, not the other
way), and importing it does not import torch or any backend.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from .base import KINDS, Grammar, GrammarBackend, GrammarError, GrammarSpec, Matcher, canonical_json
from .cache import GrammarCache
from .tokenizer_info import TokenizerInfo

__all__ = [
    "GrammarError",
    "GrammarSpec",
    "TokenizerInfo",
    "Grammar",
    "Matcher",
    "GrammarBackend",
    "GrammarCache",
    "make_backend",
    "available_backends",
    "allocate_token_bitmask",
    "apply_token_bitmask_",
    "canonical_json",
    "BACKENDS",
    "KINDS",
    "DEFAULT_BACKEND",
]

DEFAULT_BACKEND = "auto"
# name -> (module, class, the pip requirement that brings it); "auto" combines the others
# (see auto_backend.py)
BACKENDS = {
    "xgrammar": (".xgrammar_backend", "XGrammarBackend", "xgrammar"),
    "outlines": (".outlines_backend", "OutlinesBackend", "outlines-core"),
    "llguidance": (".llguidance_backend", "LLGuidanceBackend", "llguidance"),
}
AUTO = "auto"

_infos: dict[tuple, tuple[Any, TokenizerInfo]] = {}
_infos_lock = threading.Lock()


def tokenizer_info(tokenizer, vocab_size: int | None = None, eos_token_ids=None) -> TokenizerInfo:
    """The TokenizerInfo of an HF tokenizer, built once per (tokenizer, vocab_size, eos ids)."""
    if isinstance(tokenizer, TokenizerInfo):
        return tokenizer
    eos = (
        None
        if eos_token_ids is None
        else ((int(eos_token_ids),) if isinstance(eos_token_ids, int) else tuple(int(i) for i in eos_token_ids))
    )
    key = (id(tokenizer), vocab_size, eos)
    with _infos_lock:
        hit = _infos.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
    info = TokenizerInfo(tokenizer, vocab_size, eos)
    with _infos_lock:
        _infos[key] = (tokenizer, info)  # holds the tokenizer, so its id stays unique
    return info


def _backend_class(name: str):
    try:
        module_name, cls_name, requirement = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown grammar backend {name!r}; expected one of {', '.join([AUTO, *BACKENDS])}") from None
    try:
        module = importlib.import_module(module_name, __name__)
    except ImportError as e:
        raise ImportError(f"grammar backend {name!r} is not available: it needs {requirement} ({e})") from e
    return getattr(module, cls_name)


def available_backends() -> list[str]:
    """The backends whose package is installed."""
    out = []
    for name in BACKENDS:
        try:
            _backend_class(name)
        except ImportError:
            continue
        out.append(name)
    return out


def make_backend(
    name: str | None, tokenizer, vocab_size: int | None = None, *, eos_token_ids=None, **options
) -> GrammarBackend:
    """A grammar backend for an HF tokenizer (or a TokenizerInfo). `vocab_size` is the MODEL's
    vocabulary size (logits width). `options` go to the backend (json_whitespace="default" |
    "compact" | "any"; xgrammar and llguidance: strict_mode; xgrammar: max_threads, any_order; outlines: max_memory_mb,
    compile_timeout_s, isolate). "auto" (the default) combines xgrammar and llguidance, whichever
    are installed, and takes json_whitespace and strict_mode. Raises ImportError naming the package if it
    is missing."""
    info = tokenizer_info(tokenizer, vocab_size, eos_token_ids)
    name = name or DEFAULT_BACKEND
    if name == AUTO:
        from .auto_backend import ORDER, AutoBackend

        members = {n for kinds in ORDER.values() for n in kinds}
        backends = {n: _backend_class(n)(info, **options) for n in available_backends() if n in members}
        if not backends:
            raise ImportError("the auto grammar backend needs xgrammar or llguidance (pip install xgrammar)")
        return AutoBackend(backends)
    return _backend_class(name)(info, **options)


def allocate_token_bitmask(batch: int, vocab_size: int, **kw):
    from .bitmask import allocate_token_bitmask as f

    return f(batch, vocab_size, **kw)


def apply_token_bitmask_(logits, bitmask) -> None:
    from .bitmask import apply_token_bitmask_ as f

    f(logits, bitmask)
