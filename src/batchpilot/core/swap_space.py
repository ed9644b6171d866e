"""Host swap space: the host KV blocks a preempted sequence's device blocks are copied to. Mechanism only.

``SwapSpace(num_blocks)`` is a free list of host block numbers and, per swapped sequence, its host table
(the host blocks holding its device blocks' contents, in position order). It moves a sequence between
the device pool (``BlockManager``) and the host pool and returns the block copies that move implies;
it never decides *who* is swapped or when (that is ``LLMScheduler`` with ``core/preemption.py``).

```
 swap_out(bm, seq, k):  device table [d0 d1 d2 ...]  ─copy d_i -> h_i─▶  host table [h0 h1 ... h_{k-1}]
                        the device table is freed; returns [(d0, h0), ..., (d_{k-1}, h_{k-1})]
 swap_in(bm, seq, n):   device blocks for n tokens (fresh)  ◀─copy h_i -> d_i─  host table, then freed
                        returns [(h0, d0), ..., (h_{k-1}, d_{k-1})]
```

The copies are plain data for the model runner, which must make them before the step's forward (the
device blocks a swap-out frees may be handed to another sequence in the same step). Host blocks are
never shared: a swapped sequence owns its host table alone.
"""

from __future__ import annotations

from collections import deque

from batchpilot.core.block_manager import BlockManager


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
