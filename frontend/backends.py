"""Backends: where a program's gen/select calls go.

- `RuntimeEndpoint(url)`: a plait (or SGLang-compatible) server over the native HTTP protocol.
- `EngineBackend(engine)`: an in-process `plait.Engine`.
- `OpenAIBackend(base_url, model)`: an OpenAI-compatible endpoint (chat completions for gen inside
  an assistant role, completions elsewhere); no logprob-based select, no regex.

The native backends share one wire format (`shared/protocol.md`); select is built on prefill-only
calls (`max_new_tokens: 0`) that return input-token logprobs.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from typing import Any, Iterator

from .chat_template import ChatTemplate, from_tokenizer, get_chat_template, guess_by_name


class BackendError(RuntimeError):
    """A backend call failed (HTTP error, bad request, engine failure)."""


class BaseBackend:
    is_chat_model = False
    supports_logprobs = True

    def __init__(self, chat_template: str | ChatTemplate | None = None):
        self._template_choice = chat_template
        self._template: ChatTemplate | None = None
        self._template_lock = threading.Lock()

    # --- chat template ---------------------------------------------------------------------------
    def get_chat_template(self) -> ChatTemplate:
        with self._template_lock:
            if self._template is None:
                choice = self._template_choice
                if isinstance(choice, ChatTemplate):
                    self._template = choice
                elif isinstance(choice, str):
                    self._template = get_chat_template(choice)
                else:
                    self._template = self._derive_template()
            return self._template

    def _derive_template(self) -> ChatTemplate:
        return get_chat_template("default")

    # --- calls ------------------------------------------------------------------------------------
    def generate(self, text: str, sampling_params: dict, logprob: dict | None = None) -> tuple[str, dict]:
        raise NotImplementedError

    def generate_stream(
        self, text: str, sampling_params: dict, logprob: dict | None = None
    ) -> Iterator[tuple[str, dict]]:
        """Yields (cumulative text, meta_info)."""
        yield self.generate(text, sampling_params, logprob)

    def generate_n(self, text: str, sampling_params: dict, logprob: dict | None = None) -> list[tuple[str, dict]]:
        """`sampling_params["n"]` samples of one continuation, as (text, meta_info) pairs. This
        default makes one call per sample (seeds, if given, differ by one between samples)."""
        return [self.generate(text, _one_of_n(sampling_params, i), logprob) for i in range(_n(sampling_params))]

    def chat(self, messages: list[dict], sampling_params: dict) -> tuple[str, dict]:
        raise NotImplementedError(f"{type(self).__name__} is not a chat backend")

    def chat_n(self, messages: list[dict], sampling_params: dict) -> list[tuple[str, dict]]:
        """`chat` for `sampling_params["n"]` samples; by default one call per sample."""
        return [self.chat(messages, _one_of_n(sampling_params, i)) for i in range(_n(sampling_params))]

    def score_choices(self, prefix: str, choices: list[str], unconditional: bool = False) -> dict:
        raise NotImplementedError(
            f"{type(self).__name__} cannot score choices by logprobs; "
            "select needs a native backend (RuntimeEndpoint or EngineBackend)"
        )

    def cache_prefix(self, text: str) -> None:
        pass

    def flush_cache(self) -> None:
        pass

    def get_model_name(self) -> str:
        return "unknown"

    def shutdown(self) -> None:
        pass


def _n(sampling_params: dict) -> int:
    return int(sampling_params.get("n") or 1)


def _one_of_n(sampling_params: dict, i: int) -> dict:
    """The settings of sample i of n made one call at a time."""
    sp = {**sampling_params, "n": 1}
    if sp.get("seed") is not None:
        sp["seed"] += i
    return sp


def _check(out: Any) -> Any:
    """An aborted request (an invalid grammar, a shut-down engine, ...) is an error to the program."""
    for o in out if isinstance(out, list) else [out]:
        reason = (o.get("meta_info") or {}).get("finish_reason") or {}
        if reason.get("type") == "abort":
            raise BackendError(f"the request was aborted: {reason.get('message', 'no reason given')}")
    return out


class _NativeBackend(BaseBackend):
    """Shared logic of backends that speak the native protocol (`_post` is the one call)."""

    def _post(self, payload: dict) -> Any:
        raise NotImplementedError

    def _post_stream(self, payload: dict) -> Iterator[dict]:
        raise NotImplementedError

    @staticmethod
    def _payload(text, sampling_params, logprob=None, stream=False) -> dict:
        payload: dict[str, Any] = {"text": text, "sampling_params": sampling_params, "stream": stream}
        for k, v in (logprob or {}).items():
            if v is not None:
                payload[k] = v
        return payload

    def generate(self, text, sampling_params, logprob=None):
        out = _check(self._post(self._payload(text, sampling_params, logprob)))
        return out["text"], out["meta_info"]

    def generate_stream(self, text, sampling_params, logprob=None):
        for out in self._post_stream(self._payload(text, sampling_params, logprob, stream=True)):
            _check(out)
            yield out["text"], out["meta_info"]

    def generate_n(self, text, sampling_params, logprob=None):
        """One request with n: the samples share the prompt's KV cache."""
        outs = _check(self._post(self._payload(text, sampling_params, logprob)))
        outs = outs if isinstance(outs, list) else [outs]
        return [(o["text"], o["meta_info"]) for o in outs]

    def cache_prefix(self, text: str) -> None:
        if text:
            self._post(self._payload(text, {"max_new_tokens": 0}))

    def score_choices(self, prefix: str, choices: list[str], unconditional: bool = False) -> dict:
        """Per choice, the logprobs of its own tokens after `prefix`: one prefill of the prefix (it
        counts the prefix tokens and warms the cache), then one batch of prefill-only calls that
        return input logprobs from two tokens before the prefix ends; the prefix's own ids there
        show where each choice's tokens begin, even when a token straddles the boundary."""
        n = 0
        if prefix:
            n = self._post(self._payload(prefix, {"max_new_tokens": 0}))["meta_info"]["prompt_tokens"]
        start = max(n - 2, 0)
        texts = ([prefix] if prefix else []) + [prefix + c for c in choices]
        outs = _check(
            self._post(
                {
                    "text": texts,
                    "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": True,
                    "logprob_start_len": start,
                    "return_text_in_logprobs": True,
                }
            )
        )
        prefix_ids = [t[1] for t in outs[0]["meta_info"]["input_token_logprobs"]] if prefix else []
        result: dict[str, Any] = {"input_token_logprobs": [], "prompt_tokens": n}
        for out in outs[1:] if prefix else outs:
            triples = out["meta_info"]["input_token_logprobs"]
            k = 0
            while k < len(prefix_ids) and k < len(triples) and triples[k][1] == prefix_ids[k]:
                k += 1
            result["input_token_logprobs"].append(triples[k:] if prefix else triples)
        if unconditional:
            outs = self._post(
                {
                    "text": list(choices),
                    "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": True,
                    "logprob_start_len": 0,
                    "return_text_in_logprobs": True,
                }
            )
            result["unconditional_token_logprobs"] = [o["meta_info"]["input_token_logprobs"] for o in outs]
        return result


class EngineBackend(_NativeBackend):
    """An in-process `plait.Engine` (the caller owns it and shuts it down)."""

    def __init__(self, engine, chat_template: str | ChatTemplate | None = None, chat_template_name: str | None = None):
        super().__init__(chat_template or chat_template_name)
        self.engine = engine

    def _derive_template(self) -> ChatTemplate:
        return from_tokenizer(self.engine.tokenizer, "model") or guess_by_name(str(self.engine.model_path))

    def _kwargs(self, payload: dict) -> dict:
        return dict(
            prompt=payload["text"],
            sampling_params=payload["sampling_params"],
            return_logprob=payload.get("return_logprob", False),
            logprob_start_len=payload.get("logprob_start_len", -1),
            top_logprobs_num=payload.get("top_logprobs_num", 0),
            return_text_in_logprobs=payload.get("return_text_in_logprobs", False),
        )

    def _post(self, payload):
        try:
            return self.engine.generate(**self._kwargs(payload))
        except (ValueError, RuntimeError) as e:
            raise BackendError(str(e)) from e

    def _post_stream(self, payload):
        try:
            yield from self.engine.generate(**self._kwargs(payload), stream=True)
        except (ValueError, RuntimeError) as e:
            raise BackendError(str(e)) from e

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def get_model_name(self) -> str:
        return str(self.engine.args.model)

    def get_server_info(self) -> dict:
        return self.engine.get_server_info()


def _error_message(resp) -> str:
    try:
        body = resp.json()
        err = body.get("error", body)
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except Exception:
        return resp.text


class _HTTP:
    def __init__(self, base_url: str, api_key: str | None, timeout: float | None, verify: Any = True):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            base_url=base_url.rstrip("/"), headers=headers, verify=verify, timeout=httpx.Timeout(timeout, connect=30.0)
        )

    def request(self, method: str, path: str, body: Any = None) -> Any:
        resp = self.client.request(method, path, json=body)
        if resp.status_code != 200:
            raise BackendError(f"{method} {path}: HTTP {resp.status_code}: {_error_message(resp)}")
        return resp.json() if resp.content else None

    def stream(self, path: str, body: Any) -> Iterator[dict]:
        with self.client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                raise BackendError(f"POST {path}: HTTP {resp.status_code}: {_error_message(resp)}")
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise BackendError(f"POST {path}: {obj['error'].get('message', obj['error'])}")
                yield obj


class RuntimeEndpoint(_NativeBackend):
    """A plait (or SGLang-compatible) server at `base_url`, over the native protocol. `verify`:
    TLS certificate checking, as in requests/httpx (None: on; False: off; a CA bundle path)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        verify: Any = None,
        chat_template_name: str | None = None,
        *,
        chat_template: str | ChatTemplate | None = None,
        timeout: float | None = 600.0,
    ):
        super().__init__(chat_template or chat_template_name)
        self.base_url = base_url.rstrip("/")
        self.verify = verify
        self._http = _HTTP(self.base_url, api_key, timeout, verify=True if verify is None else verify)
        self.model_info = self._http.request("GET", "/get_model_info")

    def _derive_template(self) -> ChatTemplate:
        path = self.model_info.get("tokenizer_path") or self.model_info.get("model_path") or ""
        if path and os.path.isdir(path):  # the server's tokenizer is on this machine: use its template
            try:
                from transformers import AutoTokenizer

                tmpl = from_tokenizer(AutoTokenizer.from_pretrained(path), "model")
                if tmpl is not None:
                    return tmpl
            except Exception:
                pass
        return guess_by_name(path)

    def _post(self, payload):
        return self._http.request("POST", "/generate", payload)

    def _post_stream(self, payload):
        return self._http.stream("/generate", payload)

    def flush_cache(self) -> None:
        self._http.request("POST", "/flush_cache")

    def get_model_name(self) -> str:
        return self.model_info["model_path"]

    def get_server_info(self) -> dict:
        return self._http.request("GET", "/get_server_info")

    def shutdown(self) -> None:
        self._http.client.close()


class OpenAIBackend(BaseBackend):
    """An OpenAI-compatible endpoint (`base_url` ends in /v1). gen inside an assistant role is a
    chat completion over the conversation so far; gen elsewhere is a text completion. Structured
    output by json_schema (response_format) works; regex, ebnf, logprobs and select do not."""

    is_chat_model = True
    supports_logprobs = False

    def __init__(
        self,
        base_url: str = "https://api.openai.com/v1",
        model: str = "gpt-4o-mini",
        api_key: str | None = None,
        chat_template: str | ChatTemplate | None = None,
        timeout: float | None = 600.0,
    ):
        super().__init__(chat_template or "default")
        self.model = model
        self._http = _HTTP(base_url, api_key or os.environ.get("OPENAI_API_KEY"), timeout)

    def _body(self, sp: dict) -> dict:
        for key in ("regex", "ebnf"):
            if sp.get(key) is not None:
                raise NotImplementedError(f"OpenAIBackend cannot honour {key}= (use a native backend)")
        body: dict[str, Any] = {"model": self.model}
        mapping = {
            "max_new_tokens": "max_tokens",
            "temperature": "temperature",
            "top_p": "top_p",
            "stop": "stop",
            "frequency_penalty": "frequency_penalty",
            "presence_penalty": "presence_penalty",
            "seed": "seed",
            "n": "n",
        }
        for k, v in mapping.items():
            if sp.get(k) is not None:
                body[v] = sp[k]
        if sp.get("json_schema") is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": json.loads(sp["json_schema"])},
            }
        return body

    def chat(self, messages, sampling_params):
        return self._chat(messages, {**sampling_params, "n": 1})[0]

    def chat_n(self, messages, sampling_params):
        """One chat completion with `n` choices."""
        return self._chat(messages, sampling_params)

    def generate(self, text, sampling_params, logprob=None):
        return self._complete(text, {**sampling_params, "n": 1}, logprob)[0]

    def generate_n(self, text, sampling_params, logprob=None):
        """One text completion with `n` choices."""
        return self._complete(text, sampling_params, logprob)

    def _chat(self, messages: list[dict], sampling_params: dict) -> list[tuple[str, dict]]:
        body = self._body(sampling_params)
        body["messages"] = messages
        out = self._http.request("POST", "/chat/completions", body)
        return [
            (c["message"].get("content") or "", {"finish_reason": c.get("finish_reason"), "usage": out.get("usage")})
            for c in _in_order(out["choices"])
        ]

    def _complete(self, text: str, sampling_params: dict, logprob: dict | None) -> list[tuple[str, dict]]:
        if logprob and logprob.get("return_logprob"):
            raise NotImplementedError("OpenAIBackend does not return logprobs to programs")
        body = self._body(sampling_params)
        if "response_format" in body:
            raise NotImplementedError("OpenAIBackend supports json_schema only inside an assistant role (chat)")
        body["prompt"] = text
        out = self._http.request("POST", "/completions", body)
        return [
            (c["text"], {"finish_reason": c.get("finish_reason"), "usage": out.get("usage")})
            for c in _in_order(out["choices"])
        ]

    def get_model_name(self) -> str:
        return self.model

    def shutdown(self) -> None:
        self._http.client.close()


def _in_order(choices: list[dict]) -> list[dict]:
    """An OpenAI response's choices by their index (a server may list them as they finish)."""
    return sorted(choices, key=lambda c: c.get("index", 0))


_wrapped: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def as_backend(obj: Any) -> BaseBackend:
    """A backend, or a `plait.Engine` (wrapped in an EngineBackend, once per engine)."""
    if isinstance(obj, BaseBackend):
        return obj
    if hasattr(obj, "generate") and hasattr(obj, "tokenizer") and hasattr(obj, "flush_cache"):
        try:
            return _wrapped.setdefault(obj, EngineBackend(obj)) if obj not in _wrapped else _wrapped[obj]
        except TypeError:
            return EngineBackend(obj)
    raise TypeError(f"not a backend: {obj!r} (use RuntimeEndpoint(url), EngineBackend(engine) or an Engine)")
