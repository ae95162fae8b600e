"""BlockManager: unit tests plus a model-based (hypothesis stateful) property test.

The state machine keeps its own model of the manager: block tables, a shadow
prefix cache (token-prefix tuple -> block id), the LRU order of cached blocks,
and what a caller would have written into each KV slot. Every step is checked
against that model, so prefix reuse, eviction, that writes never land in a
shared block, and atomicity on OutOfBlocks are all verified, not just the
internal invariants. (Only prefix reuse shares a block, and it only shares full
blocks, which an append never writes into: no copy-on-write is needed.)
"""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cabinllm.runtime.errors import OutOfBlocks
from cabinllm.runtime.kv.blocks import BlockManager, BlockStats, Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def allocated(bm: BlockManager, token_ids: list[int]) -> Sequence:
    """A new sequence allocated with ``token_ids``."""
    seq = Sequence()
    bm.allocate(seq, token_ids)
    return seq


# -- unit tests ----------------------------------------------------------------


def test_allocate_slots_and_stats():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence()
    assert not seq and len(seq) == 0
    assert bm.allocate(seq, list(range(10))) == 0
    table = seq.block_table
    assert seq and len(table) == 3 and len(seq) == 10 and seq.token_ids == list(range(10))
    assert len(seq.hashes) == 2
    assert bm.slots(seq, 3, 6) == [table[0] * 4 + 3, table[1] * 4, table[1] * 4 + 1]
    assert bm.stats() == BlockStats(num_blocks=8, free=5, cached=0, in_use=3, reuse_hits=0)
    bm.free(seq)
    assert not seq and seq.block_table == [] and seq.token_ids == [] and seq.hashes == []
    assert bm.stats() == BlockStats(num_blocks=8, free=6, cached=2, in_use=0, reuse_hits=0)
    bm.check_invariants()


def test_prefix_reuse_leaves_at_least_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = allocated(bm, list(range(9)))
    first_two = first.block_table[:2]
    bm.free(first)
    second = Sequence()
    assert bm.allocate(second, list(range(9)) + [42]) == 8
    assert second.block_table[:2] == first_two
    # Exactly two full blocks, all cached: the last one is recomputed, not reused.
    third = Sequence()
    assert bm.allocate(third, list(range(8))) == 4
    assert third.block_table[0] == first_two[0] and third.block_table[1] != first_two[1]
    assert bm.allocate(Sequence(), [7, 7, 7]) == 0
    assert bm.stats().reuse_hits == 3
    bm.check_invariants()


def test_block_reuse_disabled_never_reuses_cached_blocks():
    bm = BlockManager(num_blocks=8, block_size=4, enable_block_reuse=False)
    first = allocated(bm, list(range(9)))
    full = first.block_table[:2]
    bm.free(first)
    assert bm.stats() == BlockStats(num_blocks=8, free=6, cached=2, in_use=0, reuse_hits=0)
    second = Sequence()
    assert bm.allocate(second, list(range(9))) == 0
    assert not set(second.block_table) & set(full)  # fresh blocks, the cached ones are left alone
    assert bm.stats() == BlockStats(num_blocks=8, free=3, cached=2, in_use=3, reuse_hits=0)
    bm.check_invariants()


def test_shared_prefix_blocks_are_never_written():
    """Prefix reuse shares full blocks only; appends open new blocks, so there is nothing to copy."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = allocated(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    b = Sequence()
    assert bm.allocate(b, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    shared = list(a.block_table)
    assert b.block_table[:2] == shared  # a's last block is full and shared with b
    assert bm.blocks_needed(a, 1) == 1 and bm.blocks_needed(b, 1) == 0
    bm.append(a, [5])
    assert a.block_table[:2] == shared and a.block_table[2] not in b.block_table
    assert bm.slots(a, 8, 9) == [a.block_table[2] * 4]
    bm.append(b, [0, 0, 0, 0])  # b's partial last block is its own: written in place
    assert b.block_table[:3] == shared + [b.block_table[2]] and len(b.block_table) == 4
    assert bm.stats() == BlockStats(num_blocks=8, free=3, cached=0, in_use=5, reuse_hits=2)
    bm.check_invariants()


def test_out_of_blocks_is_atomic_and_explains():
    bm = BlockManager(num_blocks=3, block_size=2)
    seq = allocated(bm, [1, 2, 3])
    before = (bm.stats(), list(seq.block_table), list(seq.token_ids), list(seq.hashes))
    with pytest.raises(OutOfBlocks, match=r"need 2 KV blocks but only 1 .*KV cache budget"):
        bm.append(seq, [4, 5, 6, 7])
    other = Sequence()
    with pytest.raises(OutOfBlocks):
        bm.allocate(other, [1, 2, 3, 4, 5])
    assert (bm.stats(), seq.block_table, seq.token_ids, seq.hashes) == before
    assert not other
    bm.check_invariants()


def test_lru_evicts_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=1)
    s1 = allocated(bm, [1, 2])  # block size 1: both blocks are full, so both get hashed
    s2 = allocated(bm, [5, 6])
    (a1, a2), (b1, b2) = s1.block_table, s2.block_table
    bm.free(s1)  # tail first, so a sequence's prefix outlives its tail: LRU a2, a1
    bm.free(s2)  # LRU a2, a1, b2, b1
    assert bm.stats() == BlockStats(num_blocks=4, free=0, cached=4, in_use=0, reuse_hits=0)
    s3 = allocated(bm, [9])
    assert s3.block_table == [a2]
    bm.free(s3)  # LRU a1, b2, b1, a2
    s4 = Sequence()
    assert bm.allocate(s4, [1, 2, 3]) == 1  # [1] is still cached, [1, 2] was evicted
    assert s4.block_table == [a1, b2, b1]
    assert bm.stats() == BlockStats(num_blocks=4, free=0, cached=1, in_use=3, reuse_hits=1)
    bm.check_invariants()


def test_errors():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = allocated(bm, [1])
    with pytest.raises(ValueError):
        bm.allocate(seq, [2])  # already holds tokens
    empty = Sequence()
    with pytest.raises(ValueError):
        bm.allocate(empty, [])
    assert not empty
    with pytest.raises(ValueError):
        bm.slots(seq, 0, 2)
    with pytest.raises(ValueError):
        bm.blocks_needed(seq, -1)
    assert bm.blocks_needed(None, 3) == bm.blocks_needed(Sequence(), 3) == 2
    with pytest.raises(KeyError):
        bm.append(Sequence(), [1])
    with pytest.raises(KeyError):
        bm.free(allocated(BlockManager(num_blocks=4, block_size=2), [1]))  # held by another manager
    bm.free(seq)
    with pytest.raises(KeyError):
        bm.free(seq)
    with pytest.raises(KeyError):
        bm.append(seq, [3])
    assert bm.allocate(seq, [4, 5, 6]) == 0  # a freed sequence is empty and can be allocated again
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    bm.check_invariants()


# -- model-based property test --------------------------------------------------

VOCAB = st.integers(min_value=0, max_value=2)


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 16), block_size=st.integers(1, 4), reuse=st.booleans())
    def setup(self, num_blocks: int, block_size: int, reuse: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_block_reuse=reuse)
        self.bs = block_size
        self.reuse = reuse
        self.seqs: dict[int, Sequence] = {}
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
            {s: (list(q.block_table), list(q.token_ids), list(q.hashes)) for s, q in self.seqs.items()},
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
        for pos, slot in zip(range(start, end), self.bm.slots(self.seqs[seq], start, end)):
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
        sid, self.next_id = self.next_id, self.next_id + 1
        seq = Sequence()
        if not tokens:
            with pytest.raises(ValueError):
                self.bm.allocate(seq, tokens)
            assert not seq
            return
        bs = self.bs
        expected_hits = []
        for i in range((len(tokens) - 1) // bs if self.reuse else 0):
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
            assert self.snapshot() == before and not seq
            return
        cached = self.bm.allocate(seq, tokens)
        assert cached == len(expected_hits) * bs and cached <= len(tokens) - 1
        table = list(seq.block_table)
        assert table[: len(expected_hits)] == expected_hits, "reused blocks differ from the cached prefix"
        self.lru = lru_after_hits
        self.take_blocks(table[len(expected_hits) :], lru_after_hits, free_before)
        self.seqs[sid], self.tables[sid], self.tokens[sid] = seq, table, list(tokens)
        self.register_full_blocks(sid, len(expected_hits))
        refs = self.refs()
        assert all(refs[b] == 1 for b in table[len(expected_hits) :])
        self.write(sid, cached, len(tokens))
        self.hits += len(expected_hits)
        self.history.append(list(tokens))

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), new=st.lists(VOCAB, min_size=1, max_size=6))
    def append(self, data, new: list[int]) -> None:
        sid = self.pick(data)
        seq = self.seqs[sid]
        bs, n, table = self.bs, len(self.tokens[sid]), self.tables[sid]
        refs = self.refs()
        cow = bool(n % bs) and refs[table[-1]] > 1  # a partial last block shared with a fork: copied first
        if n % bs:
            assert table[-1] not in self.hashed(), "a partial block is hashed"
        needed = cdiv(n + len(new), bs) - cdiv(n, bs) + cow
        assert self.bm.blocks_needed(seq, len(new)) == needed
        free_before = self.unhashed_free()
        before = self.snapshot()
        if needed > free_before + len(self.lru):
            with pytest.raises(OutOfBlocks):
                self.bm.append(seq, new)
            assert self.snapshot() == before
            return
        copies = self.bm.append(seq, new)
        new_table = list(seq.block_table)
        kept = len(table) - cow
        assert new_table[:kept] == table[:kept]
        if cow:
            assert copies == [(table[-1], new_table[kept])] and new_table[kept] != table[-1]
            self.content[new_table[kept]] = list(self.content[table[-1]])  # the storage copies the written part
        else:
            assert copies == []
        self.take_blocks(new_table[kept:], list(self.lru), free_before)  # a copied block keeps its other users
        self.tables[sid] = new_table
        self.tokens[sid] = self.tokens[sid] + new
        self.register_full_blocks(sid, n // bs)
        refs = self.refs()
        written = set(new_table[n // bs :])
        assert all(refs[b] == 1 for b in written), "an appended position lands in a shared block"
        self.write(sid, n, n + len(new))
        self.history.append(list(self.tokens[sid]))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = self.pick(data)
        sid, self.next_id = self.next_id, self.next_id + 1
        child = Sequence()
        before = self.bm.num_free_blocks()
        self.bm.fork(self.seqs[parent], child)
        assert self.bm.num_free_blocks() == before, "a fork takes no block"
        assert child.block_table == self.tables[parent] and child.token_ids == self.tokens[parent]
        self.seqs[sid], self.tables[sid], self.tokens[sid] = child, list(self.tables[parent]), list(
            self.tokens[parent])
        with pytest.raises(ValueError):  # only into an empty sequence
            self.bm.fork(self.seqs[parent], child)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = self.pick(data)
        seq = self.seqs.pop(sid)
        self.bm.free(seq)
        assert not seq and seq.block_table == [] and seq.hashes == []
        blocks = self.tables.pop(sid)
        del self.tokens[sid]
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
        assert self.seqs.keys() == self.tables.keys()
        for sid, table in self.tables.items():
            seq = self.seqs[sid]
            assert seq
            assert seq.block_table == table
            assert seq.token_ids == self.tokens[sid] and len(seq) == len(self.tokens[sid])
            read = [self.content[table[p // self.bs]][p % self.bs] for p in range(len(self.tokens[sid]))]
            assert read == self.tokens[sid], f"sequence {sid} reads back wrong KV"
        for prefix, b in self.prefix_block.items():  # cached blocks hold what their prefix says
            assert self.content[b] == list(prefix[-self.bs :])

    def teardown(self) -> None:
        for seq in self.seqs.values():
            self.bm.free(seq)
        self.seqs.clear()
        self.tables.clear()
        self.bm.check_invariants()
        stats = self.bm.stats()
        assert stats.in_use == 0 and stats.free + stats.cached == stats.num_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.pytestmark = [pytest.mark.slow]  # hypothesis' runs of the machine: seconds
