"""A grammar that binds only after a reasoning model's thinking section (`<think>` ... `</think>`).

A reasoning model asked for JSON (or a regex, a tool call, ...) must first be free to think: the
constraint starts once the output has written the section's end marker. `ReasoningGate` wraps the
request's matcher: while the section is open every token but EOS is allowed (the answer must still
come), and the marker's tokens are watched for; the inner matcher is made when the marker is written,
with the tokens left of the request's budget (so a JSON guard closes its document in time). Where
the section is optional (Qwen3 writes `<think>` itself, or answers straight away) the first token is
either the marker's first token, which opens the section, or a token the grammar allows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .base import Matcher
from .bitmask import set_token_bits

if TYPE_CHECKING:
    import torch


class ReasoningGate(Matcher):
    """Free text until `end_ids` is written, then the matcher `make_inner(tokens_left)` made."""

    def __init__(
        self,
        make_inner: Callable[[int], Matcher],
        end_ids: Sequence[int],
        eos_ids: Sequence[int],
        budget: int,
        start_id: int | None = None,
    ) -> None:
        """`end_ids`: the end marker's tokens; `budget`: the request's max_new_tokens; `start_id`:
        the first token of the start marker where the section is optional (None: it is open)."""
        if not end_ids:
            raise ValueError("the reasoning end marker has no tokens")
        self._make_inner = make_inner
        self._end = tuple(end_ids)
        self._eos = tuple(eos_ids)
        self._budget = budget
        self._start = start_id
        self._free: list[int] = []  # tokens of the thinking section, the end marker included
        self._inner: Matcher | None = None
        self._undecided: Matcher | None = None  # optional section, nothing written yet: the answer's matcher
        if start_id is not None:
            self._undecided = make_inner(budget)

    @property
    def _open(self) -> bool:  # the section is being written
        return self._inner is None and self._undecided is None

    def accept(self, token_id: int) -> bool:
        if self._undecided is not None:  # the first token: the section's start or the answer's
            if token_id == self._start:
                self._undecided = None
                self._free.append(token_id)
                return True
            if not self._undecided.accept(token_id):
                return False
            self._inner, self._undecided = self._undecided, None
            return True
        if self._inner is not None:
            return self._inner.accept(token_id)
        if token_id in self._eos:
            return False
        self._free.append(token_id)
        if tuple(self._free[-len(self._end) :]) == self._end:
            self._inner = self._make_inner(max(self._budget - len(self._free), 0))
        return True

    def fill_mask(self, bitmask: "torch.Tensor", row: int) -> None:
        if self._undecided is not None:
            self._undecided.fill_mask(bitmask, row)
            set_token_bits(bitmask, row, (self._start,))
        elif self._inner is not None:
            self._inner.fill_mask(bitmask, row)
        else:
            bitmask[row].fill_(-1)
            set_token_bits(bitmask, row, self._eos, False)

    def defer_mask(self, row: int, jobs) -> bool:
        inner = self._undecided if self._undecided is not None else self._inner
        return inner is not None and inner.defer_mask(row, jobs)

    def finish_mask(self, bitmask: "torch.Tensor", row: int) -> None:
        if self._undecided is not None:
            self._undecided.finish_mask(bitmask, row)
            set_token_bits(bitmask, row, (self._start,))
        else:
            self._inner.finish_mask(bitmask, row)

    def is_finished(self) -> bool:
        return self._inner is not None and self._inner.is_finished()

    def can_end(self) -> bool:
        if self._undecided is not None:
            return self._undecided.can_end()
        return self._inner is not None and self._inner.can_end()

    def rollback(self, n: int) -> None:
        if n > self.num_accepted:
            raise ValueError(f"cannot roll back {n} tokens, {self.num_accepted} accepted")
        if self._inner is not None and self._free:  # the answer's tokens first, then the section's
            k = min(n, self._inner.num_accepted)
            self._inner.rollback(k)
            n -= k
            if n:
                self._inner = None
        elif self._inner is not None:  # an optional section not taken: the answer is all there is
            self._inner.rollback(n)
            if not self._inner.num_accepted:
                self._undecided, self._inner = self._inner, None
            return
        if n:
            del self._free[len(self._free) - n :]
            if not self._free and self._start is not None:
                self._undecided = self._make_inner(self._budget)

    def forced_text(self) -> str:
        return self._inner.forced_text() if self._inner is not None else ""

    @property
    def num_accepted(self) -> int:
        inner = self._inner or self._undecided
        return len(self._free) + (inner.num_accepted if inner is not None else 0)
