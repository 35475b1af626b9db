"""The prefix tree and block pool: token-exact reuse, ref counts, LRU eviction of whole subtrees."""

import pytest
import torch

from svrmad_local.engine.block_manager import BlockManager, CacheFull


def fill(bm, tokens, parent=None):
    """Allocate and index blocks for `tokens` like a finished sequence would."""
    bs, blocks = bm.block_size, []
    for i in range(0, len(tokens), bs):
        b = bm.allocate()
        b = bm.register(blocks[-1] if blocks else parent, b, tuple(tokens[i : i + bs]))
        blocks.append(b)
    return blocks


def test_full_blocks_shared_partial_copied():
    bm = BlockManager(16, 4)
    seq = fill(bm, list(range(10)))  # blocks [0-3] [4-7] [8,9]
    bm.release(seq)
    shared, covered, partial = bm.match(list(range(9)) + [99, 98], limit=10)
    assert shared == seq[:2] and covered == 8
    assert partial == (seq[2], 1)  # token 8 matches inside the partial block: copy one row
    assert all(bm.ref[b] == 1 for b in shared) and bm.ref[seq[2]] == 1


def test_match_respects_limit_and_divergence():
    bm = BlockManager(16, 4)
    bm.release(fill(bm, [1, 2, 3, 4, 5, 6, 7, 8]))
    shared, covered, partial = bm.match([1, 2, 3, 4, 5, 6, 7, 8], limit=7)
    assert covered == 4 and partial[1] == 3  # never the whole prompt: its last token is recomputed
    bm.release(shared + [partial[0]])
    shared, covered, partial = bm.match([1, 2, 9, 9], limit=4)
    assert shared == [] and covered == 0 and partial[1] == 2


def test_register_adopts_identical_block():
    bm = BlockManager(8, 2)
    a = fill(bm, [1, 2, 3, 4])
    b0 = bm.allocate()
    adopted = bm.register(None, b0, (1, 2))
    assert adopted == a[0] and bm.ref[a[0]] == 2 and b0 in bm.free


def test_lru_evicts_subtrees_and_never_referenced_blocks():
    bm = BlockManager(4, 2)
    old = fill(bm, [1, 2, 3, 4])
    bm.release(old)
    held = fill(bm, [5, 6, 7, 8])  # uses the two free blocks
    assert bm.num_free == 2  # the old chain is evictable
    x = bm.allocate()  # the leaf is least recently used: it goes first, its parent stays cached
    assert bm.evictions == 1
    shared, covered, _ = bm.match([1, 2, 3, 4], 4)
    assert covered == 2
    bm.release(shared)
    bm.allocate()
    with pytest.raises(CacheFull):
        bm.allocate()
    assert bm.peak_used == 4 and all(bm.ref[b] == 1 for b in held + [x])


def test_release_twice_is_caught():
    bm = BlockManager(2, 2)
    b = bm.allocate()
    bm.release([b])
    with pytest.raises(AssertionError):
        bm.release([b])


def test_evicting_a_block_drops_its_whole_subtree():
    bm = BlockManager(6, 2)
    chain = fill(bm, [1, 2, 3, 4, 5, 6])
    bm.release(chain)
    bm._evict(chain[0])
    assert bm.evictions == 3 and bm.num_free == 6 and not bm.root.children


def test_block_tables_give_the_cpu_kernel_int64_once_a_step():
    """The compiled CPU decode kernel takes int64 ids: the step's int32 tables are converted on first use
    and the same tensors serve every later layer (the general attention path and our decoder alike)."""
    from svrmad_local.engine.kv_cache import BlockTables

    t = BlockTables.of_runs([(0, 5, [3, 1]), (0, 2, [2])], "cpu")
    assert t.block_table.dtype == torch.int32
    table, lens = t.as_long()
    assert table.dtype == lens.dtype == torch.int64
    assert table.tolist() == [[3, 1], [2, 0]] and lens.tolist() == [5, 2]
    again = t.as_long()
    assert again[0] is table and again[1] is lens
