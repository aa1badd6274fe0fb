"""plait.frontend — the DSL: programs over a state, run on a backend.

    @plait.function
    def qa(s, question):
        s += plait.user(question)
        s += plait.assistant(plait.gen("answer", max_tokens=32))

Its public names are SGLang 0.5.5's frontend API (`import plait as sgl` runs SGLang programs).
"""

from .api import (
    Function,
    GlobalConfig,
    Runtime,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    global_config,
    greedy_token,
    greedy_token_selection,
    image,
    select,
    separate_reasoning,
    set_default_backend,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
    video,
)
from .backends import BackendError, BaseBackend, EngineBackend, OpenAIBackend, RuntimeEndpoint
from .chat_template import ChatTemplate, get_chat_template
from .interpreter import ProgramError, ProgramState, ProgramStateGroup

__all__ = [
    "Function",
    "GlobalConfig",
    "Runtime",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "get_server_info",
    "global_config",
    "greedy_token",
    "greedy_token_selection",
    "image",
    "select",
    "separate_reasoning",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
    "BackendError",
    "BaseBackend",
    "EngineBackend",
    "OpenAIBackend",
    "RuntimeEndpoint",
    "ChatTemplate",
    "get_chat_template",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
]
