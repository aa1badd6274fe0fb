"""N-gram (prompt-lookup) speculative decoding: the draft side.

A request's next tokens are guessed by finding the most recent earlier occurrence of its last
n tokens (n from `max_match` down to `min_match`) in prompt + output and proposing the tokens
that followed it. Nothing is sampled here: the scheduler appends the drafts to the request,
computes them all in the next forward pass and keeps the longest prefix that equals what the
sampler draws at each position (see `accepted_prefix`). How many drafts a request proposes
adapts to how many it had kept (`DraftLength`), for n-gram and draft-model drafts alike.

Why that acceptance rule is exact: the sampler's draw at a position is a pure function of
(seed, step, distribution). A point-mass draft t is kept iff that draw equals t, which happens
with probability p(t); when it does not, the draw is distributed as p with t removed and
renormalised — the speculative-sampling rule for a deterministic draft. And since the draw is
the very one decoding without speculation makes, a seeded request produces the same tokens with
and without speculation (greedy is the special case argmax). Nothing of this depends on where a
draft comes from: the draft model's greedy proposals (plait.runtime.speculative.draft_model) are verified
the same way.
"""

from __future__ import annotations


class NgramIndex:
    """Incremental map from each n-gram (n in [min_match, max_match]) of a token sequence to the
    position right after its most recent occurrence. Appending tokens costs O(max_match) each;
    a lookup is O(max_match): no scan over the history per step."""

    __slots__ = ("_done", "_last", "max_match", "min_match")

    def __init__(self, min_match: int, max_match: int):
        self.min_match = min_match
        self.max_match = max_match
        self._last: dict[tuple[int, ...], int] = {}
        self._done = 0  # n-grams ending before this position are indexed

    def _extend(self, ids: list[int], end: int) -> None:
        """Index the n-grams that end at positions [self._done, end)."""
        last, lo, hi = self._last, self.min_match, self.max_match
        for p in range(self._done, end):
            for n in range(lo, min(hi, p + 1) + 1):
                last[tuple(ids[p - n + 1 : p + 1])] = p + 1
        self._done = max(self._done, end)

    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching
        suffix of `ids` (which only grows between calls, apart from its unindexed last token)."""
        L = len(ids)
        if k <= 0 or L < self.min_match + 1:
            return []
        if L - 1 < self._done:  # the sequence shrank below what was indexed: start over
            self._last.clear()
            self._done = 0
        # Everything but the final n-gram: a match must have at least one token after it.
        self._extend(ids, L - 1)
        for n in range(min(self.max_match, L - 1), self.min_match - 1, -1):
            start = self._last.get(tuple(ids[L - n :]))
            if start is not None:
                return ids[start : start + k]
        return []


MAX_PAUSE = 16  # rounds a request whose drafts keep failing waits before drafting again


class DraftLength:
    """A request's adaptive draft length. Rejected drafts are not free: each costs a verification
    position in the target's forward (at batch 1 a float32 step with 9 rows costs more than one with
    1), and with a draft model a draft forward too, so a request whose drafts keep failing is slower
    with speculation than without. A round with nothing kept pauses drafting for 1, 2, 4 ...
    MAX_PAUSE rounds (doubling while nothing is kept, reset by any kept draft). With `shrink` (draft
    models, where each draft costs a forward) a partial round also sets the length to what was
    kept plus one, and a fully kept one doubles it again (up to `max_k`). n-gram drafts cost nothing
    to propose and keep `max_k`: shrinking them lost more kept drafts than it saved rows
    (`plait bench speculative`, float32: extract-json 1.47x with shrinking, 1.78x without)."""

    __slots__ = ("k", "max_k", "misses", "pause", "shrink")

    def __init__(self, max_k: int, shrink: bool = True):
        self.k = self.max_k = max_k  # drafts to propose next
        self.shrink = shrink
        self.misses = 0  # consecutive rounds with no draft kept
        self.pause = 0  # rounds left without drafting

    def record(self, proposed: int, kept: int) -> None:
        """Adapt to a verified round: `kept` of `proposed` drafts were kept."""
        if proposed <= 0:
            return
        if kept == 0:
            self.misses += 1
            self.pause = min(2 ** (self.misses - 1), MAX_PAUSE)
        else:
            self.misses = 0
        if self.shrink:
            self.k = min(2 * self.k, self.max_k) if kept == proposed else kept + 1

    def take(self) -> int:
        """How many drafts to propose this round: 0 while pausing (using up one paused round)."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.k


def accepted_prefix(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the tokens drawn at their positions (`targets[i]` is the
    draw given drafts[:i]); the caller then also keeps targets[n], the model's own token."""
    n = 0
    for d, t in zip(drafts, targets):
        if d != t:
            break
        n += 1
    return n


def acceptance_rate(proposed: int, accepted: int) -> float:
    """Accepted over proposed draft tokens (0 before any proposal)."""
    return accepted / proposed if proposed else 0.0
