"""Radix prefix cache: unit tests plus a stateful test against a per-position reference model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from plait.runtime.mem_cache.memory_pool import TokenSlotAllocator
from plait.runtime.mem_cache.radix_cache import NaiveCache, RadixCache


def free_slots(alloc: TokenSlotAllocator) -> list[int]:
    """The allocator's free slots, read through its public interface (order preserved)."""
    s = alloc.alloc(alloc.available())
    alloc.free(s)
    return s.tolist()


def make(num_slots: int = 64) -> tuple[TokenSlotAllocator, RadixCache]:
    alloc = TokenSlotAllocator(num_slots)
    return alloc, RadixCache(alloc)


def insert_new(alloc, cache, ids) -> tuple[torch.Tensor, int]:
    """Allocate slots for ids, insert them and free the duplicates, like a scheduler would."""
    slots = alloc.alloc(len(ids))
    assert slots is not None
    n = cache.insert(ids, slots)
    alloc.free(slots[:n])
    return slots, n


def assert_conserved(alloc, cache, held=()) -> None:
    everything = free_slots(alloc) + cache.all_slots().tolist() + list(held)
    assert sorted(everything) == list(range(1, alloc.num_slots + 1))


def assert_sizes(cache, evictable, protected) -> None:
    assert cache.evictable_size() == evictable
    assert cache.protected_size() == protected
    assert cache.total_size() == evictable + protected == cache.all_slots().numel()


# ---- unit tests --------------------------------------------------------------------------


def test_match_on_empty_tree():
    alloc, cache = make()
    slots, node = cache.match_prefix([1, 2, 3])
    assert slots.dtype == torch.int64 and slots.shape == (0,)
    assert node is cache.root
    assert_sizes(cache, 0, 0)
    assert cache.evict(10) == 0


def test_insert_then_match_full_and_partial():
    alloc, cache = make()
    slots, n = insert_new(alloc, cache, [1, 2, 3, 4])
    assert n == 0
    assert_sizes(cache, 4, 0)

    got, node = cache.match_prefix([1, 2, 3, 4])
    assert got.tolist() == slots.tolist() and got.dtype == torch.int64
    got, _ = cache.match_prefix([1, 2, 3, 4, 5, 6])  # longer query: whole entry
    assert got.tolist() == slots.tolist()
    got, _ = cache.match_prefix([1, 2, 9])
    assert got.tolist() == slots[:2].tolist()
    got, node = cache.match_prefix([7, 1, 2])
    assert got.numel() == 0 and node is cache.root
    got, node = cache.match_prefix([])
    assert got.numel() == 0 and node is cache.root
    # Tuples and tensors are accepted as ids too.
    assert cache.match_prefix((1, 2, 3))[0].tolist() == slots[:3].tolist()
    assert cache.match_prefix(torch.tensor([1, 2]))[0].tolist() == slots[:2].tolist()
    assert_sizes(cache, 4, 0)
    assert_conserved(alloc, cache)


def test_match_splits_edge_in_the_middle():
    alloc, cache = make()
    slots, _ = insert_new(alloc, cache, [1, 2, 3, 4, 5])
    got, node = cache.match_prefix([1, 2, 9])
    assert got.tolist() == slots[:2].tolist()
    assert node is not cache.root and node.key == [1, 2]
    assert node.value.tolist() == slots[:2].tolist()
    (child,) = node.children.values()
    assert child.key == [3, 4, 5] and child.parent is node
    assert_sizes(cache, 5, 0)  # a split moves no tokens
    # Locking the split node protects exactly the two tokens above the cut.
    cache.inc_lock(node)
    assert_sizes(cache, 3, 2)
    cache.dec_lock(node)
    assert_sizes(cache, 5, 0)
    # The full sequence still matches across the split.
    _, leaf = cache.match_prefix([1, 2, 3, 4, 5])
    assert cache.match_prefix([1, 2, 3, 4, 5])[0].tolist() == slots.tolist()
    # Splitting a locked edge: both halves stay locked, and one dec_lock releases both.
    cache.inc_lock(leaf)
    assert_sizes(cache, 0, 5)
    _, mid = cache.match_prefix([1, 2, 3, 9])
    assert mid.key == [3] and leaf.key == [4, 5]
    assert_sizes(cache, 0, 5)
    assert cache.evict(5) == 0
    cache.dec_lock(leaf)
    assert_sizes(cache, 5, 0)
    assert_conserved(alloc, cache)


def test_insert_returns_present_length_and_skips_duplicates():
    alloc, cache = make()
    a = alloc.alloc(3)
    assert cache.insert([1, 2, 3], a) == 0
    b = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], b) == 3
    # The tree keeps its original slots for the shared prefix, and takes only b[3:].
    assert sorted(cache.all_slots().tolist()) == sorted(a.tolist() + b[3:].tolist())
    assert cache.match_prefix([1, 2, 3, 4, 5])[0].tolist() == a.tolist() + b[3:].tolist()
    assert_conserved(alloc, cache, held=b[:3].tolist())  # duplicates are still ours
    alloc.free(b[:3])
    assert_conserved(alloc, cache)
    # A mid-edge divergence: [1, 2, 7] shares two tokens.
    c = alloc.alloc(3)
    assert cache.insert([1, 2, 7], c) == 2
    alloc.free(c[:2])
    assert cache.match_prefix([1, 2, 7])[0].tolist() == a[:2].tolist() + c[2:].tolist()
    # Fully present: nothing taken.
    d = alloc.alloc(2)
    assert cache.insert([1, 2], d) == 2
    alloc.free(d)
    assert_sizes(cache, 6, 0)
    assert_conserved(alloc, cache)


def test_insert_copies_caller_ids_and_rejects_length_mismatch():
    alloc, cache = make()
    ids = [1, 2, 3]
    slots, _ = insert_new(alloc, cache, ids)
    ids.append(4)  # the caller keeps growing its list; the tree must not see it
    ids[0] = 99
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == slots.tolist()
    with pytest.raises(ValueError):
        cache.insert([5, 6], alloc.alloc(1))


def test_locks_protect_from_eviction():
    alloc, cache = make()
    insert_new(alloc, cache, [1, 2, 3])
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock(node)
    assert_sizes(cache, 0, 3)
    assert cache.evict(10) == 0
    assert_sizes(cache, 0, 3)

    b, _ = insert_new(alloc, cache, [1, 2, 3, 4, 5])  # unlocked extension of a locked path
    assert_sizes(cache, 2, 3)
    assert cache.evict(10) == 2  # less than asked: the rest is locked
    assert_sizes(cache, 0, 3)
    assert set(b[3:].tolist()) <= set(free_slots(alloc))

    cache.inc_lock(node)  # locks nest
    cache.dec_lock(node)
    assert cache.evict(10) == 0
    cache.dec_lock(node)
    assert_sizes(cache, 3, 0)
    with pytest.raises(RuntimeError):
        cache.dec_lock(node)
    assert cache.evict(10) == 3
    assert_sizes(cache, 0, 0)
    assert alloc.available() == alloc.num_slots


def test_eviction_is_lru():
    alloc, cache = make()
    a, _ = insert_new(alloc, cache, [1, 1])
    b, _ = insert_new(alloc, cache, [2, 2])
    c, _ = insert_new(alloc, cache, [3, 3])
    cache.match_prefix([1, 1, 5])  # refresh a: b is now the oldest
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2])[0].numel() == 0  # this query must not resurrect b
    assert cache.match_prefix([1, 1])[0].tolist() == a.tolist()
    assert cache.match_prefix([3, 3])[0].tolist() == c.tolist()  # now a is older than c
    assert cache.evict(2) == 2
    assert cache.match_prefix([1, 1])[0].numel() == 0
    assert cache.match_prefix([3, 3])[0].tolist() == c.tolist()
    assert set(a.tolist() + b.tolist()) <= set(free_slots(alloc))
    assert_conserved(alloc, cache)


def test_evicting_last_child_makes_parent_evictable():
    alloc, cache = make()
    p, _ = insert_new(alloc, cache, [1, 2, 3])
    insert_new(alloc, cache, [1, 2, 4])  # tree: [1,2] -> {[3], [4]}
    assert_sizes(cache, 4, 0)
    assert cache.evict(2) == 2  # both leaves; the parent is next but 2 tokens are enough
    assert cache.match_prefix([1, 2, 3])[0].tolist() == p[:2].tolist()
    assert_sizes(cache, 2, 0)
    assert cache.evict(1) == 2  # the parent, now a leaf, goes whole
    assert_sizes(cache, 0, 0)
    assert alloc.available() == alloc.num_slots

    # Same tree, one branch locked: the parent stays because a locked child hangs off it.
    insert_new(alloc, cache, [1, 2, 3])
    insert_new(alloc, cache, [1, 2, 4])
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock(node)
    assert cache.evict(100) == 1
    assert_sizes(cache, 0, 3)
    cache.dec_lock(node)
    assert cache.evict(100) == 3
    assert_conserved(alloc, cache)


def test_sizes_track_every_operation():
    alloc, cache = make()
    insert_new(alloc, cache, [1, 2, 3, 4])
    assert_sizes(cache, 4, 0)
    _, n2 = cache.match_prefix([1, 2])  # split
    assert_sizes(cache, 4, 0)
    cache.inc_lock(n2)
    assert_sizes(cache, 2, 2)
    insert_new(alloc, cache, [1, 2, 5, 6, 7])
    assert_sizes(cache, 5, 2)
    _, n3 = cache.match_prefix([1, 2, 5])  # split under a locked node
    assert_sizes(cache, 5, 2)
    cache.inc_lock(n3)
    assert_sizes(cache, 4, 3)
    assert cache.evict(1) == 2  # LRU unlocked leaf: [3, 4]
    assert_sizes(cache, 2, 3)
    cache.dec_lock(n2)
    assert_sizes(cache, 2, 3)  # n3's lock still covers [1, 2]
    cache.dec_lock(n3)
    assert_sizes(cache, 5, 0)
    assert cache.evict(100) == 5
    assert_sizes(cache, 0, 0)


def test_reset_frees_everything():
    alloc, cache = make(32)
    for ids in ([1, 2, 3], [1, 2, 4, 5], [7], [7, 8, 9, 9]):
        insert_new(alloc, cache, ids)
    cache.match_prefix([1])
    assert alloc.available() == 32 - cache.total_size() and cache.total_size() > 0
    cache.reset()
    assert alloc.available() == 32
    assert sorted(free_slots(alloc)) == list(range(1, 33))
    assert_sizes(cache, 0, 0)
    assert cache.match_prefix([1, 2, 3])[0].numel() == 0
    insert_new(alloc, cache, [1, 2])  # usable after reset
    assert_sizes(cache, 2, 0)


# ---- NaiveCache --------------------------------------------------------------------------


def test_naive_cache_frees_on_insert_and_never_matches():
    alloc = TokenSlotAllocator(16)
    cache = NaiveCache(alloc)
    assert cache.enabled is False and RadixCache.enabled is True
    slots = alloc.alloc(5)
    assert alloc.available() == 11
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    assert alloc.available() == 16
    assert sorted(free_slots(alloc)) == list(range(1, 17))
    got, node = cache.match_prefix([1, 2, 3, 4, 5])
    assert got.dtype == torch.int64 and got.numel() == 0
    assert node is cache.root
    cache.inc_lock(node)
    cache.dec_lock(node)
    assert cache.evict(10) == 0
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
    assert cache.all_slots().numel() == 0
    cache.reset()
    assert alloc.available() == 16


# ---- stateful test against a reference model ---------------------------------------------

ALPHABET = st.integers(0, 2)  # tiny alphabet: prefixes collide and edges split often
SEQS = st.lists(ALPHABET, min_size=1, max_size=8)
NUM_SLOTS = 40


class RadixMachine(RuleBasedStateMachine):
    """Reference: `ref` maps every cached prefix (tuple) to the slot of its last token.

    Cached prefixes are prefix-closed, so the longest match is the longest i with ids[:i] in ref.
    Eviction is observed through the allocator: the evicted positions are exactly those whose
    slot came back free.
    """

    @initialize()
    def setup(self):
        self.alloc = TokenSlotAllocator(NUM_SLOTS)
        self.cache = RadixCache(self.alloc)
        self.ref: dict[tuple, int] = {}
        self.held: list[int] = []  # duplicate slots the test still owns
        self.locks: list[tuple] = []  # (node, locked prefix)

    def ref_match(self, ids) -> int:
        k = 0
        while k < len(ids) and tuple(ids[: k + 1]) in self.ref:
            k += 1
        return k

    def locked_prefixes(self) -> set[tuple]:
        return {p[:j] for _, p in self.locks for j in range(1, len(p) + 1)}

    @rule(ids=SEQS)
    def insert(self, ids):
        slots = self.alloc.alloc(len(ids))
        if slots is None:
            return
        expected = self.ref_match(ids)
        n = self.cache.insert(ids, slots)
        assert n == expected
        self.held += slots[:n].tolist()
        for j in range(n, len(ids)):
            self.ref[tuple(ids[: j + 1])] = int(slots[j])

    @rule(ids=SEQS)
    def match(self, ids):
        k = self.ref_match(ids)
        got, node = self.cache.match_prefix(ids)
        assert got.dtype == torch.int64 and got.dim() == 1
        assert got.tolist() == [self.ref[tuple(ids[: j + 1])] for j in range(k)]
        assert (node is self.cache.root) == (k == 0)

    @rule(ids=SEQS)
    def lock(self, ids):
        k = self.ref_match(ids)
        _, node = self.cache.match_prefix(ids)
        self.cache.inc_lock(node)  # checked by the size invariant: it must lock ids[:k] exactly
        self.locks.append((node, tuple(ids[:k])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _ = self.locks.pop(i)
        self.cache.dec_lock(node)

    @rule(n=st.integers(0, 25))
    def evict(self, n):
        before = set(free_slots(self.alloc))
        evictable = self.cache.evictable_size()
        freed = self.cache.evict(n)
        newly_free = set(free_slots(self.alloc)) - before
        assert freed == len(newly_free)
        assert freed >= min(n, evictable)  # stops early only when nothing evictable is left
        if freed < n:
            assert self.cache.evictable_size() == 0
        assert self.cache.evictable_size() == evictable - freed
        gone = {p for p, s in self.ref.items() if s in newly_free}
        assert len(gone) == freed
        assert not gone & self.locked_prefixes()
        for p in gone:
            del self.ref[p]
        # Leaves go first, so what remains is still prefix-closed.
        assert all(p[:-1] in self.ref for p in self.ref if len(p) > 1)

    @precondition(lambda self: self.held)
    @rule()
    def free_held(self):
        self.alloc.free(torch.tensor(self.held, dtype=torch.int64))
        self.held = []

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self):
        self.cache.reset()
        self.ref.clear()

    @invariant()
    def sizes_match_reference(self):
        protected = len(self.locked_prefixes())
        assert self.cache.total_size() == len(self.ref)
        assert self.cache.protected_size() == protected
        assert self.cache.evictable_size() == len(self.ref) - protected
        assert self.cache.evictable_size() + self.cache.protected_size() == self.cache.total_size()

    @invariant()
    def slots_conserved(self):
        free = free_slots(self.alloc)
        owned = self.cache.all_slots().tolist()
        assert sorted(owned) == sorted(self.ref.values())
        assert not set(free) & set(owned)
        assert sorted(free + owned + self.held) == list(range(1, NUM_SLOTS + 1))

    @invariant()
    def tree_matches_reference(self):
        # White-box, read-only walk (match_prefix would split edges and touch LRU times).
        seen, stack = {}, [((), self.cache.root)]
        while stack:
            prefix, node = stack.pop()
            for first, child in node.children.items():
                assert child.parent is node and child.key and child.key[0] == first
                assert len(child.key) == child.value.numel()
                assert child.lock_ref <= node.lock_ref or node is self.cache.root
                path = prefix
                for tok, slot in zip(child.key, child.value.tolist()):
                    path = path + (tok,)
                    seen[path] = slot
                stack.append((path, child))
        assert seen == self.ref


RadixMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_radix_cache_stateful = RadixMachine.TestCase
