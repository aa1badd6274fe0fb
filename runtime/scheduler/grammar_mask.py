"""The scheduler's grammar side: compiling grammars off the step, matchers with JSON guards, and
the packed token bitmasks applied to logits rows (sampled and draft positions)."""

from __future__ import annotations

import torch

from ..kernels.cpu import cpu_kernels
from ..request import Req, TokenOutput


class GrammarMaskMixin:
    """Grammar compilation and token masks; mixed into `Scheduler`."""

    def _grammars(self):
        if self._grammar_cache is None:
            from plait.grammar import GrammarCache, make_backend, tokenizer_info

            self._grammar_info = tokenizer_info(self.tokenizer, self.runner.vocab_size, sorted(self.eos_ids))
            backend = make_backend(self.args.grammar_backend, self._grammar_info)
            self._grammar_cache = GrammarCache(backend, compile_timeout_s=self.args.grammar_compile_timeout)
        return self._grammar_cache

    def _guarded(self, grammar, params):
        """A matcher of `grammar` for a request, with the JSON length guards where it is JSON, bound
        only after the reasoning section where the request has one (`reasoning_end`)."""
        from plait.grammar.json_guard import JsonLimits, guarded
        from plait.grammar.reasoning_gate import ReasoningGate

        a = self.args
        limits = JsonLimits(
            a.json_max_number_digits if params.json_max_number_digits is None else params.json_max_number_digits,
            a.json_max_string_length if params.json_max_string_length is None else params.json_max_string_length,
        )

        def make(budget: int):
            return guarded(grammar.matcher(), grammar.spec, self._grammar_info, limits, budget)

        if params.reasoning_end is None:
            return make(params.max_new_tokens)
        start = self._marker_ids(params.reasoning_start)[0] if params.reasoning_start else None
        end = self._marker_ids(params.reasoning_end)
        return ReasoningGate(make, end, sorted(self.eos_ids), params.max_new_tokens, start)

    def _marker_ids(self, text: str) -> list[int]:
        """A reasoning marker's token ids (one special token on models that have it)."""
        ids = self._markers.get(text)
        if ids is None:
            ids = self._markers[text] = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError(f"the reasoning marker {text!r} has no tokens")
        return ids

    def _poll_grammars(self, outputs: list[TokenOutput]) -> None:
        """Move requests whose grammar is ready to the waiting queue; fail those whose compile failed."""
        pending = []
        for req, fut in self.grammar_queue:
            if not fut.done():
                pending.append((req, fut))
                continue
            try:
                req.matcher = self._guarded(fut.result(), req.params)
            except Exception as e:  # GrammarError, a compile timeout, a backend failure
                outputs.append(self._finish_output(req, {"type": "abort", "message": f"invalid grammar: {e}"}, []))
                continue
            self.waiting.append(req)
        self.grammar_queue = pending

    def _grammar_bitmask(self, rows: int) -> torch.Tensor:
        """A packed bitmask of at least `rows` rows, allocated once and reused every step."""
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            from plait.grammar import allocate_token_bitmask

            self._bitmask = allocate_token_bitmask(max(rows, self.args.max_running_requests), self.runner.vocab_size)
        return self._bitmask[:rows]

    def _apply_grammar_masks(self, reqs: list[Req], row_logits: torch.Tensor) -> None:
        """-inf on every token the grammar of each constrained row disallows (one packed bitmask)."""
        idx = [i for i, r in enumerate(reqs) if r.matcher is not None]
        if not idx:
            return
        from plait.grammar.base import fill_masks

        mask = self._grammar_bitmask(len(idx))
        fill_masks([reqs[i].matcher for i in idx], mask)
        self._apply_mask_rows(mask, idx, row_logits)

    def _apply_draft_masks(self, reqs: list[Req], drafts_of: list[list[int]], row_logits: torch.Tensor) -> None:
        """Grammar masks for every draft position: the matcher is walked back over the drafts and
        forward again, filling one mask row per position; it ends at the last committed token."""
        total = sum(len(d) + 1 for r, d in zip(reqs, drafts_of) if r.matcher is not None)
        if not total:
            return
        mask = self._grammar_bitmask(total)
        idx, off = [], 0
        for req, drafts in zip(reqs, drafts_of):
            k = len(drafts)
            if req.matcher is not None:
                m = req.matcher
                m.rollback(k)
                for i in range(k + 1):
                    m.fill_mask(mask, len(idx))
                    idx.append(off + i)
                    if i < k:
                        m.accept(drafts[i])
                m.rollback(k)
            off += k + 1
        self._apply_mask_rows(mask, idx, row_logits)

    def _apply_mask_rows(self, mask: torch.Tensor, idx: list[int], row_logits: torch.Tensor) -> None:
        """Apply mask row j to logits row idx[j], in place: the CPU kernel where it runs, else the
        mask applied to all rows at once, unconstrained ones getting an all-allowed row (copying
        the constrained logits rows out and back costs ~30x more than the mask itself)."""
        from plait.grammar import apply_token_bitmask_

        if cpu_kernels.bitmask_fill_(row_logits, mask[: len(idx)], torch.tensor(idx, dtype=torch.int64)):
            return
        n = row_logits.shape[0]
        if idx != list(range(n)):
            full = self._full_mask_buffer(n, mask.shape[1])
            full.fill_(-1)
            full[torch.tensor(idx, dtype=torch.int64)] = mask[: len(idx)]
            mask = full
        apply_token_bitmask_(row_logits, mask[:n].to(row_logits.device))

    def _full_mask_buffer(self, rows: int, width: int) -> torch.Tensor:
        """A [rows, width] int32 buffer reused across steps (grown when a batch needs more)."""
        buf = self._full_bitmask
        if buf is None or buf.shape[0] < rows:
            buf = self._full_bitmask = torch.empty(max(rows, self.args.max_running_requests), width, dtype=torch.int32)
        return buf[:rows]

    def _grammar_eos(self) -> int:
        eos = self.tokenizer.eos_token_id
        return eos if eos in self.eos_ids else min(self.eos_ids)


def grammar_rejected(matcher, tok: int, vocab_size: int) -> dict:
    """The abort reason when a grammar refuses the sampled token: the client's grammar when it
    allows no token at all (it cannot be met with this vocabulary: a 400), else a bug (a 500)."""
    from plait.grammar import allocate_token_bitmask

    mask = allocate_token_bitmask(1, vocab_size)
    mask.zero_()
    matcher.fill_mask(mask, 0)
    if not bool(mask.any()):
        return {
            "type": "abort",
            "message": "invalid grammar: no token of the model's vocabulary can continue the constrained output",
        }
    return {"type": "abort", "message": f"internal error: the grammar rejected sampled token {tok}"}
