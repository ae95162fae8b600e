"""Paged KV-cache bookkeeping: which block holds which tokens, with prefix reuse.

Pure Python, no tensors. A ``Sequence`` owns its tokens and its block table
(block ids, one per ``block_size`` tokens); the ``BlockManager`` is the operations
on it. Full blocks are keyed by a chained content hash so a new sequence with the
same token prefix reuses their KV instead of recomputing it. Blocks nobody
references but whose hash is known stay cached (LRU, oldest evicted first) until
a new block is needed and the free list is empty. A sequence forks into children
that share all its blocks by reference count; the first write into a shared partial
last block gives the writer a copy of its own (copy-on-write: ``append`` returns
the copies the storage must make).

Images and audio clips in a sequence (``MediaSpan``) enter the block keys: a block that holds part of one is keyed
by the digest of its decoded pixels (or samples) and where it starts relative to the block, so the same
placeholder tokens of another image or clip, or the same one at another offset, miss. A reused prefix never ends
inside an image (or clip):
the image's tokens are computed together again (the feature rows are at hand, not the KV of half an image).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from cabinllm.runtime.errors import OutOfBlocks


@dataclass
class BlockStats:
    """Block counts; ``reuse_hits`` is the cumulative number of blocks served from the prefix cache."""

    num_blocks: int
    free: int
    cached: int
    in_use: int
    reuse_hits: int


@dataclass
class _Block:
    ref_count: int = 0
    hash: bytes | None = None


@dataclass(frozen=True)
class MediaSpan:
    """A picture's or clip's tokens in a sequence: positions [start, start + length), keyed by ``digest`` (of its
    decoded pixels or samples); ``grid`` (t, h, w) lays its tokens out in M-RoPE positions where the model has them
    (Qwen2-VL)."""

    start: int
    length: int
    digest: bytes
    grid: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        """The position after the image's last token."""
        return self.start + self.length

    def shifted(self, offset: int) -> "MediaSpan":
        """The same image ``offset`` positions later."""
        return MediaSpan(self.start + offset, self.length, self.digest, self.grid)


@dataclass(eq=False)
class Sequence:
    """One sequence's tokens, the KV blocks that hold them and the chained hash of each full block.

    Empty until a BlockManager allocates it, empty again once freed; only the manager writes it.
    """

    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # chained hash of each full block, registered or not
    media: list[MediaSpan] = field(default_factory=list)  # its images, in order of position

    def __len__(self) -> int:
        return len(self.token_ids)


def _chain_hash(prev: bytes, token_ids: list[int], media: list[tuple[bytes, int]]) -> bytes:
    """blake2b of the previous block's hash, this block's token ids and the (digest, start relative to the
    block) of each image it holds part of."""
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    for digest, start in media:
        h.update(digest)
        h.update(start.to_bytes(8, "little", signed=True))
    return h.digest()


def whole_media_prefix(tokens: int, media: list[MediaSpan]) -> int:
    """The longest prefix of at most ``tokens`` positions that ends outside every image (at a span's start where
    ``tokens`` would end inside it)."""
    for span in media:
        if span.start < tokens < span.end:
            return span.start
    return tokens


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks of ``b`` tokens that ``a`` tokens take."""
    return -(-a // b)


def fork_blocks(forks: int, reply_tokens: int, tokens_per_block: int) -> int:
    """Blocks ``forks`` sequences forked from one prompt may add at most: each its reply's blocks and its copy of
    the shared last block (copy-on-write). The one formula for choices and beams."""
    return forks * (cdiv(max(reply_tokens, 0), tokens_per_block) + 1)


class BlockManager:
    """Allocates KV blocks to sequences, with prefix caching and LRU eviction of cached blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_block_reuse: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must both be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_block_reuse = enable_block_reuse
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced hashed blocks, oldest first
        self._hash_to_block: dict[bytes, int] = {}
        self._seqs: set[Sequence] = set()
        self._reuse_hits = 0

    # -- sequences ---------------------------------------------------------

    def allocate(self, seq: Sequence, token_ids: list[int], reusable: Callable[[list[int]], int] | None = None,
                 media: list[MediaSpan] = ()) -> int:
        """Fill an empty sequence with ``token_ids`` (``media``: the images among them); return how many leading
        tokens already have cached KV (``reusable`` says how many of the cached leading blocks the storage can still
        serve)."""
        if seq:
            raise ValueError(f"the sequence already holds {len(seq)} tokens; free it first")
        if not token_ids:
            raise ValueError("token_ids is empty")
        token_ids, media = list(token_ids), list(media)
        bs = self.block_size
        hashes = self._full_block_hashes(b"", token_ids, 0, media)
        hits = self._reusable_hits(hashes, len(token_ids), reusable, media)
        num_new = cdiv(len(token_ids), bs) - len(hits)
        available = self.num_free_blocks() - sum(self._blocks[b].ref_count == 0 for b in hits)
        self._check_available(num_new, available)
        for block_id in hits:
            self._acquire(block_id)
        table = hits + [self._take_block() for _ in range(num_new)]
        for i in range(len(hits), len(hashes)):
            self._register(table[i], hashes[i])
        self._reuse_hits += len(hits)
        seq.token_ids, seq.block_table, seq.hashes, seq.media = token_ids, table, hashes, media
        self._seqs.add(seq)
        return len(hits) * bs

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Make the empty ``child`` hold ``parent``'s tokens in the same blocks, shared by reference."""
        self._check_live(parent)
        if child:
            raise ValueError(f"the child already holds {len(child)} tokens; fork into an empty sequence")
        for block_id in parent.block_table:
            self._acquire(block_id)
        child.token_ids, child.block_table, child.hashes, child.media = (
            list(parent.token_ids), list(parent.block_table), list(parent.hashes), list(parent.media))
        self._seqs.add(child)

    def append(self, seq: Sequence, token_ids: list[int], media: list[MediaSpan] = ()) -> list[tuple[int, int]]:
        """Extend a sequence with new blocks as needed (``media``: images among the new tokens, at their positions
        in the sequence); returns the (source, copy) blocks whose written K/V the storage must copy first.

        Prefix reuse shares only full blocks, but a fork shares the parent's partial last block: the first
        sequence to write into it gets a copy of its own (copy-on-write); the others keep the original.
        """
        self._check_live(seq)
        if not token_ids:
            return []
        self._check_available(self.blocks_needed(seq, len(token_ids)), self.num_free_blocks())
        bs = self.block_size
        copies = []
        if self._shared_tail(seq):
            shared = seq.block_table[-1]
            seq.block_table[-1] = self._take_block()
            self._release(shared)
            copies.append((shared, seq.block_table[-1]))
        seq.token_ids.extend(token_ids)
        seq.media.extend(media)
        while len(seq.block_table) < cdiv(len(seq.token_ids), bs):
            seq.block_table.append(self._take_block())
        prev = seq.hashes[-1] if seq.hashes else b""
        new_hashes = self._full_block_hashes(prev, seq.token_ids, len(seq.hashes), seq.media)
        for i, h in enumerate(new_hashes, start=len(seq.hashes)):
            self._register(seq.block_table[i], h)
        seq.hashes.extend(new_hashes)
        return copies

    def free(self, seq: Sequence) -> None:
        """Release a sequence and empty it; its hashed blocks stay cached until evicted."""
        self._check_live(seq)
        for block_id in reversed(seq.block_table):  # tail first, so prefixes are evicted last
            self._release(block_id)
        self._seqs.remove(seq)
        seq.token_ids, seq.block_table, seq.hashes, seq.media = [], [], [], []

    def discard(self, seq: Sequence, written: int) -> None:
        """Free a sequence whose K/V was written only before position ``written`` (its forward pass failed): the
        blocks from there on lose their keys, so no later prefix reuses K/V that was never written."""
        self._check_live(seq)
        for block_id in seq.block_table[written // self.block_size:]:
            if self._blocks[block_id].hash is not None:
                self._unregister(block_id)
        self.free(seq)

    # -- queries -----------------------------------------------------------

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat KV slot (``block * block_size + offset``) of each token position in ``[start, end)``."""
        if not 0 <= start <= end <= len(seq.token_ids):
            raise ValueError(f"positions [{start}, {end}) outside the sequence's [0, {len(seq.token_ids)})")
        bs = self.block_size
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def blocks_to_admit(self, token_ids: list[int], reserve_tokens: int,
                        reusable: Callable[[list[int]], int] | None = None,
                        media: list[MediaSpan] = ()) -> tuple[int, int]:
        """For a new sequence of ``token_ids`` (``media`` among them) that may grow by ``reserve_tokens``: the free
        or evictable blocks it would take (new blocks plus reused cached ones that leave the LRU) and the tokens
        reused."""
        hashes = self._full_block_hashes(b"", token_ids, 0, list(media))
        hits = self._reusable_hits(hashes, len(token_ids), reusable, list(media))
        new = cdiv(len(token_ids) + reserve_tokens, self.block_size) - len(hits)
        return new + sum(self._blocks[b].ref_count == 0 for b in hits), len(hits) * self.block_size

    @property
    def num_sequences(self) -> int:
        """Sequences allocated (or forked) and not freed."""
        return len(self._seqs)

    def num_free_blocks(self) -> int:
        """Blocks available for new tokens: free plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    def blocks_needed(self, seq: Sequence | None, num_new_tokens: int) -> int:
        """Worst-case new blocks for an allocate (``seq`` None or empty) or an append (a shared partial last
        block's copy included), ignoring prefix reuse."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if not seq:
            return cdiv(num_new_tokens, self.block_size)
        n = len(seq.token_ids)
        copy = int(num_new_tokens > 0 and self._shared_tail(seq))
        return cdiv(n + num_new_tokens, self.block_size) - cdiv(n, self.block_size) + copy

    def stats(self) -> BlockStats:
        """Current block counts."""
        in_use = sum(b.ref_count > 0 for b in self._blocks)
        return BlockStats(self.num_blocks, len(self._free), len(self._lru), in_use, self._reuse_hits)

    def check_invariants(self) -> None:
        """Assert the internal bookkeeping is consistent (for tests and debugging)."""
        refs = [0] * self.num_blocks
        for seq in self._seqs:
            assert len(seq.block_table) == cdiv(len(seq.token_ids), self.block_size)
            assert len(seq.hashes) == len(seq.token_ids) // self.block_size
            assert len(set(seq.block_table)) == len(seq.block_table)
            for block_id in seq.block_table:
                refs[block_id] += 1
            if len(seq) % self.block_size:
                assert self._blocks[seq.block_table[-1]].hash is None, "a partial last block is hashed"
        free, cached = set(self._free), set(self._lru)
        assert len(free) == len(self._free) and not free & cached
        for block_id, block in enumerate(self._blocks):
            assert block.ref_count == refs[block_id], f"block {block_id}: ref {block.ref_count} != {refs[block_id]}"
            if block_id in free:
                assert block.ref_count == 0 and block.hash is None, f"free block {block_id} is referenced or hashed"
            elif block_id in cached:
                assert block.ref_count == 0 and block.hash is not None, f"cached block {block_id} is in use or unhashed"
            else:
                assert block.ref_count > 0, f"block {block_id} is leaked"
            if block.hash is not None:
                assert self._hash_to_block.get(block.hash) == block_id
        for h, block_id in self._hash_to_block.items():
            assert self._blocks[block_id].hash == h

    # -- internals ---------------------------------------------------------

    def _check_live(self, seq: Sequence) -> None:
        if seq not in self._seqs:
            raise KeyError("the sequence is not allocated in this cache; allocate it first")

    def _shared_tail(self, seq: Sequence) -> bool:
        """Whether the sequence's last block is partly written and shared with a fork (writing needs a copy)."""
        return bool(len(seq) % self.block_size) and self._blocks[seq.block_table[-1]].ref_count > 1

    def _full_block_hashes(self, prev: bytes, token_ids: list[int], first: int,
                           media: list[MediaSpan]) -> list[bytes]:
        """Chained hashes of full blocks ``first``, ``first + 1``, ...; ``prev`` is the hash of block ``first - 1``."""
        bs, hashes = self.block_size, []
        for i in range(first, len(token_ids) // bs):
            lo, hi = i * bs, (i + 1) * bs
            held = [(span.digest, span.start - lo) for span in media if span.start < hi and span.end > lo]
            prev = _chain_hash(prev, token_ids[lo:hi], held)
            hashes.append(prev)
        return hashes

    def _reusable_hits(self, hashes: list[bytes], num_tokens: int, reusable: Callable[[list[int]], int] | None,
                       media: list[MediaSpan]) -> list[int]:
        """The cached leading blocks a new sequence takes: those the storage can serve, ending outside every image."""
        hits = self._prefix_hits(hashes, num_tokens)
        hits = hits[:reusable(hits)] if reusable else hits
        return hits[:whole_media_prefix(len(hits) * self.block_size, media) // self.block_size]

    def _prefix_hits(self, hashes: list[bytes], num_tokens: int) -> list[int]:
        """Cached blocks holding the leading full blocks of a new sequence; its last token is always left to compute."""
        hits: list[int] = []
        for h in hashes[: (num_tokens - 1) // self.block_size] if self.enable_block_reuse else []:
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _check_available(self, needed: int, available: int) -> None:
        if needed > available:
            raise OutOfBlocks(
                f"need {needed} KV blocks but only {available} of {self.num_blocks} are free or evictable; "
                f"raise the KV cache budget (more blocks) or use shorter or fewer sequences"
            )

    def _take_block(self) -> int:
        """A fresh unreferenced, unhashed block with refcount 1: free list first, else evict the LRU cached one."""
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._lru.popitem(last=False)
            self._unregister(block_id)
        block = self._blocks[block_id]
        assert block.ref_count == 0 and block.hash is None
        block.ref_count = 1
        return block_id

    def _acquire(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._lru[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} released twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self._lru[block_id] = None
            else:
                self._free.append(block_id)

    def _register(self, block_id: int, h: bytes) -> None:
        """Key a just-filled block by its hash, unless another block already holds that content."""
        assert self._blocks[block_id].hash is None
        if h not in self._hash_to_block:
            self._hash_to_block[h] = block_id
            self._blocks[block_id].hash = h

    def _unregister(self, block_id: int) -> None:
        block = self._blocks[block_id]
        del self._hash_to_block[block.hash]
        block.hash = None
