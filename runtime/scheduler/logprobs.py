"""The scheduler's logprobs: input (prompt) logprobs collected during prefill, top-k rows."""

from __future__ import annotations

import torch

from ..request import Req, TokenOutput


class LogprobsMixin:
    """Prompt logprobs; mixed into `Scheduler`."""

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
            req.input_top_logprobs += [top_logprobs(row, req.top_logprobs_num) for row in lp]

    def _attach_input_logprobs(self, req: Req, out: TokenOutput) -> None:
        if not (req.return_logprob and req.logprob_start_len >= 0):
            return
        head = [[None, req.origin_ids[0]]] if req.logprob_start_len == 0 else []
        out.input_logprobs = head + req.input_logprobs
        if req.top_logprobs_num > 0:
            out.input_top_logprobs = ([None] if head else []) + req.input_top_logprobs


def top_logprobs(row: torch.Tensor, k: int) -> list[list]:
    vals, ids = torch.topk(row, k)
    return [[v, i] for v, i in zip(vals.tolist(), ids.tolist())]
