"""The paged KV cache's block manager: fixed-size blocks, per-sequence block tables, reference counts, and
prefix caching by chained block hashes with LRU eviction.

A block is full once block_size of a sequence's tokens are computed into it; a full block gets the hash of
(its parent block's hash, its token ids), so equal hashes mean equal prefixes. Full blocks are never written
again, which is what lets several sequences share one by reference count. A block whose count drops to zero
goes back to the free list but keeps its hash and contents until it is handed out again: free cached blocks
are evicted least recently freed first, and blocks that hold nothing reusable are handed out before them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple = ()


def block_hash(parent: int | None, token_ids: tuple) -> int:
    return hash((parent, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # front: next out
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found cached

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, seq, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_append(self, seq, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free)

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]  # evicted: its contents are about to be overwritten
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def allocate_cached_prefix(self, seq) -> int:
        """On a sequence's first scheduling: take the cached blocks of its longest cached prefix of full blocks
        (never its last token, whose logits must be computed). Returns the number of tokens found cached."""
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        tokens, bs, parent = seq.token_ids, self.block_size, None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            parent = h
        seq.num_hashed_blocks, seq.last_block_hash = len(seq.block_table), parent
        return len(seq.block_table) * bs

    def record_prefix_lookup(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_prompt_tokens
            self.prefix_cache_hits += num_cached_tokens

    def try_append(self, seq, num_new_tokens: int) -> bool:
        """can_append and append_slots in one pass: gives seq its blocks and returns True, or returns False
        and changes nothing."""
        need = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free())
        return True

    def reserve(self, seq, num_tokens: int) -> bool:
        """Blocks for the first num_tokens tokens of seq, whatever it has computed (a step queued before the
        previous one's token is known); False, changing nothing, when the pool has too few."""
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free())
        return True

    def append_slots(self, seq, num_new_tokens: int) -> None:
        """Give seq enough blocks for its next num_new_tokens tokens (caller checked can_append)."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free())

    def mark_computed(self, seq) -> None:
        """After a step wrote seq's tokens: hash the blocks that became full so later prompts can share them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // bs):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                chunk = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                block.hash, block.token_ids = block_hash(seq.last_block_hash, chunk), chunk
                self.cached.setdefault(block.hash, block.block_id)
            seq.last_block_hash = block.hash
            seq.num_hashed_blocks = i + 1

    def free_sequence(self, seq) -> None:
        """Return seq's blocks. Its tail goes first, so a freed prompt's head stays cached longest."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:  # nothing reusable: hand it out before any cached block
                    self.free.move_to_end(block_id, last=False)
        seq.block_table = []  # a new list: the runner tells a sequence's tables apart by the list object
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks, seq.last_block_hash = 0, None

    def reset_prefix_cache(self) -> None:
        for block_id in self.free:
            self.blocks[block_id].hash, self.blocks[block_id].token_ids = None, ()
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].ref_count > 0}
