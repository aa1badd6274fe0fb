"""Radix prefix cache over token ids (page size 1).

Each node is one edge of the tree: `key` holds its token ids (a Python list) and `value`
the KV slots of those tokens (an int64 tensor of the same length). A path from the root
spells a token prefix whose KV is already computed, so requests sharing that prefix can
reuse the slots instead of recomputing them.

`NaiveCache` has the same interface and caches nothing (the "radix cache disabled" mode).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence

import torch

from .memory_pool import TokenSlotAllocator

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None, last_access: int = 0):
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int, TreeNode] = {}  # keyed by the child's first token id
        self.lock_ref = 0
        self.last_access = last_access

    def __lt__(self, other: TreeNode) -> bool:  # heapq orders eviction candidates by LRU
        return self.last_access < other.last_access

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref}, t={self.last_access})"


def _as_list(ids: Sequence[int]) -> list[int]:
    # Tensor elements would hash by identity as dict keys, so turn tensors into ints.
    if isinstance(ids, torch.Tensor):
        return ids.tolist()
    return ids if isinstance(ids, list) else list(ids)


def _common_len(edge: list[int], ids: list[int], start: int) -> int:
    """Length of the common prefix of `edge` and `ids[start:]`."""
    n = min(len(edge), len(ids) - start)
    # Fast path: a whole-edge match is one C-level list comparison.
    if n == len(edge) and ids[start : start + n] == edge:
        return n
    i = 0
    while i < n and edge[i] == ids[start + i]:
        i += 1
    return i


class RadixCache:
    """Prefix cache: a radix tree that owns the KV slots of every token it holds."""

    enabled = True

    def __init__(self, allocator: TokenSlotAllocator):
        self.allocator = allocator
        # A logical clock instead of wall time: strictly ordered and deterministic.
        self._clock = itertools.count(1)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode([], _EMPTY, None)
        self.root.lock_ref = 1  # the root is never evicted nor counted
        self._evictable = 0
        self._protected = 0

    # ---- lookup / insert ---------------------------------------------------------------

    def _walk(self, ids: list[int]) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow `ids` down the tree, splitting the last edge if the match ends inside it.

        Returns (node ending exactly at the match, match length, slot tensors along the path)
        and refreshes the access time of every node on the path.
        """
        now = next(self._clock)
        node, i, n, values = self.root, 0, len(ids), []
        while i < n:
            child = node.children.get(ids[i])
            if child is None:
                break
            child.last_access = now
            m = _common_len(child.key, ids, i)
            if m < len(child.key):  # match ends inside this edge
                node = self._split(child, m)
                values.append(node.value)
                i += m
                break
            values.append(child.value)
            node, i = child, i + m
        return node, i, values

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut `child`'s edge after `m` tokens; return the new upper node (ends at the cut)."""
        upper = TreeNode(child.key[:m], child.value[:m], child.parent, child.last_access)
        # The upper half lies on every path through `child`, so it inherits its locks;
        # both halves keep the same lock state, hence the size counters are unchanged.
        upper.lock_ref = child.lock_ref
        upper.children[child.key[m]] = child
        child.parent.children[child.key[0]] = upper
        child.parent = upper
        child.key = child.key[m:]
        child.value = child.value[m:]
        return upper

    def match_prefix(self, ids: Sequence[int]) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of `ids`: (its slots as an int64 1-D tensor, the node ending there).

        A match ending inside an edge splits that edge so a node ends exactly at the match.
        Refreshes the LRU time along the path. An empty match gives (empty tensor, root).
        """
        node, _, values = self._walk(_as_list(ids))
        # torch.cat copies, so callers never alias the tree's own slot tensors.
        return (torch.cat(values) if values else _EMPTY.clone()), node

    def insert(self, ids: Sequence[int], slots: torch.Tensor) -> int:
        """Insert `ids` with their KV `slots`; return how many leading tokens were already cached.

        The tree takes ownership of `slots[returned:]`. It does not take `slots[:returned]`
        (duplicates of slots it already holds): the caller must free those it owns.
        Never frees anything itself.
        """
        ids = _as_list(ids)
        if len(slots) != len(ids):
            raise ValueError(f"insert: {len(ids)} ids but {len(slots)} slots")
        node, i, _ = self._walk(ids)
        if i < len(ids):
            # Copy both: the caller may keep mutating its id list or slot tensor.
            leaf = TreeNode(ids[i:], slots[i:].to(torch.int64, copy=True), node, next(self._clock))
            node.children[ids[i]] = leaf
            self._evictable += len(leaf.key)
        return i

    # ---- locking ------------------------------------------------------------------------

    def inc_lock(self, node: TreeNode) -> None:
        """Lock `node` and its ancestors (not the root) against eviction; nests."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: TreeNode) -> None:
        """Undo one `inc_lock(node)`."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock on a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node = node.parent

    # ---- eviction -----------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until `num_tokens` are freed.

        A parent whose last child goes becomes a candidate itself. Stops early when nothing
        evictable remains. Returns the number of tokens freed to the allocator.
        """
        if num_tokens <= 0 or self._evictable == 0:
            return 0
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed, released = 0, []
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)
            released.append(node.value)
            freed += len(node.key)
            parent = node.parent
            del parent.children[node.key[0]]
            if not parent.children and parent.lock_ref == 0:  # the root is always locked
                heapq.heappush(heap, parent)
        self._evictable -= freed
        if released:  # one allocator call: each free() concatenates the whole free list
            self.allocator.free(torch.cat(released))
        return freed

    # ---- sizes / bookkeeping ------------------------------------------------------------

    def evictable_size(self) -> int:
        """Tokens held in unlocked nodes."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens held in locked nodes."""
        return self._protected

    def total_size(self) -> int:
        """All tokens held by the tree."""
        return self._evictable + self._protected

    def _nodes(self) -> list[TreeNode]:
        """Every node except the root (iterative: deep trees would overflow recursion)."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree owns (int64 1-D), in no particular order."""
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else _EMPTY.clone()

    def reset(self) -> None:
        """Free every slot the tree owns and start empty. The caller must hold no locks."""
        self.allocator.free(self.all_slots())
        self._init_tree()


class NaiveCache:
    """The disabled prefix cache: matches nothing and gives every inserted slot straight back."""

    enabled = False

    def __init__(self, allocator: TokenSlotAllocator):
        self.allocator = allocator
        self.root = TreeNode([], _EMPTY, None)

    def match_prefix(self, ids: Sequence[int]) -> tuple[torch.Tensor, TreeNode]:
        """Always an empty match: (empty int64 tensor, root sentinel)."""
        return _EMPTY.clone(), self.root

    def insert(self, ids: Sequence[int], slots: torch.Tensor) -> int:
        """Free all `slots` now and return 0, so the caller frees nothing more."""
        self.allocator.free(slots)
        return 0

    def inc_lock(self, node: TreeNode) -> None:
        """No-op."""

    def dec_lock(self, node: TreeNode) -> None:
        """No-op."""

    def evict(self, num_tokens: int) -> int:
        """Nothing to evict: returns 0."""
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def all_slots(self) -> torch.Tensor:
        return _EMPTY.clone()

    def reset(self) -> None:
        """No-op: the naive cache owns nothing."""
