"""Engine and server arguments, shared by `plait.Engine(...)` and `plait serve`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")  # dtype's (auto: the model's)
# kv_cache_dtype's: the model's dtypes and, as SGLang names them, 8-bit floats (no scales: SmolLM2's
# K/V stay below 25 in magnitude, e4m3 holds up to 448); vLLM's "fp8" is fp8_e4m3
FP8_KV_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_CACHE_DTYPE_CHOICES = DTYPE_CHOICES + tuple(FP8_KV_DTYPES)
SCHEDULE_POLICIES = ("lpm", "fcfs")
GRAMMAR_BACKENDS = ("auto", "xgrammar", "llguidance", "outlines")
# gguf: each layer as the GGUF file stores it (see layers/quantization.py, model_executor/gguf_weights.py)
QUANTIZATIONS = ("int8", "int4", "fp8", "gguf")
SPECULATIVE_ALGORITHMS = ("ngram", "draft")
REASONING_PARSERS = ("qwen3", "deepseek-r1")  # <think> ... </think> (runtime/server/reasoning.py)
# --tool-call-parser's (runtime/server/tool_parsers.py; SGLang's and vLLM's names)
TOOL_CALL_PARSERS = ("auto", "hermes", "qwen25", "qwen", "llama3", "llama3_json", "mistral", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
PYTHON_ONLY = ("cuda_graph_eager",)  # fields with no `plait serve` flag (tests and debugging)


def kv_cache_torch_dtype(name: str, model_dtype):
    """The torch dtype of a KV cache named `name` (one of KV_CACHE_DTYPE_CHOICES) under a model of
    `model_dtype`."""
    import torch

    if name == "auto":
        return model_dtype
    return getattr(torch, FP8_KV_DTYPES.get(name, name))


def option(default, help: str, choices: tuple | None = None):
    """A ServerArgs field with the help and choices of its `plait serve` flag (plait/cli.py builds
    the flags from these, so an option is defined once)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class ServerArgs:
    """Every engine option: `plait.Engine(**kwargs)` takes them as keyword arguments and
    `plait serve` as flags (`max_total_tokens` is `--max-total-tokens`)."""

    model: str = option("smollm2", "'smollm2' (default, bundled), a .gguf file, a HF folder or a hub id")
    dtype: str = option(
        "auto", "the weights' and activations' dtype (auto: the model's, float32 for a GGUF on the CPU)", DTYPE_CHOICES
    )
    kv_cache_dtype: str = option(
        "auto",
        "the KV cache's dtype (auto: the model's); bfloat16 under a float32 model halves the cache's "
        "memory and what each decode step reads of it, fp8_e4m3 / fp8_e5m2 (8-bit floats, no scales; "
        "fp8 = fp8_e4m3) halve a bfloat16 model's",
        KV_CACHE_DTYPE_CHOICES,
    )
    device: str = option("cpu", "cpu | cuda | cuda:N")
    reasoning_parser: str | None = option(
        None,
        "chat answers' <think> ... </think> section goes to reasoning_content (streamed as its own "
        "deltas): qwen3 (a section when the output opens one), deepseek-r1 (the prompt opened it). Per request: "
        "separate_reasoning false keeps it in the content",
        REASONING_PARSERS,
    )
    tool_call_parser: str = option(
        "auto",
        "how the model writes tool calls, for chat tools with tool_choice auto (each call it opens is "
        "held to the tools' schemas, then read into tool_calls): hermes / qwen25 (<tool_call> blocks), "
        "llama3 / llama3_json (a bare {name, parameters} JSON), mistral ([TOOL_CALLS][...]), json (plain "
        "JSON or <tool_call> blocks read back, no grammar); auto: the chat template's (hermes where it "
        "does not render tools: plait's tools block asks for hermes calls)",
        TOOL_CALL_PARSERS,
    )
    chat_template: str | None = option(
        None, "a chat template replacing the model's: the path of a Jinja file, or the template itself"
    )
    context_length: int | None = option(
        None, "longest prompt + output in tokens (default: the model's max_position_embeddings)"
    )
    max_total_tokens: int | None = option(None, "KV pool size in tokens (default: from --kv-memory-fraction)")
    kv_memory_fraction: float = option(
        0.15, "KV pool size as a fraction of available RAM (CPU) or free GPU memory, when --max-total-tokens is unset"
    )
    max_running_requests: int = option(128, "requests decoded together at most (the rest wait)")
    chunked_prefill_size: int = option(1024, "prefill tokens per step; longer prompts are prefilled in chunks")
    schedule_policy: str = option("lpm", "lpm: longest cached prefix first; fcfs: arrival order", SCHEDULE_POLICIES)
    disable_radix_cache: bool = option(False, "no prefix sharing between requests (the naive cache)")
    disable_weight_prepack: bool = option(
        False,
        "CPU: plain F.linear on one copy of the weights, instead of oneDNN's prepacked copy plus the "
        "plain one for decode's GEMV (about twice the weights' memory)",
    )
    enable_torch_compile: bool = option(False, "torch.compile the model step (attention stays eager)")
    disable_cuda_graph: bool = option(False, "CUDA: decode eagerly instead of replaying captured CUDA graphs")
    cuda_graph_max_bs: int | None = option(
        None, "largest decode batch replayed from a CUDA graph (default min(max running requests, 64))"
    )
    # tests / debugging: the graph runner's padded static decode without capture (also on the CPU)
    cuda_graph_eager: bool = False
    quantization: str | None = option(
        None,
        "int8: per-channel int8 weights; int4: 4-bit weights in groups of 32 (GGUF Q4_1's scheme; a GGUF's "
        "Q4_0 / Q4_1 / Q4_K tensors are read as their codes; LM head int8); gguf: a GGUF's own types "
        "(4-bit ones int4, 5- to 8-bit ones int8 with group scales, both from the file's codes; "
        "2- and 3-bit ones int8; float ones float); "
        "fp8: CUDA sm90+ only (else int8)",
        QUANTIZATIONS,
    )
    num_threads: int | None = option(None, "torch intra-op threads (default: all cores)")
    omp_spincount: int = option(
        20000,
        "OpenMP busy-wait of the model's threads after each parallel region, in spin-loop iterations "
        "(GOMP_SPINCOUNT; well under a millisecond): saves a thread wake-up on every matmul of a step. 0: "
        "sleep at once, for cores shared with other compute-heavy processes. GOMP_SPINCOUNT in the "
        "environment wins",
    )
    random_seed: int | None = option(None, "seed of the sampler's generator (requests' own seeds win)")
    revision: str | None = option(None, "the hub revision (branch, tag or commit) of a hub --model")
    grammar_backend: str = option(
        "auto",
        "constrained decoding backend (auto: llguidance for JSON schemas, xgrammar for the rest, each "
        "falling back to the other)",
        GRAMMAR_BACKENDS,
    )
    grammar_compile_timeout: float = option(30.0, "seconds per grammar compile; a slower one fails its request")
    disable_jump_forward: bool = option(False, "sample grammar-forced text token by token instead of appending it")
    json_max_number_digits: int = option(
        19,
        "JSON output: at most this many digits in a number's integer part (its fraction at most 17, its "
        "exponent 3); 0: no bound. Per request: json_max_number_digits",
    )
    json_max_string_length: int = option(
        512,
        "JSON output: a string ends after this many characters unless the schema allows longer; 0: no "
        "bound. Per request: json_max_string_length",
    )
    json_resample: int = option(
        2,
        "a JSON-schema document that breaks its schema (a keyword the grammar only approximates) is sampled "
        "again up to this many times before the request fails (non-streamed requests at temperature > 0)",
    )
    speculative_algorithm: str | None = option(
        None,
        "ngram: prompt-lookup speculative decoding (drafts copied from prompt + output); draft: a smaller "
        "draft model with the same tokenizer proposes (--speculative-draft-model)",
        SPECULATIVE_ALGORITHMS,
    )
    speculative_draft_model: str | None = option(
        None, "the draft model for --speculative-algorithm draft (any form --model accepts)"
    )
    speculative_draft_quantization: str | None = option(
        None, "quantize the draft model's weights (the methods of --quantization)"
    )
    speculative_draft_max_tokens: int = option(4096, "the draft model's KV pool in tokens")
    speculative_num_draft_tokens: int = option(8, "draft tokens proposed per step and request")
    speculative_ngram_min_match: int = option(1, "shortest suffix n-gram looked up")
    speculative_ngram_max_match: int = option(4, "longest suffix n-gram looked up (tried first)")
    speculative_max_batch: int = option(4, "speculate only while at most this many requests run")
    tp_size: int = option(1, "tensor parallelism: split the model over N ranks (one scheduler process each)")
    nnodes: int = option(1, "nodes the --tp-size ranks span (tp_size / nnodes per node)")
    node_rank: int = option(0, "this node's index; node 0 serves HTTP, the others only run their ranks")
    dist_init_addr: str | None = option(
        None,
        "HOST:PORT where node 0's rank 0 hosts the torch.distributed store (required with --nnodes > 1; "
        "default: a free loopback port)",
    )
    dist_timeout: float = option(300.0, "seconds a tensor-parallel collective may wait on a silent rank before failing")
    log_level: str = option("warning", "logging level of the server and its processes", LOG_LEVELS)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, got {self.kv_cache_dtype!r}"
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be 'lpm' or 'fcfs', got {self.schedule_policy!r}")
        for name in ("max_running_requests", "chunked_prefill_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"grammar_backend must be auto, xgrammar, outlines or llguidance, got {self.grammar_backend!r}"
            )
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} (or unset), "
                f"got {self.reasoning_parser!r}"
            )
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.speculative_algorithm not in (None, *SPECULATIVE_ALGORITHMS):
            raise ValueError(
                f"speculative_algorithm must be 'ngram' or 'draft' (or unset), got {self.speculative_algorithm!r}"
            )
        if self.speculative_algorithm == "draft" and not self.speculative_draft_model:
            raise ValueError(
                "speculative_algorithm 'draft' needs speculative_draft_model: a model name or folder "
                "that shares the target's tokenizer"
            )
        if self.speculative_draft_model and self.speculative_algorithm != "draft":
            raise ValueError("speculative_draft_model is only used with speculative_algorithm 'draft'")
        if self.speculative_algorithm == "draft" and self.tp_size > 1:
            raise ValueError("speculative_algorithm 'draft' is not supported with tp_size > 1")
        if self.speculative_draft_max_tokens < 2:
            raise ValueError(f"speculative_draft_max_tokens must be >= 2, got {self.speculative_draft_max_tokens}")
        for name in ("speculative_num_draft_tokens", "speculative_ngram_min_match", "speculative_max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.speculative_ngram_max_match < self.speculative_ngram_min_match:
            raise ValueError("speculative_ngram_max_match must be >= speculative_ngram_min_match")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset), got {self.quantization!r}"
            )
        for name in ("json_max_number_digits", "json_max_string_length", "json_resample"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no bound), got {getattr(self, name)}")
        if self.omp_spincount < 0:
            raise ValueError(f"omp_spincount must be >= 0, got {self.omp_spincount}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2, got {self.max_total_tokens}")
        if not 0 < self.kv_memory_fraction <= 0.9:  # the KV pool must leave room for the rest: no OOM kill
            raise ValueError(f"kv_memory_fraction must be in (0, 0.9], got {self.kv_memory_fraction}")

        for name in ("tp_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr (HOST:PORT of node 0) is required when nnodes > 1")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"dist_init_addr must be HOST:PORT, got {self.dist_init_addr!r}")
        if self.dist_timeout <= 0:
            raise ValueError(f"dist_timeout must be > 0, got {self.dist_timeout}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ServerArgs":
        """Build from keyword arguments, naming any unknown one."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


OPENMP_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # the variables set_openmp_defaults sets


def set_openmp_defaults(spincount: int = ServerArgs.omp_spincount) -> None:
    """The OpenMP settings of the model's processes, unless the environment has its own: idle
    threads sleep (OMP_WAIT_POLICY=PASSIVE: spinning threads of several processes sharing cores
    can slow a step 20x) after busy-waiting `spincount` spins (GOMP_SPINCOUNT), so the back-to-back
    matmuls of one step do not each pay a futex wake-up. libgomp reads them once, when torch loads:
    call this before, in a process that runs a model (the scheduler's, a benchmark's)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", str(spincount))
