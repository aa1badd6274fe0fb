"""Shared fixtures: the real default model (converted once and cached) and tiny random-weight
models of each supported architecture, saved to disk and loaded by the real loader, with the
real SmolLM2 tokenizer."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from plait.frontend import BaseBackend  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from plait.runtime.model_executor.model_loader import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    """The default model's real tokenizer, loaded once."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def quantizable_llama_config():
    """The tiny llama with rows of 256 values (hidden 256, intermediate 512): K-quants'
    super-blocks and GPTQ / AWQ groups of 128 fit."""
    config = _tiny_config("llama", 49152)
    config.hidden_size, config.intermediate_size, config.head_dim = 256, 512, 64
    config.initializer_range = 0.02
    return config


def _tiny_config(arch: str, vocab_size: int):
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0)
    if arch == "llama3-rope":
        return LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1000000.0)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0)
    if arch == "phi3":  # Phi-4-mini's shape: longrope, partial rotary; a short original context so
        # that prompts longer than 8 tokens run on the long factors
        rotary_pairs = 6  # head_dim 16 * 0.75 / 2
        return Phi3Config(
            **common,
            tie_word_embeddings=False,
            original_max_position_embeddings=8,
            partial_rotary_factor=0.75,
            rope_scaling={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(rotary_pairs)],
                "long_factor": [2.0 + 3.0 * i for i in range(rotary_pairs)],
            },
        )
    # Gemma: a sliding layer then a global one, a window of 8 (shorter than the test prompts), a
    # query_pre_attn_scalar apart from head_dim, and caps low enough that tanh bends the values
    gemma = dict(
        common,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
    )
    if arch == "gemma2":
        return Gemma2Config(**gemma, attn_logit_softcapping=5.0, final_logit_softcapping=10.0)
    if arch == "gemma3":
        rope = {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
        return Gemma3TextConfig(**gemma, rope_parameters=rope, final_logit_softcapping=10.0)
    if arch == "mistral-window":  # Mistral v0.1's sliding window, shorter than the test prompts
        from transformers import MistralConfig

        return MistralConfig(**common, sliding_window=8, tie_word_embeddings=False, rope_theta=10000.0)
    # MoE: 4 experts, 2 chosen per token, so tokens of one batch take different experts
    moe = dict(num_experts_per_tok=2, router_jitter_noise=0.0)
    if arch == "qwen3-moe":  # a dense first layer (mlp_only_layers), a sparse second
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common, **moe, head_dim=16, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True,
            mlp_only_layers=[0], tie_word_embeddings=False, rope_theta=1000000.0,
        )  # fmt: skip
    if arch == "qwen2-moe":  # a gated shared expert beside the routed ones, top-k not renormalized
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(
            **common, **moe, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            norm_topk_prob=False, tie_word_embeddings=False, rope_theta=1000000.0,
        )  # fmt: skip
    if arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(**common, **moe, num_local_experts=4, tie_word_embeddings=False, rope_theta=1e6)
    raise ValueError(arch)


MOE_ARCHS = ("qwen3-moe", "qwen2-moe", "mixtral")
TINY_ARCHS = ("llama", "llama3-rope", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mistral-window", *MOE_ARCHS)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, smollm2_path) -> dict[str, str]:
    """arch -> folder with a tiny random model (safetensors) and the SmolLM2 tokenizer."""
    from transformers import AutoModelForCausalLM

    out = {}
    for arch in TINY_ARCHS:
        folder = tmp_path_factory.mktemp(f"tiny-{arch}")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_tiny_config(arch, 49152))
        if getattr(model.config, "attention_bias", False) or arch in ("qwen2", "qwen2-moe"):
            with torch.no_grad():  # random, non-zero biases so that their mapping is tested
                for name, p in model.named_parameters():
                    if name.endswith("bias"):
                        p.normal_(0, 0.2)
        if arch.startswith("gemma"):
            with torch.no_grad():  # Gemma's norms start at 0 (they scale by 1 + weight): random ones
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.normal_(0, 0.2)
        model.save_pretrained(folder, safe_serialization=True)
        for name in TOKENIZER_FILES:
            src = os.path.join(smollm2_path, name)
            if os.path.exists(src):
                shutil.copy(src, folder / name)
        out[arch] = str(folder)
    return out


def one_track_model(folder: str, smollm2_path: str, favourites: dict[str, float], special: bool = False) -> str:
    """A tiny Qwen3 with the tokens `favourites` added, whose every next-token logit is the same
    but theirs (`favourites[token]` above the rest): its layers add nothing to the embeddings, which
    share one direction that only those tokens' output rows read. Greedy, it writes the first
    favourite its constraint allows, else what its random weights say. Saved to `folder`; with
    `special` the added tokens are special tokens (as Mistral's [TOOL_CALLS] is)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.add_tokens(list(favourites), special_tokens=special)
    cfg = _tiny_config("qwen3", len(tok))
    cfg.tie_word_embeddings = False  # the output rows are set apart from the embeddings
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        for token, logit in favourites.items():
            model.lm_head.weight[tok.convert_tokens_to_ids(token), 0] = logit
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def reassemble_tool_calls(deltas: list[dict]) -> dict[int, dict]:
    """Streamed chat deltas -> {index: {"name", "arguments"}}, as a client adds them up."""
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            call["name"] += c["function"].get("name", "")
            call["arguments"] += c["function"].get("arguments", "")
    return calls


def require_kernels(march: str | None = None) -> None:
    """Build the fused CPU kernels for `march` (default: the configured path); skip the test with
    the reason where they are not wanted or there is no compiler; fail where a build failed."""
    from plait.runtime.kernels.cpu import cpu_kernels

    march = march or cpu_kernels.default_march()
    if cpu_kernels.build(march) is None:
        err = cpu_kernels.build_error(march)
        if isinstance(err, cpu_kernels.Unavailable):
            pytest.skip(f"fused CPU kernels ({march}): {err}")
        pytest.fail(f"fused CPU kernels ({march}) did not build: {err}")


def assert_no_leak(engine) -> None:
    """Every KV slot is free or owned by the prefix cache once the engine is idle."""
    assert engine.kv_slots_in_use() == 0


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, base: str, timeout: float, what: str = "plait serve") -> None:
    """Wait until the server subprocess `proc` answers /health at `base` with 200; fail (with its
    output) if it exits first or `timeout` seconds pass."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"{what} did not become healthy"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)


@contextlib.contextmanager
def serve(app):
    """Run an ASGI app with uvicorn on a free loopback port in a thread; yield its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class SlowBackend(BaseBackend):
    """Answers every gen with "x" after `delay` seconds; counts calls running at once."""

    def __init__(self, delay: float = 0.3):
        super().__init__("default")
        self.delay, self.running, self.peak = delay, 0, 0
        self.lock = threading.Lock()

    def generate(self, text, sampling_params, logprob=None):
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(self.delay)
        with self.lock:
            self.running -= 1
        return "x", {"finish_reason": {"type": "length"}}


@pytest.fixture(scope="module")
def engine(smollm2_path):
    """The default model in an in-process Engine, shared by a test module."""
    import plait

    with plait.Engine(model="smollm2", dtype="float32", max_total_tokens=8192, random_seed=0) as eng:
        yield eng


@pytest.fixture(scope="module")
def url(engine):
    """`engine` behind the HTTP server on loopback (served as "smollm2"); its base URL."""
    from plait.runtime.server.http_server import create_app

    with serve(create_app(engine, served_model_name="smollm2")) as base:
        yield base


def skip_without_fused_op(dtype: str, quantization: str | None = None) -> None:
    """Skip where this path has no kernel for the decoder's projections in `dtype` / `quantization`
    (a scalar build, or AVX-512 without BF16 for bfloat16 / without VNNI for int8 and int4): there
    the model runs its layer loop, which the other tests cover."""
    from plait.runtime.kernels.cpu import cpu_kernels

    cpu_kernels.load()  # (a no op where a test chose its build already)
    if quantization in ("int4", "gguf"):  # (gguf: int4_gemv and int8g_gemv, on the same condition)
        has = cpu_kernels.int4_gemv_available()
    elif quantization == "int8":
        has = cpu_kernels.int8_gemv_available() or cpu_kernels.int8_rows_available()
    else:
        has = cpu_kernels.small_gemm_available(getattr(torch, dtype))
    if not has:
        pytest.skip(f"no fused decode op on this path for {dtype} {quantization or ''} projections")


def decode_logits(
    path: str,
    fused: bool,
    rows: int,
    prompt: int = 9,
    new: int = 9,
    head_in_op: bool = True,
    keep: dict | None = None,
    **args,
) -> tuple[list[torch.Tensor], int]:
    """Every step's logits of `rows` greedy requests (request i: a `prompt + 5 i`-token prompt,
    `new` tokens), with `decode_layers_` (`fused`) or the layer loop; and how many steps took the
    fused op. With 2 or more rows the first request ends early: the rest keep their mirror rows,
    which from 3 rows on leaves them in another order than the batch's (request 2 moves into the
    gap). `head_in_op=False`: the LM head runs in Python after `decode_layers_`, not in `decode_step`.
    `keep`: gets the scheduler ("sched")."""
    from plait.runtime.request import GenerateInput
    from plait.runtime.sampling_params import SamplingParams
    from plait.runtime.scheduler.scheduler import Scheduler
    from plait.runtime.server_args import ServerArgs

    s = Scheduler(ServerArgs(model=path, max_total_tokens=4096, max_running_requests=rows, **args))
    if keep is not None:
        keep["sched"] = s
    model, logits, fused_steps, whole_steps, head_kernel = s.runner.model, [], [0], [0], [0]
    if not fused:
        model._decode_plan = lambda *a: None
    if not head_in_op:
        model.lm_head.decode_kernel = lambda *a: None
    begin, forward = model._begin_fused_decode, model.forward

    def count(batch, *a):  # steps fused: their layers in one op, and from token ids to logits in one op
        out = begin(batch, *a)
        fused_steps[0] += out is not None
        whole_steps[0] += out is not None and out[2]
        # (the head has one of the op's kernels at these rows: not an int8 head's bfloat16 copy, 9+
        # rows where the CPU has bfloat16 dot products, whose logits are rounded to bfloat16 first)
        rows = batch.input_ids.shape[0]
        head_kernel[0] += (
            out is not None and model.lm_head.decode_kernel(rows, model.embed_tokens.weight.dtype) is not None
        )
        return out

    model._begin_fused_decode = count
    model.forward = lambda *a: logits.append(forward(*a)) or logits[-1]
    for i in range(rows):
        ids = [(37 * i + 11 * j) % 40000 + 100 for j in range(prompt + 5 * i)]
        s.add_request(
            GenerateInput(
                rid=str(i),
                input_ids=ids,
                seed=i,
                params=SamplingParams(max_new_tokens=4 if i == 0 and rows > 1 else new, temperature=0, ignore_eos=True),
            )
        )
    while s.has_work():
        s.step()
    assert whole_steps[0] == (head_kernel[0] if head_in_op else 0), "the LM head ran elsewhere than asked"
    return logits, fused_steps[0]
