"""plait: a structured-generation program runtime.

`import plait as pl`; `pl.Engine(model="smollm2")` starts the engine (its model runs in a scheduler process).
"""
from __future__ import annotations

import os

# torch's OpenMP workers spin by default; with several processes on few cores that makes a
# step many times slower. This must be set before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
__all__ = ["Engine", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import plait` stays cheap and does not import torch until needed.
    if name == "Engine":
        from plait.runtime.engine import Engine
        return Engine
    raise AttributeError(f"module 'plait' has no attribute {name!r}")
