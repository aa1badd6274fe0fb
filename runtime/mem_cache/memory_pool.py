"""KV memory: the per-layer K/V pool, the slot allocator and the request-to-token table.

A slot holds one token's K and V for every layer. Slot 0 (`PAD_SLOT`) is never handed out:
padded attention reads point at it, so stale or padding indices always address valid memory, and
the padded rows of a CUDA-graph decode step write their (finite, unused) K/V there.
"""

from __future__ import annotations

import torch

PAD_SLOT = 0


class TokenSlotAllocator:
    """Hands out and takes back KV slots in bulk (page size 1)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.clear()

    def clear(self) -> None:
        # Slot 0 is the padding slot; usable slots are 1..num_slots.
        self._free = torch.arange(PAD_SLOT + 1, self.num_slots + 1, dtype=torch.int64)
        self._head = 0  # free slots are _free[_head:]: an allocation is one slice (a decode step's is one slot)

    def available(self) -> int:
        return self._free.numel() - self._head

    def alloc(self, n: int) -> torch.Tensor | None:
        """Return `n` free slots (int64), or None when fewer than `n` are free."""
        if n > self.available():
            return None
        out = self._free[self._head : self._head + n]
        self._head += n
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat((self._free[self._head :], slots.to(torch.int64)))
            self._head = 0


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def index_copy_bits_(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, dim: int = 0) -> None:
    """`dst.index_copy_(dim, index, src)`, also for fp8 tensors (which torch's CPU index_copy_ does
    not take): as their bytes."""
    if dst.dtype in FP8_DTYPES:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.index_copy_(dim, index, src)


def index_select_bits(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.index_select(src, 0, index, out=out)`; fp8 tensors gathered as their bytes (a gather
    every device runs for uint8)."""
    if src.dtype not in FP8_DTYPES:
        return torch.index_select(src, 0, index, out=out)
    got = torch.index_select(src.view(torch.uint8), 0, index, out=None if out is None else out.view(torch.uint8))
    return got.view(src.dtype)


class KVPool:
    """Preallocated K and V buffers, one pair per layer: `[num_slots + 1, kv_heads, head_dim]`."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (num_slots + 1, kv_heads, head_dim)
        self.num_slots = num_slots
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        index_copy_bits_(self.k[layer], slots, k)
        index_copy_bits_(self.v[layer], slots, v)

    @staticmethod
    def bytes_per_slot(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


class ReqToTokenTable:
    """`[max_running_requests, context_len]` slot indices: where request row r's token i lives."""

    def __init__(self, max_requests: int, context_len: int, device: torch.device | str = "cpu"):
        self.table = torch.zeros((max_requests, context_len), dtype=torch.int64, device=device)
        self._flat = self.table.view(-1)
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self.max_requests = max_requests
        self.context_len = context_len

    def available(self) -> int:
        return len(self._free_rows)

    def entries(self, row: int, start: int, n: int) -> torch.Tensor:
        """Row `row`'s entries [start, start + n) as a view: one op (indexing the table by row and
        range is two; a decode step's Python runs with cold caches, see README)."""
        return self._flat.narrow(0, row * self.context_len + start, n)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def clear(self) -> None:
        self._free_rows = list(range(self.max_requests - 1, -1, -1))
