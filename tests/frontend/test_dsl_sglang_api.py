"""plait's DSL against SGLang 0.5.5's frontend API: every public name and parameter of
`sglang/lang/api.py`, of `SglFunction` and of the state / group classes of
`sglang/lang/interpreter.py` exists in plait with the same parameters and defaults, compared with
the installed sglang wheel so that drift is caught; the names plait does not do raise
NotImplementedError naming them. Then the pieces SGLang programs need, on scripted backends (no
model, so the outcomes are exact): state assignment after run, var_scope with unnamed typed gens,
fork item assignment, gen(n), stop_regex, separate_reasoning, run_batch's forms and API
speculation (`num_api_spec_tokens`) on completion and chat backends. The same pieces on the real
model run in test_sglang_programs.py.
"""

from __future__ import annotations

import inspect
import json
import threading
from typing import Any

import pytest

sgl_api = pytest.importorskip(
    "sglang.lang.api", reason="sglang frontend not installed (pip install --no-deps sglang==0.5.5)"
)

import sglang  # noqa: E402
import sglang.lang.backend.runtime_endpoint as sgl_endpoint  # noqa: E402
import sglang.lang.choices as sgl_choices  # noqa: E402
import sglang.lang.interpreter as sgl_interp  # noqa: E402
import sglang.lang.ir as sgl_ir  # noqa: E402

import plait  # noqa: E402
from plait.frontend import BaseBackend, ProgramError, ProgramState, ProgramStateGroup  # noqa: E402
from plait.frontend.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR  # noqa: E402

P = inspect.Parameter
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)

# sglang's top-level names that are not its frontend API, and why plait has no such name.
NOT_FRONTEND = {
    "ServerArgs": "SGLang's server runtime settings; plait.Engine / `plait serve` take plait's own",
    "Anthropic": "another vendor's backend class; not in plait",
    "LiteLLM": "another vendor's backend class; not in plait",
    "VertexAI": "another vendor's backend class; not in plait",
    "OpenAI": "SGLang's OpenAI client backend; plait's is plait.OpenAIBackend(base_url, model)",
}
# api.py functions that only forward *args/**kwargs to another engine's own settings: the name
# must exist, the parameters are that engine's.
FORWARDERS = {"Engine": "sgl.Engine(**server_args) starts SGLang's engine; plait.Engine(model, **server_args) plait's"}
# Methods of SGLang's classes plait leaves out on purpose.
LEFT_OUT_METHODS = {
    "__del__": "plait ends a state when its program returns (a finalizer could end one another thread reads)",
    "_role_common": "private",
}


# --- signatures -----------------------------------------------------------------------------------
def _default(value: Any) -> Any:
    """An SGLang default as plait spells it (its choices methods are objects, plait's names)."""
    if isinstance(value, sgl_choices.ChoicesSamplingMethod):
        name = next(n for n, o in vars(sgl_choices).items() if o is value)
        return getattr(plait, name)
    return value


def signature_problems(sgl_fn: Any, plait_fn: Any) -> list[str]:
    """How plait's callable differs from SGLang's: a parameter missing, in another position, not
    accepted as keyword/positional as SGLang's, with another default; an extra required one."""
    sg, pl = inspect.signature(sgl_fn), inspect.signature(plait_fn)
    problems = []
    sg_pos = [p.name for p in sg.parameters.values() if p.kind in POSITIONAL]
    pl_pos = [p.name for p in pl.parameters.values() if p.kind in POSITIONAL]
    if pl_pos[: len(sg_pos)] != sg_pos:
        problems.append(f"positional parameters {pl_pos} do not begin with SGLang's {sg_pos}")
    kinds = {p.kind for p in pl.parameters.values()}
    for p in sg.parameters.values():
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            if p.kind not in kinds:
                problems.append(f"no {'*args' if p.kind is P.VAR_POSITIONAL else '**kwargs'}")
            continue
        q = pl.parameters.get(p.name)
        if q is None:
            problems.append(f"no parameter {p.name!r}")
            continue
        if p.kind is P.KEYWORD_ONLY and q.kind not in (P.KEYWORD_ONLY, P.POSITIONAL_OR_KEYWORD):
            problems.append(f"{p.name!r} cannot be given by keyword")
        if _default(p.default) != q.default:
            problems.append(f"{p.name!r} defaults to {q.default!r}, SGLang's to {p.default!r}")
    for q in pl.parameters.values():
        if q.name not in sg.parameters and q.default is P.empty and q.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            problems.append(f"extra required parameter {q.name!r}")
    return problems


def _api_functions() -> list[str]:
    return [
        n
        for n, o in vars(sgl_api).items()
        if inspect.isfunction(o) and o.__module__ == sgl_api.__name__ and not n.startswith("_")
    ]


def _methods(cls: type) -> list[str]:
    return [n for n, o in vars(cls).items() if callable(o) and n not in LEFT_OUT_METHODS]


def test_the_comparison_catches_differences():
    def sg(name=None, max_tokens=None, *, temperature=0.0, **kw): ...
    def same(name=None, max_tokens=None, *, temperature=0.0, seed=None, **kw): ...
    def reordered(max_tokens=None, name=None, *, temperature=0.0, **kw): ...
    def other_default(name=None, max_tokens=None, *, temperature=1.0, **kw): ...
    def missing(name=None, max_tokens=None, **kw): ...
    def strict(name=None, max_tokens=None, *, temperature=0.0): ...
    def required(name=None, max_tokens=None, *, temperature=0.0, backend, **kw): ...

    assert signature_problems(sg, same) == []
    for bad in (reordered, other_default, missing, strict, required):
        assert signature_problems(sg, bad), bad.__name__
    assert (
        signature_problems(
            lambda choices_method=sgl_choices.token_length_normalized: 0,
            lambda choices_method=plait.token_length_normalized: 0,
        )
        == []
    )


@pytest.mark.parametrize("name", _api_functions())
def test_api_function_signature(name):
    assert hasattr(plait, name), f"plait has no {name}"
    if name in FORWARDERS:
        return
    assert signature_problems(getattr(sgl_api, name), getattr(plait, name)) == []


@pytest.mark.parametrize(
    "sgl_cls,plait_cls",
    [
        (sgl_interp.ProgramState, ProgramState),
        (sgl_interp.ProgramStateGroup, ProgramStateGroup),
        (sgl_ir.SglFunction, plait.Function),
    ],
    ids=["ProgramState", "ProgramStateGroup", "SglFunction"],
)
def test_class_method_signatures(sgl_cls, plait_cls):
    problems = {}
    for name in _methods(sgl_cls):
        if not hasattr(plait_cls, name):
            problems[name] = ["missing"]
        elif found := signature_problems(getattr(sgl_cls, name), getattr(plait_cls, name)):
            problems[name] = found
    assert problems == {}


def test_runtime_endpoint_and_top_level_names():
    assert signature_problems(sgl_endpoint.RuntimeEndpoint.__init__, plait.RuntimeEndpoint.__init__) == []
    for name in sglang.__all__:
        assert name in NOT_FRONTEND or hasattr(plait, name), f"plait has no {name}"
    assert plait.greedy_token_selection == "greedy_token"
    assert plait.unconditional_likelihood_normalized == "unconditional_likelihood_normalized"


def test_dtype_regexes_are_sglangs():
    assert (REGEX_INT, REGEX_FLOAT, REGEX_BOOL, REGEX_STR) == (
        sgl_ir.REGEX_INT,
        sgl_ir.REGEX_FLOAT,
        sgl_ir.REGEX_BOOL,
        sgl_ir.REGEX_STR,
    )


def test_what_plait_does_not_do_says_so():
    with pytest.raises(NotImplementedError, match="sgl.image"):
        plait.image("cat.png")
    with pytest.raises(NotImplementedError, match="sgl.video"):
        plait.video("cat.mp4", 4)
    with pytest.raises(NotImplementedError, match="sgl.Runtime"):
        plait.Runtime(model_path="smollm2")

    @plait.function
    def prog(s):
        s += "x"

    with pytest.raises(NotImplementedError, match="trace"):
        prog.trace()
    with pytest.raises(NotImplementedError, match="compile"):
        prog.compile()
    with pytest.raises(NotImplementedError, match="gpt-oss"):
        plait.separate_reasoning(plait.gen("a"), model_type="gpt-oss")

    @plait.function
    def forks(s):
        s.fork(2, position_ids_offset=[0, 3])

    with pytest.raises(NotImplementedError, match="position_ids_offset"):
        forks.run(backend=Scripted())

    @plait.function(num_api_spec_tokens=16)
    def spec(s):
        s += plait.gen("a", stop="\n")

    with pytest.raises(NotImplementedError, match="stream"):
        spec.run(backend=Scripted(), stream=True)


# --- scripted backends ----------------------------------------------------------------------------
class Scripted(BaseBackend):
    """Answers each gen with the next of `replies` (cycling; default "x"), streamed one character
    at a time; records each call's prompt and settings and how many characters a stream gave."""

    def __init__(self, replies: list[str] | None = None, chat: bool = False):
        super().__init__("default")
        self.replies, self.is_chat_model = list(replies or ["x"]), chat
        self.calls: list[tuple[Any, dict]] = []
        self.streamed = 0
        self._lock = threading.Lock()

    def _next(self, prompt: Any, sp: dict) -> str:
        with self._lock:
            self.calls.append((prompt, dict(sp)))
            return self.replies[(len(self.calls) - 1) % len(self.replies)]

    def generate(self, text, sampling_params, logprob=None):
        return self._next(text, sampling_params), {"finish_reason": {"type": "length"}}

    def generate_stream(self, text, sampling_params, logprob=None):
        reply = self._next(text, sampling_params)
        for i in range(1, len(reply) + 1):
            self.streamed += 1
            yield reply[:i], {"finish_reason": None}

    def chat(self, messages, sampling_params):
        return self._next(messages, sampling_params), {"finish_reason": "stop"}


# --- the pieces SGLang programs need --------------------------------------------------------------
def test_state_assignment_after_run_and_in_order_during_it():
    @plait.function
    def prog(s):
        s += "A: " + plait.gen("v", dtype=int)
        s["before"] = "set"
        s += plait.gen("w")

    state = prog.run(backend=Scripted(["42", "x"]))
    state["v"] = int(state["v"])  # SGLang's test_dtype_gen does this after run()
    assert state["v"] == 42 and state["before"] == "set"
    state["new"] = [1]
    assert state["new"] == [1] and "new" in state


def test_var_scope_with_unnamed_typed_gens_is_constrained():
    backend = Scripted(['"Paris"', "2148000", "105", '"France"', '"CET"', "48.85", '{"a": 1}'])

    @plait.function
    def city(s):
        s += "Describe Paris.\n"
        with s.var_scope("json_output"):
            s += "{\n"
            s += '  "name": ' + plait.gen_string() + ",\n"
            s += '  "population": ' + plait.gen_int() + ",\n"
            s += '  "area": ' + plait.gen(dtype=int, stop=",") + ",\n"
            s += '  "country": ' + plait.gen(dtype="str") + ",\n"
            s += '  "timezone": ' + plait.gen(dtype=str) + ",\n"
            s += '  "latitude": ' + plait.gen(regex=REGEX_FLOAT) + ",\n"
            s += '  "extra": ' + plait.gen(json_schema={"type": "object"}) + "\n"
            s += "}"
        s += " done"

    state = city.run(backend=backend)
    obj = json.loads(state["json_output"])
    assert obj["name"] == "Paris" and obj["population"] == 2148000 and obj["extra"] == {"a": 1}
    assert state.text().endswith("}" + " done") and state["json_output"].startswith("{\n")
    settings = [sp for _, sp in backend.calls]
    assert [sp.get("regex") for sp in settings[:6]] == [
        REGEX_STR,
        REGEX_INT,
        REGEX_INT,
        REGEX_STR,
        REGEX_STR,
        REGEX_FLOAT,
    ]
    assert settings[6]["json_schema"] == '{"type": "object"}'
    # int (and float) also stop at a blank, on top of the gen's own stops (SGLang)
    assert settings[1]["stop"] == [" ", "\n"] and settings[2]["stop"] == [",", " ", "\n"]
    assert "stop" not in settings[0] or not settings[0]["stop"]


def test_fork_item_assignment_and_copy():
    @plait.function
    def tips(s):
        s += "Tips:\n"
        forks = s.fork(3)
        for i in range(3):
            forks[i] += f"Tip {i + 1}:"
            forks[i] += plait.gen("tip", stop="\n")
        forks.join()
        with s.copy() as c:
            c += plait.gen("copied")
        s += "Best: " + forks[1]["tip"]

    state = tips.run(backend=Scripted(["a", "b", "c", "d"]))
    assert sorted(state["tip"]) == ["a", "b", "c"] and state["copied"] == ["d"]
    assert state.text() == "Tips:\nBest: " + state["tip"][1]

    @plait.function
    def replace(s):
        forks = s.fork(2)
        forks[0] = forks[1]

    with pytest.raises(TypeError, match="cannot be replaced"):
        replace.run(backend=Scripted())


def test_gen_n_makes_a_list_and_the_text_goes_on_with_the_first():
    backend = Scripted(["one", "two", "three"])

    @plait.function
    def prog(s):
        s += "Q:" + plait.gen("a", n=3, seed=7) + "|"

    state = prog.run(backend=backend)
    assert state["a"] == ["one", "two", "three"] and state.text() == "Q:one|"
    assert len(state.get_meta_info("a")) == 3
    assert [sp["seed"] for _, sp in backend.calls] == [7, 8, 9]  # distinct samples one call at a time
    state = one_gen.run(backend=Scripted(["p", "q"]), n=2)  # run(n=...): every gen's default
    assert state["b"] == ["p", "q"] and state.text() == "p"


@plait.function
def one_gen(s):
    s += plait.gen("b")


def test_stop_regex_cuts_where_the_text_first_matches_and_stops_reading():
    backend = Scripted(["count 1 2 3 10 11 12 13 14 15"])

    @plait.function
    def prog(s):
        s += "N:" + plait.gen("a", stop_regex=[r"\d\d", "zzz"]) + "|"

    for stream in (False, True):
        backend.streamed = 0
        state = prog.run(backend=backend, stream=stream)
        if stream:
            assert "".join(state.text_iter("a")) == "count 1 2 3 10"
        assert state["a"] == "count 1 2 3 10" and state.text() == "N:count 1 2 3 10|"
        assert state.get_meta_info("a")["finish_reason"] == {"type": "stop", "matched": r"\d\d"}
        assert backend.streamed == len("count 1 2 3 10")  # the rest was never read
        assert backend.calls[-1][1]["stop_regex"] == [r"\d\d", "zzz"]  # and the server is told too
    # run(stop_regex=...) is every gen's default; an end-anchored pattern matches a prefix
    assert one_gen.run(backend=Scripted(["ab1cd"]), stop_regex=r"[0-9]$")["b"] == "ab1"


def test_separate_reasoning_splits_variable_and_text():
    @plait.function
    def ask(s):
        s += plait.user("Capital of France?")
        s += plait.assistant(plait.separate_reasoning(plait.gen("answer"), model_type="deepseek-r1"))
        s += plait.user("Sure?")

    state = ask.run(backend=Scripted(["<think>It is Paris.</think>\n\nParis"]))
    assert state["answer"] == "Paris" and state["answer_reasoning_content"] == "It is Paris."
    assert state.messages()[1] == {"role": "assistant", "content": "Paris"}
    assert "think" not in state.text() and "ASSISTANT:Paris\nUSER:Sure?" in state.text()

    # qwen3 does not always think: no marker, all answer
    @plait.function
    def qwen(s):
        s += plait.separate_reasoning(plait.gen("a"), "qwen3")

    st = qwen.run(backend=Scripted(["Paris"]))
    assert (st["a"], st["a_reasoning_content"]) == ("Paris", "")
    with pytest.raises(ValueError, match="name"):
        plait.separate_reasoning(plait.gen(), model_type="qwen3")
    with pytest.raises(ValueError, match="model_type"):
        plait.separate_reasoning(plait.gen("a"))


def test_run_batch_tuples_generator_style_and_global_config():
    @plait.function
    def prog(s, a, b="B"):
        s += a + b

    backend = Scripted()
    states = prog.run_batch([("x",), ("y", "z")], backend=backend)
    assert [st.text() for st in states] == ["xB", "yz"]
    gen = prog.run_batch([{"a": str(i)} for i in range(5)], backend=backend, generator_style=True)
    assert inspect.isgenerator(gen) and [st.text() for st in gen] == [f"{i}B" for i in range(5)]
    assert prog.run_batch([], backend=backend) == []
    with pytest.raises(TypeError, match="mismatch"):
        prog.run_batch([("x", "y", "z")], backend=backend)
    old = plait.get_default_backend()
    try:
        plait.global_config.default_backend = backend
        assert plait.get_default_backend() is backend and prog.run(a="q").text() == "qB"
        plait.set_default_backend(None)
        assert plait.global_config.default_backend is None and plait.flush_cache() is False
    finally:
        plait.frontend.api._default_backend = old


# --- API speculation --------------------------------------------------------------------------------
CHARACTER = "Name: Ann\nBirthday: May 1\nJob: cook"


def character(spec: int | None):
    @plait.function(num_api_spec_tokens=spec)
    def prog(s):
        s += "Make a character.\n"
        s += "Name:" + plait.gen("name", stop="\n") + "\nBirthday:" + plait.gen("birthday", stop="\n")
        s += "\nJob:" + plait.gen("job", stop="\n") + "\n"

    return prog


def test_completion_speculation_one_call_for_three_gens():
    backend = Scripted([CHARACTER[len("Name:") :] + "\nMore text"])
    state = character(64).run(backend=backend, max_new_tokens=8)
    assert (state["name"], state["birthday"], state["job"]) == (" Ann", " May 1", " cook")
    assert state.text() == "Make a character.\n" + CHARACTER + "\n"
    assert len(backend.calls) == 1
    prompt, sp = backend.calls[0]
    assert prompt == "Make a character.\nName:" and sp["max_new_tokens"] == 64 and sp.get("stop") is None
    # without speculation: one call per gen; with a wrong guess: the text written ahead is dropped
    backend = Scripted([" Ann", " May 1", " cook"])
    assert character(None).run(backend=backend).text() == state.text() and len(backend.calls) == 3
    backend = Scripted([" Ann\nJob: x", " May 1\nJob: cook"])
    state = character(64).run(backend=backend)
    assert (state["name"], state["birthday"], state["job"]) == (" Ann", " May 1", " cook")
    assert len(backend.calls) == 2


def chat_character(spec: int):
    @plait.function(num_api_spec_tokens=spec)
    def prog(s):
        s += plait.system("You are helpful.")
        s += plait.user("Make a character.")
        s += plait.assistant(
            "Name:"
            + plait.gen("name", stop="\n")
            + "\nBirthday:"
            + plait.gen("birthday", stop="\n")
            + "\nJob:"
            + plait.gen("job", stop="\n")
        )
        s += plait.user("Thanks.")

    return prog


def test_chat_speculation_one_reply_matched_back():
    backend = Scripted(["Name: Ann\nBirthday: May 1\nJob: cook"], chat=True)
    state = chat_character(128).run(backend=backend, temperature=0)
    assert (state["name"], state["birthday"], state["job"]) == (" Ann", " May 1", " cook")
    assert len(backend.calls) == 1
    messages, sp = backend.calls[0]
    assert [m["role"] for m in messages] == ["system", "user"] and sp["max_new_tokens"] == 128
    assert state.messages()[2] == {"role": "assistant", "content": "Name: Ann\nBirthday: May 1\nJob: cook"}
    assert state.messages()[3]["role"] == "user"
    # a reply that does not fit is asked for again, up to 3 times, then the gens are empty
    backend = Scripted(["I am a model.", "Name: Bo\nBirthday: June 2\nJob: smith"], chat=True)
    assert chat_character(128).run(backend=backend)["job"] == " smith" and len(backend.calls) == 2
    backend = Scripted(["I am a model."], chat=True)
    with pytest.warns(RuntimeWarning, match="did not fit"):
        state = chat_character(128).run(backend=backend)
    assert len(backend.calls) == 3 and state["name"] == ""


def test_chat_speculation_refuses_what_one_reply_cannot_honour():
    @plait.function(num_api_spec_tokens=64)
    def typed(s):
        s += plait.assistant("Age:" + plait.gen("age", dtype=int))

    with pytest.raises(ProgramError, match="num_api_spec_tokens") as failed:
        typed.run(backend=Scripted(chat=True))
    assert isinstance(failed.value.__cause__, NotImplementedError)

    @plait.function(num_api_spec_tokens=64)
    def mixed(s):
        s += plait.assistant(plait.gen("a", stop="\n", temperature=0) + plait.gen("b", temperature=1))

    with pytest.raises(ProgramError, match="share their sampling settings"):
        mixed.run(backend=Scripted(chat=True))
