"""Fixed-size KV blocks: a free list, reference counts, per-sequence block tables. Mechanism only.

The block manager answers ``can_allocate / allocate / append_slot / free`` and keeps counters; it
never decides *who* gets blocks (that is ``LLMScheduler``). A failed ``allocate`` raises
``NoFreeBlocksError`` and changes nothing, so callers may probe and back off.

Prefix caching (optional) follows vLLM's design: every *full, computed* block gets a key chained
from its parent's key and its own tokens, ``key_i = (hash(key_{i-1}), tokens_i)``. A new sequence
whose prompt starts with the same full blocks shares them (reference count + 1) instead of
computing them again. A freed block keeps its key while it sits in the free list, so it can still be
hit; it loses the key only when it is handed out again. The free list is LRU ordered and a sequence's
blocks are freed tail first, so a shared prefix outlives the tails that hang off it.

```
 free list (evict from the left) ─▶ [ b7 | b3 (key k2) | b9 (key k1) ]
 cache: {k1: b9, k2: b3}            ref[b] == 0 for every b in the free list
```

Host swap space (``SwapSpace``: the host blocks a preempted sequence's device blocks are copied to)
is the file's last section: the same mechanism, on the host.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

BlockKey = tuple[int, tuple[int, ...]]
Source = tuple[int, int]  # (sequence id, its leading computed tokens another sequence may share)


class NoFreeBlocksError(RuntimeError):
    """Not enough free KV blocks for the requested allocation; nothing was changed."""


@dataclass(frozen=True, slots=True)
class BlockStats:
    num_blocks: int
    num_free: int
    num_used: int
    usage: float  # used / total
    fragmentation: float  # share of allocated slots that hold no token (internal fragmentation)
    num_cached_free: int  # free blocks still holding a prefix-cache key
    num_cache_hit_tokens: int
    num_failed_allocations: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Block tables of ``block_size`` token slots over a pool of ``num_blocks`` blocks."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"block manager: num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block manager: block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._key_of: list[BlockKey | None] = [None] * num_blocks
        self._cache: dict[BlockKey, int] = {}
        self._tables: dict[int, list[int]] = {}
        self._num_slots_used: dict[int, int] = {}
        self._num_hashed: dict[int, int] = {}  # per sequence: leading blocks already keyed
        self._num_cached_free = 0  # free blocks still holding a key (kept as they move: stats() per step)
        self.num_cache_hit_tokens = 0
        self.num_failed_allocations = 0

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's blocks in position order (a copy: plans must not alias live state)."""
        return list(self._tables.get(seq_id, ()))

    def has_blocks(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def blocks_for(self, num_tokens: int) -> int:
        return _ceil_div(num_tokens, self.block_size)

    def _prefix_hits(self, token_ids: Sequence[int], source: Source | None = None) -> list[int]:
        """Blocks to share for the longest run of leading full blocks, leaving >= 1 token to compute (the
        step that computes the last prompt token is the one that yields logits): the prefix cache's, or
        with ``source = (seq_id, tokens)``, the blocks of that sequence's first ``tokens`` tokens (the
        samples of one prompt share its blocks whether or not the prefix cache is on; the caller vouches
        that those tokens are computed and that ``token_ids`` starts with them)."""
        hits: list[int] = []
        bs = self.block_size
        limit = (len(token_ids) - 1) // bs
        if source is not None:
            return list(self._tables.get(source[0], [])[: min(limit, source[1] // bs)])
        if not self.enable_prefix_caching:
            return hits
        parent = 0
        for i in range(limit):
            key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            block = self._cache.get(key)
            if block is None:
                break
            hits.append(block)
            parent = hash(key)
        return hits

    def num_cached_tokens(self, seq_id: int, token_ids: Sequence[int], source: Source | None = None) -> int:
        """Tokens a sequence without blocks would get from the prefix cache (or ``source``) on
        ``allocate``."""
        if seq_id in self._tables:
            return 0
        return len(self._prefix_hits(token_ids, source)) * self.block_size

    def _free_blocks_needed(self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None,
                            source: Source | None = None) -> int:
        table = self._tables.get(seq_id)
        if table is not None:
            return max(0, self.blocks_for(num_tokens) - len(table))
        hits = self._prefix_hits(token_ids, source) if token_ids is not None else []
        revived = sum(1 for b in hits if self._ref[b] == 0)  # cached but free: taking it uses a free block
        return max(0, self.blocks_for(num_tokens) - len(hits)) + revived

    def can_allocate(self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None = None,
                     source: Source | None = None) -> bool:
        """Whether the sequence's table can grow to hold ``num_tokens`` KV slots in total."""
        return self._free_blocks_needed(seq_id, num_tokens, token_ids, source) <= len(self._free)

    # -- mutations ---------------------------------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None = None,
                 source: Source | None = None) -> int:
        """Grow the sequence's table to hold ``num_tokens`` slots; return prefix-cache hit tokens.

        ``token_ids`` (the sequence's tokens so far) is only used on the first allocation, to look up
        the prefix cache, or with ``source`` to share that sequence's leading full blocks (``_prefix_hits``).
        Raises ``NoFreeBlocksError`` with the state untouched when blocks run out.
        """
        needed = self._free_blocks_needed(seq_id, num_tokens, token_ids, source)
        if needed > len(self._free):
            self.num_failed_allocations += 1
            raise NoFreeBlocksError(
                f"sequence {seq_id} needs {needed} "
                f"free KV blocks for {num_tokens} tokens, {len(self._free)} are free"
            )
        hit_tokens = 0
        table = self._tables.get(seq_id)
        if table is None:
            table = []
            hits = self._prefix_hits(token_ids, source) if token_ids is not None else []
            for b in hits:
                if self._ref[b] == 0:
                    del self._free[b]
                    self._num_cached_free -= self._key_of[b] is not None
                self._ref[b] += 1
                table.append(b)
            hit_tokens = len(hits) * self.block_size
            self.num_cache_hit_tokens += hit_tokens
            self._tables[seq_id] = table
            self._num_hashed[seq_id] = len(hits)
            self._num_slots_used[seq_id] = hit_tokens
        while len(table) < self.blocks_for(num_tokens):
            b, _ = self._free.popitem(last=False)
            key = self._key_of[b]
            if key is not None:  # evict: this block's cached contents are about to be overwritten
                del self._cache[key]
                self._key_of[b] = None
                self._num_cached_free -= 1
            self._ref[b] = 1
            table.append(b)
        self._num_slots_used[seq_id] = max(self._num_slots_used[seq_id], num_tokens)
        return hit_tokens

    def append_slot(self, seq_id: int) -> None:
        """Room for one more token (a decode step). Raises ``NoFreeBlocksError`` if a block is needed."""
        self.allocate(seq_id, self._num_slots_used.get(seq_id, 0) + 1)

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references; blocks reaching zero go to the free list, tail first."""
        table = self._tables.pop(seq_id, None)
        self._num_slots_used.pop(seq_id, None)
        self._num_hashed.pop(seq_id, None)
        if table is None:
            return
        for b in reversed(table):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                self._num_cached_free += self._key_of[b] is not None

    def on_computed(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Key the sequence's blocks that are now full of computed KV, so later prompts can share them.

        Called after a step, never at allocation: a block is only shareable once its KV is written.
        If another block already holds the same key (computed concurrently), this one stays unkeyed.
        """
        if not self.enable_prefix_caching or seq_id not in self._tables:
            return
        table = self._tables[seq_id]
        bs = self.block_size
        done = self._num_hashed[seq_id]
        full = min(num_computed // bs, len(table))
        if full <= done:
            return
        parent = 0
        if done:
            prev_key = self._key_of[table[done - 1]]
            if prev_key is None:  # the chain broke on a concurrent duplicate: children are unreachable
                self._num_hashed[seq_id] = full
                return
            parent = hash(prev_key)
        for i in range(done, full):
            key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            b = table[i]
            if key not in self._cache and self._key_of[b] is None:
                self._cache[key] = b
                self._key_of[b] = key
            elif self._cache.get(key) != b:
                self._num_hashed[seq_id] = full
                return
            parent = hash(key)
        self._num_hashed[seq_id] = full

    # -- counters ----------------------------------------------------------------------------
    def stats(self) -> BlockStats:
        allocated = sum(len(t) for t in self._tables.values()) * self.block_size
        used = sum(self._num_slots_used.values())
        return BlockStats(
            num_blocks=self.num_blocks,
            num_free=len(self._free),
            num_used=self.num_used_blocks,
            usage=self.num_used_blocks / self.num_blocks,
            fragmentation=(1.0 - used / allocated) if allocated else 0.0,
            num_cached_free=self._num_cached_free,
            num_cache_hit_tokens=self.num_cache_hit_tokens,
            num_failed_allocations=self.num_failed_allocations,
        )


# -- Host swap space -------------------------------------------------------------------------------
# Host swap space: the host KV blocks a preempted sequence's device blocks are copied to. Mechanism only.
#
# ``SwapSpace(num_blocks)`` is a free list of host block numbers and, per swapped sequence, its host table
# (the host blocks holding its device blocks' contents, in position order). It moves a sequence between
# the device pool (``BlockManager``) and the host pool and returns the block copies that move implies;
# it never decides *who* is swapped or when (that is ``LLMScheduler`` with ``core/llm/scheduler.py``).
#
# ```
#  swap_out(bm, seq, k):  device table [d0 d1 d2 ...]  ─copy d_i -> h_i─▶  host table [h0 h1 ... h_{k-1}]
#                         the device table is freed; returns [(d0, h0), ..., (d_{k-1}, h_{k-1})]
#  swap_in(bm, seq, n):   device blocks for n tokens (fresh)  ◀─copy h_i -> d_i─  host table, then freed
#                         returns [(h0, d0), ..., (h_{k-1}, d_{k-1})]
# ```
#
# The copies are plain data for the model runner, which must make them before the step's forward (the
# device blocks a swap-out frees may be handed to another sequence in the same step). Host blocks are
# never shared: a swapped sequence owns its host table alone.

class NoFreeSwapBlocksError(RuntimeError):
    """Not enough free host blocks for a swap-out; nothing was changed."""


class SwapSpace:
    """``num_blocks`` host KV blocks (0: no swap space; every swap-out fails)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"swap space: num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def has(self, seq_id: int) -> bool:
        """Whether the sequence is swapped out (holds host blocks)."""
        return seq_id in self._tables

    def host_table(self, seq_id: int) -> list[int]:
        """The sequence's host blocks in position order (a copy)."""
        return list(self._tables.get(seq_id, ()))

    def swap_out(self, bm: BlockManager, seq_id: int, num_blocks: int) -> list[tuple[int, int]]:
        """Copy the first ``num_blocks`` blocks of the sequence's device table to fresh host blocks, then
        free its whole device table. Returns the ``(device_block, host_block)`` copies to make.

        Raises ``NoFreeSwapBlocksError`` (nothing changed) when fewer than ``num_blocks`` host blocks are
        free, ``ValueError`` when the sequence is already swapped out or has fewer device blocks."""
        table = bm.block_table(seq_id)
        if seq_id in self._tables:
            raise ValueError(f"swap space: sequence {seq_id} is already swapped out")
        if num_blocks > len(table):
            raise ValueError(f"swap space: sequence {seq_id} has {len(table)} device blocks, "
                             f"asked to swap out {num_blocks}")
        if num_blocks > len(self._free):
            raise NoFreeSwapBlocksError(f"sequence {seq_id} needs {num_blocks} host blocks, "
                                        f"{len(self._free)} are free")
        host = [self._free.popleft() for _ in range(num_blocks)]
        self._tables[seq_id] = host
        bm.free(seq_id)
        return list(zip(table[:num_blocks], host, strict=True))

    def swap_in(self, bm: BlockManager, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Give the swapped sequence fresh device blocks for ``num_tokens`` slots (at least as many as it
        has host blocks), free its host blocks, and return the ``(host_block, device_block)`` copies.

        Raises ``NoFreeBlocksError`` from the block manager (nothing changed) when the device pool is
        short, ``ValueError`` when the sequence is not swapped out or already has device blocks."""
        host = self._tables.get(seq_id)
        if host is None:
            raise ValueError(f"swap space: sequence {seq_id} is not swapped out")
        if bm.has_blocks(seq_id):
            raise ValueError(f"swap space: sequence {seq_id} already has device blocks")
        if bm.blocks_for(num_tokens) < len(host):
            raise ValueError(f"swap space: {num_tokens} tokens do not cover the {len(host)} swapped blocks "
                             f"of sequence {seq_id}")
        bm.allocate(seq_id, num_tokens)  # no token ids: fresh blocks, no prefix-cache lookup
        del self._tables[seq_id]
        self._free.extend(host)
        return list(zip(host, bm.block_table(seq_id), strict=False))

    def free(self, seq_id: int) -> None:
        """Drop a swapped sequence's host blocks without copying them back (an abort). No-op if none."""
        host = self._tables.pop(seq_id, None)
        if host is not None:
            self._free.extend(host)
