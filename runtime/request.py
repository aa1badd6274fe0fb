"""A request inside the scheduler, and the typed messages that enter and leave it."""

from __future__ import annotations

import functools
import re

import msgspec

from .sampling_params import SamplingParams


class GenerateInput(msgspec.Struct, kw_only=True, tag=True):
    """A tokenized request, as the scheduler receives it (tagged: one of the ZeroMQ messages)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position with an input logprob; -1: none
    top_logprobs_num: int = 0
    # An embedding request (prefill only): its output carries the last prompt token's final hidden
    # state (after the last norm), L2-normalized, as decoder embedding models are pooled.
    return_embedding: bool = False
    # False (a caller that waits for the whole result): the scheduler process sends this request's
    # tokens once, when it finishes, instead of every step (SGLang does the same): at batch 1 each
    # output wakes the detokenizer and the caller's process while the next step runs on both cores.
    stream: bool = True


class TokenOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one step produced for one request: new tokens (and logprobs), and whether it finished."""

    rid: str
    new_ids: list[int]
    finish_reason: dict | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # [logprob, token_id] pairs; input ones arrive once, when the prompt is done
    input_logprobs: list | None = None
    input_top_logprobs: list | None = None
    output_logprobs: list | None = None
    output_top_logprobs: list | None = None
    embedding: list[float] | None = None
    # Detokenization options, attached by the scheduler to a request's first output only (the
    # detokenizer process keeps them for the rest of the request); absent: the defaults (True).
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    # The new text of this output, filled in by the detokenizer process (stable: never a split
    # UTF-8 character; a final EOS / stop-token id is not shown). Stop strings are not trimmed here.
    text_delta: str = ""

    def merged(self, later: "TokenOutput") -> "TokenOutput":
        """This output followed by `later` (of the same request), as one output."""

        def cat(a: list | None, b: list | None) -> list | None:
            return b if a is None else a if b is None else a + b

        return TokenOutput(
            rid=self.rid,
            new_ids=self.new_ids + later.new_ids,
            finish_reason=later.finish_reason,
            prompt_tokens=later.prompt_tokens,
            cached_tokens=later.cached_tokens,
            input_logprobs=cat(self.input_logprobs, later.input_logprobs),
            input_top_logprobs=cat(self.input_top_logprobs, later.input_top_logprobs),
            output_logprobs=cat(self.output_logprobs, later.output_logprobs),
            output_top_logprobs=cat(self.output_top_logprobs, later.output_top_logprobs),
            embedding=later.embedding if later.embedding is not None else self.embedding,
            skip_special_tokens=self.skip_special_tokens
            if self.skip_special_tokens is not None
            else later.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens
            if self.spaces_between_special_tokens is not None
            else later.spaces_between_special_tokens,
            text_delta=self.text_delta + later.text_delta,
        )


# How many trailing output tokens a `stop_regex` is searched in, each step. Checked every step, so a
# match is found at the token that completes it; only a match spanning more than this is missed.
STOP_REGEX_WINDOW = 256


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern)


class Req:
    """Scheduler-side state of one request.

    KV bookkeeping: `fill_ids` = prompt + output. `kv_len` tokens of it have KV in the pool,
    at `req_to_token[row, :kv_len]`; the first `cached_len` of those are owned by the prefix
    cache (held by a lock on `last_node`), the rest by this request.
    """

    __slots__ = (
        "rid",
        "origin_ids",
        "output_ids",
        "params",
        "seed",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "row",
        "kv_len",
        "cached_len",
        "last_node",
        "cached_tokens",
        "finish_reason",
        "prefilled",
        "input_logprobs",
        "input_top_logprobs",
        "stop_tail_tokens",
        "stop_patterns",
        "arrival",
        "matcher",
        "num_draft",
        "return_embedding",
        "draft_source",
        "ngram",
        "ngram_length",
    )

    def __init__(self, inp: GenerateInput, arrival: int):
        self.rid = inp.rid
        self.origin_ids = list(inp.input_ids)
        self.output_ids: list[int] = []
        self.params = inp.params
        self.seed = inp.seed
        self.return_logprob = inp.return_logprob
        self.logprob_start_len = inp.logprob_start_len
        self.top_logprobs_num = inp.top_logprobs_num
        self.return_embedding = inp.return_embedding
        self.row: int | None = None
        self.kv_len = 0
        self.cached_len = 0
        self.last_node = None
        self.cached_tokens = -1  # reported once, at the first admission
        self.finish_reason: dict | None = None
        self.prefilled = False  # prompt fully computed at least once
        self.input_logprobs: list = []
        self.input_top_logprobs: list = []
        longest = max((len(s) for s in self.params.stop), default=0)
        self.stop_tail_tokens = longest + 2  # a token is at least one character
        self.stop_patterns = tuple(_compiled(p) for p in self.params.stop_regex)
        if self.stop_patterns:  # a regex match has no length bound: look further back
            self.stop_tail_tokens = max(self.stop_tail_tokens, STOP_REGEX_WINDOW)
        self.arrival = arrival
        self.matcher = None  # grammar matcher, when the request has a grammar
        self.num_draft = 0  # trailing output_ids proposed as drafts, not yet verified
        self.draft_source = ""  # who proposed them: "grammar" (jump-forward), "ngram" or "draft"
        self.ngram = None  # speculative.NgramIndex over fill_ids, made on first use
        self.ngram_length = None  # speculative.DraftLength of its n-gram drafts, likewise

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_ids + self.output_ids if self.output_ids else self.origin_ids

    @property
    def fill_len(self) -> int:
        """`len(fill_ids)` without building the list (a long request's step asked for it ~6 times)."""
        return len(self.origin_ids) + len(self.output_ids)

    def fill_from(self, start: int) -> list[int]:
        """`fill_ids[start:]`, building only that (a decode step's: its last token)."""
        n = len(self.origin_ids)
        return self.output_ids[start - n :] if start >= n else self.origin_ids[start:] + self.output_ids

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.prefilled

    def max_cacheable_prefix(self) -> int:
        """How many leading tokens may come from the cache: at least one token must be computed
        (its logits are needed), and positions that need input logprobs need their logits."""
        limit = self.fill_len - 1
        if self.wants_input_logprobs:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit
