"""The block manager: reference counts, prefix hits by chained hashes, LRU eviction, nothing leaked."""

from kiln.llm.kv_cache import BlockManager
from kiln.llm.sampling import SamplingParams
from kiln.llm.sequence import Sequence


def seq(tokens):
    return Sequence("r", 0, list(tokens), SamplingParams())


def run_prompt(bm, s):
    """What the scheduler and a step do for a whole prompt: cached prefix, new blocks, mark computed."""
    cached = bm.allocate_cached_prefix(s)
    s.num_computed_tokens = cached
    bm.append_slots(s, s.num_tokens - cached)
    s.num_computed_tokens = s.num_tokens
    bm.mark_computed(s)
    return cached


def test_prefix_hit_shares_blocks_by_refcount():
    bm = BlockManager(8, block_size=4)
    a = seq(range(10))  # blocks: [0..3] [4..7] [8, 9]
    assert run_prompt(bm, a) == 0 and len(a.block_table) == 3 and bm.num_free_blocks == 5
    b = seq(list(range(8)) + [50, 51, 52])
    assert run_prompt(bm, b) == 8  # two full blocks shared
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    c = seq([0, 1, 2, 3, 99, 5, 6, 7, 8])  # second block differs: the chain breaks there
    assert run_prompt(bm, c) == 4
    for s in (a, b, c):
        bm.free_sequence(s)
    assert bm.num_free_blocks == 8 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_whole_prompt_cached_still_computes_its_last_token():
    bm = BlockManager(8, block_size=4)
    a = seq(range(8))
    run_prompt(bm, a)
    bm.free_sequence(a)
    b = seq(range(8))
    assert bm.allocate_cached_prefix(b) == 4  # the last block is recomputed, so the last token has logits


def test_freed_cached_blocks_evicted_least_recently_freed_first():
    bm = BlockManager(4, block_size=2)
    a, b = seq([1, 2, 3]), seq([5, 6, 7])
    run_prompt(bm, a)
    run_prompt(bm, b)
    bm.free_sequence(a)  # a's full block [1, 2] freed first...
    bm.free_sequence(b)  # ...then b's [5, 6]; the partial tail blocks hold nothing reusable
    c = seq([9, 9, 9, 9, 9])  # needs 3 blocks: the two uncached tails, then evicts a's cached block
    assert run_prompt(bm, c) == 0
    assert bm.allocate_cached_prefix(seq([1, 2, 0])) == 0  # evicted
    d = seq([5, 6, 0])
    assert bm.allocate_cached_prefix(d) == 2  # b's survived
    bm.free_sequence(d)
    bm.free_sequence(c)
    assert bm.num_free_blocks == 4


def test_prefix_caching_off_and_decode_growth():
    bm = BlockManager(4, block_size=2, enable_prefix_caching=False)
    a = seq([1, 2, 3])
    run_prompt(bm, a)
    bm.free_sequence(a)
    b = seq([1, 2, 3])
    assert bm.allocate_cached_prefix(b) == 0
    bm.append_slots(b, 3)
    b.num_computed_tokens = 3
    b.token_ids.append(4)
    assert bm.blocks_needed(b, 1) == 0  # the 4th token fits the second block
    b.token_ids.append(5)
    b.num_computed_tokens = 4
    assert bm.blocks_needed(b, 1) == 1 and bm.can_append(b, 1)
    bm.free_sequence(b)
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 0


def test_freed_sequence_gets_a_new_table():
    """The runner tells a sequence's block tables apart by the list object: freeing gives a new one."""
    bm = BlockManager(4, block_size=4)
    s = seq(range(6))
    run_prompt(bm, s)
    table = s.block_table
    bm.free_sequence(s)
    assert s.block_table == [] and s.block_table is not table and bm.num_free_blocks == 4
