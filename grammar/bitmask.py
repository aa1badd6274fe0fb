"""Packed vocabulary bitmasks: int32 [batch, ceil(V/32)], bit (t & 31) of word (t >> 5) = token t
allowed — the layout xgrammar, outlines-core and llguidance all write."""

from __future__ import annotations

import functools
import os

import torch

_XGR_KERNEL: dict[str, bool] = {}  # device type -> xgrammar's kernel works there


def bitmask_width(vocab_size: int) -> int:
    return (int(vocab_size) + 31) // 32


def allocate_token_bitmask(batch: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """int32 [batch, ceil(V/32)], all ones (everything allowed)."""
    return torch.full((batch, bitmask_width(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


def checked_row(bitmask: torch.Tensor, row: int, width: int) -> torch.Tensor:
    """bitmask[row], checked to be what native mask writers take by pointer: contiguous int32
    [width] on the CPU."""
    r = bitmask[row]
    if r.shape[0] != width or r.dtype != torch.int32 or r.device.type != "cpu" or not r.is_contiguous():
        raise ValueError(
            f"bitmask row must be contiguous int32 [{width}] on CPU, got {r.dtype} {tuple(r.shape)} on {r.device}"
        )
    return r


def reset_token_bitmask(bitmask: torch.Tensor) -> None:
    bitmask.fill_(-1)


@functools.lru_cache(maxsize=8)
def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [batch, vocab_size]: the allowed tokens (batched shifts, no loop over the vocabulary)."""
    bm = bitmask if bitmask.dim() == 2 else bitmask.unsqueeze(0)
    bits = (bm.unsqueeze(-1) >> _shifts(bm.device)) & 1
    flat = bits.reshape(bm.shape[0], -1).bool()
    if flat.shape[1] >= vocab_size:
        return flat[:, :vocab_size]
    pad = torch.zeros(bm.shape[0], vocab_size - flat.shape[1], dtype=torch.bool, device=bm.device)
    return torch.cat([flat, pad], dim=1)


@functools.lru_cache(maxsize=8)
def _byte_bias(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256 * 8]: for each byte value, the 8 additive biases of its bits (0 if set, -inf if not)."""
    bits = (torch.arange(256, dtype=torch.int32).unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)) & 1
    return torch.where(bits.bool(), 0.0, float("-inf")).to(dtype=dtype, device=device).reshape(256, 8)


def _apply_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Add 0 / -inf per token, looked up a byte of the bitmask at a time: one gather and one add
    over [B, V], several times faster on the CPU than unpacking bits with shifts or xgrammar's
    kernel at a batch of 32 (the bitmask's bytes are little-endian, as on every platform torch
    runs on, so byte j of word w holds tokens 32w + 8j ... 32w + 8j + 7)."""
    vocab = logits.shape[1]
    n = min(vocab, bitmask.shape[1] * 32)
    with torch.inference_mode():  # the model's logits are inference tensors
        table = _byte_bias(logits.dtype, logits.device)
        bias = table.index_select(0, bitmask.view(torch.uint8).reshape(-1).long()).view(bitmask.shape[0], -1)
        logits[:, :n].add_(bias[:, :n])
        if vocab > n:  # logits past the bitmask: never allowed
            logits[:, n:] = float("-inf")


def _apply_xgrammar(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """xgrammar's kernel (C++ on CPU, CUDA/Triton on GPU); False where it is unavailable."""
    dev = logits.device.type
    if dev not in ("cpu", "cuda") or _XGR_KERNEL.get(dev) is False or os.environ.get("PLAIT_GRAMMAR_TORCH_MASK"):
        return False
    try:
        import xgrammar as xgr

        vocab = logits.shape[1]
        n = min(vocab, bitmask.shape[1] * 32)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=n)
        if vocab > n:
            logits[:, n:] = float("-inf")
        _XGR_KERNEL[dev] = True
        return True
    except Exception:  # noqa: BLE001 — missing package, no kernel for this device / dtype
        if dev in _XGR_KERNEL:  # it worked before on this device: a real error, not a missing kernel
            raise
        _XGR_KERNEL[dev] = False
        return False


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[b, t] = -inf where bit t of bitmask[b] is 0 (and for t past the bitmask).

    logits: [B, V] (or [V]) on any device and float dtype; bitmask: int32 [B, ceil(V/32)] (moved to
    the logits' device if needed). Uses xgrammar's kernel on a GPU where it runs, otherwise a
    byte-table gather and add (finite logits stay, masked ones become -inf)."""
    if bitmask.dtype != torch.int32:
        raise TypeError(f"the bitmask must be int32, got {bitmask.dtype}")
    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
    if bitmask.dim() == 1:
        bitmask = bitmask.unsqueeze(0)
    if logits.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} do not match")
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if not bitmask.is_contiguous():
        bitmask = bitmask.contiguous()
    # on a GPU xgrammar's kernel (it takes fp16 / bf16 too); on the CPU the byte-table add is faster
    if logits.is_contiguous() and logits.device.type != "cpu" and _apply_xgrammar(logits, bitmask):
        return
    _apply_torch(logits, bitmask)


def set_token_bits(bitmask: torch.Tensor, row: int, token_ids, value: bool = True) -> None:
    """Set (or clear) the bits of a few tokens in bitmask[row] (a handful of ids, e.g. EOS)."""
    r = bitmask[row]
    for t in token_ids:
        w, b = t >> 5, t & 31
        if w >= r.shape[0]:
            continue
        bit = (1 << b) if b < 31 else -(1 << 31)  # int32 two's complement for bit 31
        cur = int(r[w])
        r[w] = _to_int32((cur | bit) if value else (cur & ~bit))


def _to_int32(x: int) -> int:
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= (1 << 31) else x


def eos_only_row(vocab_size: int, eos_token_ids) -> torch.Tensor:
    """A one-row bitmask allowing only the EOS tokens (what a finished matcher writes)."""
    row = torch.zeros(1, bitmask_width(vocab_size), dtype=torch.int32)
    set_token_bits(row, 0, eos_token_ids)
    return row
