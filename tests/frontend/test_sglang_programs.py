"""SGLang 0.5.5's own frontend test programs (`sglang.test.test_programs`) run unchanged under
`import plait as sgl`: the module's `sgl` is plait, and each program whose outcome does not depend
on the model's answers runs on the real default model, in process (plait.Engine) and behind
plait's HTTP server (plait.RuntimeEndpoint). `SKIPPED` says, for each of the others, why.

Cost bound: the programs' longest gens (a 512-token summary, 128-token defaults that a small
model under an int regex fills with digits) take minutes on 2 busy CPU cores, and no outcome
checked here depends on length, so the backends below cap each gen at `MAX_TOKENS` (64) tokens,
which shortens only the gens that ask for more. PLAIT_SGL_PROGRAMS_MAX_TOKENS=0 runs them all uncapped
(about 80 s on 2 idle cores). The programs themselves are not changed.

Also here, on the real model: gen(n=...) in one request, stop_regex stopping the generation early,
and SGLang's chat API speculation program on plait.OpenAIBackend (plait's /v1 server).
"""

from __future__ import annotations

import inspect
import os
import re
import warnings

import pytest

programs = pytest.importorskip(
    "sglang.test.test_programs", reason="sglang frontend not installed (pip install --no-deps sglang==0.5.5)"
)

import plait  # noqa: E402

pytestmark = pytest.mark.integration

MAX_TOKENS = int(os.environ.get("PLAIT_SGL_PROGRAMS_MAX_TOKENS", "64"))

# The programs run, with the arguments that make their outcome independent of the model's answers.
RUN: dict[str, dict] = {
    "test_mt_bench": {},
    "test_select": {"check_answer": False},
    "test_decode_json_regex": {},
    "test_decode_json": {},
    "test_expert_answer": {"check_answer": False},
    "test_parallel_decoding": {},
    "test_parallel_encoding": {"check_answer": False},
    "test_stream": {},
    "test_regex": {},
    "test_dtype_gen": {},
    "test_chat_completion_speculative": {},
}
SKIPPED: dict[str, str] = {
    "test_few_shot_qa": "asserts the model's answers (Washington, Tokyo, London, Beijing)",
    "test_decode_int": "asserts the model's numbers (24 hours, 365 days)",
    "test_tool_use": "evaluates the expression the model writes and asserts it computes 257 * 983",
    "test_react": "asserts the model's answer names Finland or the States (and needs it to choose Finish)",
    "test_image_qa": "image input: plait's models take text only (sgl.image raises NotImplementedError), "
    "and the program needs example_image.png",
    "test_completion_speculative": "compares prompt-token counts read from SGLang's OpenAI backend "
    "(token_usage), which depend on whether the model's text written ahead "
    "follows the format; plait's speculation is checked in test_dsl_sglang_api.py",
    "test_hellaswag_select": "downloads the HellaSwag data set and asserts accuracy and latency bounds",
    "test_gen_min_new_tokens": "imports sglang itself inside the program (`import sglang as sgl`), so it runs "
    "SGLang's interpreter, not plait's, and needs sglang.srt's tokenizer utilities",
}


def _program_names() -> set[str]:
    return {
        n
        for n, f in vars(programs).items()
        if n.startswith("test_") and inspect.isfunction(f) and f.__module__ == programs.__name__
    }


def test_every_program_is_run_or_skipped_with_a_reason():
    assert _program_names() == set(RUN) | set(SKIPPED) and not set(RUN) & set(SKIPPED)
    assert all(reason.strip() for reason in SKIPPED.values())


# --- backends -------------------------------------------------------------------------------------
class Capped:
    """A backend mixin: every gen at most `cap` tokens (0: as asked); counts the calls by kind."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cap = MAX_TOKENS
        self.calls: dict[str, int] = {}

    def _count(self, kind: str) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def _capped(self, sp: dict) -> dict:
        if not self.cap:
            return sp
        cap = min(sp.get("max_new_tokens") or self.cap, self.cap)
        return {**sp, "max_new_tokens": cap, "min_new_tokens": min(sp.get("min_new_tokens") or 0, cap)}

    def generate(self, text, sampling_params, logprob=None):
        self._count("generate")
        return super().generate(text, self._capped(sampling_params), logprob)

    def generate_stream(self, text, sampling_params, logprob=None):
        self._count("generate")
        return super().generate_stream(text, self._capped(sampling_params), logprob)

    def generate_n(self, text, sampling_params, logprob=None):
        self._count("generate")
        return super().generate_n(text, self._capped(sampling_params), logprob)

    def chat_n(self, messages, sampling_params):
        self._count("chat")
        return super().chat_n(messages, self._capped(sampling_params))

    def chat(self, messages, sampling_params):
        self._count("chat")
        return super().chat(messages, self._capped(sampling_params))


class CappedEngine(Capped, plait.EngineBackend):
    pass


class CappedEndpoint(Capped, plait.RuntimeEndpoint):
    pass


class CappedOpenAI(Capped, plait.OpenAIBackend):
    pass


@pytest.fixture(params=["engine", "server"])
def backend(request, engine):
    """The same engine in process and behind plait's HTTP server."""
    if request.param == "engine":
        return CappedEngine(engine)
    return CappedEndpoint(request.getfixturevalue("url"))


@pytest.fixture
def as_sgl(monkeypatch, backend):
    """`import plait as sgl` for the programs' module, with `backend` as the default backend."""
    monkeypatch.setattr(programs, "sgl", plait)
    old = plait.get_default_backend()
    plait.set_default_backend(backend)
    yield backend
    plait.set_default_backend(old)


# --- SGLang's programs ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(RUN) + sorted(SKIPPED))
def test_sglang_program(name, as_sgl):
    if name in SKIPPED:
        pytest.skip(SKIPPED[name])
    getattr(programs, name)(**RUN[name])
    assert as_sgl.calls.get("generate", 0) > 0 or name == "test_select"  # it ran on this backend


# --- the pieces the programs use, on the real model -----------------------------------------------
@plait.function
def count_and_colors(s):
    s += "Count: 1, 2, 3,"
    s += plait.gen("more", max_tokens=24, stop_regex=r"\d\d", temperature=0)
    s += "\nA color:" + plait.gen("colors", n=3, max_tokens=4, temperature=1.0, ignore_eos=True)


def test_stop_regex_and_n_on_the_model(backend):
    backend.cap = 0  # the lengths are what this test checks
    state = count_and_colors.run(backend=backend)
    more = state["more"]
    # generation stopped where the text first matched: the match is its end, well before 24 tokens
    assert re.search(r"\d\d", more).end() == len(more), more
    assert state.get_meta_info("more")["finish_reason"] == {"type": "stop", "matched": r"\d\d"}
    assert state.get_meta_info("more")["completion_tokens"] < 24
    colors, metas = state["colors"], state.get_meta_info("colors")
    assert isinstance(colors, list) and len(colors) == 3 and len(metas) == 3
    assert all(m["completion_tokens"] == 4 for m in metas)
    assert state.text() == "Count: 1, 2, 3," + more + "\nA color:" + colors[0]
    assert backend.calls == {"generate": 2}  # the 3 samples were one request


def test_chat_speculation_program_on_openai_backend(url, monkeypatch):
    backend = CappedOpenAI(url + "/v1", model="smollm2", api_key="unused")
    monkeypatch.setattr(programs, "sgl", plait)
    old = plait.get_default_backend()
    plait.set_default_backend(backend)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a reply that does not fit the template warns
            programs.test_chat_completion_speculative()
    finally:
        plait.set_default_backend(old)
    # the assistant role's three gens: one chat call (asked again if the reply does not fit)
    assert set(backend.calls) == {"chat"} and 1 <= backend.calls["chat"] <= 3
