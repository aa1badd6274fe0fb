"""The scheduler: continuous batching over a paged KV pool with a radix prefix cache.

It knows nothing of HTTP or processes: `add_request`, `abort_request` and `step()` are the whole
surface. Each step decodes every running request and, within a token budget, prefills waiting
ones (chunking long prompts) in the same forward pass. When KV memory runs out it evicts cached
prefixes, then retracts running requests back to the queue — their generated tokens kept.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures

import torch

from ..layers.sampler import Sampler, SamplingBatch
from ..mem_cache.memory_pool import ReqToTokenTable, TokenSlotAllocator
from ..mem_cache.radix_cache import NaiveCache, RadixCache
from ..model_executor.forward_batch import ForwardBatch
from ..model_executor.model_runner import ModelRunner
from ..request import GenerateInput, Req, TokenOutput
from ..server_args import ServerArgs
from ..speculative.draft_model import DraftModel
from ..speculative.ngram import acceptance_rate
from .grammar_mask import GrammarMaskMixin, grammar_rejected
from .logprobs import LogprobsMixin, top_logprobs
from .speculation import SpeculationMixin

logger = logging.getLogger(__name__)

# Fraction of each running request's remaining budget (capped) kept free before admitting more;
# too little means admitted requests are soon retracted again, too much wastes memory.
NEW_TOKEN_RATIO = 0.4
RESERVE_CAP = 256
# A waiting request sharing this many uncached tokens with one being prefilled now waits a step,
# so it can take them from the cache instead of computing them twice.
IN_BATCH_SHARE_MIN = 16
LPM_MAX_QUEUE = 128
# From this many decode rows, a step where each appends one token writes the rows' new table
# entries with one indexed op instead of a tensor slice per row (a few us each).
INDEXED_ROWS_MIN = 8


class Scheduler(SpeculationMixin, GrammarMaskMixin, LogprobsMixin):
    """Owns the requests, the KV memory and the cache; runs one batch per `step()`."""

    def __init__(self, args: ServerArgs, runner: ModelRunner | None = None, draft: DraftModel | None = None):
        self.args = args
        self.runner = runner or ModelRunner(args)
        self.tokenizer = self.runner.tokenizer
        self.context_len = self.runner.context_len
        self.num_slots = self.runner.pool.num_slots
        self.allocator = TokenSlotAllocator(self.num_slots)
        self.table = ReqToTokenTable(args.max_running_requests, self.context_len + 1)
        self.cache = NaiveCache(self.allocator) if args.disable_radix_cache else RadixCache(self.allocator)
        self.sampler = Sampler()
        self.eos_ids = _eos_ids(self.runner.config, self.tokenizer)
        self.waiting: deque[Req] = deque()
        self.grammar_queue: list[tuple[Req, Future]] = []  # waiting for their grammar to compile
        self._grammar_cache = None  # made on first use (imports a backend)
        self._bitmask = None
        self._full_bitmask = None  # batch-wide mask rows (see _apply_mask_rows)
        self._markers: dict[str, list[int]] = {}  # reasoning marker text -> token ids
        self.running: list[Req] = []  # decoding
        self.chunked: Req | None = None  # mid-prefill, continues next step
        self._arrivals = 0
        # counters (read by metrics and tests)
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_generated_tokens = 0
        self.num_retractions = 0
        self.num_steps = 0
        self.num_repeat_steps = 0  # steps whose batch was the step before's advanced (_repeat_batch)
        self.num_jump_forward_tokens = 0
        self.num_spec_proposed_tokens = 0  # speculative (n-gram / draft-model) tokens proposed ...
        self.num_spec_accepted_tokens = 0  # ... and kept after verification
        self.jump_forward = not args.disable_jump_forward
        self.speculative = args.speculative_algorithm is not None
        if args.speculative_algorithm == "draft":
            self.draft = draft or DraftModel(args, self.runner)
        else:
            self.draft = None
        self._draft_queue: list[tuple[Req, int]] = []  # (request, k) drafting at the end of this step
        self._active = 0  # requests sampling in the current step
        self._last_decode = None  # a pure decode step's (requests, batch, rows_of)

    # --- requests in and out ---------------------------------------------------------------
    def add_request(self, inp: GenerateInput) -> None:
        """Queue a tokenized request; ValueError for one that can never run."""
        n = len(inp.input_ids)
        if n == 0:
            raise ValueError("the prompt is empty (0 tokens)")
        if n >= self.context_len:
            raise ValueError(
                f"the prompt has {n} tokens, more than the context length allows "
                f"({self.context_len} including at least one generated token)"
            )
        if n + 1 > self.num_slots:
            raise ValueError(f"the prompt has {n} tokens, more than the KV cache holds ({self.num_slots})")
        vocab = self.runner.vocab_size
        if min(inp.input_ids) < 0 or max(inp.input_ids) >= vocab:
            raise ValueError(f"input_ids must be token ids in [0, {vocab})")
        inp.params.validate(vocab)
        spec = inp.params.grammar_spec()
        self._arrivals += 1
        req = Req(inp, self._arrivals)
        if spec is None:
            self.waiting.append(req)
        else:  # compiled off this thread; the batch keeps running meanwhile
            self.grammar_queue.append((req, self._grammars().submit(spec)))

    def abort_request(self, rid: str) -> TokenOutput | None:
        """Drop a request wherever it is and release its KV; None if it is unknown (or done)."""
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                return self._finish_output(req, {"type": "abort", "message": "aborted"}, [])
        for item in self.grammar_queue:
            if item[0].rid == rid:
                self.grammar_queue.remove(item)
                return self._finish_output(item[0], {"type": "abort", "message": "aborted"}, [])
        for req in self.running + ([self.chunked] if self.chunked else []):
            if req.rid == rid:
                if req is self.chunked:
                    self.chunked = None
                else:
                    self.running.remove(req)
                self._release(req)
                return self._finish_output(req, {"type": "abort", "message": "aborted"}, [])
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.grammar_queue)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; only when no request holds KV."""
        if self.running or self.chunked:
            return False
        self.cache.reset()
        return True

    def kv_slots_in_use(self) -> int:
        """Slots neither free nor owned by the cache (held by requests); 0 when idle."""
        return self.num_slots - self.allocator.available() - self.cache.total_size()

    def speculative_stats(self) -> dict:
        """Speculation counters since start, and the fraction of drafts kept; with a draft model
        also the draft KV slots requests hold (0 when idle)."""
        stats = {
            "num_spec_proposed_tokens": self.num_spec_proposed_tokens,
            "num_spec_accepted_tokens": self.num_spec_accepted_tokens,
            "spec_accept_rate": acceptance_rate(self.num_spec_proposed_tokens, self.num_spec_accepted_tokens),
        }
        if self.draft is not None:
            stats["draft_kv_slots_in_use"] = self.draft.slots_in_use()
        return stats

    # --- one iteration ---------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Schedule and run one batch; return what each touched request produced."""
        outputs: list[TokenOutput] = []
        if self.grammar_queue:
            self._poll_grammars(outputs)
        decode, decode_slots = self._prepare_decode(outputs)
        prefill = self._schedule_prefill(outputs)
        if not decode and not prefill:
            if self.grammar_queue and not outputs:  # only compiles pending: wait briefly, don't spin
                wait_futures([f for _, f in self.grammar_queue], timeout=0.005, return_when=FIRST_COMPLETED)
            return outputs
        self.num_steps += 1
        batch, rows_of = (None, None) if prefill else self._repeat_batch(decode, decode_slots)
        if batch is None:
            batch, rows_of = self._build_batch(prefill, decode, decode_slots)
        self._last_decode = (decode, batch, rows_of) if batch.advanceable else None
        placed = [(r, r.kv_len, r.kv_len + take) for r, take in prefill] + [(r, r.kv_len, r.fill_len) for r in decode]
        try:
            logits = self.runner.forward(batch)
            outputs += self._process(prefill, decode, logits, rows_of)
        except BaseException:
            self._recover(prefill, placed)
            raise
        return outputs

    def _recover(self, prefill: list[tuple[Req, int]], placed: list[tuple[Req, int, int]]) -> None:
        """After a step that raised: free the slots it placed for tokens it did not compute, and put
        its new requests in `running` (they hold table rows but were not there yet), so that
        aborting what the scheduler holds, as the scheduler process then does, releases it all."""
        for req, start, end in placed:
            if req.row is not None and req.kv_len == start and end > start:
                self.allocator.free(self.table.table[req.row, start:end].clone())
        for req, _ in prefill:
            if req is not self.chunked and req not in self.running and req.finish_reason is None:
                self.running.append(req)
        self._last_decode = None

    def _repeat_batch(self, decode: list[Req], decode_slots: torch.Tensor | None):
        """The step before's batch advanced by a token (`ForwardBatch.advance`) when this step decodes
        the same requests in the same order, one token each (each then one token past the step
        before, whose batch had one token a row; anything that moves a request otherwise, a
        retraction or prefill, makes a step that is not advanceable); else (None, None)."""
        last = self._last_decode
        if last is None or len(last[0]) != len(decode):
            return None, None
        reqs, batch, rows_of = last
        for req, before in zip(decode, reqs):
            if req is not before or req.fill_len != req.kv_len + 1:
                return None, None
        self.num_repeat_steps += 1
        return batch.advance([r.output_ids[-1] for r in decode], decode_slots, self.table.table), rows_of

    def _prepare_decode(self, outputs: list[TokenOutput]) -> tuple[list[Req], torch.Tensor | None]:
        """Give every running request slots for its uncomputed tokens — one, or more after a
        jump-forward — retracting requests if memory is short. Returns the requests, multi-token
        ones first, and their new slots in that order (where this step's K/V go)."""
        while self.running and not self._make_room(sum(r.fill_len - r.kv_len for r in self.running)):
            drafted = [r for r in self.running if r.num_draft]
            if drafted:  # drafts are optional: drop them before retracting anyone
                for r in drafted:
                    self._drop_drafts(r)
                continue
            if len(self.running) == 1 and not self.chunked and not self.waiting:
                req = self.running.pop()
                self._release(req)
                outputs.append(self._finish_output(req, {"type": "abort", "message": "out of KV cache memory"}, []))
                break
            self._retract(max(self.running, key=lambda r: r.arrival))
        if not self.running:
            return [], None
        decode = sorted(self.running, key=lambda r: r.fill_len - r.kv_len == 1)
        need = [r.fill_len - r.kv_len for r in decode]
        slots = self.allocator.alloc(sum(need))
        if len(need) >= INDEXED_ROWS_MIN and min(need) == max(need) == 1:
            self.table.table[self._table_index(decode)] = slots
            return decode, slots
        start = 0
        for req, n in zip(decode, need):
            self.table.entries(req.row, req.kv_len, n).copy_(slots if n == len(slots) else slots[start : start + n])
            start += n
        return decode, slots

    def _table_index(self, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor]:
        """The table entries of the requests' first uncomputed tokens, as an advanced index."""
        device = self.table.table.device
        return (
            torch.tensor([r.row for r in reqs], dtype=torch.int64, device=device),
            torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=device),
        )

    def _schedule_prefill(self, outputs: list[TokenOutput]) -> list[tuple[Req, int]]:
        budget = self.args.chunked_prefill_size
        selected: list[tuple[Req, int]] = []
        if self.chunked is not None:
            req = self.chunked
            take = min(req.fill_len - req.kv_len, budget)
            if not self._make_room(take):
                return []  # memory frees up as decodes finish
            self._place(req, req.kv_len, self.allocator.alloc(take))
            selected.append((req, take))
            if req.kv_len + take < req.fill_len:
                return selected  # still chunking: it takes the whole budget
            self.chunked = None
            budget -= take
        if not self.waiting:
            return selected
        reserve = sum(self._future_need(r) for r in self.running)
        for req in self._ordered_waiting():
            if (
                budget <= 0
                or self.table.available() == 0
                or len(self.running) + len(selected) >= self.args.max_running_requests
            ):
                break
            if req.fill_len + 1 > self.num_slots:
                self.waiting.remove(req)
                outputs.append(self._finish_output(req, {"type": "abort", "message": "out of KV cache memory"}, []))
                continue
            fill = req.fill_ids
            prefix, node = self.cache.match_prefix(fill[: req.max_cacheable_prefix()])
            p = len(prefix)
            if any(_common_prefix_len(fill, s.fill_ids) - p >= IN_BATCH_SHARE_MIN for s, _ in selected):
                continue
            take = min(len(fill) - p, budget)
            self.cache.inc_lock(node)
            if not self._make_room(take + reserve):
                self.cache.dec_lock(node)
                break
            self.waiting.remove(req)
            req.row = self.table.alloc()
            req.last_node, req.cached_len = node, p
            self.table.table[req.row, :p] = prefix
            self._place(req, p, self.allocator.alloc(take))
            if req.cached_tokens < 0:
                req.cached_tokens = p
                self.num_prompt_tokens += len(req.origin_ids)
                self.num_cached_tokens += p
            selected.append((req, take))
            budget -= take
            reserve += self._future_need(req)
            if p + take < len(fill):
                self.chunked = req
                break
        return selected

    def _place(self, req: Req, start: int, slots: torch.Tensor) -> None:
        """Record slots for fill_ids[start:start+len(slots)] in the request's table row."""
        req.kv_len = start
        self.table.table[req.row, start : start + len(slots)] = slots

    def _ordered_waiting(self) -> list[Req]:
        reqs = list(self.waiting)
        if self.args.schedule_policy == "lpm" and self.cache.enabled and len(reqs) <= LPM_MAX_QUEUE:
            lens = {id(r): len(self.cache.match_prefix(r.fill_ids[: r.max_cacheable_prefix()])[0]) for r in reqs}
            reqs.sort(key=lambda r: -lens[id(r)])  # stable: FCFS among equals
        return reqs

    def _future_need(self, req: Req) -> int:
        left = req.params.max_new_tokens - len(req.output_ids)
        return int(min(max(left, 0), RESERVE_CAP) * NEW_TOKEN_RATIO)

    def _make_room(self, n: int) -> bool:
        """True when `n` slots are free, evicting cached prefixes if that gets there."""
        short = n - self.allocator.available()
        if short > 0 and self.cache.evictable_size() >= short:
            self.cache.evict(short)
        return self.allocator.available() >= n

    # --- the batch -------------------------------------------------------------------------
    def _build_batch(self, prefill: list[tuple[Req, int]], decode: list[Req], decode_slots: torch.Tensor | None):
        input_ids, rows, prefix_lens, extend_lens, locs, logits_index = [], [], [], [], [], []
        rows_of: dict[int, tuple[int, int]] = {}  # id(req) -> (first logits row, count)
        table = self.table.table
        pos = 0
        for req, take in prefill:
            start = req.kv_len
            input_ids += req.fill_ids[start : start + take]
            rows.append(req.row)
            prefix_lens.append(start)
            extend_lens.append(take)
            locs.append(table[req.row, start : start + take])
            if req.wants_input_logprobs:
                rows_of[id(req)] = (len(logits_index), take)
                logits_index += range(pos, pos + take)
            elif start + take == req.fill_len:
                rows_of[id(req)] = (len(logits_index), 1)
                logits_index.append(pos + take - 1)
            pos += take
        if decode:
            locs.append(decode_slots)  # as _prepare_decode placed them, in this order
        for req in decode:
            take = req.fill_len - req.kv_len
            input_ids += req.fill_from(req.kv_len)
            rows.append(req.row)
            prefix_lens.append(req.kv_len)
            extend_lens.append(take)
            if req.num_draft:  # the logits after the last committed token and after each draft
                rows_of[id(req)] = (len(logits_index), req.num_draft + 1)
                logits_index += range(pos + take - req.num_draft - 1, pos + take)
            else:
                rows_of[id(req)] = (len(logits_index), 1)
                logits_index.append(pos + take - 1)
            pos += take
        batch = ForwardBatch.build(
            input_ids,
            rows,
            prefix_lens,
            extend_lens,
            locs[0] if len(locs) == 1 else torch.cat(locs),
            table,
            logits_index,
            device=self.runner.device,
        )
        batch.keep_hidden = any(req.return_embedding and req.kv_len + take == req.fill_len for req, take in prefill)
        return batch, rows_of

    def _process(self, prefill, decode, logits: torch.Tensor, rows_of) -> list[TokenOutput]:
        """Turn one forward pass's logits into outputs: complete prefills, verify drafts, sample
        the other rows (logprobs, grammar masks, accept), then keep or finish each request."""
        outputs: list[TokenOutput] = []
        to_sample, sample_rows, input_lp = self._complete_prefills(prefill, logits, rows_of, outputs)
        drafted = [r for r in decode if r.num_draft]
        for req in decode:
            if not req.num_draft:
                req.kv_len = req.fill_len
                to_sample.append(req)
                sample_rows.append(rows_of[id(req)][0])
        self._active = len(to_sample) + len(drafted)
        still_running: list[Req] = []
        if drafted:
            for req, out in zip(drafted, self._verify_drafts(drafted, logits, rows_of)):
                self._finish_step(req, out, outputs, still_running)
        if to_sample:
            next_ids, logprobs, lp_rows = self._sample(to_sample, sample_rows, logits)
            for i, (req, tok) in enumerate(zip(to_sample, next_ids)):
                lp_row = logprobs[lp_rows.index(i)] if req.return_logprob else None
                out = self._take_token(req, tok, lp_row, id(req) in input_lp)
                self._finish_step(req, out, outputs, still_running)
        self.running = sorted(still_running, key=lambda r: r.arrival)
        self._propose_from_draft_model()
        return outputs

    def _complete_prefills(self, prefill, logits: torch.Tensor, rows_of, outputs: list[TokenOutput]):
        """Advance each prefilled request past its chunk; a request whose prompt is now complete is
        cached, and either finished at once (max_new_tokens 0) or queued to sample its first token.
        Returns (requests to sample, their logits rows, requests owed their input logprobs)."""
        to_sample: list[Req] = []
        sample_rows: list[int] = []
        input_lp: dict[int, TokenOutput] = {}
        for req, take in prefill:
            start = req.kv_len
            req.kv_len += take
            if req.wants_input_logprobs:
                first, count = rows_of[id(req)]
                self._collect_input_logprobs(req, start, logits[first : first + count])
            if req.kv_len < req.fill_len:
                continue  # chunk done, prompt not yet
            first_time = not req.prefilled
            req.prefilled = True
            if self.cache.enabled:
                self._cache_prefix(req)
            if req.params.max_new_tokens == 0:
                outputs.append(self._finish_prompt_only(req, rows_of))
                continue
            if first_time and req.return_logprob and req.logprob_start_len >= 0:
                input_lp[id(req)] = req  # attached to its first output below
            first, count = rows_of[id(req)]
            to_sample.append(req)
            sample_rows.append(first + count - 1)
        return to_sample, sample_rows, input_lp

    def _finish_prompt_only(self, req: Req, rows_of) -> TokenOutput:
        """The only output of a request that generates nothing: input logprobs, or an embedding."""
        self._release(req)
        out = self._finish_output(req, {"type": "length", "length": 0}, [])
        self._attach_input_logprobs(req, out)
        if req.return_embedding:
            first, count = rows_of[id(req)]
            hidden = self.runner.model.last_hidden[first + count - 1].float()
            out.embedding = torch.nn.functional.normalize(hidden, dim=-1).tolist()
        return out

    def _sample(self, to_sample: list[Req], sample_rows: list[int], logits: torch.Tensor):
        """Sample one token for each request from its logits row. Returns (token ids, the
        log-softmax of the rows that asked for logprobs, those rows' indices in `to_sample`)."""
        if sample_rows == list(range(logits.shape[0])):
            row_logits = logits  # a pure decode step: every row is sampled, in order (no 6 MB copy)
        else:
            row_logits = logits.index_select(0, torch.tensor(sample_rows, dtype=torch.int64, device=logits.device))
        lp_rows = [i for i, r in enumerate(to_sample) if r.return_logprob]
        # logprobs report the model's distribution, before grammar masks and penalties
        logprobs = torch.log_softmax(row_logits[lp_rows], dim=-1) if lp_rows else None
        self._apply_grammar_masks(to_sample, row_logits)
        sbatch = SamplingBatch.build(
            [r.params for r in to_sample],
            [r.seed for r in to_sample],
            [len(r.output_ids) for r in to_sample],
            [r.origin_ids for r in to_sample],
            [r.output_ids for r in to_sample],
            sorted(self.eos_ids),
            self.runner.vocab_size,
            device=logits.device,
        )
        return self.sampler(row_logits, sbatch).tolist(), logprobs, lp_rows

    def _take_token(self, req: Req, tok: int, lp_row: torch.Tensor | None, owes_input_lp: bool) -> TokenOutput:
        """Append a sampled token: its logprobs, the grammar's accept, finish checks, then
        jump-forward and the next step's drafts while the request runs on."""
        req.output_ids.append(tok)
        first = len(req.output_ids) - 1
        self.num_generated_tokens += 1
        out = TokenOutput(
            rid=req.rid, new_ids=[tok], prompt_tokens=len(req.origin_ids), cached_tokens=max(req.cached_tokens, 0)
        )
        if lp_row is not None:
            out.output_logprobs = [[float(lp_row[tok]), tok]]
            if req.top_logprobs_num > 0:
                out.output_top_logprobs = [top_logprobs(lp_row, req.top_logprobs_num)]
        if owes_input_lp:
            self._attach_input_logprobs(req, out)
        if req.matcher is not None and not req.matcher.accept(tok):
            reason = grammar_rejected(req.matcher, tok, self.runner.vocab_size)
        else:
            reason = self._check_finish(req, tok)
            if reason is None and self._direct_jump(req) and self._jump_forward(req):
                self.num_generated_tokens += len(req.output_ids) - first - 1
                reason = self._check_finish(req, req.output_ids[-1])
            if reason is None:
                self._propose(req)
        # jump-forward or a grammar's final EOS may add tokens; unverified drafts are not output
        out.new_ids = req.output_ids[first : len(req.output_ids) - req.num_draft]
        out.finish_reason = reason
        return out

    def _finish_step(self, req: Req, out: TokenOutput, outputs: list[TokenOutput], still_running: list[Req]) -> None:
        if out.finish_reason is not None:
            self._drop_drafts(req)
            self._release(req)
        else:
            still_running.append(req)
        outputs.append(out)

    # --- finishing and KV release -----------------------------------------------------------
    def _check_finish(self, req: Req, tok: int) -> dict | None:
        p = req.params
        n = len(req.output_ids)
        if n >= p.min_new_tokens:
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
                return {"type": "stop", "matched": tok}
            if req.matcher is not None and req.matcher.is_finished():
                # The structure is complete and the mask would allow nothing but EOS: append it
                # now instead of spending a forward pass to sample the only possible token.
                eos = tok if tok in self.eos_ids else self._grammar_eos()
                if eos != tok:
                    req.output_ids.append(eos)
                return {"type": "stop", "matched": eos}
            if p.stop or req.stop_patterns:
                tail = self.tokenizer.decode(
                    req.output_ids[-req.stop_tail_tokens :], skip_special_tokens=p.skip_special_tokens
                )
                for s in p.stop:
                    if s in tail:
                        return {"type": "stop", "matched": s}
                for pattern in req.stop_patterns:  # SGLang's stop_regex: the match stays in the text
                    if pattern.search(tail):
                        return {"type": "stop", "matched": pattern.pattern}
        if n >= p.max_new_tokens:
            return {"type": "length", "length": n}
        if len(req.origin_ids) + n >= self.context_len:
            return {"type": "length", "length": n}
        return None

    def _cache_prefix(self, req: Req) -> None:
        """Insert the request's computed tokens into the cache and lock them, so requests that
        share the prefix can use it while this one still runs."""
        ids = req.fill_ids[: req.kv_len]
        slots = self.table.table[req.row, : req.kv_len].clone()
        present = self.cache.insert(ids, slots)
        if present > req.cached_len:
            self.allocator.free(slots[req.cached_len : present])
        new_slots, node = self.cache.match_prefix(ids)
        self.table.table[req.row, : len(new_slots)] = new_slots
        self.cache.inc_lock(node)
        self.cache.dec_lock(req.last_node)
        req.last_node, req.cached_len = node, len(new_slots)

    def _release(self, req: Req) -> None:
        """Give the request's KV to the cache (or back to the allocator) and free its row (and its
        draft model cache: finished, aborted and retracted requests keep none)."""
        if self.draft is not None:
            self.draft.release(req.rid)
        if req.row is None:
            return
        slots = self.table.table[req.row, : req.kv_len].clone()
        present = self.cache.insert(req.fill_ids[: req.kv_len], slots)
        if present > req.cached_len:
            self.allocator.free(slots[req.cached_len : present])
        self.cache.dec_lock(req.last_node)
        self.table.free(req.row)
        req.row, req.last_node, req.kv_len, req.cached_len = None, None, 0, 0

    def _retract(self, req: Req) -> None:
        """Send a running request back to the queue; its tokens are kept and recomputed later
        (from the cache, when its prefix survives)."""
        self.running.remove(req)
        self._drop_drafts(req)  # their slots go with the rest of its KV
        self._release(req)
        self.waiting.appendleft(req)
        self.num_retractions += 1
        logger.info("retracted request %s (%d tokens) to free KV memory", req.rid, req.fill_len)

    def _finish_output(self, req: Req, reason: dict, new_ids: list[int]) -> TokenOutput:
        req.finish_reason = reason
        return TokenOutput(
            rid=req.rid,
            new_ids=new_ids,
            finish_reason=reason,
            prompt_tokens=len(req.origin_ids),
            cached_tokens=max(req.cached_tokens, 0),
        )


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    return len(os.path.commonprefix([a, b]))


def _eos_ids(config, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    return ids
