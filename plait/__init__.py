"""plait: a structured-generation program runtime.

`import plait as pl`; `pl.Engine(model="smollm2")` starts the engine (its model runs in a scheduler process).
"""

from __future__ import annotations

import os

# torch's OpenMP workers spin by default; with several processes on few cores that makes a
# step many times slower. This must be set before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
# The DSL (plait.frontend), re-exported lazily like Engine.
_FRONTEND = (
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "select",
    "system",
    "user",
    "assistant",
    "system_begin",
    "system_end",
    "user_begin",
    "user_end",
    "assistant_begin",
    "assistant_end",
    "set_default_backend",
    "get_default_backend",
    "flush_cache",
    "get_server_info",
    "RuntimeEndpoint",
    "EngineBackend",
    "OpenAIBackend",
    "BaseBackend",
    "BackendError",
    "ProgramState",
    "ProgramStateGroup",
    "ProgramError",
    "Function",
    "ChatTemplate",
    "get_chat_template",
    "token_length_normalized",
    "greedy_token",
    "greedy_token_selection",
    "unconditional_likelihood_normalized",
    "separate_reasoning",
    "image",
    "video",
    "Runtime",
    "global_config",
    "GlobalConfig",
)
__all__ = ["Engine", "__version__", *_FRONTEND]


def __getattr__(name: str):
    # Lazy, so `import plait` stays cheap and does not import torch until needed.
    if name == "Engine":
        from plait.runtime.engine import Engine

        return Engine
    if name in _FRONTEND:
        from plait import frontend

        return getattr(frontend, name)
    raise AttributeError(f"module 'plait' has no attribute {name!r}")
