"""Tensor parallelism on torch.distributed: the process group, the sharded layers, and the channel
over which rank 0 hands every step's batch to the other ranks.

Megatron-style sharding: a column-parallel projection keeps a slice of the output features on each
rank (no communication), the row-parallel projection after it keeps the matching slice of its
input features and sums the partial results with one all-reduce. Attention heads follow the
column split (KV heads are replicated when there are fewer of them than ranks); the embedding and
the LM head split the vocabulary. At `tp_size == 1` every layer is a plain local op: nothing here
calls torch.distributed.

Backends: gloo on the CPU, NCCL on CUDA. Collective failures (a peer that died, a timeout) are
raised as `RankFailure`, which the scheduler treats as fatal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from ..layers.quantization import QuantizedWeight, as_float, keep_quantized

logger = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """A collective failed: a rank died, hung past the timeout, or the group was torn down."""

    fatal = True  # the ranks can no longer step together: the scheduler process exits


@dataclass
class _TPState:
    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


_tp = _TPState()


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 when not distributed)."""
    return _tp.rank


def tp_size() -> int:
    """Number of tensor-parallel ranks (1 when not distributed)."""
    return _tp.size


# --- launch -------------------------------------------------------------------------------------
def ranks_on_this_node(args) -> list[int]:
    """Global ranks that run on node `args.node_rank` (ranks are laid out node after node)."""
    per_node = args.tp_size // args.nnodes
    return list(range(args.node_rank * per_node, (args.node_rank + 1) * per_node))


def threads_per_rank(args) -> int:
    """Intra-op threads per rank: the cores (or `num_threads`) split over this node's ranks."""
    total = args.num_threads or len(os.sched_getaffinity(0))
    return max(1, total // len(ranks_on_this_node(args)))


def rank_device(args, rank: int) -> torch.device:
    """The device of `rank`: its local GPU index on CUDA, the CPU otherwise."""
    device = torch.device(args.device)
    if device.type != "cuda" or args.tp_size == 1:
        return device
    return torch.device("cuda", rank % (args.tp_size // args.nnodes))


def split_addr(addr: str) -> tuple[str, int]:
    """`host:port` (IPv6 hosts in brackets) -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"dist_init_addr must be HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def init_tensor_parallel(args, rank: int) -> None:
    """Join the group of `args.tp_size` ranks (a no-op at tp_size 1). Rank 0 hosts the rendezvous
    store, listening on `args.dist_init_addr` only (not on every interface)."""
    if args.tp_size == 1:
        return
    import torch.distributed as dist

    host, port = split_addr(args.dist_init_addr)
    device = rank_device(args, rank)
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
        if host in ("127.0.0.1", "localhost", "::1"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep the data connections on loopback too
    listener = None
    if rank == 0:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError as e:
            listener.close()
            raise ValueError(f"cannot listen on dist_init_addr {args.dist_init_addr}: {e.strerror or e}") from None
        listener.listen(128)
    try:
        store = dist.TCPStore(
            host, port, args.tp_size, rank == 0, timeout, master_listen_fd=listener.fileno() if listener else None
        )
        dist.init_process_group(backend, store=store, rank=rank, world_size=args.tp_size, timeout=timeout)
    except RuntimeError as e:  # DistError and its subclasses included
        raise RankFailure(
            f"tensor-parallel rank {rank} could not join the group at {args.dist_init_addr}: {e}"
        ) from None
    finally:
        if listener is not None:
            listener.close()  # the store holds its own duplicate of the descriptor
    _tp.rank, _tp.size, _tp.device = rank, args.tp_size, device
    logger.info("tensor-parallel rank %d/%d up (%s)", rank, args.tp_size, backend)


def destroy_tensor_parallel() -> None:
    """Leave the group (best effort: peers may already be gone)."""
    if _tp.size == 1:
        return
    import torch.distributed as dist

    try:
        dist.destroy_process_group()
    except Exception:
        logger.debug("destroy_process_group failed", exc_info=True)
    _tp.rank, _tp.size = 0, 1


def exit_rank(code: int) -> None:
    """End a rank's process now, after its group is left: skip the interpreter's finalization,
    in which C++ objects of torch.distributed still alive at exit can abort the process
    ("terminate called without an active exception", exit -6) after its work is done."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _collective(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:  # DistBackendError and gloo's connection errors are RuntimeErrors
        raise RankFailure(f"tensor-parallel collective failed on rank {_tp.rank}: {e}") from None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; identity at tp_size 1."""
    if _tp.size > 1:
        import torch.distributed as dist

        _collective(dist.all_reduce, x)
    return x


def all_reduce_min(value: int) -> int:
    """The smallest of each rank's `value` (ranks agree on sizes such as the KV pool's)."""
    if _tp.size == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=_tp.device)
    _collective(dist.all_reduce, t, op=dist.ReduceOp.MIN)
    return int(t.item())


def gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's `x` along the last dim on rank 0 (None on the others)."""
    if _tp.size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_tp.size)] if _tp.rank == 0 else None
    _collective(dist.gather, x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None


# --- layers -------------------------------------------------------------------------------------
def balanced_split(units: int, what: str) -> tuple[int, int]:
    """(first, count) of this rank's contiguous share of `units`; shares differ by at most one."""
    size, rank = _tp.size, _tp.rank
    if units < size:
        raise ValueError(f"{what} ({units}) cannot be split over tp_size {size} ranks")
    first = rank * units // size
    return first, (rank + 1) * units // size - first


def head_split(num_heads: int, kv_heads: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """This rank's (first, count) of query heads and of KV heads. Ranks take whole GQA groups
    (a KV head with its query heads), as evenly as they divide; with fewer KV heads than ranks,
    each KV head is replicated on `tp_size / kv_heads` ranks that split its group's query heads."""
    size, rank = _tp.size, _tp.rank
    group = num_heads // kv_heads
    if kv_heads >= size:
        kv_first, kv_count = balanced_split(kv_heads, "num_key_value_heads")
        return (kv_first * group, kv_count * group), (kv_first, kv_count)
    per_kv = size // kv_heads
    if size % kv_heads or group < per_kv:
        raise ValueError(
            f"tp_size {size} does not fit {num_heads} attention heads with {kv_heads} KV heads "
            f"(it must divide the KV heads, or be a multiple of them of at most {num_heads})"
        )
    kv, j = rank // per_kv, rank % per_kv
    first, end = j * group // per_kv, (j + 1) * group // per_kv
    return (kv * group + first, end - first), (kv, 1)


class ColumnParallelLinear(nn.Module):
    """`x @ W.T (+ b)` with W's output features split across ranks; the output stays split.

    A fused projection lists its pieces in `output_sizes` (q, k, v or gate, up): each piece is split
    on its own, so every rank holds its rows of each piece, concatenated in the same order.
    `shards[i]` = (first row, rows) of piece i on this rank (default: a balanced split). The local
    math is the plain `nn.Linear` in `self.linear` (so CPU prepacking can replace it).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        shards: list[tuple[int, int]] | None = None,
        name: str = "output features",
    ):
        super().__init__()
        shards = shards or [balanced_split(size, name) for size in output_sizes]
        self.pieces = []  # (first global row, local rows, local offset) per piece
        offset = 0
        for first, rows in shards:
            self.pieces.append((first, rows, offset))
            offset += rows
        self.output_sizes = [rows for _, rows in shards]  # local sizes, for splitting the output
        self.linear = nn.Linear(input_size, offset, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def load_weight(self, param: str, loaded: torch.Tensor | QuantizedWeight, piece: int = 0) -> None:
        """Copy this rank's rows of piece `piece` of a full checkpoint tensor (`weight` or `bias`);
        a quantized weight's rows are kept as codes (`keep_quantized`)."""
        start, rows, offset = self.pieces[piece]
        if isinstance(loaded, QuantizedWeight):
            keep_quantized(self.linear, loaded.narrow(0, start, rows), (offset, rows))
            return
        getattr(self.linear, param).data[offset : offset + rows].copy_(loaded.narrow(0, start, rows))

    def weight_keys(self) -> list[str]:
        """`param#piece` for everything `load_weight` must fill exactly once."""
        params = ["weight"] + (["bias"] if self.linear.bias is not None else [])
        return [f"{p}#{i}" for p in params for i in range(len(self.pieces))]


class RowParallelLinear(nn.Module):
    """`x @ W.T` with W's input features split across ranks (`x` arrives split, as a column-parallel
    layer leaves it); the partial products are summed over the ranks with one all-reduce.
    `shard` = (first column, columns) on this rank (default: a balanced split)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        shard: tuple[int, int] | None = None,
        name: str = "input features",
    ):
        super().__init__()
        self.start, self.cols = shard or balanced_split(input_size, name)
        self.linear = nn.Linear(self.cols, output_size, bias=False)
        # A bias is added once, after the sum.
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if _tp.size > 1:
            all_reduce(y)
        return y if self.bias is None else y + self.bias

    def load_weight(self, param: str, loaded: torch.Tensor, piece: int = 0) -> None:
        """Copy this rank's columns of the full weight (or the whole bias)."""
        if param == "bias":
            self.bias.data.copy_(as_float(loaded))
            return
        loaded = loaded.narrow(1, self.start, self.cols)
        if isinstance(loaded, QuantizedWeight):  # (columns that split a group came back as float)
            keep_quantized(self.linear, loaded)
        else:
            self.linear.weight.data.copy_(loaded)

    def weight_keys(self) -> list[str]:
        return ["weight#0"] + (["bias#0"] if self.bias is not None else [])


def unwrap_single_rank(model: nn.Module) -> int:
    """At tp_size 1, replace each (loaded) parallel linear by its plain `nn.Linear`: the model then
    runs exactly the modules it would without tensor parallelism. Returns how many were replaced."""
    if _tp.size != 1:
        return 0
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, ColumnParallelLinear) or (isinstance(mod, RowParallelLinear) and mod.bias is None)
    ]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, mod.linear)
    return len(targets)


def _load_vocab_rows(mod: nn.Module, loaded: torch.Tensor | QuantizedWeight) -> None:
    """The embedding's (or untied head's) rows of this rank, as float; a quantized checkpoint's codes
    of them are kept too (`ParallelLMHead.take_checkpoint_codes`: a tied head follows the embedding's)."""
    rows = loaded.narrow(0, mod.start, mod.rows)
    mod._checkpoint_quantized = isinstance(loaded, QuantizedWeight)
    mod._checkpoint_codes = rows if isinstance(rows, QuantizedWeight) and mod.rows == mod.per_rank else None
    mod.weight.data[: mod.rows].copy_(as_float(rows))


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks in equal (padded) ranges; a rank
    embeds the ids in its range, zeros the rest, and the all-reduce completes every row."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // _tp.size)
        self.start = _tp.rank * self.per_rank
        self.rows = max(0, min(self.per_rank, vocab_size - self.start))  # real (unpadded) rows here
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if _tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(x.masked_fill_(outside[:, None], 0))

    def load_weight(self, param: str, loaded: torch.Tensor | QuantizedWeight, piece: int = 0) -> None:
        _load_vocab_rows(self, loaded)

    def weight_keys(self) -> list[str]:
        return ["weight#0"]


class ParallelLMHead(nn.Module):
    """Logits over the vocabulary split like `VocabParallelEmbedding` (whose weight it shares when
    the embeddings are tied); the slices are gathered on rank 0, the only rank that samples."""

    def __init__(self, vocab_size: int, hidden_size: int, tied: VocabParallelEmbedding | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self._tied = (tied,) if tied is not None else None  # a tuple: not a second submodule
        if tied is None:
            ref = VocabParallelEmbedding(vocab_size, hidden_size)  # same split, same loader
            self.start, self.rows, self.per_rank = ref.start, ref.rows, ref.per_rank
            self.weight = ref.weight
        self.packed = None

    def local_weight(self) -> torch.Tensor:
        return self._tied[0].weight if self._tied else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits `[N, vocab]` on rank 0; None on the other ranks."""
        if self.packed is None:
            logits = F.linear(x, self.local_weight())
        else:  # bfloat16 logits widened as they are written, where the layer can
            logits = self.packed(x, widen=True) if getattr(self.packed, "widens", False) else self.packed(x)
        if _tp.size == 1:
            return logits.float()
        full = gather_last_dim(logits)
        return None if full is None else full[:, : self.vocab_size].float()

    def decode_kernel(self, rows: int, dtype: torch.dtype) -> tuple | None:
        """The head as `cpu_kernels.decode_step` runs it for `rows` rows of `dtype`, with the float32
        logits `forward` returns: (kind, a, b, out_features) of its packed projection where that
        runs small_gemm widening its output (kind 0) or an int8 kernel (2, 3, 4: float32 out); None
        elsewhere (tensor parallel, an unpacked head, another kernel)."""
        packed = self.packed
        if (
            _tp.size != 1
            or packed is None
            or not getattr(packed, "widens", False)
            or not hasattr(packed, "decode_kernel")
        ):
            return None
        spec = packed.decode_kernel(rows, dtype)
        from ..layers.prepack import PackedLinear  # kind 0 widens in PackedLinear's forward only

        if spec is None or spec[0] not in (0, 2, 3, 4) or (spec[0] == 0) != isinstance(packed, PackedLinear):
            return None
        return spec

    def prepack(self) -> None:
        """Hold the (local) weight in oneDNN's layout; CPU only."""
        from ..layers.prepack import PackedLinear

        if self.packed is not None:  # already quantized (`--quantization gguf`'s int8 head)
            return
        self.packed = PackedLinear(self.local_weight(), None)
        if not self._tied:
            del self.weight  # the packed copy replaces it

    @property
    def checkpoint_quantized(self) -> bool:
        """Whether the checkpoint stores this head's weight (or the tied embedding) quantized."""
        return getattr(self._tied[0] if self._tied else self, "_checkpoint_quantized", False)

    def take_checkpoint_codes(self) -> QuantizedWeight | None:
        """The checkpoint's quantized codes of this head's rows (once; None where it had none, or its
        rows are padded on this rank)."""
        owner = self._tied[0] if self._tied else self
        codes = getattr(owner, "_checkpoint_codes", None)
        owner._checkpoint_codes = None
        return codes

    def load_weight(self, param: str, loaded: torch.Tensor | QuantizedWeight, piece: int = 0) -> None:
        _load_vocab_rows(self, loaded)

    def weight_keys(self) -> list[str]:
        return [] if self._tied else ["weight#0"]


# --- lockstep -----------------------------------------------------------------------------------
FORWARD, KEEPALIVE, STOP = 0, 1, 2
_ALIGN = 16  # every tensor starts at a multiple of this in the payload, so it can be viewed in place


def _step_types() -> dict[str, type]:
    """The only classes a step payload may rebuild (no pickle: nothing else can be instantiated)."""
    from ..model_executor.forward_batch import AttnGroup, ForwardBatch

    return {"ForwardBatch": ForwardBatch, "AttnGroup": AttnGroup}


class _Packer:
    """A batch as msgpack-able metadata, its tensors left out of band (recorded with their offsets
    in one flat payload)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.nbytes = 0

    def pack(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            flat = obj.detach().reshape(-1).contiguous()
            self.tensors.append(flat)
            ref = {"tensor": [self.nbytes, str(obj.dtype).removeprefix("torch."), list(obj.shape)]}
            self.nbytes += -(-flat.numel() * flat.element_size() // _ALIGN) * _ALIGN
            return ref
        if dataclasses.is_dataclass(obj) and type(obj).__name__ in _step_types():
            return {
                "dataclass": type(obj).__name__,
                "fields": {f.name: self.pack(getattr(obj, f.name)) for f in dataclasses.fields(obj)},
            }
        if isinstance(obj, (list, tuple)):
            return [self.pack(x) for x in obj]
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise TypeError(f"a step payload cannot carry {type(obj).__name__}")


def _unpack(meta: Any, data: torch.Tensor) -> Any:
    """Inverse of `_Packer.pack`: tensors become views into `data`."""
    if isinstance(meta, list):
        return [_unpack(x, data) for x in meta]
    if not isinstance(meta, dict):
        return meta
    if "tensor" in meta:
        offset, dtype_name, shape = meta["tensor"]
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise RankFailure(f"a step payload names an unknown dtype {dtype_name!r}")
        n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        return data[offset : offset + n].view(dtype).view(shape)
    cls = _step_types().get(meta.get("dataclass"))
    if cls is None:
        raise RankFailure(f"a step payload names an unknown type {meta.get('dataclass')!r}")
    return cls(**{k: _unpack(v, data) for k, v in meta["fields"].items()})


class StepChannel:
    """Rank 0 sends each step's batch (a ForwardBatch, as msgpack metadata; its tensors travel as one flat
    buffer on the device) to every other rank, which run the same forward. Two broadcasts per
    step: a fixed header (command, sizes), then the payload."""

    def __init__(self):
        self.header = torch.zeros(3, dtype=torch.int64, device=_tp.device)

    def send(self, obj: Any) -> None:
        """Rank 0: send `obj` (a ForwardBatch) to the other ranks."""
        import torch.distributed as dist

        packer = _Packer()
        meta = msgspec.msgpack.encode(packer.pack(obj))
        meta_len = -(-len(meta) // _ALIGN) * _ALIGN
        payload = torch.empty(meta_len + packer.nbytes, dtype=torch.uint8, device=_tp.device)
        payload[: len(meta)].copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        offset = meta_len
        for t in packer.tensors:
            raw = t.view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
            payload[offset : offset + raw.numel()].copy_(raw)
            offset += -(-raw.numel() // _ALIGN) * _ALIGN
        self._header(FORWARD, len(meta), payload.numel())
        _collective(dist.broadcast, payload, src=0)

    def keepalive(self) -> None:
        """Rank 0, while idle: lets the others know it is alive (and find out whether they are)."""
        self._header(KEEPALIVE, 0, 0)

    def stop(self) -> None:
        """Rank 0: tell the others to exit."""
        self._header(STOP, 0, 0)

    def recv(self) -> tuple[int, Any]:
        """Ranks > 0: block for the next (command, batch); the batch is None unless FORWARD."""
        import torch.distributed as dist

        _collective(dist.broadcast, self.header, src=0)
        cmd, meta_len, total = self.header.tolist()
        if cmd != FORWARD:
            return cmd, None
        payload = torch.empty(total, dtype=torch.uint8, device=_tp.device)
        _collective(dist.broadcast, payload, src=0)
        meta = payload[:meta_len].cpu().numpy().tobytes()
        tensors_at = -(-meta_len // _ALIGN) * _ALIGN
        return cmd, _unpack(msgspec.msgpack.decode(meta), payload[tensors_at:])

    def _header(self, cmd: int, meta_len: int, total: int) -> None:
        import torch.distributed as dist

        self.header.copy_(torch.tensor([cmd, meta_len, total], dtype=torch.int64))
        _collective(dist.broadcast, self.header, src=0)
