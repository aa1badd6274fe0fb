"""Draft-model speculative decoding: the draft side.

A second, smaller model sharing the target's vocabulary proposes the next k tokens greedily. It
runs through plait's own ModelRunner (loader, model classes, quantization, prepacking) with a KV
pool of its own, sized by `speculative_draft_max_tokens`, and keeps each request's draft KV between
steps: at the next proposal only the tokens it has not seen (the target's own token and whatever
followed the first rejected draft) are computed, after cutting its cache back to the longest
common prefix with the request's committed tokens.

Drafts are point masses, so the scheduler's acceptance rule (see plait.runtime.speculative.ngram) keeps
greedy output identical and seeded sampling exact, whatever the draft proposes — or declines to.
That freedom pays for an adaptive draft length per request (`speculative.DraftLength`): a draft
forward costs a fair part of a target forward (SmolLM2 int4 drafting for float32: ~0.4x), so drafts
that are rejected (sampled requests, where a greedy draft is kept with probability p(draft)) make a
request slower than no speculation at all.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from ..mem_cache.memory_pool import ReqToTokenTable, TokenSlotAllocator
from ..model_executor.forward_batch import ForwardBatch
from ..model_executor.model_loader import load_config, resolve_model
from ..model_executor.model_runner import ModelRunner
from ..server_args import ServerArgs
from .ngram import DraftLength

logger = logging.getLogger(__name__)


class _DraftState:
    """What the draft cache holds for one request (KV of `ids` at `table[row, :len(ids)]`) and its
    adaptive draft length."""

    __slots__ = ("base", "drafts", "ids", "length", "row", "used")

    def __init__(self, row: int, max_k: int):
        self.row = row
        self.ids: list[int] = []
        self.used = 0  # proposal round of the last use (least recently used is evicted first)
        self.length = DraftLength(max_k)
        self.drafts: list[int] = []  # the last proposal, not yet compared with what was kept ...
        self.base = 0  # ... which followed the first `base` committed tokens

    def observe(self, ids: list[int]) -> None:
        """Adapt the draft length to how many of the last drafts the committed `ids` kept."""
        if not self.drafts:
            return
        n = len(self.drafts)
        self.length.record(n, len(os.path.commonprefix([self.drafts, ids[self.base : self.base + n]])))
        self.drafts = []


class DraftModel:
    """The draft model, its KV pool and per-request draft caches (keyed by request id)."""

    def __init__(self, args: ServerArgs, target: ModelRunner):
        name = args.speculative_draft_model
        path = resolve_model(name, float_weights=False)
        check_vocab_size(name, load_config(path).vocab_size, target.vocab_size)  # before loading weights
        if args.speculative_draft_quantization is not None:
            from ..layers.quantization import QUANTIZATIONS

            if args.speculative_draft_quantization not in QUANTIZATIONS:
                raise ValueError(
                    f"speculative_draft_quantization must be one of {', '.join(QUANTIZATIONS)}, "
                    f"got {args.speculative_draft_quantization!r}"
                )
        # The draft keeps its own position limit (RoPE tables); drafting stops at the smaller one.
        draft_args = dataclasses.replace(
            args,
            model=path,
            revision=None,
            quantization=args.speculative_draft_quantization,
            max_total_tokens=args.speculative_draft_max_tokens,
            context_length=None,
            speculative_algorithm=None,
            speculative_draft_model=None,
            speculative_draft_quantization=None,
        )
        self.runner = ModelRunner(draft_args)
        check_same_tokens(name, self.runner.tokenizer, target.tokenizer)
        self.context_len = min(self.runner.context_len, target.context_len)
        self.num_slots = self.runner.pool.num_slots
        self.allocator = TokenSlotAllocator(self.num_slots)
        self.table = ReqToTokenTable(args.max_running_requests, self.context_len + 1)
        self.states: dict[str, _DraftState] = {}
        self.max_k = args.speculative_num_draft_tokens
        self._round = 0
        logger.info("draft model %s: %d KV slots", args.speculative_draft_model, self.num_slots)

    # --- bookkeeping --------------------------------------------------------------------------
    def slots_in_use(self) -> int:
        """Draft KV slots held by requests; 0 once every request has been released."""
        return self.num_slots - self.allocator.available()

    def release(self, rid: str) -> None:
        """Free the request's draft KV and row (finished, aborted or retracted); no-op if none."""
        st = self.states.pop(rid, None)
        if st is not None:
            self.allocator.free(self.table.table[st.row, : len(st.ids)].clone())
            self.table.free(st.row)

    def _truncate(self, st: _DraftState, keep: int) -> None:
        if keep < len(st.ids):
            self.allocator.free(self.table.table[st.row, keep : len(st.ids)].clone())
            del st.ids[keep:]

    def _make_room(self, n: int, busy: set[str]) -> bool:
        """True when `n` slots are free, releasing the least recently used caches of requests not
        drafting this round (those that stopped drafting, e.g. while the batch is large)."""
        if self.allocator.available() < n:
            idle = sorted((st.used, rid) for rid, st in self.states.items() if rid not in busy)
            for _, rid in idle:
                self.release(rid)
                if self.allocator.available() >= n:
                    break
        return self.allocator.available() >= n

    def _state(self, rid: str) -> _DraftState | None:
        st = self.states.get(rid)
        if st is None:
            row = self.table.alloc()
            if row is None:
                return None
            st = self.states[rid] = _DraftState(row, self.max_k)
        return st

    # --- proposing ----------------------------------------------------------------------------
    def propose(self, requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """For each (request id, committed token ids, k): up to k greedy draft tokens following the
        ids (fewer by the request's adaptive length). All requests advance together: one forward
        for the tokens their caches lack, then one batched decode forward per further draft
        position. A request gets no drafts while it pauses, when the draft pool cannot hold it or
        when the draft's context is exhausted."""
        self._round += 1
        busy = {rid for rid, _, _ in requests}
        out: list[list[int]] = [[] for _ in requests]
        live: list[tuple[int, _DraftState, list[int], int]] = []  # (index, state, ids, k)
        for i, (rid, ids, k) in enumerate(requests):
            st = self.states.get(rid)
            if st is not None:
                st.used = self._round
                st.observe(ids)
                if (own := st.length.take()) == 0:  # pausing
                    continue
                k = min(k, own)
            # the last draft's position must be < context_len
            k = min(k, self.context_len - len(ids))
            st = self._state(rid) if k > 0 and ids else None
            if st is None:
                continue
            st.used = self._round
            # Keep the common prefix, but recompute at least the last token: its logits give draft 1.
            self._truncate(st, min(len(os.path.commonprefix([st.ids, ids])), len(ids) - 1))
            live.append((i, st, ids, k))
        placed = []
        for i, st, ids, k in live:
            need = len(ids) - len(st.ids) + k - 1  # the missing tokens, then drafts 1..k-1
            if not self._make_room(need, busy):
                self.release(requests[i][0])
                continue
            self.table.table[st.row, len(st.ids) : len(st.ids) + need] = self.allocator.alloc(need)
            placed.append((i, st, ids, k))
        if not placed:
            return out
        # Draft 1: extend each cache by what it lacks (longest first: single-token extends must
        # come last in a ForwardBatch).
        placed.sort(key=lambda x: len(x[1].ids) - len(x[2]))
        first = self._forward([(st, ids[len(st.ids) :]) for _, st, ids, _ in placed])
        for (i, st, ids, _), tok in zip(placed, first):
            st.ids[len(st.ids) :] = ids[len(st.ids) :]
            out[i].append(tok)
        # Drafts 2..k: one token per request per forward, while a request still wants more.
        for step in range(1, max(k for *_, k in placed)):
            active = [(i, st) for i, st, _, k in placed if k > step]
            toks = self._forward([(st, [out[i][-1]]) for i, st in active])
            for (i, st), tok in zip(active, toks):
                st.ids.append(out[i][-1])
                out[i].append(tok)
        for i, st, ids, _ in placed:
            st.drafts, st.base = list(out[i]), len(ids)
        return out

    def _forward(self, items: list[tuple[_DraftState, list[int]]]) -> list[int]:
        """One draft forward: append `new` tokens to each cache (slots already placed in the table
        after `st.ids`), return the greedy next token after each. The caller extends `st.ids`."""
        input_ids, rows, prefix, extend, logits_index = [], [], [], [], []
        table = self.table.table
        for st, new in items:
            input_ids += new
            rows.append(st.row)
            prefix.append(len(st.ids))
            extend.append(len(new))
            logits_index.append(len(input_ids) - 1)
        locs = torch.cat([table[st.row, len(st.ids) : len(st.ids) + len(new)] for st, new in items])
        batch = ForwardBatch.build(
            input_ids, rows, prefix, extend, locs, table, logits_index, device=self.runner.device
        )
        return self.runner.forward(batch).argmax(dim=-1).tolist()


def check_vocab_size(name: str, draft_size: int, target_size: int) -> None:
    """A ValueError unless the draft model's vocabulary has the target's size."""
    if draft_size != target_size:
        raise ValueError(
            f"draft model {name!r} has a vocabulary of {draft_size} tokens, the target model "
            f"{target_size}: the draft model must use the target's tokenizer"
        )


def check_same_tokens(name: str, tokenizer, target_tokenizer) -> None:
    """A ValueError unless both tokenizers map the same strings to the same ids."""
    if tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"draft model {name!r} has a different tokenizer than the target model (same size, "
            f"different tokens): the draft model must use the target's tokenizer"
        )
