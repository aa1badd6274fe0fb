"""ModelRunner: loads the model, owns the KV pool and the attention backend, runs one forward."""
from __future__ import annotations

import logging
import os
import sys

import torch
from tqdm import tqdm

from .attention import TorchNativeAttention
from .forward_batch import ForwardBatch
from .memory_pool import KVPool
from .model_loader import load_config, load_tokenizer, load_weights, resolve_model
from .models import get_model_class
from .server_args import ServerArgs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, config, device: torch.device) -> torch.dtype:
    """`auto` keeps a bf16 checkpoint in bf16 and runs everything else in float32
    (float16 matmuls are slow on CPUs)."""
    if name != "auto":
        dtype = _DTYPES[name]
        if dtype == torch.float16 and device.type == "cpu":
            raise ValueError("dtype float16 is not supported on the CPU; use bfloat16 or float32")
        return dtype
    cfg = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    cfg = str(cfg).removeprefix("torch.") if cfg is not None else ""
    if cfg == "bfloat16":
        return torch.bfloat16
    if cfg == "float16" and device.type == "cuda":
        return torch.float16
    return torch.float32


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ModelRunner:
    """Holds the model, tokenizer and KV pool; `forward(batch)` returns logits at `batch.logits_index`."""

    def __init__(self, args: ServerArgs):
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {args.device!r} requested but CUDA is not available")
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.model_path = resolve_model(args.model, revision=args.revision)
        self.config = load_config(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        model_cls = get_model_class(self.config)
        self.dtype = resolve_dtype(args.dtype, self.config, self.device)
        self.context_len = args.context_length or self.config.max_position_embeddings
        self.model = model_cls(self.config, max_positions=self.context_len)
        # A progress bar on a terminal (plait serve); silent in logs and tests.
        weights = tqdm(load_weights(self.model_path), desc="loading weights", unit=" tensors",
                       disable=not sys.stderr.isatty(), leave=False)
        self.model.load_weights(weights)
        self.model.to(device=self.device, dtype=self.dtype).eval()
        if self.device.type == "cpu" and not args.disable_weight_prepack:
            self.model.prepack_for_cpu()
        # RoPE tables stay float32 for accuracy; they are cast per step.
        self.model.rope_cos = self.model.rope_cos.float()
        self.model.rope_sin = self.model.rope_sin.float()
        attn = self.model.layers[0].self_attn
        self.num_layers = self.config.num_hidden_layers
        # On the CPU, bf16 SDPA is ~3x slower than float32 for these head sizes, so a bf16 model
        # keeps its KV in float32 (the pool is small next to the weights' bandwidth).
        self.kv_dtype = torch.float32 if (self.device.type == "cpu" and self.dtype == torch.bfloat16) else self.dtype
        per_slot = KVPool.bytes_per_slot(self.num_layers, attn.kv_heads, attn.head_dim, self.kv_dtype)
        num_slots = args.max_total_tokens or max(
            2, min(int(_available_memory(self.device) * args.kv_memory_fraction) // per_slot, 1 << 20))
        self.pool = KVPool(num_slots, self.num_layers, attn.kv_heads, attn.head_dim, self.kv_dtype, self.device)
        self.backend = TorchNativeAttention(self.pool)
        self.vocab_size = self.config.vocab_size
        logger.info("model %s loaded: %s, %d KV slots (%.1f MiB)", args.model, self.dtype, num_slots,
                    num_slots * per_slot / 2**20)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step; float32 logits `[len(batch.logits_index), vocab]`."""
        return self.model(batch, self.backend)
