"""BlockManager: unit tests plus a model-based (hypothesis stateful) property test.

The state machine keeps its own model of the manager: block tables, a shadow
prefix cache (token-prefix tuple -> block id), the LRU order of cached blocks,
and what a caller would have written into each KV slot. Every step is checked
against that model, so prefix reuse, eviction, copy-on-write and atomicity on
OutOfBlocks are all verified, not just the internal invariants.
"""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from runtime.block_manager import BlockManager, BlockStats, OutOfBlocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- unit tests ----------------------------------------------------------------


def test_allocate_slots_and_stats():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate(1, list(range(10))) == 0
    table = bm.block_table(1)
    assert len(table) == 3 and bm.num_tokens(1) == 10 and bm.token_ids(1) == list(range(10))
    assert bm.slots(1, 3, 6) == [table[0] * 4 + 3, table[1] * 4, table[1] * 4 + 1]
    assert bm.stats() == BlockStats(num_blocks=8, free=5, cached=0, in_use=3, reuse_hits=0)
    bm.free(1)
    assert not bm.has_sequence(1)
    assert bm.stats() == BlockStats(num_blocks=8, free=6, cached=2, in_use=0, reuse_hits=0)
    bm.check_invariants()


def test_prefix_reuse_leaves_at_least_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(1, list(range(9)))
    first_two = bm.block_table(1)[:2]
    bm.free(1)
    assert bm.allocate(2, list(range(9)) + [42]) == 8
    assert bm.block_table(2)[:2] == first_two
    # Exactly two full blocks, all cached: the last one is recomputed, not reused.
    assert bm.allocate(3, list(range(8))) == 4
    assert bm.block_table(3)[0] == first_two[0] and bm.block_table(3)[1] != first_two[1]
    assert bm.allocate(4, [7, 7, 7]) == 0
    assert bm.stats().reuse_hits == 3
    bm.check_invariants()


def test_fork_then_append_copies_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(1, [1, 2, 3, 4, 5, 6])
    bm.fork(1, 2)
    shared = bm.block_table(1)
    assert bm.block_table(2) == shared
    assert bm.blocks_needed(2, 1) == 1
    copies = bm.append(2, [9])
    assert copies == [(shared[1], bm.block_table(2)[1])]
    assert bm.block_table(2)[0] == shared[0] and bm.block_table(2)[1] != shared[1]
    # Parent is now the only owner of its last block: no copy needed.
    assert bm.append(1, [8]) == []
    assert bm.block_table(1) == shared
    bm.check_invariants()


def test_out_of_blocks_is_atomic_and_explains():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate(1, [1, 2, 3])
    before = (bm.stats(), bm.block_table(1), bm.token_ids(1))
    with pytest.raises(OutOfBlocks, match=r"need 2 KV blocks but only 1 .*KV cache budget"):
        bm.append(1, [4, 5, 6, 7])
    with pytest.raises(OutOfBlocks):
        bm.allocate(2, [1, 2, 3, 4, 5])
    assert (bm.stats(), bm.block_table(1), bm.token_ids(1)) == before
    assert not bm.has_sequence(2)
    bm.check_invariants()


def test_lru_evicts_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=1)
    bm.allocate(1, [1, 2])  # block size 1: both blocks are full, so both get hashed
    bm.allocate(2, [5, 6])
    (a1, a2), (b1, b2) = bm.block_table(1), bm.block_table(2)
    bm.free(1)  # tail first, so a sequence's prefix outlives its tail: LRU a2, a1
    bm.free(2)  # LRU a2, a1, b2, b1
    assert bm.stats() == BlockStats(num_blocks=4, free=0, cached=4, in_use=0, reuse_hits=0)
    bm.allocate(3, [9])
    assert bm.block_table(3) == [a2]
    bm.free(3)  # LRU a1, b2, b1, a2
    assert bm.allocate(4, [1, 2, 3]) == 1  # [1] is still cached, [1, 2] was evicted
    assert bm.block_table(4) == [a1, b2, b1]
    assert bm.stats() == BlockStats(num_blocks=4, free=0, cached=1, in_use=3, reuse_hits=1)
    bm.check_invariants()


def test_truncate_unregisters_exclusive_partial_block():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate(1, [1, 2, 3, 4, 5])
    bm.truncate(1, 3)  # the block of [3, 4] is exclusive and will be overwritten: its hash is dropped
    assert len(bm.block_table(1)) == 2 and bm.token_ids(1) == [1, 2, 3]
    assert bm.stats().free == 6
    assert bm.allocate(2, [1, 2, 3, 4, 9]) == 2
    bm.check_invariants()


def test_truncate_keeps_hash_of_shared_block_and_append_copies_it():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate(1, [1, 2, 3, 4, 5])
    bm.fork(1, 2)
    bm.truncate(1, 3)  # shared with seq 2: hash kept, the block still holds [3, 4]
    shared = bm.block_table(2)[1]
    assert bm.block_table(1)[1] == shared
    assert bm.allocate(3, [1, 2, 3, 4, 0]) == 4 and bm.block_table(3)[1] == shared
    copies = bm.append(1, [7])
    assert copies == [(shared, bm.block_table(1)[1])] and bm.block_table(1)[1] != shared
    bm.check_invariants()


def test_errors():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate(1, [1])
    with pytest.raises(ValueError):
        bm.allocate(1, [2])
    with pytest.raises(ValueError):
        bm.allocate(2, [])
    with pytest.raises(ValueError):
        bm.fork(1, 1)
    with pytest.raises(ValueError):
        bm.truncate(1, 0)
    with pytest.raises(ValueError):
        bm.slots(1, 0, 2)
    bm.free(1)
    with pytest.raises(KeyError):
        bm.free(1)
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    bm.check_invariants()


# -- model-based property test --------------------------------------------------

VOCAB = st.integers(min_value=0, max_value=2)


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 16), block_size=st.integers(1, 4))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.bs = block_size
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.prefix_block: dict[tuple[int, ...], int] = {}  # shadow of the hash map
        self.lru: list[int] = []  # shadow of the cached blocks, oldest first
        self.content: dict[int, list[int | None]] = {b: [None] * block_size for b in range(num_blocks)}
        self.history: list[list[int]] = [[0, 1, 2, 0, 1, 2, 0, 1]]
        self.hits = 0
        self.next_id = 0

    # -- model helpers --

    def refs(self) -> list[int]:
        refs = [0] * self.bm.num_blocks
        for table in self.tables.values():
            for b in table:
                refs[b] += 1
        return refs

    def hashed(self) -> set[int]:
        return set(self.prefix_block.values())

    def unhashed_free(self) -> int:
        refs = self.refs()
        return sum(refs[b] == 0 and b not in self.lru for b in range(self.bm.num_blocks))

    def snapshot(self):
        return (
            self.bm.stats(),
            {s: (self.bm.block_table(s), self.bm.token_ids(s)) for s in self.tables},
            self.bm.num_free_blocks(),
        )

    def take_blocks(self, new_blocks: list[int], lru_after_hits: list[int], free_before: int) -> None:
        """Check new blocks came from the free list first, then the oldest cached ones; drop evicted hashes."""
        refs = self.refs()
        assert all(refs[b] == 0 for b in new_blocks), "a taken block was still referenced"
        evicted = lru_after_hits[: max(0, len(new_blocks) - free_before)]
        assert set(new_blocks) & set(self.lru) == set(evicted)
        for b in evicted:
            self.lru.remove(b)
            self.unregister(b)

    def unregister(self, block: int) -> None:
        for prefix, b in list(self.prefix_block.items()):
            if b == block:
                del self.prefix_block[prefix]

    def register_full_blocks(self, seq: int, first: int) -> None:
        tokens, table = self.tokens[seq], self.tables[seq]
        for i in range(first, len(tokens) // self.bs):
            prefix = tuple(tokens[: (i + 1) * self.bs])
            if prefix not in self.prefix_block:
                assert table[i] not in self.hashed()
                self.prefix_block[prefix] = table[i]

    def release(self, blocks: list[int]) -> None:
        """Model freeing ``blocks`` (already removed from the tables) in reverse order."""
        refs = self.refs()
        hashed = self.hashed()
        for b in reversed(blocks):
            if refs[b] == 0 and b in hashed:
                assert b not in self.lru, "block cached twice"
                self.lru.append(b)

    def write(self, seq: int, start: int, end: int) -> None:
        """Act as the caller: write tokens [start, end) into their KV slots."""
        for pos, slot in zip(range(start, end), self.bm.slots(seq, start, end)):
            block, offset = divmod(slot, self.bs)
            assert block == self.tables[seq][pos // self.bs] and offset == pos % self.bs
            self.content[block][offset] = self.tokens[seq][pos]

    def pick(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.tables)), label="seq")

    # -- rules --

    @rule(data=st.data(), suffix=st.lists(VOCAB, max_size=6))
    def allocate(self, data, suffix: list[int]) -> None:
        base = data.draw(st.sampled_from(self.history), label="base")
        tokens = base[: data.draw(st.integers(0, len(base)), label="prefix_len")] + suffix
        seq, self.next_id = self.next_id, self.next_id + 1
        if not tokens:
            with pytest.raises(ValueError):
                self.bm.allocate(seq, tokens)
            return
        bs = self.bs
        expected_hits = []
        for i in range((len(tokens) - 1) // bs):
            b = self.prefix_block.get(tuple(tokens[: (i + 1) * bs]))
            if b is None:
                break
            expected_hits.append(b)
        num_new = cdiv(len(tokens), bs) - len(expected_hits)
        lru_after_hits = [b for b in self.lru if b not in expected_hits]
        free_before = self.unhashed_free()
        before = self.snapshot()
        if num_new > free_before + len(lru_after_hits):
            with pytest.raises(OutOfBlocks):
                self.bm.allocate(seq, tokens)
            assert self.snapshot() == before and not self.bm.has_sequence(seq)
            return
        cached = self.bm.allocate(seq, tokens)
        assert cached == len(expected_hits) * bs and cached <= len(tokens) - 1
        table = self.bm.block_table(seq)
        assert table[: len(expected_hits)] == expected_hits, "reused blocks differ from the cached prefix"
        self.lru = lru_after_hits
        self.take_blocks(table[len(expected_hits) :], lru_after_hits, free_before)
        self.tables[seq], self.tokens[seq] = table, list(tokens)
        self.register_full_blocks(seq, len(expected_hits))
        refs = self.refs()
        assert all(refs[b] == 1 for b in table[len(expected_hits) :])
        self.write(seq, cached, len(tokens))
        self.hits += len(expected_hits)
        self.history.append(list(tokens))

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), new=st.lists(VOCAB, min_size=1, max_size=6))
    def append(self, data, new: list[int]) -> None:
        seq = self.pick(data)
        bs, n, table = self.bs, len(self.tokens[seq]), self.tables[seq]
        refs = self.refs()
        cow = n % bs != 0 and refs[table[-1]] > 1
        needed = int(cow) + cdiv(n + len(new), bs) - cdiv(n, bs)
        assert self.bm.blocks_needed(seq, len(new)) == needed
        free_before = self.unhashed_free()
        before = self.snapshot()
        if needed > free_before + len(self.lru):
            with pytest.raises(OutOfBlocks):
                self.bm.append(seq, new)
            assert self.snapshot() == before
            return
        copies = self.bm.append(seq, new)
        new_table = self.bm.block_table(seq)
        if n % bs and not cow:
            self.unregister(table[-1])  # about to be overwritten in place
        if cow:
            assert new_table[: n // bs] == table[: n // bs]
            assert copies == [(table[-1], new_table[n // bs])]
            taken = new_table[n // bs :]
        else:
            assert new_table[: len(table)] == table and copies == []
            taken = new_table[len(table) :]
        self.take_blocks(taken, list(self.lru), free_before)
        for src, dst in copies:
            self.content[dst] = list(self.content[src])
        self.tables[seq] = new_table
        self.tokens[seq] = self.tokens[seq] + new
        self.register_full_blocks(seq, n // bs)
        refs = self.refs()
        written = set(new_table[n // bs :])
        assert all(refs[b] == 1 for b in written), "an appended position lands in a shared block"
        self.write(seq, n, n + len(new))
        self.history.append(list(self.tokens[seq]))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = self.pick(data)
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent, child)
        self.tables[child] = self.bm.block_table(child)
        self.tokens[child] = list(self.tokens[parent])
        assert self.tables[child] == self.tables[parent]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def truncate(self, data) -> None:
        seq = self.pick(data)
        num = data.draw(st.integers(1, len(self.tokens[seq])), label="keep_tokens")
        keep = cdiv(num, self.bs)
        dropped = self.tables[seq][keep:]
        self.bm.truncate(seq, num)
        self.tables[seq] = self.tables[seq][:keep]
        self.tokens[seq] = self.tokens[seq][:num]
        assert self.bm.block_table(seq) == self.tables[seq]
        self.release(dropped)
        if num % self.bs and self.refs()[self.tables[seq][-1]] == 1:
            self.unregister(self.tables[seq][-1])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = self.pick(data)
        self.bm.free(seq)
        blocks = self.tables.pop(seq)
        del self.tokens[seq]
        self.release(blocks)
        with pytest.raises(KeyError):  # a second free is refused, never double-counted
            self.bm.free(seq)

    # -- checks after every step --

    @invariant()
    def consistent(self) -> None:
        bm = self.bm
        bm.check_invariants()
        stats = bm.stats()
        refs = self.refs()
        assert stats.free + stats.cached + stats.in_use == stats.num_blocks, "leaked block"
        assert stats.in_use == sum(r > 0 for r in refs)
        assert stats.cached == len(self.lru)
        assert stats.reuse_hits == self.hits
        assert bm.num_free_blocks() == self.unhashed_free() + len(self.lru)
        assert all(refs[b] == 0 for b in self.lru) and set(self.lru) <= self.hashed()
        for seq, table in self.tables.items():
            assert bm.has_sequence(seq)
            assert bm.block_table(seq) == table
            assert bm.token_ids(seq) == self.tokens[seq] and bm.num_tokens(seq) == len(self.tokens[seq])
            read = [self.content[table[p // self.bs]][p % self.bs] for p in range(len(self.tokens[seq]))]
            assert read == self.tokens[seq], f"sequence {seq} reads back wrong KV"
        for prefix, b in self.prefix_block.items():  # cached blocks hold what their prefix says
            assert self.content[b] == list(prefix[-self.bs :])

    def teardown(self) -> None:
        for seq in list(self.tables):
            self.bm.free(seq)
        self.tables.clear()
        self.bm.check_invariants()
        stats = self.bm.stats()
        assert stats.in_use == 0 and stats.free + stats.cached == stats.num_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
