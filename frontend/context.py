"""Which program body the current thread is running, for nested calls.

`inner(...)` called inside a running program returns a pending call (api.ProgramCall). Appended
to a state (`s += inner(...)`) it runs there, inline; otherwise it starts as its own program as
soon as the caller needs any value (reads a variable or text, forks, returns), so that, as in
SGLang, several such calls made one after another run concurrently.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

_local = threading.local()


class Frame:
    """One running program body: its state (or a tracer) and its calls not started yet."""

    def __init__(self, state: Any, tracing: bool = False):
        self.state, self.tracing = state, tracing
        self.pending: list[Any] = []


def _stack() -> list[Frame]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current() -> Frame | None:
    """The innermost program body running on this thread, or None."""
    stack = _stack()
    return stack[-1] if stack else None


def start_pending() -> None:
    """Start every pending call made by the bodies running on this thread."""
    for frame in _stack():
        while frame.pending and not frame.tracing:
            frame.pending[0].start()  # which takes it off the list


@contextlib.contextmanager
def running(state: Any, tracing: bool = False) -> Iterator[Frame]:
    """Mark the body of the program on `state` as running on this thread; when it returns, its
    pending calls start (their results are reachable through the call objects)."""
    frame = Frame(state, tracing)
    _stack().append(frame)
    try:
        yield frame
    finally:
        _stack().pop()
    if not tracing:  # not after an error: the program failed, its calls' results are moot
        while frame.pending:
            frame.pending[0].start()  # which takes it off the list
