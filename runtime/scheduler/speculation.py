"""The scheduler's speculation: proposing draft tokens (the grammar's forced text, an n-gram
lookup, the draft model), verifying them in one sampler call, accepting the kept ones, and
jump-forward for sampled constrained requests."""

from __future__ import annotations

import torch

from ..layers.sampler import SamplingBatch
from ..model_executor.forward_batch import DRAFT_MAX_TOKENS
from ..request import Req, TokenOutput
from ..sampling_params import SamplingParams
from ..speculative.ngram import DraftLength, NgramIndex
from .grammar_mask import grammar_rejected
from .logprobs import top_logprobs

# Verifying grammar-forced drafts costs extra rows of logits and sampling; above this many running
# requests greedy constrained ones decode one token per step instead (same text).
JUMP_FORWARD_MAX_BATCH = 8


class SpeculationMixin:
    """Draft proposal, verification and jump-forward; mixed into `Scheduler`."""

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
        budget = req.params.max_new_tokens - len(req.output_ids) - 1  # room for the model's own next token
        if not forced or budget <= 0:
            return
        # at most DRAFT_MAX_TOKENS positions per verify pass (drafts + the model's own token), so the
        # request stays in the decode attention group; the rest of the forced text comes next step
        limit = min(budget, DRAFT_MAX_TOKENS - 1)
        self._append_drafts(req, self.tokenizer.encode(forced, add_special_tokens=False)[:limit])

    def _draft_budget(self, req: Req) -> int:
        """How many speculative tokens the request may take now (<= 0: none)."""
        return min(
            self.args.speculative_num_draft_tokens,
            req.params.max_new_tokens - len(req.output_ids) - 1,  # room for the model's own token
            self.context_len - len(req.origin_ids) - len(req.output_ids) - 1,
        )

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
        if k <= 0:  # pausing after rejected rounds
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
            del req.output_ids[-req.num_draft :]
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
                outs.append(base + drafts[:i] if penalised else base)  # only penalties read them
            drafts_of.append(drafts)
        rows = torch.tensor(idx, dtype=torch.int64, device=logits.device)
        row_logits = logits.index_select(0, rows)
        # logprobs report the model's distribution, before grammar masks and penalties
        logprobs = torch.log_softmax(row_logits, dim=-1) if any(r.return_logprob for r in reqs) else None
        self._apply_draft_masks(reqs, drafts_of, row_logits)
        sbatch = SamplingBatch.build(
            params, seeds, steps, prompts, outs, sorted(self.eos_ids), self.runner.vocab_size, device=logits.device
        )
        targets = self.sampler(row_logits, sbatch).tolist()
        results, off = [], 0
        for req, drafts in zip(reqs, drafts_of):
            n = len(drafts) + 1
            lp = logprobs[off : off + n] if logprobs is not None and req.return_logprob else None
            results.append(self._accept_drafts(req, drafts, targets[off : off + n], lp))
            off += n
        return results

    def _accept_drafts(self, req: Req, drafts: list[int], targets: list[int], lp: torch.Tensor | None) -> TokenOutput:
        """Commit the kept drafts and the model's own token, checking finish after each exactly
        as single-token decoding does; free the KV slots of rejected drafts."""
        k = len(drafts)
        end = req.fill_len  # positions that got KV this step
        del req.output_ids[-k:]  # (the matcher is already back before the drafts)
        req.num_draft = 0
        start = len(req.output_ids)
        valid_kv = req.fill_len  # the last committed token's KV was computed this step
        reason = None
        kept = 0
        for i, tok in enumerate(targets):
            if req.matcher is not None and not req.matcher.accept(tok):
                reason = grammar_rejected(req.matcher, tok, self.runner.vocab_size)
                break
            req.output_ids.append(tok)
            matched = i < k and tok == drafts[i]
            kept += matched  # a kept draft: its KV (computed this step) stands
            reason = self._check_finish(req, tok)
            if reason is not None or not matched:
                break
        if reason is None and self._direct_jump(req) and self._jump_forward(req):
            reason = self._check_finish(req, req.output_ids[-1])  # as after a sampled token
        new = req.output_ids[start:]
        self.num_generated_tokens += len(new)
        if req.draft_source in ("ngram", "draft"):
            self.num_spec_proposed_tokens += k
            self.num_spec_accepted_tokens += kept
            if req.draft_source == "ngram":  # (the draft model tracks its own from the committed ids)
                req.ngram_length.record(k, kept)
        else:
            self.num_jump_forward_tokens += max(len(new) - 1, 0)
        # KV stands for the kept drafts only: not for the model's own last token (its slot may
        # hold a rejected draft's KV) nor for an EOS a finished grammar appended.
        req.kv_len = valid_kv + kept
        if end > req.kv_len:  # slots of rejected drafts
            self.allocator.free(self.table.table[req.row, req.kv_len : end].clone())
        out = TokenOutput(
            rid=req.rid,
            new_ids=new,
            prompt_tokens=len(req.origin_ids),
            cached_tokens=max(req.cached_tokens, 0),
            finish_reason=reason,
        )
        if lp is not None:
            sampled = len(new) if reason is None or req.matcher is None else min(len(new), kept + 1)
            out.output_logprobs = [[float(lp[i, t]), t] for i, t in enumerate(new[:sampled])]
            if req.top_logprobs_num > 0:
                out.output_top_logprobs = [top_logprobs(lp[i], req.top_logprobs_num) for i in range(sampled)]
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
        replace = "\ufffd" not in last_text  # a partial UTF-8 byte can't be re-tokenized alone
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
        if replace and not accepted:  # keep what was sampled
            req.matcher.accept(last)
            return False
        if replace:
            req.output_ids[-1:] = accepted
        else:
            req.output_ids += accepted
        self.num_jump_forward_tokens += len(accepted)
        return bool(accepted) or replace


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
