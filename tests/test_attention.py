"""Mask, positions and KV compaction helpers, by hand and against one-by-one decoding."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from recap.core import ROOT, DraftTree
from recap.decoding import reference_generate
from recap.verifier.acceptance import first_argmax
from recap.verifier.attention import compact_cache, tree_attention_mask, tree_positions


def test_mask_is_additive_float_with_visible_prefix():
    tree = DraftTree([1, 2, 3], [ROOT, ROOT, 0])
    mask = tree_attention_mask(tree.ancestor_matrix(), past_len=2, dtype=torch.bfloat16, device="cpu")
    assert mask.shape == (1, 1, 4, 6) and mask.dtype == torch.bfloat16
    blocked = torch.finfo(torch.bfloat16).min
    visible = (mask[0, 0] == 0).int().tolist()
    assert visible == [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0],  # sibling of node 0: cannot see it
        [1, 1, 1, 1, 0, 1],  # child of node 0
    ]
    assert bool((mask[0, 0][mask[0, 0] != 0] == blocked).all())


def test_positions_are_past_plus_depth_plus_offset():
    depths = np.array([0, 1, 1, 2, 3])
    assert tree_positions(depths, past_len=10).tolist() == [[10, 11, 11, 12, 13]]
    assert tree_positions(depths, past_len=10, offset=-4).tolist() == [[6, 7, 7, 8, 9]]


def _cache(length: int, layers: int = 2) -> DynamicCache:
    cache = DynamicCache()
    for layer in range(layers):
        keys = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1).repeat(1, 2, 1, 3) + 100 * layer
        cache.update(keys, -keys, layer)
    return cache


def test_compact_cache_moves_kept_slots_after_prefix():
    cache = _cache(10)  # 4 cached + 6 packed
    compact_cache(cache, past_len=4, keep=[0, 2, 5], packed=6)
    assert cache.get_seq_length() == 7
    for index, layer in enumerate(cache.layers):
        expected = torch.tensor([0, 1, 2, 3, 4, 6, 9], dtype=torch.float32) + 100 * index
        assert torch.equal(layer.keys[0, 0, :, 0], expected)
        assert torch.equal(layer.values[0, 1, :, 2], -expected)


def test_compact_cache_contiguous_prefix_only_crops():
    cache = _cache(8)
    compact_cache(cache, past_len=3, keep=[0, 1], packed=5)
    assert cache.get_seq_length() == 5
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]


def test_verify_then_commit_equals_feeding_tokens_one_by_one(tiny_stock_target):
    """The compacted cache after a tree step matches the cache of sequential decoding
    (stock path; the fast path's compaction is covered bit for bit by tests/test_kernels.py)."""
    target = tiny_stock_target
    inputs = target.prepare("Compaction check, please.")
    rows, first = target.prefill(inputs)
    reference = reference_generate(target, inputs, 6)
    # Decoys first, the true path second, so compaction must move slots.
    tree = DraftTree([7, reference[1], 8, reference[2], reference[3]], [ROOT, ROOT, 1, 1, 3])
    step = target.verify(first, tree)
    assert step.committed[:3] == reference[1:4]
    target.commit(step.accepted)
    tree_cache = [(layer.keys.clone(), layer.values.clone()) for layer in target.lane.cache.layers]

    target.prefill(inputs)
    for token in [first, *reference[1:4]][: len(step.accepted) + 1]:
        target.commit(target.verify(token, DraftTree.empty()).accepted)
    for (keys, values), layer in zip(tree_cache, target.lane.cache.layers):
        assert keys.shape == layer.keys.shape
        torch.testing.assert_close(keys, layer.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(values, layer.values, rtol=1e-4, atol=1e-5)
    target.release()


# ----------------------------------------------------------------------------- argmax off the Top-K
@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 40), k=st.integers(1, 8), seed=st.integers(0, 10_000),
       nan=st.booleans(), minus_inf_row=st.booleans())
def test_argmax_read_off_the_top_k_is_torchs(rows, vocab, k, seed, nan, minus_inf_row):
    """Integer logits in a small range tie often; NaN and all -inf rows too: the argmax taken
    from the Top-K must be torch's first index of the maximum in every case."""
    k = min(k, vocab)
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 3, (rows, vocab), generator=generator).float()
    if nan:
        logits[0, seed % vocab] = float("nan")
    if minus_inf_row:
        logits[-1] = float("-inf")
    values, ids = torch.topk(logits, k, dim=-1)
    assert torch.equal(first_argmax(logits, values, ids), logits.argmax(dim=-1, keepdim=True))


def test_argmax_off_the_top_k_needs_its_fallback():
    """Negative control: a row whose K values all tie may have a valid Top-K without its first
    maximum (here ids 5, 6, 7 of ten zeros): the smallest id there is wrong, the fallback is
    right."""
    logits = torch.zeros(1, 10)
    values, ids = torch.zeros(1, 3), torch.tensor([[5, 6, 7]])
    assert int(ids.min()) != int(logits.argmax())
    assert int(first_argmax(logits, values, ids)) == 0
