"""ModelRunner: loads the model, owns the KV pool and the attention backend, runs one forward."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import torch
from tqdm import tqdm

from ..distributed.parallel import (
    FORWARD,
    STOP,
    RankFailure,
    StepChannel,
    all_reduce_min,
    destroy_tensor_parallel,
    init_tensor_parallel,
    rank_device,
    ranks_on_this_node,
    threads_per_rank,
)
from ..kernels.cpu import cpu_kernels
from ..layers.quantization import build_quantized_layers, quantize_model
from ..mem_cache.memory_pool import KVPool
from ..models import get_model_class
from ..server_args import ServerArgs, kv_cache_torch_dtype
from . import weight_arena
from .attention import make_attention_backend
from .cuda_graph import make_decode_graph_runner
from .forward_batch import ForwardBatch
from .gguf_weights import gguf_index, read_tensors
from .model_loader import load_config, load_tokenizer, load_weights, resolve_model
from .quantized_checkpoint import assemble, checkpoint_quantization

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


@contextlib.contextmanager
def _no_weight_init():
    """Build a model without the random init of its parameters: every one is then loaded from the
    checkpoint (`load_weights` checks each is filled), and the float weights of layers built from
    quantized codes are never written (their pages never become resident)."""
    from torch.nn import init

    names = ("kaiming_uniform_", "uniform_", "normal_", "trunc_normal_", "xavier_uniform_")
    saved = {name: getattr(init, name) for name in names}
    for name in names:
        setattr(init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


class ModelRunner:
    """Holds the model, tokenizer and KV pool; `forward(batch)` returns logits at `batch.logits_index`.

    With tensor parallelism (`args.tp_size > 1`) there is one runner per rank, each holding its
    shard of the model and of the KV heads: rank 0's `forward` sends the batch to the others, whose
    `follow()` loop runs the same forward in lockstep; the logits are gathered on rank 0."""

    def __init__(self, args: ServerArgs, rank: int = 0):
        self.args = args
        self.rank = rank
        self.device = rank_device(args, rank)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {args.device!r} requested but CUDA is not available")
        if args.num_threads or args.tp_size > 1:
            torch.set_num_threads(threads_per_rank(args))
        init_tensor_parallel(args, rank)  # before the model: its layers take their shard sizes from it
        self.channel = StepChannel() if args.tp_size > 1 else None
        self.model_path = resolve_model(args.model, revision=args.revision, float_weights=False)
        index = gguf_index(self.model_path)
        if args.quantization == "gguf" and index is None:
            raise ValueError(
                f"--quantization gguf computes with a GGUF file's own types, and {args.model!r} is not a "
                "GGUF; use int8 or int4 to quantize its weights"
            )
        self.config = load_config(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        model_cls = get_model_class(self.config)
        self.dtype = resolve_dtype(args.dtype, self.config, self.device)
        self.context_len = args.context_length or self.config.max_position_embeddings
        if self.device.type == "cpu":  # the fused small-op kernels (built once per machine)
            cpu_kernels.load()
        with _no_weight_init():
            self.model = model_cls(self.config, max_positions=self.context_len)
        # GPTQ / AWQ, and a GGUF under int4 / gguf (its 4-bit tensors; gguf: all its quantized ones):
        # layers built from the checkpoint's codes
        from_file = index is not None and args.quantization in ("int4", "gguf")
        checkpoint_quant = checkpoint_quantization(self.config)
        source = read_tensors(index, self.config, args.quantization) if from_file else load_weights(self.model_path)
        if checkpoint_quant is not None:
            source = assemble(source, checkpoint_quant)
        # A progress bar on a terminal (plait serve); silent in logs and tests.
        weights = tqdm(
            source,
            desc="loading weights",
            unit=" tensors",
            disable=not sys.stderr.isatty(),
            leave=False,
        )
        self.model.load_weights(weights)
        self.model.to(device=self.device, dtype=self.dtype).eval()
        build_quantized_layers(self.model)  # the layers the checkpoint's codes make (if it kept any)
        if args.quantization:  # quantized layers replace the float ones (and prepacking)
            quantize_model(self.model, args.quantization)
        # float layers prepacked (with gguf, the file's float ones); inductor cannot lower prepacked weights
        if (
            args.quantization in (None, "gguf")
            and self.device.type == "cpu"
            and not (args.disable_weight_prepack or args.enable_torch_compile)
        ):
            self.model.prepack_for_cpu()
        # RoPE tables stay float32 for accuracy; they are cast per step.
        self.model.rope_cos = self.model.rope_cos.float()
        self.model.rope_sin = self.model.rope_sin.float()
        # one huge-page buffer, in the order a step reads them (batch-1 decode streams them faster)
        self.weight_arena = weight_arena.consolidate(self.model) if self.device.type == "cpu" else None
        attn = self.model.layers[0].self_attn
        self.num_layers = self.config.num_hidden_layers
        # KV in the model's dtype: a bfloat16 model's K/V are bfloat16 values, which a float32 pool
        # would only hold at twice the bytes (decode attention reads them every step, and is faster
        # on half the bytes; SDPA widens them to float32 on the CPU, see
        # attention.sdpa_dtype, so results are those of a float32 pool). --kv-cache-dtype picks another:
        # bfloat16 under a float32 model rounds each K/V value once and halves the cache's bytes; the
        # 8-bit floats (fp8_e4m3, fp8_e5m2) halve a bfloat16 model's (decode attention widens them).
        self.kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, self.dtype)
        # Ranks on one CPU node share its RAM: the fraction is of the whole, split between them.
        ranks_sharing = len(ranks_on_this_node(args)) if self.device.type == "cpu" else 1
        per_slot = KVPool.bytes_per_slot(self.num_layers, attn.kv_heads, attn.head_dim, self.kv_dtype)
        num_slots = args.max_total_tokens or max(
            2, min(int(_available_memory(self.device) * args.kv_memory_fraction / ranks_sharing) // per_slot, 1 << 20)
        )
        num_slots = all_reduce_min(num_slots)  # every rank's pool holds the same slots
        available = _available_memory(self.device)
        if num_slots * per_slot > available:  # fail now rather than be OOM-killed while serving
            raise ValueError(
                f"a KV pool of {num_slots} tokens needs {num_slots * per_slot / 2**20:.0f} MiB, more "
                f"than the {available / 2**20:.0f} MiB available; lower --max-total-tokens"
            )
        self.pool = KVPool(num_slots, self.num_layers, attn.kv_heads, attn.head_dim, self.kv_dtype, self.device)
        self.backend = make_attention_backend(self.pool, self.device)
        if args.enable_torch_compile:  # the dense parts; attention keeps Python state and stays eager
            self.backend.forward = torch.compiler.disable(self.backend.forward)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * self.num_layers)
            self.model.forward = torch.compile(self.model.forward, dynamic=True)
        # Pure-decode steps replayed from CUDA graphs (on by default on CUDA; see cuda_graph.py).
        self.graphs = make_decode_graph_runner(self)
        self.vocab_size = self.config.vocab_size
        logger.info(
            "model %s loaded: %s, %d KV slots (%.1f MiB)",
            args.model,
            self.dtype,
            num_slots,
            num_slots * per_slot / 2**20,
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step; float32 logits `[len(batch.logits_index), vocab]`."""
        if self.channel is not None:
            self.channel.send(batch)
        if self.graphs is not None and not batch.keep_hidden:  # a graph keeps no hidden states
            logits = self.graphs.forward(batch)
            if logits is not None:
                return logits
        return self.model(batch, self.backend)

    # --- tensor parallelism (no-ops at tp_size 1) -----------------------------------------------
    def follow(self) -> None:
        """Ranks > 0: run every forward rank 0 sends until it says stop; a RankFailure when rank 0
        is gone (or hangs past the timeout)."""
        while True:
            cmd, batch = self.channel.recv()
            if cmd == STOP:
                return
            if cmd == FORWARD:
                self.model(batch, self.backend)

    def keepalive(self) -> None:
        """Rank 0, while idle: a no-op step, so a dead rank is noticed (RankFailure) before the next
        request and the others' receive does not time out."""
        if self.channel is not None:
            self.channel.keepalive()

    def close(self) -> None:
        """Rank 0: release the other ranks (they exit), then leave the group."""
        if self.channel is not None and self.rank == 0:
            try:
                self.channel.stop()
            except RankFailure:
                pass  # a rank is already gone: nothing to stop
        destroy_tensor_parallel()
