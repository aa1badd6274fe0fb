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

from ..speculative.draft_model import DraftModel
from ..model_executor.forward_batch import DRAFT_MAX_TOKENS, ForwardBatch
from ..mem_cache.memory_pool import ReqToTokenTable, TokenSlotAllocator
from ..model_executor.model_runner import ModelRunner
from ..mem_cache.radix_cache import NaiveCache, RadixCache
from ..request import GenerateInput, Req, TokenOutput
from ..layers.sampler import Sampler, SamplingBatch
from ..sampling_params import SamplingParams
from ..server_args import ServerArgs
from ..speculative.ngram import DraftLength, NgramIndex, acceptance_rate

logger = logging.getLogger(__name__)

# Fraction of each running request's remaining budget (capped) kept free before admitting more;
# too little means admitted requests are soon retracted again, too much wastes memory.
NEW_TOKEN_RATIO = 0.4
RESERVE_CAP = 256
# A waiting request sharing this many uncached tokens with one being prefilled now waits a step,
# so it can take them from the cache instead of computing them twice.
IN_BATCH_SHARE_MIN = 16
LPM_MAX_QUEUE = 128
# Verifying grammar-forced drafts costs extra rows of logits and sampling; above this many running
# requests greedy constrained ones decode one token per step instead (same text).
JUMP_FORWARD_MAX_BATCH = 8
# From this many decode rows, a step where each appends one token writes the rows' new table
# entries with one indexed op instead of a tensor slice per row (a few us each).
INDEXED_ROWS_MIN = 8


class Scheduler:
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
        self.grammar_queue: list[tuple[Req, Future]] = []   # waiting for their grammar to compile
        self._grammar_cache = None                          # made on first use (imports a backend)
        self._bitmask = None
        self._full_bitmask = None        # batch-wide mask rows (see _apply_mask_rows)
        self.running: list[Req] = []          # decoding
        self.chunked: Req | None = None       # mid-prefill, continues next step
        self._arrivals = 0
        # counters (read by metrics and tests)
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_generated_tokens = 0
        self.num_retractions = 0
        self.num_steps = 0
        self.num_repeat_steps = 0             # steps whose batch was the step before's advanced (_repeat_batch)
        self.num_jump_forward_tokens = 0
        self.num_spec_proposed_tokens = 0     # speculative (n-gram / draft-model) tokens proposed ...
        self.num_spec_accepted_tokens = 0     # ... and kept after verification
        self.jump_forward = not args.disable_jump_forward
        self.speculative = args.speculative_algorithm is not None
        if args.speculative_algorithm == "draft":
            self.draft = draft or DraftModel(args, self.runner)
        else:
            self.draft = None
        self._draft_queue: list[tuple[Req, int]] = []   # (request, k) drafting at the end of this step
        self._active = 0                      # requests sampling in the current step
        self._last_decode = None              # a pure decode step's (requests, batch, rows_of)

    # --- requests in and out ---------------------------------------------------------------
    def add_request(self, inp: GenerateInput) -> None:
        """Queue a tokenized request; ValueError for one that can never run."""
        n = len(inp.input_ids)
        if n == 0:
            raise ValueError("the prompt is empty (0 tokens)")
        if n >= self.context_len:
            raise ValueError(f"the prompt has {n} tokens, more than the context length allows "
                             f"({self.context_len} including at least one generated token)")
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
        else:   # compiled off this thread; the batch keeps running meanwhile
            self.grammar_queue.append((req, self._grammars().submit(spec)))

    def _grammars(self):
        if self._grammar_cache is None:
            from plait.grammar import GrammarCache, make_backend, tokenizer_info
            self._grammar_info = tokenizer_info(self.tokenizer, self.runner.vocab_size, sorted(self.eos_ids))
            backend = make_backend(self.args.grammar_backend, self._grammar_info)
            self._grammar_cache = GrammarCache(backend, compile_timeout_s=self.args.grammar_compile_timeout)
        return self._grammar_cache

    def _guarded(self, grammar, params):
        """A matcher of `grammar` for a request, with the JSON length guards where it is JSON."""
        from plait.grammar.json_guard import JsonLimits, guarded
        a = self.args
        limits = JsonLimits(
            a.json_max_number_digits if params.json_max_number_digits is None else params.json_max_number_digits,
            a.json_max_string_length if params.json_max_string_length is None else params.json_max_string_length)
        return guarded(grammar.matcher(), grammar.spec, self._grammar_info, limits, params.max_new_tokens)

    def _poll_grammars(self, outputs: list[TokenOutput]) -> None:
        """Move requests whose grammar is ready to the waiting queue; fail those whose compile failed."""
        pending = []
        for req, fut in self.grammar_queue:
            if not fut.done():
                pending.append((req, fut))
                continue
            try:
                req.matcher = self._guarded(fut.result(), req.params)
            except Exception as e:   # GrammarError, a compile timeout, a backend failure
                outputs.append(self._finish_output(req, {"type": "abort", "message": f"invalid grammar: {e}"}, []))
                continue
            self.waiting.append(req)
        self.grammar_queue = pending

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
        stats = {"num_spec_proposed_tokens": self.num_spec_proposed_tokens,
                 "num_spec_accepted_tokens": self.num_spec_accepted_tokens,
                 "spec_accept_rate": acceptance_rate(self.num_spec_proposed_tokens, self.num_spec_accepted_tokens)}
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
            if self.grammar_queue and not outputs:   # only compiles pending: wait briefly, don't spin
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
            if drafted:             # drafts are optional: drop them before retracting anyone
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
            self.table.entries(req.row, req.kv_len, n).copy_(slots if n == len(slots) else slots[start:start + n])
            start += n
        return decode, slots

    def _table_index(self, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor]:
        """The table entries of the requests' first uncomputed tokens, as an advanced index."""
        device = self.table.table.device
        return (torch.tensor([r.row for r in reqs], dtype=torch.int64, device=device),
                torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=device))

    def _schedule_prefill(self, outputs: list[TokenOutput]) -> list[tuple[Req, int]]:
        budget = self.args.chunked_prefill_size
        selected: list[tuple[Req, int]] = []
        if self.chunked is not None:
            req = self.chunked
            take = min(req.fill_len - req.kv_len, budget)
            if not self._make_room(take):
                return []            # memory frees up as decodes finish
            self._place(req, req.kv_len, self.allocator.alloc(take))
            selected.append((req, take))
            if req.kv_len + take < req.fill_len:
                return selected      # still chunking: it takes the whole budget
            self.chunked = None
            budget -= take
        if not self.waiting:
            return selected
        reserve = sum(self._future_need(r) for r in self.running)
        for req in self._ordered_waiting():
            if budget <= 0 or self.table.available() == 0 or \
                    len(self.running) + len(selected) >= self.args.max_running_requests:
                break
            if req.fill_len + 1 > self.num_slots:
                self.waiting.remove(req)
                outputs.append(self._finish_output(req, {"type": "abort", "message": "out of KV cache memory"}, []))
                continue
            fill = req.fill_ids
            prefix, node = self.cache.match_prefix(fill[:req.max_cacheable_prefix()])
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
        self.table.table[req.row, start:start + len(slots)] = slots

    def _ordered_waiting(self) -> list[Req]:
        reqs = list(self.waiting)
        if self.args.schedule_policy == "lpm" and self.cache.enabled and len(reqs) <= LPM_MAX_QUEUE:
            lens = {id(r): len(self.cache.match_prefix(r.fill_ids[:r.max_cacheable_prefix()])[0]) for r in reqs}
            reqs.sort(key=lambda r: -lens[id(r)])   # stable: FCFS among equals
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
        rows_of: dict[int, tuple[int, int]] = {}    # id(req) -> (first logits row, count)
        table = self.table.table
        pos = 0
        for req, take in prefill:
            start = req.kv_len
            input_ids += req.fill_ids[start:start + take]
            rows.append(req.row)
            prefix_lens.append(start)
            extend_lens.append(take)
            locs.append(table[req.row, start:start + take])
            if req.wants_input_logprobs:
                rows_of[id(req)] = (len(logits_index), take)
                logits_index += range(pos, pos + take)
            elif start + take == req.fill_len:
                rows_of[id(req)] = (len(logits_index), 1)
                logits_index.append(pos + take - 1)
            pos += take
        if decode:
            locs.append(decode_slots)   # as _prepare_decode placed them, in this order
        for req in decode:
            take = req.fill_len - req.kv_len
            input_ids += req.fill_from(req.kv_len)
            rows.append(req.row)
            prefix_lens.append(req.kv_len)
            extend_lens.append(take)
            if req.num_draft:    # the logits after the last committed token and after each draft
                rows_of[id(req)] = (len(logits_index), req.num_draft + 1)
                logits_index += range(pos + take - req.num_draft - 1, pos + take)
            else:
                rows_of[id(req)] = (len(logits_index), 1)
                logits_index.append(pos + take - 1)
            pos += take
        batch = ForwardBatch.build(input_ids, rows, prefix_lens, extend_lens,
                                   locs[0] if len(locs) == 1 else torch.cat(locs), table, logits_index,
                                   device=self.runner.device)
        batch.keep_hidden = any(req.return_embedding and req.kv_len + take == req.fill_len for req, take in prefill)
        return batch, rows_of

    def _process(self, prefill, decode, logits: torch.Tensor, rows_of) -> list[TokenOutput]:
        outputs: list[TokenOutput] = []
        to_sample: list[Req] = []
        sample_rows: list[int] = []
        input_lp: dict[int, TokenOutput] = {}
        for req, take in prefill:
            start = req.kv_len
            req.kv_len += take
            if req.wants_input_logprobs:
                first, count = rows_of[id(req)]
                self._collect_input_logprobs(req, start, logits[first:first + count])
            if req.kv_len < req.fill_len:
                continue                                   # chunk done, prompt not yet
            first_time = not req.prefilled
            req.prefilled = True
            if self.cache.enabled:
                self._cache_prefix(req)
            if req.params.max_new_tokens == 0:
                self._release(req)
                out = self._finish_output(req, {"type": "length", "length": 0}, [])
                self._attach_input_logprobs(req, out)
                if req.return_embedding:
                    first, count = rows_of[id(req)]
                    hidden = self.runner.model.last_hidden[first + count - 1].float()
                    out.embedding = torch.nn.functional.normalize(hidden, dim=-1).tolist()
                outputs.append(out)
                continue
            if first_time and req.return_logprob and req.logprob_start_len >= 0:
                input_lp[id(req)] = req            # attached to its first output below
            first, count = rows_of[id(req)]
            to_sample.append(req)
            sample_rows.append(first + count - 1)
        still_running: list[Req] = []
        drafted = [r for r in decode if r.num_draft]
        for req in decode:
            if not req.num_draft:
                req.kv_len = req.fill_len
                to_sample.append(req)
                sample_rows.append(rows_of[id(req)][0])
        self._active = len(to_sample) + len(drafted)
        if drafted:
            for req, out in zip(drafted, self._verify_drafts(drafted, logits, rows_of)):
                self._finish_step(req, out, outputs, still_running)
        if not to_sample:
            self.running = sorted(still_running, key=lambda r: r.arrival)
            self._propose_from_draft_model()
            return outputs
        if sample_rows == list(range(logits.shape[0])):
            row_logits = logits        # a pure decode step: every row is sampled, in order (no 6 MB copy)
        else:
            row_logits = logits.index_select(0, torch.tensor(sample_rows, dtype=torch.int64, device=logits.device))
        lp_rows = [i for i, r in enumerate(to_sample) if r.return_logprob]
        # logprobs report the model's distribution, before grammar masks and penalties
        logprobs = torch.log_softmax(row_logits[lp_rows], dim=-1) if lp_rows else None
        self._apply_grammar_masks(to_sample, row_logits)
        sbatch = SamplingBatch.build(
            [r.params for r in to_sample], [r.seed for r in to_sample],
            [len(r.output_ids) for r in to_sample], [r.origin_ids for r in to_sample],
            [r.output_ids for r in to_sample], sorted(self.eos_ids), self.runner.vocab_size,
            device=logits.device)
        next_ids = self.sampler(row_logits, sbatch).tolist()
        for i, (req, tok) in enumerate(zip(to_sample, next_ids)):
            req.output_ids.append(tok)
            first = len(req.output_ids) - 1
            self.num_generated_tokens += 1
            out = TokenOutput(rid=req.rid, new_ids=[tok], prompt_tokens=len(req.origin_ids),
                              cached_tokens=max(req.cached_tokens, 0))
            if req.return_logprob:
                row = logprobs[lp_rows.index(i)]
                out.output_logprobs = [[float(row[tok]), tok]]
                if req.top_logprobs_num > 0:
                    out.output_top_logprobs = [_top(row, req.top_logprobs_num)]
            if id(req) in input_lp:
                self._attach_input_logprobs(req, out)
            if req.matcher is not None and not req.matcher.accept(tok):
                reason = _grammar_rejected(req.matcher, tok, self.runner.vocab_size)
            else:
                reason = self._check_finish(req, tok)
                if reason is None and self._direct_jump(req) and self._jump_forward(req):
                    self.num_generated_tokens += len(req.output_ids) - first - 1
                    reason = self._check_finish(req, req.output_ids[-1])
                if reason is None:
                    self._propose(req)
            # jump-forward or a grammar's final EOS may add tokens; unverified drafts are not output
            out.new_ids = req.output_ids[first:len(req.output_ids) - req.num_draft]
            out.finish_reason = reason
            self._finish_step(req, out, outputs, still_running)
        self.running = sorted(still_running, key=lambda r: r.arrival)
        self._propose_from_draft_model()
        return outputs

    def _finish_step(self, req: Req, out: TokenOutput, outputs: list[TokenOutput], still_running: list[Req]) -> None:
        if out.finish_reason is not None:
            self._drop_drafts(req)
            self._release(req)
        else:
            still_running.append(req)
        outputs.append(out)

    # --- jump-forward ----------------------------------------------------------------------
    @staticmethod
    def _exact_jump(req: Req) -> bool:
        """Greedy requests verify forced tokens against the model, so their text is exactly what
        decoding without jump-forward gives; sampled ones take the forced text directly."""
        p = req.params
        return p.greedy and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0

    def _direct_jump(self, req: Req) -> bool:
        """Sampled constrained requests take the grammar's forced text directly after a sampled token."""
        return req.matcher is not None and self.jump_forward and not req.return_logprob and not self._exact_jump(req)

    def _propose(self, req: Req) -> None:
        """Append draft tokens for the next step to verify: the grammar's forced text for greedy
        constrained requests (jump-forward), else an n-gram lookup or the draft model when
        speculation is on. Only at small batches: there the extra positions are nearly free; at
        large ones they are not. Draft-model requests are queued and drafted together at the end
        of the step (`_propose_from_draft_model`)."""
        if req.matcher is not None and self.jump_forward and not req.return_logprob and self._exact_jump(req):
            if self._active <= JUMP_FORWARD_MAX_BATCH:
                self._propose_forced(req)
            if req.num_draft:
                req.draft_source = "grammar"
                return
        if self.speculative and self._active <= self.args.speculative_max_batch:
            if self.draft is None:
                self._propose_ngram(req)
            elif (k := self._draft_budget(req)) > 0:
                self._draft_queue.append((req, k))

    def _propose_forced(self, req: Req) -> None:
        """Append the grammar's forced text as draft tokens (the matcher accepts them now)."""
        forced = req.matcher.forced_text()
        budget = req.params.max_new_tokens - len(req.output_ids) - 1   # room for the model's own next token
        if not forced or budget <= 0:
            return
        # at most DRAFT_MAX_TOKENS positions per verify pass (drafts + the model's own token), so the
        # request stays in the decode attention group; the rest of the forced text comes next step
        limit = min(budget, DRAFT_MAX_TOKENS - 1)
        self._append_drafts(req, self.tokenizer.encode(forced, add_special_tokens=False)[:limit])

    def _draft_budget(self, req: Req) -> int:
        """How many speculative tokens the request may take now (<= 0: none)."""
        return min(self.args.speculative_num_draft_tokens,
                   req.params.max_new_tokens - len(req.output_ids) - 1,      # room for the model's own token
                   self.context_len - len(req.origin_ids) - len(req.output_ids) - 1)

    def _propose_ngram(self, req: Req) -> None:
        """Append the tokens that followed the latest earlier occurrence of the request's tail."""
        a = self.args
        k = self._draft_budget(req)
        if k <= 0:
            return
        if req.ngram is None:
            req.ngram = NgramIndex(a.speculative_ngram_min_match, a.speculative_ngram_max_match)
        if req.ngram_length is None:
            req.ngram_length = DraftLength(a.speculative_num_draft_tokens, shrink=False)
        k = min(k, req.ngram_length.take())
        if k <= 0:   # pausing after rejected rounds
            return
        self._append_drafts(req, req.ngram.propose(req.fill_ids, k), self._direct_jump(req))
        if req.num_draft:
            req.draft_source = "ngram"

    def _propose_from_draft_model(self) -> None:
        """Draft for every request queued this step in one batched call of the draft model."""
        if not self._draft_queue:
            return
        queue, self._draft_queue = self._draft_queue, []
        proposals = self.draft.propose([(req.rid, req.fill_ids, k) for req, k in queue])
        for (req, _), tokens in zip(queue, proposals):
            self._append_drafts(req, tokens, self._direct_jump(req))
            if req.num_draft:
                req.draft_source = "draft"

    @staticmethod
    def _append_drafts(req: Req, tokens: list[int], stop_before_forced: bool = False) -> None:
        """Drafts up to the first one the grammar (if any) rejects; the matcher accepts them.
        `stop_before_forced`: also stop before a draft after which the grammar forces text — there
        decoding would jump forward instead of sampling the next token, so verification must end
        at that position (`_accept_drafts` then jumps, as decoding does)."""
        for t in tokens:
            if req.matcher is not None:
                if not req.matcher.accept(t):
                    break
                if stop_before_forced and req.matcher.forced_text():
                    req.matcher.rollback(1)
                    break
            req.output_ids.append(t)
            req.num_draft += 1

    def _drop_drafts(self, req: Req) -> None:
        if req.num_draft:
            if req.matcher is not None:
                req.matcher.rollback(req.num_draft)
            del req.output_ids[-req.num_draft:]
            req.num_draft = 0

    def _verify_drafts(self, reqs: list[Req], logits: torch.Tensor, rows_of) -> list[TokenOutput]:
        """Verify every drafted request of the step in one sampler call. For a request with k
        drafts, row i holds the logits after its last committed token and drafts[:i]; each row is
        sampled exactly as decoding one token at a time would sample it there (same penalties,
        grammar mask, min_new_tokens, seed and step). Drafts are kept while they equal those
        draws; the first draw that differs (or the one after the last draft) is the model's own
        token. Greedy: lossless; sampled: see plait.runtime.speculative.ngram."""
        idx, params, seeds, steps, prompts, outs, drafts_of = [], [], [], [], [], [], []
        for req in reqs:
            k = req.num_draft
            drafts, base = req.output_ids[-k:], req.output_ids[:-k]
            first, count = rows_of[id(req)]
            idx += range(first, first + count)
            penalised = _has_penalty(req.params)
            for i in range(k + 1):
                params.append(req.params)
                seeds.append(req.seed)
                steps.append(len(base) + i)
                prompts.append(req.origin_ids)
                outs.append(base + drafts[:i] if penalised else base)   # only penalties read them
            drafts_of.append(drafts)
        rows = torch.tensor(idx, dtype=torch.int64, device=logits.device)
        row_logits = logits.index_select(0, rows)
        # logprobs report the model's distribution, before grammar masks and penalties
        logprobs = torch.log_softmax(row_logits, dim=-1) if any(r.return_logprob for r in reqs) else None
        self._apply_draft_masks(reqs, drafts_of, row_logits)
        sbatch = SamplingBatch.build(params, seeds, steps, prompts, outs, sorted(self.eos_ids),
                                     self.runner.vocab_size, device=logits.device)
        targets = self.sampler(row_logits, sbatch).tolist()
        results, off = [], 0
        for req, drafts in zip(reqs, drafts_of):
            n = len(drafts) + 1
            lp = logprobs[off:off + n] if logprobs is not None and req.return_logprob else None
            results.append(self._accept_drafts(req, drafts, targets[off:off + n], lp))
            off += n
        return results

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

    def _accept_drafts(self, req: Req, drafts: list[int], targets: list[int], lp: torch.Tensor | None) -> TokenOutput:
        """Commit the kept drafts and the model's own token, checking finish after each exactly
        as single-token decoding does; free the KV slots of rejected drafts."""
        k = len(drafts)
        end = req.fill_len                      # positions that got KV this step
        del req.output_ids[-k:]                 # (the matcher is already back before the drafts)
        req.num_draft = 0
        start = len(req.output_ids)
        valid_kv = req.fill_len                 # the last committed token's KV was computed this step
        reason = None
        kept = 0
        for i, tok in enumerate(targets):
            if req.matcher is not None and not req.matcher.accept(tok):
                reason = _grammar_rejected(req.matcher, tok, self.runner.vocab_size)
                break
            req.output_ids.append(tok)
            matched = i < k and tok == drafts[i]
            kept += matched                     # a kept draft: its KV (computed this step) stands
            reason = self._check_finish(req, tok)
            if reason is not None or not matched:
                break
        if reason is None and self._direct_jump(req) and self._jump_forward(req):
            reason = self._check_finish(req, req.output_ids[-1])   # as after a sampled token
        new = req.output_ids[start:]
        self.num_generated_tokens += len(new)
        if req.draft_source in ("ngram", "draft"):
            self.num_spec_proposed_tokens += k
            self.num_spec_accepted_tokens += kept
            if req.draft_source == "ngram":   # (the draft model tracks its own from the committed ids)
                req.ngram_length.record(k, kept)
        else:
            self.num_jump_forward_tokens += max(len(new) - 1, 0)
        # KV stands for the kept drafts only: not for the model's own last token (its slot may
        # hold a rejected draft's KV) nor for an EOS a finished grammar appended.
        req.kv_len = valid_kv + kept
        if end > req.kv_len:                    # slots of rejected drafts
            self.allocator.free(self.table.table[req.row, req.kv_len:end].clone())
        out = TokenOutput(rid=req.rid, new_ids=new, prompt_tokens=len(req.origin_ids),
                          cached_tokens=max(req.cached_tokens, 0), finish_reason=reason)
        if lp is not None:
            sampled = len(new) if reason is None or req.matcher is None else min(len(new), kept + 1)
            out.output_logprobs = [[float(lp[i, t]), t] for i, t in enumerate(new[:sampled])]
            if req.top_logprobs_num > 0:
                out.output_top_logprobs = [_top(lp[i], req.top_logprobs_num) for i in range(sampled)]
        if reason is None:
            self._propose(req)
        return out

    def _jump_forward(self, req: Req) -> bool:
        """Append the text the grammar forces next without sampling it. The just-sampled token has
        no KV yet, so it is re-tokenized together with the forced text: the tokens are the ones the
        tokenizer would produce for that text. True if the output changed."""
        forced = req.matcher.forced_text()
        budget = req.params.max_new_tokens - len(req.output_ids)
        if not forced or budget <= 0:
            return False
        last = req.output_ids[-1]
        last_text = self.tokenizer.decode([last])
        replace = "\ufffd" not in last_text        # a partial UTF-8 byte can't be re-tokenized alone
        ids = self.tokenizer.encode((last_text if replace else "") + forced, add_special_tokens=False)
        if replace and ids and ids[0] == last:
            ids, replace = ids[1:], False
        if replace:
            req.matcher.rollback(1)
            budget += 1
        accepted = []
        for t in ids[:budget]:
            if not req.matcher.accept(t):
                break
            accepted.append(t)
        if replace and not accepted:             # keep what was sampled
            req.matcher.accept(last)
            return False
        if replace:
            req.output_ids[-1:] = accepted
        else:
            req.output_ids += accepted
        self.num_jump_forward_tokens += len(accepted)
        return bool(accepted) or replace

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
        mask = self._grammar_bitmask(len(idx))
        for j, i in enumerate(idx):
            reqs[i].matcher.fill_mask(mask, j)
        self._apply_mask_rows(mask, idx, row_logits)

    def _apply_mask_rows(self, mask: torch.Tensor, idx: list[int], row_logits: torch.Tensor) -> None:
        """Apply mask row j to logits row idx[j], in place. The mask is applied to all rows at
        once, unconstrained ones getting an all-allowed row: copying the constrained logits rows
        out and back costs ~30x more than the mask itself."""
        from plait.grammar import apply_token_bitmask_
        n = row_logits.shape[0]
        if idx != list(range(n)):
            full = self._full_mask_buffer(n, mask.shape[1])
            full.fill_(-1)
            full[torch.tensor(idx, dtype=torch.int64)] = mask[:len(idx)]
            mask = full
        apply_token_bitmask_(row_logits, mask[:n].to(row_logits.device))

    def _full_mask_buffer(self, rows: int, width: int) -> torch.Tensor:
        """A [rows, width] int32 buffer reused across steps (grown when a batch needs more)."""
        buf = self._full_bitmask
        if buf is None or buf.shape[0] < rows:
            buf = self._full_bitmask = torch.empty(max(rows, self.args.max_running_requests), width,
                                                   dtype=torch.int32)
        return buf[:rows]

    # --- logprobs --------------------------------------------------------------------------
    def _collect_input_logprobs(self, req: Req, start: int, logits: torch.Tensor) -> None:
        """Logits row i (position start+i) scores prompt token start+i+1."""
        ids = req.origin_ids
        lo = max(req.logprob_start_len, 1)
        idx = [i for i in range(logits.shape[0]) if lo <= start + i + 1 < len(ids)]
        if not idx:
            return
        lp = torch.log_softmax(logits[idx], dim=-1)
        targets = torch.tensor([ids[start + i + 1] for i in idx])
        vals = lp.gather(1, targets[:, None])[:, 0].tolist()
        req.input_logprobs += [[v, t] for v, t in zip(vals, targets.tolist())]
        if req.top_logprobs_num > 0:
            req.input_top_logprobs += [_top(row, req.top_logprobs_num) for row in lp]

    def _attach_input_logprobs(self, req: Req, out: TokenOutput) -> None:
        if not (req.return_logprob and req.logprob_start_len >= 0):
            return
        head = [[None, req.origin_ids[0]]] if req.logprob_start_len == 0 else []
        out.input_logprobs = head + req.input_logprobs
        if req.top_logprobs_num > 0:
            out.input_top_logprobs = ([None] if head else []) + req.input_top_logprobs

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
                tail = self.tokenizer.decode(req.output_ids[-req.stop_tail_tokens:],
                                             skip_special_tokens=p.skip_special_tokens)
                for s in p.stop:
                    if s in tail:
                        return {"type": "stop", "matched": s}
                for pattern in req.stop_patterns:   # SGLang's stop_regex: the match stays in the text
                    if pattern.search(tail):
                        return {"type": "stop", "matched": pattern.pattern}
        if n >= p.max_new_tokens:
            return {"type": "length", "length": n}
        if len(req.origin_ids) + n >= self.context_len:
            return {"type": "length", "length": n}
        return None

    def _grammar_eos(self) -> int:
        eos = self.tokenizer.eos_token_id
        return eos if eos in self.eos_ids else min(self.eos_ids)

    def _cache_prefix(self, req: Req) -> None:
        """Insert the request's computed tokens into the cache and lock them, so requests that
        share the prefix can use it while this one still runs."""
        ids = req.fill_ids[:req.kv_len]
        slots = self.table.table[req.row, :req.kv_len].clone()
        present = self.cache.insert(ids, slots)
        if present > req.cached_len:
            self.allocator.free(slots[req.cached_len:present])
        new_slots, node = self.cache.match_prefix(ids)
        self.table.table[req.row, :len(new_slots)] = new_slots
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
        slots = self.table.table[req.row, :req.kv_len].clone()
        present = self.cache.insert(req.fill_ids[:req.kv_len], slots)
        if present > req.cached_len:
            self.allocator.free(slots[req.cached_len:present])
        self.cache.dec_lock(req.last_node)
        self.table.free(req.row)
        req.row, req.last_node, req.kv_len, req.cached_len = None, None, 0, 0

    def _retract(self, req: Req) -> None:
        """Send a running request back to the queue; its tokens are kept and recomputed later
        (from the cache, when its prefix survives)."""
        self.running.remove(req)
        self._drop_drafts(req)                  # their slots go with the rest of its KV
        self._release(req)
        self.waiting.appendleft(req)
        self.num_retractions += 1
        logger.info("retracted request %s (%d tokens) to free KV memory", req.rid, req.fill_len)

    def _finish_output(self, req: Req, reason: dict, new_ids: list[int]) -> TokenOutput:
        req.finish_reason = reason
        return TokenOutput(rid=req.rid, new_ids=new_ids, finish_reason=reason,
                           prompt_tokens=len(req.origin_ids), cached_tokens=max(req.cached_tokens, 0))


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _top(row: torch.Tensor, k: int) -> list[list]:
    vals, ids = torch.topk(row, k)
    return [[v, i] for v, i in zip(vals.tolist(), ids.tolist())]


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


def _grammar_rejected(matcher, tok: int, vocab_size: int) -> dict:
    """The abort reason when a grammar refuses the sampled token: the client's grammar when it
    allows no token at all (it cannot be met with this vocabulary: a 400), else a bug (a 500)."""
    from plait.grammar import allocate_token_bitmask
    mask = allocate_token_bitmask(1, vocab_size)
    mask.zero_()
    matcher.fill_mask(mask, 0)
    if not bool(mask.any()):
        return {"type": "abort", "message": "invalid grammar: no token of the model's vocabulary can continue the "
                                            "constrained output"}
    return {"type": "abort", "message": f"internal error: the grammar rejected sampled token {tok}"}
