"""ForwardBatch: the flat tensors one model step consumes.

Requests are laid out flat, token-major, request after request: prefill (extend) requests
first, then decode requests (one token each). Each of the two runs is one attention group with
its own padded gather index into the KV pool and mask, built once per step here and reused by
every layer — so a decode row never pays for a long prefill's padding. A few decode requests
that verify drafts (a handful of tokens on top of their context) join the decode group when the
group is small (speculation and jump-forward run at small batches): the padding is cheap there
and the attention backend can keep treating them as decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A decode group may take multi-token (draft) extends up to this long, while it has at most
# DRAFT_GROUP_MAX requests: each of its rows is padded to the longest extend.
DRAFT_MAX_TOKENS = 16
DRAFT_GROUP_MAX = 8


@dataclass
class AttnGroup:
    """Requests attended together in one padded SDPA call."""

    start: int  # token range [start, end) of the flat batch
    end: int
    bsz: int
    max_q: int
    max_kv: int
    kv_indices: torch.Tensor  # [bsz * max_kv] slot ids (padding points at valid slots, masked out)
    attn_mask: torch.Tensor | None  # [bsz, 1, max_q, max_kv] bool; None when nothing needs masking
    q_scatter: torch.Tensor | None  # [end - start] positions in the padded [bsz * max_q] layout; None if dense
    rows: list[int]  # request-to-token rows, one per request (identify requests across steps)
    prefix_lens: torch.Tensor  # [bsz] int64 context already in the pool
    seq_lens: torch.Tensor  # [bsz] int64 context length after this step (prefix + extend)
    decode: bool = False  # the trailing group of decodes (and small draft extends)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: KV slots written this step
    groups: list[AttnGroup]
    logits_index: torch.Tensor  # [N] flat positions whose logits the caller wants
    logits_all: bool = False  # logits_index is every position in order (a pure decode step)
    repeat: bool = False  # made by `advance`: the step before's rows, each one token further
    keep_hidden: bool = False  # the model keeps the normed hidden states of the logits rows (embeddings)

    @property
    def advanceable(self) -> bool:
        """Whether `advance` applies: one decode group of one-token rows, every row's logits."""
        return len(self.groups) == 1 and self.groups[0].decode and self.groups[0].max_q == 1 and self.logits_all

    def advance(self, input_ids: list[int], out_cache_loc: torch.Tensor, req_to_token: torch.Tensor) -> ForwardBatch:
        """The next step of this `advanceable` batch: the same rows in the same order, each one token
        further (token `input_ids[b]`, its K/V to slot `out_cache_loc[b]`, the table already holding
        that slot). What does not change is shared and the rest is ~5 tensor ops, against `build`'s ~8
        and its Python, which at batch 1 run in the cold caches the step's weights leave (README)."""
        g = self.groups[0]
        positions, seq_lens, max_kv = self.positions + 1, g.seq_lens + 1, g.max_kv + 1
        if g.bsz == 1:
            kv_indices, attn_mask = req_to_token[g.rows[0], :max_kv], None
        else:
            kv_indices = req_to_token[torch.tensor(g.rows, device=req_to_token.device), :max_kv].view(-1)
            attn_mask = (
                None
                if g.attn_mask is None
                else (cached_arange(max_kv, seq_lens.device)[None, :] < seq_lens[:, None])[:, None, None, :]
            )
        group = AttnGroup(
            0, g.end, g.bsz, 1, max_kv, kv_indices, attn_mask, None, g.rows, positions, seq_lens, decode=True
        )
        return ForwardBatch(
            torch.tensor(input_ids, dtype=torch.int64, device=positions.device),
            positions,
            _to(out_cache_loc, positions.device),
            [group],
            self.logits_index,
            True,
            repeat=True,
        )

    @classmethod
    def build(
        cls,
        input_ids: list[int],
        req_rows: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
        req_to_token: torch.Tensor,
        logits_index: list[int],
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Lay out one step. Token i of request b sits at position prefix_lens[b] + i; its K/V go to
        out_cache_loc and attention reads the request's context through req_to_token[req_rows[b]].
        Decode requests (extend 1) must come after all prefill requests."""
        n = len(req_rows)
        split = _decode_start(prefix_lens, extend_lens)
        groups, positions, start = [], [], 0
        for lo, hi in ((0, split), (split, n)):
            if lo == hi:
                continue
            group, pos = _build_group(start, req_rows[lo:hi], prefix_lens[lo:hi], extend_lens[lo:hi], req_to_token)
            group.decode = lo == split
            groups.append(group)
            positions.append(pos)
            start = group.end
        if device != "cpu":
            for g in groups:
                g.kv_indices = g.kv_indices.to(device)
                g.attn_mask = None if g.attn_mask is None else g.attn_mask.to(device)
                g.q_scatter = None if g.q_scatter is None else g.q_scatter.to(device)
                g.prefix_lens, g.seq_lens = g.prefix_lens.to(device), g.seq_lens.to(device)
        logits_all = len(logits_index) == len(input_ids) and logits_index == list(range(len(input_ids)))
        return cls(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=_to(torch.cat(positions) if len(positions) > 1 else positions[0], device),
            out_cache_loc=_to(out_cache_loc, device),
            groups=groups,
            logits_index=(
                cached_arange(len(logits_index), device)
                if logits_all
                else torch.tensor(logits_index, dtype=torch.int64, device=device)
            ),
            logits_all=logits_all,
        )


# A batch-1 decode step spends a fair part of its time in Python around its op, with the caches cold
# after the weights' stream (a first tensor op then is slow). What is the same every step is made once.
_ARANGES: dict[torch.device, torch.Tensor] = {}


def cached_arange(n: int, device: torch.device | str) -> torch.Tensor:
    """`arange(n)` int64 on `device`: a view of one kept per device, so never written to."""
    device = torch.device(device)
    a = _ARANGES.get(device)
    if a is None or a.numel() < n:
        a = _ARANGES[device] = torch.arange(max(n, 256), dtype=torch.int64, device=device)
    return a[:n]


def _to(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    return t if t.device == torch.device(device) else t.to(device)


def _decode_start(prefix_lens: list[int], extend_lens: list[int]) -> int:
    """First request of the decode group: the trailing run of single-token extends, widened to
    short extends on top of a context (drafts) while the group stays small."""
    n = split = len(extend_lens)
    while split > 0 and extend_lens[split - 1] == 1:
        split -= 1
    wide = n
    while (
        wide > 0
        and n - wide < DRAFT_GROUP_MAX
        and prefix_lens[wide - 1] > 0
        and extend_lens[wide - 1] <= DRAFT_MAX_TOKENS
    ):
        wide -= 1
    return (
        wide
        if wide < split and (wide == 0 or extend_lens[wide - 1] > DRAFT_MAX_TOKENS or prefix_lens[wide - 1] == 0)
        else split
    )


def _build_group(
    start: int, rows: list[int], prefix_lens: list[int], extend_lens: list[int], req_to_token: torch.Tensor
) -> tuple[AttnGroup, torch.Tensor]:
    # sizes from the Python lists: at batch 1 each small tensor op here is a noticeable part of a step
    bsz = len(rows)
    seq_list = [p + e for p, e in zip(prefix_lens, extend_lens)]
    max_q, max_kv, num_tokens = max(extend_lens), max(seq_list), sum(extend_lens)
    pre = torch.tensor(prefix_lens, dtype=torch.int64)
    seq = torch.tensor(seq_list, dtype=torch.int64)
    # one row: a view of the table (nothing writes the table while the step runs), 1-D as it is
    kv_indices = req_to_token[rows[0], :max_kv] if bsz == 1 else req_to_token[torch.tensor(rows), :max_kv].view(-1)
    if max_q == 1:  # (a decode group: its tensors only, each one a cost at batch 1)
        positions, q_scatter = pre, None
        attn_mask = (
            None if min(seq_list) == max_kv else (torch.arange(max_kv)[None, :] < seq[:, None])[:, None, None, :]
        )
    else:
        ext = torch.tensor(extend_lens, dtype=torch.int64)
        kv_pos = torch.arange(max_kv)
        starts = torch.repeat_interleave(torch.cumsum(ext, 0) - ext, ext)
        offs = torch.arange(num_tokens) - starts  # index within its request
        req_of_tok = torch.repeat_interleave(torch.arange(bsz), ext)
        positions = pre[req_of_tok] + offs
        q_scatter = None if num_tokens == bsz * max_q else req_of_tok * max_q + offs
        # Query i of request b sees keys j <= prefix_b + i. Padding queries (i >= extend_b) are
        # clamped to the last real one so that no row is fully masked (which would give NaN).
        q_eff = torch.minimum(torch.arange(max_q)[None, :], (ext - 1)[:, None])
        attn_mask = (kv_pos[None, None, :] <= (pre[:, None] + q_eff)[:, :, None])[:, None]
    group = AttnGroup(
        start, start + num_tokens, bsz, max_q, max_kv, kv_indices, attn_mask, q_scatter, list(rows), pre, seq
    )
    return group, positions
