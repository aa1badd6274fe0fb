"""Batched next-token sampler.

Per step the engine builds one `SamplingBatch` (small per-row tensors, built only for the
features some row uses) and calls `Sampler()(logits, batch)`. Order of operations:

1. penalties (rows that use them): repetition (HF, prompt+output), frequency / presence
   (OpenAI, output only);
2. min_new_tokens: EOS ids and the row's stop_token_ids get -inf while step < min_new_tokens;
3. greedy rows: argmax;
4. sampled rows: softmax(logits / T), then top_k / top_p / min_p in sorted space
   (all three judged on the post-temperature distribution, as SGLang does);
5. the draw: exponential race, token = argmax(p / E), E = -log(U), where U for (row, token)
   is a counter-based hash of (seed, step, token id). The draw is therefore a pure function
   of the row's own (seed, step, probabilities): batch composition, row position and whether
   the batch took the sorted path do not change it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import torch

from ..kernels.cpu import cpu_kernels
from ..model_executor.forward_batch import cached_arange
from ..sampling_params import SamplingParams

# ---------------------------------------------------------------------------------------------
# Counter-based hash. lowbias32 (hash-prospector): a 32-bit bijection with strong avalanche.
# Both multipliers are < 2^31 and values stay in [0, 2^32), so every product is < 2^63:
# int64 tensor arithmetic never overflows and `>>` is a logical shift. The same function
# works on Python ints and on int64 tensors.
_M32 = 0xFFFFFFFF
_C1 = 0x21F0AAAD
_C2 = 0x735A2D97
_SALT_SEED = 0x9E3779B9
_SALT_STEP = 0x7F4A7C15
_SALT_TOKEN = 0x85EBCA6B
_U_BITS = 23  # (x + 0.5) * 2^-23 for x < 2^23 is exact in float32 and lies in [2^-24, 1 - 2^-24]
_U_SCALE = 2.0**-_U_BITS
_MIN_TEMPERATURE = 1e-6  # keeps logits / T finite for absurdly small (non-zero) temperatures


def _mix32(x):
    """lowbias32 on a value (Python int or int64 tensor) in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 15)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In-place `_mix32` on an int64 tensor (one scratch buffer instead of ~8 temporaries)."""
    t = torch.bitwise_right_shift(x, 16)
    x.bitwise_xor_(t)
    x.mul_(_C1).bitwise_and_(_M32)
    torch.bitwise_right_shift(x, 15, out=t)
    x.bitwise_xor_(t)
    x.mul_(_C2).bitwise_and_(_M32)
    torch.bitwise_right_shift(x, 15, out=t)
    return x.bitwise_xor_(t)


def row_key(seed: int, step: int) -> int:
    """32-bit key of (seed, step); any Python int seed (negative or > 64 bits is folded)."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    k = _mix32((s & _M32) ^ _SALT_SEED)
    k = _mix32(k ^ (s >> 32))
    return _mix32(k ^ ((step ^ _SALT_STEP) & _M32))


def token_hash(vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Per-token-id hash, int64 [V] in [0, 2^32) (distinct values: `_mix32` is a bijection)."""
    v = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return _mix32_(v.add_(_SALT_TOKEN).bitwise_and_(_M32))


def exponentials(keys: torch.Tensor, tok_hash: torch.Tensor) -> torch.Tensor:
    """E = -log(U) with U in (0, 1) hashed from (row key, token): float32, broadcast shape.

    `keys` is int64 [S, 1]; `tok_hash` is `token_hash(V)` [1, V] or gathered [S, W].
    """
    h = _mix32_(torch.bitwise_xor(keys, tok_hash))
    h.bitwise_right_shift_(32 - _U_BITS)  # top bits of lowbias32 are the best mixed
    e = h.to(torch.float32)
    return e.add_(0.5).mul_(_U_SCALE).log_().neg_()


# ---------------------------------------------------------------------------------------------


@dataclass
class SamplingBatch:
    """Per-step tensors for B rows, built once per step by `SamplingBatch.build`.

    Optional groups are None when no row needs them, so the sampler skips that work.
    S = number of sampled (non-greedy) rows, P = number of rows with penalties.
    """

    batch_size: int
    vocab_size: int
    device: torch.device
    # Sampled rows. sample_rows is None when every row is greedy.
    sample_rows: torch.Tensor | None = None  # int64 [S], ascending
    temperatures: torch.Tensor | None = None  # float32 [S, 1]
    row_keys: torch.Tensor | None = None  # int64 [S, 1], hash of (seed, step)
    sort_width: int | None = None  # None: no filter; V: full sort; < V: topk
    top_ks: torch.Tensor | None = None  # int64 [S, 1] (V when off)
    top_ps: torch.Tensor | None = None  # float32 [S, 1] (2.0 when off)
    min_ps: torch.Tensor | None = None  # float32 [S, 1] (0.0 when off)
    # Penalties. penalty_rows is None when no row has any.
    penalty_rows: torch.Tensor | None = None  # int64 [P]
    # Repetition penalty is sparse: only (row, token) pairs seen in prompt + output.
    rep_index: torch.Tensor | None = None  # int64 [N]: p * V + token (p indexes penalty_rows)
    rep_factor: torch.Tensor | None = None  # float32 [N]: that row's repetition_penalty
    # frequency * count + presence * (count > 0) over output tokens, counted by scatter_add.
    out_penalty: torch.Tensor | None = None  # float32 [P, V], subtracted from logits
    # min_new_tokens: (row, token) pairs set to -inf. None when nothing is blocked.
    block_rows: torch.Tensor | None = None  # int64 [K]
    block_cols: torch.Tensor | None = None  # int64 [K]

    @property
    def all_greedy(self) -> bool:
        """True when no row samples (argmax only)."""
        return self.sample_rows is None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        steps: list[int],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        eos_ids: list[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> "SamplingBatch":
        """Build the step's tensors for `len(params)` rows.

        `seeds[b]`: the row's seed (always an int; the engine draws one when the user gave
        none). `steps[b]`: index of the token being sampled (normally len(output_ids[b])).
        Params are assumed validated; token ids outside [0, vocab_size) raise ValueError.
        """
        B = len(params)
        if not (len(seeds) == len(steps) == len(prompt_ids) == len(output_ids) == B):
            raise ValueError("params, seeds, steps, prompt_ids and output_ids must have equal length")
        V = int(vocab_size)
        dev = torch.device(device)
        batch = cls(batch_size=B, vocab_size=V, device=dev)
        eos = sorted(set(eos_ids))
        _check_ids(eos, V, "eos_ids")

        rows = _RowLists.collect(params, seeds, steps, eos, V)
        if rows.blk_rows:
            batch.block_rows, batch.block_cols = _i64(rows.blk_rows, dev), _i64(rows.blk_cols, dev)
        if rows.s_rows:
            batch._set_sampling(rows)
        if rows.p_rows:
            batch._set_penalties(params, rows.p_rows, prompt_ids, output_ids)
        return batch

    def _set_sampling(self, rows: "_RowLists") -> None:
        """Tensors of the rows that sample (not greedy): temperature, key, and the top-k / top-p /
        min-p cuts only where some row uses them."""
        dev, V, tks = self.device, self.vocab_size, rows.tks
        self.sample_rows = _i64(rows.s_rows, dev)
        self.temperatures = _f32(rows.temps, dev)
        self.row_keys = _i64(rows.keys, dev).unsqueeze(1)
        use_k = any(k < V for k in tks)
        use_p = any(tp < 1.0 for tp in rows.tps)
        use_m = any(mp > 0.0 for mp in rows.mps)
        if use_k:
            self.top_ks = _i64(tks, dev).unsqueeze(1)
        if use_p:
            self.top_ps = _f32(rows.tps, dev)
        if use_m:
            self.min_ps = _f32(rows.mps, dev)
        if use_p or use_m or (use_k and max(tks) == V):
            self.sort_width = V  # some row needs the whole sorted distribution
        elif use_k:
            self.sort_width = max(tks)  # every row has top_k: a partial topk suffices

    def _set_penalties(
        self, params: list[SamplingParams], p_rows: list[int], prompt_ids: list[list[int]], output_ids: list[list[int]]
    ) -> None:
        """Repetition penalty as (index, factor) over prompt + output ids; frequency and presence
        penalties folded into one [P, V] tensor subtracted from the logits."""
        dev, V, P = self.device, self.vocab_size, len(p_rows)
        self.penalty_rows = _i64(p_rows, dev)
        # j indexes penalty rows; rows without a given penalty contribute no tokens to it.
        rep = [(j, b) for j, b in enumerate(p_rows) if params[b].repetition_penalty != 1.0]
        if rep:
            lens = [len(prompt_ids[b]) + len(output_ids[b]) for _, b in rep]
            flat = _flat_index(
                [j for j, _ in rep], lens, chain.from_iterable(chain(prompt_ids[b], output_ids[b]) for _, b in rep), V
            )
            factor = torch.repeat_interleave(
                torch.tensor([float(params[b].repetition_penalty) for _, b in rep]),
                torch.tensor(lens, dtype=torch.int64),
            )
            # Duplicate indices are harmless: each reads the original logit and writes
            # the same value back.
            self.rep_index, self.rep_factor = flat.to(dev), factor.to(dev)
        fp = [
            (j, b)
            for j, b in enumerate(p_rows)
            if params[b].frequency_penalty != 0.0 or params[b].presence_penalty != 0.0
        ]
        if fp:
            lens = [len(output_ids[b]) for _, b in fp]
            flat = _flat_index([j for j, _ in fp], lens, chain.from_iterable(output_ids[b] for _, b in fp), V).to(dev)
            counts = torch.zeros(P * V, dtype=torch.float32, device=dev)
            counts.scatter_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float32, device=dev))
            counts = counts.view(P, V)
            present = (counts > 0).to(torch.float32)
            freq = _f32([float(params[b].frequency_penalty) for b in p_rows], dev)
            pres = _f32([float(params[b].presence_penalty) for b in p_rows], dev)
            # Folded into one tensor here so the sampler does a single subtraction.
            self.out_penalty = counts.mul_(freq).add_(present.mul_(pres))


def _f32(xs: list[float], dev: torch.device) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32, device=dev).unsqueeze(1)


def _i64(xs: list[int], dev: torch.device) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64, device=dev)


@dataclass
class _RowLists:
    """One pass over a batch's rows into plain Python lists; tensors are made once from them."""

    blk_rows: list[int] = field(default_factory=list)  # (row, id) pairs blocked (EOS before min_new_tokens)
    blk_cols: list[int] = field(default_factory=list)
    s_rows: list[int] = field(default_factory=list)  # rows that sample, and their parameters
    temps: list[float] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    tks: list[int] = field(default_factory=list)
    tps: list[float] = field(default_factory=list)
    mps: list[float] = field(default_factory=list)
    p_rows: list[int] = field(default_factory=list)  # rows with a penalty

    @classmethod
    def collect(
        cls, params: list[SamplingParams], seeds: list[int], steps: list[int], eos: list[int], V: int
    ) -> "_RowLists":
        out = cls()
        for b, p in enumerate(params):
            step = int(steps[b])
            if step < p.min_new_tokens:
                ids = sorted(set(eos).union(p.stop_token_ids))
                _check_ids(ids, V, "stop_token_ids")
                out.blk_rows.extend([b] * len(ids))
                out.blk_cols.extend(ids)
            if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                out.p_rows.append(b)
            if not p.greedy:
                out.s_rows.append(b)
                out.temps.append(max(float(p.temperature), _MIN_TEMPERATURE))
                out.keys.append(row_key(int(seeds[b]), step))
                out.tks.append(p.top_k if 0 < p.top_k < V else V)
                out.tps.append(float(p.top_p) if p.top_p < 1.0 else 2.0)  # 2.0: never cuts
                out.mps.append(float(p.min_p))
        return out


def _check_ids(ids: list[int], V: int, what: str) -> None:
    for t in ids:
        if not (0 <= t < V):
            raise ValueError(f"{what} must be in [0, {V}), got {t}")


def _flat_index(rows: list[int], lengths: list[int], tokens, V: int) -> torch.Tensor:
    """CPU int64 `row * V + token` for concatenated token lists (`lengths[i]` for `rows[i]`)."""
    toks = torch.tensor(list(tokens), dtype=torch.int64)
    if toks.numel() and (int(toks.min()) < 0 or int(toks.max()) >= V):
        raise ValueError(f"token ids must be in [0, {V})")
    r = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64))
    return r.mul_(V).add_(toks)


class Sampler:
    """Turns logits [B, V] into next token ids int64 [B] following a `SamplingBatch`.

    Stateless apart from a per-(V, device) cache of the token hash.
    """

    def __init__(self) -> None:
        self._tok_hash: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _token_hash(self, V: int, dev: torch.device) -> torch.Tensor:
        key = (V, dev)
        h = self._tok_hash.get(key)
        if h is None:
            h = self._tok_hash[key] = token_hash(V, dev)
        return h

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Return next token ids (int64 [B]). `logits` is not modified."""
        B, V = batch.batch_size, batch.vocab_size
        if logits.dim() != 2 or logits.shape[0] != B or logits.shape[1] != V:
            raise ValueError(f"logits must have shape [{B}, {V}], got {list(logits.shape)}")
        if B == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        edits = batch.penalty_rows is not None or batch.block_rows is not None
        if batch.sample_rows is None and not edits:
            return cpu_kernels.argmax_rows(logits)  # all-greedy, nothing to adjust

        x = self.adjust_logits(logits, batch)
        rows = batch.sample_rows
        if rows is None:
            return cpu_kernels.argmax_rows(x)
        z = x if rows.numel() == B else x.index_select(0, rows)
        toks = self._sample(z, batch)
        if rows.numel() == B:
            return toks
        out = cpu_kernels.argmax_rows(x)
        return out.index_copy_(0, rows, toks)

    def adjust_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Steps 1-2 (penalties, min_new_tokens blocking) as float32 [B, V].

        Returns a new tensor when anything is edited (the input is never modified); with no
        edits it may alias `logits` when that is already float32.
        """
        edits = batch.penalty_rows is not None or batch.block_rows is not None
        x = logits.to(torch.float32, copy=edits)
        if batch.penalty_rows is not None:
            self._apply_penalties(x, batch)
        if batch.block_rows is not None:
            x[batch.block_rows, batch.block_cols] = float("-inf")
        return x

    @staticmethod
    def _apply_penalties(x: torch.Tensor, batch: SamplingBatch) -> None:
        """In place on x (our float32 copy): repetition, then frequency / presence."""
        rows = batch.penalty_rows
        whole = rows.numel() == x.shape[0]  # every row penalised: skip the gather / scatter
        z = x if whole else x.index_select(0, rows)
        if batch.rep_index is not None:
            zf = z.view(-1)
            v = zf[batch.rep_index]
            r = batch.rep_factor
            # HF: positive logits are divided, non-positive multiplied (both push down for r > 1).
            zf[batch.rep_index] = torch.where(v > 0, v / r, v * r)
        if batch.out_penalty is not None:
            z.sub_(batch.out_penalty)
        if not whole:
            x.index_copy_(0, rows, z)

    def _sample(self, z: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Draw one token per sampled row from float32 logits z [S, V]."""
        dev, V = z.device, batch.vocab_size
        probs = torch.softmax(z / batch.temperatures, dim=-1)
        W = batch.sort_width
        if W is None:
            e = exponentials(batch.row_keys, self._token_hash(V, dev).unsqueeze(0))
            # argmax(p / E) is an exact draw from p; no renormalisation needed (scale-free).
            return probs.div_(e).argmax(dim=-1)

        if W < V:
            p_s, idx = probs.topk(W, dim=-1, sorted=True)
        else:
            p_s, idx = probs.sort(dim=-1, descending=True)
        drop = None
        if batch.top_ks is not None:
            drop = cached_arange(W, dev).unsqueeze(0) >= batch.top_ks
        if batch.top_ps is not None:
            # Keep the smallest prefix reaching top_p: drop where the mass *before* it
            # already reaches top_p (position 0 has 0 before it, so it is always kept).
            d = (p_s.cumsum(dim=-1) - p_s) >= batch.top_ps
            drop = d if drop is None else drop.logical_or_(d)
        if batch.min_ps is not None:
            d = p_s < p_s[:, :1] * batch.min_ps
            drop = d if drop is None else drop.logical_or_(d)
        if drop is not None:
            p_s.masked_fill_(drop, 0.0)
        # Hash by the original token id, so the draw matches the unsorted path exactly.
        e = exponentials(batch.row_keys, self._token_hash(V, dev)[idx])
        pos = p_s.div_(e).argmax(dim=-1, keepdim=True)
        return idx.gather(1, pos).squeeze(1)
