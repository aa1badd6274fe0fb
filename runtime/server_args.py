"""Engine and server arguments, shared by `plait.Engine(...)` and `plait serve`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class ServerArgs:
    model: str = "smollm2"
    dtype: str = "auto"                      # auto | float32 | bfloat16
    device: str = "cpu"                      # cpu | cuda | cuda:N
    context_length: int | None = None        # default: the model's max_position_embeddings
    max_total_tokens: int | None = None      # KV pool size in tokens; default from kv_memory_fraction
    kv_memory_fraction: float = 0.15         # of available RAM (CPU) or free GPU memory, when max_total_tokens is unset
    max_running_requests: int = 128
    chunked_prefill_size: int = 1024         # token budget for prefill per step
    schedule_policy: str = "lpm"             # lpm (longest prefix match first) | fcfs
    disable_radix_cache: bool = False
    disable_weight_prepack: bool = False     # CPU: keep plain F.linear instead of oneDNN-prepacked weights
    num_threads: int | None = None           # torch intra-op threads; default: all cores
    random_seed: int | None = None
    revision: str | None = None
    grammar_backend: str = "xgrammar"        # xgrammar | outlines | llguidance
    grammar_compile_timeout: float = 30.0    # seconds; a slower compile fails that request
    disable_jump_forward: bool = False       # jump-forward: append grammar-forced text without sampling
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError(f"schedule_policy must be 'lpm' or 'fcfs', got {self.schedule_policy!r}")
        for name in ("max_running_requests", "chunked_prefill_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.grammar_backend not in ("xgrammar", "outlines", "llguidance"):
            raise ValueError(f"grammar_backend must be xgrammar, outlines or llguidance, got {self.grammar_backend!r}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2, got {self.max_total_tokens}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ServerArgs":
        """Build from keyword arguments, naming any unknown one."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)
