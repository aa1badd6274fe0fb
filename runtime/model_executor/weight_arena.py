"""The model's weights moved into one buffer backed by transparent huge pages (CPU, Linux).

A batch-1 decode step streams every weight once from memory, matrix after matrix. In 4 KB pages the
hardware prefetchers stop at each page boundary and the TLB misses every few KB, so a stream runs
well below the machine's bandwidth; in 2 MB pages, laid out in the order the step reads them, it
runs closer to it.

`consolidate(model)` copies every large weight tensor its modules hold (parameters, buffers and
plain tensor attributes such as prepacked panels), in module order (a decoder's execution order),
into one buffer whose pages are advised MADV_HUGEPAGE before first touch, and points the modules
at views of it; tensors held twice (a tied LM head) stay shared. Each old tensor is freed as it is
moved, so memory peaks at about one model plus one tensor, not two models.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MIN_BYTES = 64 << 10  # smaller tensors (norm weights, biases) are not worth a move
_ALIGN = 64  # each tensor's start: a cache line (oneDNN's packed weights need 64)
_MADV_HUGEPAGE = 14


def _movable(t: object) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_quantized
        and t._base is None
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        and t.numel() * t.element_size() >= MIN_BYTES
    )


def _slots(model: torch.nn.Module):
    """(module, kind, name, tensor) for every movable tensor a module holds, in module order."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if _movable(p):
                yield module, "param", name, p
        for name, b in module._buffers.items():
            if _movable(b):
                yield module, "buffer", name, b
        for name, t in vars(module).items():
            if not name.startswith("_") and _movable(t):
                yield module, "attr", name, t


def _layout(slots: list) -> tuple[dict[int, int], int]:
    """Each tensor's offset in the buffer (by data_ptr, once per tensor) and the buffer's size."""
    layout: dict[int, int] = {}
    size = 0
    for *_, t in slots:
        if t.data_ptr() not in layout:
            layout[t.data_ptr()] = size
            size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return layout, size


def _trim_heap() -> None:
    """Hand the moved tensors' freed memory back to the system: glibc keeps freed heap chunks
    (tensors below its mmap threshold) mapped (float32 SmolLM2: ~200 MB of resident memory)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _advise_huge(start: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) on [start, start + length) (start 2 MB-aligned, pages not yet touched);
    whether the kernel took it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """`nbytes` uint8, 2 MB-aligned, advised MADV_HUGEPAGE while still untouched (the first writes
    fault them in as huge pages); None where the kernel refuses or the system is not Linux."""
    if not sys.platform.startswith("linux"):
        return None
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    return raw[skip : skip + nbytes] if _advise_huge(raw.data_ptr() + skip, nbytes) else None


def consolidate(model: torch.nn.Module) -> torch.Tensor | None:
    """Move `model`'s large CPU weights into one huge-page buffer (see the module docstring);
    returns the buffer (the modules hold views of it), or None where nothing was moved: not Linux,
    no such weights, or the kernel refused MADV_HUGEPAGE (transparent huge pages off)."""
    slots: list = list(_slots(model))
    layout, size = _layout(slots)
    if not layout:
        return None
    arena = huge_page_buffer(size)
    if arena is None:
        return None
    moved: dict[int, torch.Tensor] = {}
    for i in range(len(slots)):
        module, kind, name, t = slots[i]
        slots[i] = None  # the old tensor goes once its last holder points at the copy
        ptr = t.data_ptr()
        if ptr not in moved:
            nbytes = t.numel() * t.element_size()
            view = arena[layout[ptr] : layout[ptr] + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            moved[ptr] = view
        view = moved[ptr]
        if kind == "param":
            module._parameters[name].data = view
        elif kind == "buffer":
            module._buffers[name] = view
        else:
            setattr(module, name, view)
        del t, module
    forget = getattr(model, "forget_decode_plans", None)
    if forget is not None:  # cached plans hold the old tensors
        forget()
    _trim_heap()
    logger.info("weights: %d tensors, %.1f MiB, in one huge-page buffer", len(moved), size / 2**20)
    return arena
