"""Routing policies for data parallelism, independent of HTTP.

`CacheAwarePolicy` keeps an approximate prefix tree over request text (characters, not tokens:
the router does not tokenize) recording which replica has seen which text, and sends a request
to the replica whose cache likely holds its longest prefix, unless that replica is overloaded
compared to the least-loaded one, or the best match is too short to matter. `RoundRobinPolicy`
ignores the text, for comparison.

A policy chooses among the replicas it is given (the healthy ones) with their current loads
(requests in flight); the caller owns health and load accounting.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping
from typing import Protocol

DEFAULT_CACHE_THRESHOLD = 0.5
DEFAULT_BALANCE_ABS_THRESHOLD = 32
DEFAULT_BALANCE_REL_THRESHOLD = 1.5
DEFAULT_MAX_TREE_CHARS = 2_000_000  # per replica; roughly the text of a few 100k tokens
TOKEN_ID_BASE = 0xE000  # token ids map to characters from here (above the surrogates)


class RoutingPolicy(Protocol):
    """What the router needs from a policy."""

    name: str

    def choose(self, text: str, loads: Mapping[str, int]) -> str:
        """The replica (a key of `loads`, non-empty) for a request whose routing text is `text`."""
        ...

    def forget(self, replica: str) -> None:
        """Drop what is known of `replica`'s cache (it died or restarted)."""
        ...


def ids_to_text(ids: list[int]) -> str:
    """Token ids as routing text, one character per token (so match ratios count tokens). The
    leading NUL keeps id text apart from prompt text."""
    span = 0x110000 - TOKEN_ID_BASE
    return "\0" + "".join(chr(TOKEN_ID_BASE + (int(i) % span)) for i in ids)


def least_loaded(loads: Mapping[str, int], tiebreak: Mapping[str, int] | None = None) -> str:
    """The replica with the fewest requests in flight; ties go to the smaller `tiebreak` value
    (e.g. the smaller cache tree), then to the first in order."""
    order = {r: i for i, r in enumerate(loads)}
    return min(loads, key=lambda r: (loads[r], (tiebreak or {}).get(r, 0), order[r]))


# --- the prefix tree --------------------------------------------------------------------------
class _Node:
    __slots__ = ("children", "edge", "parent", "seen")

    def __init__(self, edge: str, parent: _Node | None):
        self.edge = edge  # the characters on the edge into this node
        self.children: dict[str, _Node] = {}  # first character of the child's edge -> child
        self.parent = parent
        self.seen: dict[str, int] = {}  # replica -> logical time it last saw this text


class PrefixTree:
    """A character radix tree shared by all replicas: each node records which replicas have seen
    the text up to it, and when. A replica on a node is on all its ancestors, so the text a
    replica has seen is a subtree from the root. Each replica's share is bounded by `max_chars`:
    past it, its least recently seen leaves are dropped (LRU), as its real cache would."""

    def __init__(self, max_chars: int = DEFAULT_MAX_TREE_CHARS):
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_chars = max_chars
        self.root = _Node("", None)
        self.chars: dict[str, int] = {}  # replica -> characters of text it holds
        self._clock = itertools.count(1)

    def match(self, text: str) -> dict[str, int]:
        """Replica -> length of the longest prefix of `text` it has seen (replicas with none left out)."""
        matched: dict[str, int] = {}
        node, depth = self.root, 0
        while depth < len(text):
            child = node.children.get(text[depth])
            if child is None:
                break
            n = _common_len(child.edge, text, depth)
            for r in child.seen:
                matched[r] = depth + n  # deeper nodes overwrite: a replica's deepest wins
            if n < len(child.edge):
                break
            node, depth = child, depth + n
        return matched

    def insert(self, text: str, replica: str) -> None:
        """Record that `replica` has seen `text` (and so every prefix of it); evict its LRU text
        past `max_chars`."""
        now = next(self._clock)
        node, depth = self.root, 0
        node.seen[replica] = now
        while depth < len(text):
            child = node.children.get(text[depth])
            if child is None:
                child = _Node(text[depth:], node)
                node.children[text[depth]] = child
            n = _common_len(child.edge, text, depth)
            if n < len(child.edge):
                child = self._split(child, n)
            if replica not in child.seen:
                self.chars[replica] = self.chars.get(replica, 0) + len(child.edge)
            child.seen[replica] = now
            node, depth = child, depth + n
        self.chars.setdefault(replica, 0)
        if self.chars[replica] > self.max_chars:
            self._evict(replica, self.max_chars * 9 // 10)  # some slack: evict in batches

    def forget(self, replica: str) -> None:
        """Remove everything `replica` has seen."""
        self._evict(replica, 0)
        self.root.seen.pop(replica, None)
        self.chars.pop(replica, None)

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after n characters; return the new upper node."""
        parent = child.parent
        upper = _Node(child.edge[:n], parent)
        upper.seen = dict(child.seen)
        parent.children[upper.edge[0]] = upper
        child.edge = child.edge[n:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        return upper

    def _evict(self, replica: str, target: int) -> None:
        """Drop `replica`'s least recently seen leaves until it holds at most `target` chars."""
        heap = [(node.seen[replica], id(node), node) for node in self._leaves_of(replica)]
        heapq.heapify(heap)
        while heap and self.chars.get(replica, 0) > target:
            _, _, node = heapq.heappop(heap)
            del node.seen[replica]
            self.chars[replica] -= len(node.edge)
            parent = node.parent
            if not node.seen and not node.children:
                del parent.children[node.edge[0]]
            if parent is not self.root and not any(replica in c.seen for c in parent.children.values()):
                heapq.heappush(heap, (parent.seen[replica], id(parent), parent))

    def _leaves_of(self, replica: str) -> list[_Node]:
        leaves, stack = [], [c for c in self.root.children.values() if replica in c.seen]
        while stack:
            node = stack.pop()
            kids = [c for c in node.children.values() if replica in c.seen]
            if kids:
                stack += kids
            else:
                leaves.append(node)
        return leaves


def _common_len(edge: str, text: str, start: int) -> int:
    """How many leading characters of `edge` equal text[start:]."""
    n = min(len(edge), len(text) - start)
    i = 0
    while i < n and edge[i] == text[start + i]:
        i += 1
    return i


# --- policies ---------------------------------------------------------------------------------
class CacheAwarePolicy:
    """Longest-prefix routing with load balancing.

    For a request: the replica that has seen the longest prefix of its text is chosen, unless
    - the match covers less than `cache_threshold` of the text: then the least-loaded replica
      (ties: the one holding the least text, which has the most cache to spare), or
    - that replica is overloaded: its load exceeds the least-loaded replica's by more than
      `balance_abs_threshold` requests AND is more than `balance_rel_threshold` times it; then
      the least-loaded replica.
    The chosen replica is recorded as having seen the text.
    """

    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
        balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
        max_tree_chars: int = DEFAULT_MAX_TREE_CHARS,
    ):
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold}")
        if balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = PrefixTree(max_tree_chars)

    def overloaded(self, load: int, min_load: int) -> bool:
        """Whether a replica with `load` in flight is too busy next to one with `min_load`."""
        return load - min_load > self.balance_abs_threshold and load > min_load * self.balance_rel_threshold

    def choose(self, text: str, loads: Mapping[str, int]) -> str:
        """See the class docstring."""
        if not loads:
            raise ValueError("no replica to choose from")
        matched = {r: n for r, n in self.tree.match(text).items() if r in loads}
        fallback = least_loaded(loads, self.tree.chars)
        choice = fallback
        if matched and text:
            order = {r: i for i, r in enumerate(loads)}
            best = max(matched, key=lambda r: (matched[r], -loads[r], -order[r]))
            if matched[best] / len(text) >= self.cache_threshold and not self.overloaded(loads[best], loads[fallback]):
                choice = best
        self.tree.insert(text, choice)
        return choice

    def forget(self, replica: str) -> None:
        """See RoutingPolicy.forget."""
        self.tree.forget(replica)


class RoundRobinPolicy:
    """Each request to the next replica in turn, whatever its text."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, text: str, loads: Mapping[str, int]) -> str:
        """See RoutingPolicy.choose."""
        if not loads:
            raise ValueError("no replica to choose from")
        replicas = list(loads)
        choice = replicas[self._next % len(replicas)]
        self._next += 1
        return choice

    def forget(self, replica: str) -> None:
        """Nothing is kept per replica."""


POLICIES = ("cache_aware", "round_robin")


def make_policy(
    name: str,
    cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
    balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
    balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
    max_tree_chars: int = DEFAULT_MAX_TREE_CHARS,
) -> RoutingPolicy:
    """A policy by name (`POLICIES`); ValueError for an unknown name or a bad threshold."""
    if name == "cache_aware":
        return CacheAwarePolicy(cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_chars)
    if name == "round_robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
