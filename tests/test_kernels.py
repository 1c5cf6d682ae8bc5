"""The fast step path (`recap.verifier.kernels`): batch-invariant by construction, tested bit
for bit. A packed verify's logits at every node equal those of plain one-token steps along
that node's path; the linear kernel's rows never depend on their neighbours; a kernel whose
arithmetic depends on the row count is caught. Agreement with stock transformers is checked
as closeness, never as exactness."""

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

import recap
from recap.core import DraftTree
from recap.decoding import reference_generate
from recap.errors import InputError
from recap.verifier.kernels import lanes, ops, unsupported, widen
from recap.verifier.kernels import linear as kernel_linear
from recap.verifier.kernels.exp import exp32
from recap.verifier.kernels.linear import Linear, padded_rows
from recap.verifier.kernels.widen import storage
from recap.verifier.profile import profile_key
from tests.conftest import TINY_MODELS, load_target


def _random_tree(rng: np.random.Generator, size: int, vocab: int) -> DraftTree:
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, size)]
    return DraftTree(rng.integers(0, vocab, size), parents)


def _prompt(target, text: str = "Tell me about the sea and the ships on it"):
    return target.prepare(text)


def mismatched_nodes(target, tree: DraftTree, root: int = 42) -> int:
    """Packed positions whose logits in one verify of ``tree`` differ (any bit) from a plain
    one-token step at the end of the same path."""
    inputs = _prompt(target)
    target.prefill(inputs)
    target.verify(root, tree)
    packed = target.last_logits.copy()
    target.release()
    starts, paths = tree.ancestor_lists()
    tokens, _ = tree.packed(root)
    differing = 0
    for position in range(len(tokens)):
        target.prefill(inputs)
        for node in paths[starts[position]:starts[position + 1]]:
            target.verify(int(tokens[node]), DraftTree.empty())
            target.commit([])
        plain = target.last_logits[0]
        differing += not np.array_equal(plain, packed[position])
        target.release()
    return differing


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("size", [24, 5])
def test_packed_verify_is_bit_identical_to_plain_steps(name, size):
    """25 and 6 packed rows: on a 3x4 machine the last 1 or 2 rows run on a remainder block."""
    target = load_target(name)
    assert target.kernels == "fast"
    tree = _random_tree(np.random.default_rng(0), size, 1000)
    assert tree.max_depth >= 3
    assert mismatched_nodes(target, tree) == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_packed_verify_is_bit_identical_with_16_bit_weights(dtype):
    """Weights read as stored and widened in registers: the tree's nodes still get their
    plain steps' bits (a Qwen2 decoder: q/k/v biases, M-RoPE)."""
    target = load_target("tiny-qwen2.5-vl", dtype)
    assert target.kernels == "fast" and target.decoder.head.weight.dtype != np.float32
    assert mismatched_nodes(target, _random_tree(np.random.default_rng(4), 14, 1000)) == 0


@pytest.mark.slow
def test_packed_verify_is_bit_identical_on_smollm2(smollm2):
    assert smollm2.kernels == "fast"
    assert mismatched_nodes(smollm2, _random_tree(np.random.default_rng(1), 12, 5000)) == 0


def test_row_count_dependent_kernel_is_caught(monkeypatch):
    """Negative control: a linear layer that accumulates differently once a step has more
    than 4 rows (float64, then rounded) must break the bit-for-bit comparison."""
    target = load_target("tiny-llama")
    real = Linear.__call__

    def m_dependent(self, x, out, rows):
        if rows <= 4:
            return real(self, x, out, rows)
        weight = self.weight.astype(np.float64)
        out[:rows] = (x[:rows].astype(np.float64) @ weight.T + (self.bias if self.bias.size else 0)).astype(
            np.float32)
        return out

    monkeypatch.setattr(Linear, "__call__", m_dependent)
    assert mismatched_nodes(target, _random_tree(np.random.default_rng(0), 12, 1000)) > 0


@pytest.mark.parametrize("name", TINY_MODELS)
def test_packed_verify_is_bit_identical_with_quad_attention(name, monkeypatch):
    """The tiny models have 2 query heads per kv head, below `QuadAttention.MIN_GROUPS`: with
    the threshold lowered they run attention four queries at a time, and stay exact."""
    monkeypatch.setattr(ops.QuadAttention, "MIN_GROUPS", 1)
    target = recap.load(name, kernels="fast")
    assert target.decoder.quad_attention is not None
    assert mismatched_nodes(target, _random_tree(np.random.default_rng(3), 20, 1000)) == 0


def test_row_count_dependent_attention_is_caught(monkeypatch):
    """Negative control: quad attention whose softmax weights are rounded otherwise once a
    step has more than one row must break the bit-for-bit comparison."""
    monkeypatch.setattr(ops.QuadAttention, "MIN_GROUPS", 1)
    target = recap.load("tiny-llama", kernels="fast")
    real = ops.QuadAttention.__call__

    def rows_dependent(self, plan, q, keys, values, ancestors, scale, out, window=0):
        rows = plan[1]
        real(self, plan, q, keys, values, ancestors, scale * (1.0 + 1e-6 * (rows > 1)), out, window)

    monkeypatch.setattr(ops.QuadAttention, "__call__", rows_dependent)
    assert mismatched_nodes(target, _random_tree(np.random.default_rng(3), 12, 1000)) > 0


def _tree_paths(parents: list[int]) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    paths = []
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    starts = np.zeros(len(paths) + 1, np.int64)
    starts[1:] = np.cumsum([len(p) for p in paths])
    return starts, np.array([a for p in paths for a in p], np.int64), paths


def _windowed_reference(q, keys, values, past, path, scale, window):
    """float64 attention of one node (its query ``q`` (H * D,)) over the prefix and its path,
    the last ``window`` keys only (0: all), as Hugging Face's sliding mask keeps them."""
    kv_heads, _, dim = keys.shape
    heads = len(q) // dim
    slots = np.concatenate([np.arange(past), past + np.asarray(path)])
    if window:
        slots = slots[-window:]
    out = np.zeros(heads * dim)
    for h in range(heads):
        g = h // (heads // kv_heads)
        scores = keys[g, slots].astype(np.float64) @ q[h * dim:(h + 1) * dim] * scale
        weights = np.exp(scores - scores.max())
        out[h * dim:(h + 1) * dim] = weights / weights.sum() @ values[g, slots]
    return out


@settings(max_examples=40, deadline=None)
@given(past=st.integers(0, 40), size=st.integers(1, 12), groups=st.sampled_from([1, 3, 4, 6]),
       kv_heads=st.integers(1, 2), dim=st.sampled_from([16, 64]), window=st.sampled_from([0, 1, 3, 7, 30]),
       seed=st.integers(0, 999))
def test_quad_attention_gives_each_node_its_plain_steps_bits(past, size, groups, kv_heads, dim, window, seed):
    """Kernel level: every node of a packed tree (root 0, random parents) gets, bit for bit,
    what a one-row step at its position gets (a cache whose prefix holds the node's path),
    whatever the prefix length (the shared 3-key blocks end anywhere), quad filling and
    sliding window (its first key inside the prefix or inside the path); both kernels agree
    with float64 attention over the window's keys."""
    rng = np.random.default_rng(seed)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, size)]
    starts, ancestors, paths = _tree_paths(parents)
    heads = groups * kv_heads
    keys = rng.standard_normal((kv_heads, past + size + 4, dim), dtype=np.float32)
    values = rng.standard_normal((kv_heads, past + size + 4, dim), dtype=np.float32)
    q = rng.standard_normal((size, heads * dim), dtype=np.float32)
    quad = ops.QuadAttention(heads, kv_heads, dim)
    packed = np.zeros((size, heads * dim), np.float32)
    quad(quad.plan(past, starts, size), q, keys, values, ancestors, 0.3, packed, window)
    rows = np.zeros_like(packed)
    ops.tree_attention(q, keys, values, past, starts, ancestors, 0.3, window, rows, size)
    expected = np.stack([_windowed_reference(q[node], keys, values, past, path, 0.3, window)
                         for node, path in enumerate(paths)])
    np.testing.assert_allclose(packed, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rows, expected, rtol=1e-4, atol=1e-5)
    for node, path in enumerate(paths):
        k, v = keys.copy(), values.copy()
        for depth, index in enumerate(path):  # the path's K/V as cached rows, as plain steps wrote them
            k[:, past + depth], v[:, past + depth] = keys[:, past + index], values[:, past + index]
        plain = np.zeros((1, heads * dim), np.float32)
        here = past + len(path) - 1
        quad(quad.plan(here, np.array([0, 1], np.int64), 1), q[node:node + 1], k, v, np.zeros(1, np.int64), 0.3,
             plain, window)
        assert plain[0].tobytes() == packed[node].tobytes(), f"node {node} (depth {len(path) - 1})"
        single = np.zeros_like(plain)
        ops.tree_attention(q[node:node + 1], k, v, here, np.array([0, 1], np.int64), np.zeros(1, np.int64), 0.3,
                           window, single, 1)
        assert single[0].tobytes() == rows[node].tobytes(), f"node {node}, per-row kernel"


def test_quad_attention_is_used_where_it_fits():
    assert ops.QuadAttention.suits(9, 3, 64) and not ops.QuadAttention.suits(4, 2, 64)


def test_quad_attention_out_of_the_written_order_is_refused(monkeypatch):
    """Its load-time check can fail: a score block that gives the first query of a quad
    other bits (float64 sums) makes `block_slots_exact` false and `QuadAttention` refuses."""
    real = ops._quad_scores

    def reordered(queries, keys, past, lengths, firsts, ancestors, units, b, scores, window):
        real(queries, keys, past, lengths, firsts, ancestors, units, b, scores, window)
        scores[4 * b, :lengths[4 * b]] = (keys[:lengths[4 * b]].astype(np.float64) @ queries[4 * b]).astype(np.float32)

    check = ops.block_slots_exact.__wrapped__
    assert check(64) and check(37)
    monkeypatch.setattr(ops, "_quad_scores", reordered)
    monkeypatch.setattr(ops, "block_slots_exact", check)
    assert not check(64)
    with pytest.raises(kernel_linear.KernelDefect, match="lanes"):
        ops.QuadAttention(9, 3, 64)


@njit(error_model="numpy")
def _softmax_from(row, low, length, scale):
    ops._softmax(row[low:length], scale)


@njit(error_model="numpy")
def _softmax_indexed_from(row, low, length, scale):
    # `_softmax`'s operations with the row indexed from ``low`` (as before revision 15)
    for j in range(low, length):
        row[j] = row[j] * np.float32(scale)
    peak = ops._max32(row[low:length])
    for j in range(low, length):
        row[j] = exp32(row[j] - peak)
    total = ops._sum32(row[low:length])
    for j in range(low, length):
        row[j] = row[j] / total


def _vector_float_ops(function) -> int:
    function(np.ones(40, np.float32), 3, 30, 0.5)
    code = "\n".join(function.inspect_llvm().values())
    return len(re.findall(r"(?:fmul|fdiv|fsub)(?: \w+)* <\d+ x float>", code))


def test_attention_softmax_vectorises_from_a_variable_first_key():
    """Speed, not bits: the softmax of both attention kernels runs on a slice from a query's
    first key (variable under a sliding window) and compiles to vector arithmetic. Its
    negative control, the same loops indexing the row from that key, compiles element by
    element (numba's negative-index wraparound on each index: 4x slower, revision 14)."""
    row = np.random.default_rng(0).standard_normal(40).astype(np.float32)
    sliced, indexed = row.copy(), row.copy()
    _softmax_from(sliced, 3, 30, 0.5)
    _softmax_indexed_from(indexed, 3, 30, 0.5)
    assert sliced.tobytes() == indexed.tobytes()
    assert _vector_float_ops(_softmax_from) > 0
    assert _vector_float_ops(_softmax_indexed_from) == 0


# ----------------------------------------------------------------------------- the linear kernel
@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 70), out_features=st.integers(1, 37), in_features=st.integers(1, 90),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]), bias=st.booleans(), seed=st.integers(0, 99),
       weight_rows=st.sampled_from([3, 4]))
def test_linear_rows_do_not_depend_on_their_neighbours(rows, out_features, in_features, dtype, bias, seed,
                                                        weight_rows):
    """Both weight-row layouts (3x4 with its remainder and few-rows blocks; 4x4 with 8x2),
    whatever this machine picks by default."""
    rng = np.random.default_rng(seed)
    weight = torch.from_numpy(rng.standard_normal((out_features, in_features), dtype=np.float32)).to(
        getattr(torch, dtype))
    bits = weight.numpy() if dtype == "float32" else weight.view(torch.int16).numpy().view(np.uint16)
    layer = Linear(bits, rng.standard_normal(out_features).astype(np.float32) if bias else None,
                   float16=dtype == "float16", weight_rows=weight_rows)
    x = np.zeros((max(padded_rows(rows), 4), in_features), np.float32)
    x[:rows] = rng.standard_normal((rows, in_features), dtype=np.float32)
    out = layer(x, np.zeros((len(x), out_features), np.float32), rows)
    # which blocks run follows from the layout and the shape alone, on every machine
    assert layer.two_rows == (weight_rows == 4 and out_features % 8 == 0)
    assert layer.few_rows == layer.remainders == (weight_rows == 3)
    for row in range(rows):
        single = np.zeros((4, in_features), np.float32)
        single[row % 4] = x[row]  # any slot of the 4-row block
        alone = layer(single, np.zeros((4, out_features), np.float32), 4)[row % 4]
        assert np.array_equal(alone, out[row])
        if layer.two_rows:  # and any slot of the 2-row block
            pair = single[:2] if row % 4 < 2 else single[2:]
            assert np.array_equal(layer(pair, np.zeros((2, out_features), np.float32), 2)[row % 2], out[row])
        first = np.zeros((4, in_features), np.float32)
        first[0] = x[row]  # and as a step of one row (computed as 2 or 4 rows)
        assert np.array_equal(layer(first, np.zeros((4, out_features), np.float32), 1)[0], out[row])
    expected = x[:rows].astype(np.float64) @ weight.double().numpy().T + (layer.bias if bias else 0)
    np.testing.assert_allclose(out[:rows], expected, rtol=1e-4, atol=1e-4 * in_features)


@pytest.mark.parametrize("weight_rows", [3, 4])
def test_packed_verify_is_bit_identical_on_either_block(weight_rows, monkeypatch):
    """The decoder built on the block this machine would not pick by itself is exact too."""
    monkeypatch.setattr(kernel_linear, "WEIGHT_ROWS", weight_rows)
    target = recap.load("tiny-qwen2.5-vl", kernels="fast")
    assert {linear.weight_rows for layer in target.decoder.layers for linear in layer.linears()} == {weight_rows}
    assert mismatched_nodes(target, _random_tree(np.random.default_rng(2), 16, 1000)) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("in_features", [1, 7, 8, 37, 96])
def test_every_block_computes_the_written_order(in_features, dtype):
    """Every register block of both layouts, at every row count, gives each element the bits
    of `lanes.reference_dot` (the order written in `lanes`, one exact operation at a time)
    plus the bias: 26 columns, so the last N mod 3 and N mod 4 columns are compared too, and
    widths with and without a tail past the last whole group of lanes."""
    rng = np.random.default_rng(in_features)
    weight = torch.from_numpy(rng.standard_normal((26, in_features), dtype=np.float32)).to(getattr(torch, dtype))
    bits = weight.numpy() if dtype == "float32" else weight.view(torch.int16).numpy().view(np.uint16)
    wide, bias = weight.float().numpy(), rng.standard_normal(26).astype(np.float32)
    x = rng.standard_normal((16, in_features), dtype=np.float32)
    expected = np.array([[np.float32(lanes.reference_dot(row, column) + b) for column, b in zip(wide, bias)]
                         for row in x])
    for weight_rows in (3, 4):
        layer = Linear(bits, bias, float16=dtype == "float16", weight_rows=weight_rows)
        for rows in (1, 2, 3, 4, 5, 6, 9, 10, 12, 16):  # 9-16: the 4x8 block (and a 4x4 after it)
            got = layer(x, np.zeros((16, 26), np.float32), rows)[:rows]
            assert got.tobytes() == expected[:rows].tobytes(), (weight_rows, rows)
    with pytest.raises(ValueError):
        Linear(bits, bias, weight_rows=2)


@njit(cache=True)
def _dot_summed_in_lane_order(a, b):  # pragma: no cover - compiled
    # `lanes.dot` with its partial sums added one after another instead of by the tree
    acc = lanes.zeros()
    for k in range(0, lanes.whole(a.shape[0]), lanes.LANES):
        acc = lanes.fma(lanes.load(a, k), lanes.load(b, k), acc)
    s = np.float32(0)
    for i in range(lanes.LANES):
        s += lanes.lane(acc, i)
    return s


def test_the_written_order_is_the_one_compiled():
    """`lanes.dot` and `lanes.reference_dot` agree bit for bit; the same partial sums added in
    another order (a negative control) do not, so the reference can tell orders apart."""
    rng = np.random.default_rng(11)
    differing = 0
    for length in (8, 64, 576):
        for _ in range(20):
            a, b = rng.standard_normal((2, length), dtype=np.float32)
            assert np.float32(lanes.dot(a, b)).tobytes() == lanes.reference_dot(a, b).tobytes()
            differing += np.float32(_dot_summed_in_lane_order(a, b)).tobytes() != lanes.reference_dot(a, b).tobytes()
    assert differing > 10


@njit(cache=True)
def _widen_all(stored, out):  # pragma: no cover - compiled
    for k in range(0, stored.shape[0] - 8, 8):  # whole groups, as the blocks' loops load them
        group = lanes.load(stored, k)
        for i in range(8):
            out[k + i] = lanes.lane(group, i)
    tail = stored.shape[0] - 8  # the last 8 one by one, as a dot product's tail reads them
    ones = np.ones(8, np.float32)
    widened = lanes.fma_tail(lanes.zeros(), ones, stored[tail:], 0)
    for i in range(8):
        out[tail + i] = lanes.lane(widened, i)


@pytest.mark.parametrize("f16c", [True, False], ids=["f16c", "integer-ops"])
@pytest.mark.parametrize("float16", [False, True])
def test_widening_is_exact_for_every_16_bit_pattern(float16, f16c, monkeypatch):
    """float16 is widened by ``vcvtph2ps`` where the CPU has F16C and by integer operations
    where it has not (a baseline x86-64 build: `widen.half_to_float`); both exactly."""
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.zeros(1 << 16, np.float32)
    widen_all = _widen_all
    if not f16c:
        monkeypatch.setattr(widen, "compiles_for", lambda feature: False)
        widen_all = njit(_widen_all.py_func)  # compiled now, without F16C instructions
    widen_all(storage(patterns, float16=float16), out)
    expected = patterns.view(np.float16).astype(np.float32) if float16 else (patterns.astype(np.uint32) << 16).view(
        np.float32)
    nan = np.isnan(expected)
    assert nan.sum() == (2046 if float16 else 254) and np.isnan(out[nan]).all()
    assert out[~nan].tobytes() == expected[~nan].tobytes()  # infinities, signed zeros and subnormals too
    with pytest.raises(ValueError, match="16-bit"):
        storage(np.zeros(4, np.float64))
    assert kernel_linear.ROW_BLOCK == 4 and padded_rows(1) == 2 and padded_rows(2) == 2 and padded_rows(5) == 8
    assert padded_rows(3) == 4


@pytest.mark.parametrize("weight_rows", [3, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_weights_give_the_bits_of_their_float32_widening(dtype, weight_rows):
    """Widening in registers is exact: a layer reading 16-bit weights as stored gives, for
    every row count, the bits of the same layer on the weights widened to float32."""
    rng = np.random.default_rng(7)
    weight = torch.from_numpy(rng.standard_normal((52, 96), dtype=np.float32)).to(getattr(torch, dtype))
    bias = rng.standard_normal(52).astype(np.float32)
    stored = Linear(weight.view(torch.int16).numpy().view(np.uint16), bias, float16=dtype == "float16",
                    weight_rows=weight_rows)
    wide = Linear(weight.float().numpy(), bias, weight_rows=weight_rows)
    x = rng.standard_normal((12, 96), dtype=np.float32)
    for rows in (1, 2, 3, 4, 5, 6, 9, 12):
        got = stored(x, np.zeros((12, 52), np.float32), rows)[:rows]
        assert got.tobytes() == wide(x, np.zeros((12, 52), np.float32), rows)[:rows].tobytes(), rows


def test_a_layer_refuses_buffers_shorter_than_the_rows_it_computes():
    """The kernels do not check bounds: a 1-row step runs as 2 (or 4) rows and must not read
    past a 1-row buffer."""
    weight = np.ones((24, 8), np.float32)  # 24 columns: the 8x2 block
    layer = Linear(weight, None, weight_rows=4)
    assert layer.two_rows
    with pytest.raises(ValueError, match="2 rows"):
        layer(np.ones((1, 8), np.float32), np.zeros((1, 24), np.float32), 1)
    assert np.array_equal(layer(np.ones((2, 8), np.float32), np.zeros((2, 24), np.float32), 1)[0], np.full(24, 8.0))


def _float64_rows(x, w, bias, first, last):
    """Rows first..last-1 of x @ w.T + bias summed in float64, then rounded: another order."""
    wide = (w.astype(np.uint32) << 16).view(np.float32) if w.dtype == np.uint16 else w
    return (x[first:last].astype(np.float64) @ wide.astype(np.float64).T + bias).astype(np.float32)


def _reordered(name: str):
    """Kernel ``name`` of `linear`, with some of its rows summed in another order."""
    real = getattr(kernel_linear, name)
    if name == "linear3x4":  # the 12x1 / 6x2 remainder rows only
        def kernel(x, w, bias, out, rows, remainders):
            real(x, w, bias, out, rows, remainders)
            if remainders and rows > 4 and rows % 4 in (1, 2):
                out[rows - rows % 4:rows] = _float64_rows(x, w, bias, rows - rows % 4, rows)
    elif name == "linear4x4":  # one row of the 4x8 block (steps of 8 rows and more)
        def kernel(x, w, bias, out, rows):
            real(x, w, bias, out, rows)
            if rows >= 8:
                out[5] = _float64_rows(x, w, bias, 5, 6)[0]
    else:  # the second row of a 2-row block
        def kernel(x, w, bias, out):
            real(x, w, bias, out)
            out[1] = _float64_rows(x, w, bias, 1, 2)[0]
    return kernel


@pytest.mark.parametrize("name", ["linear8x2", "linear3x4_few", "linear3x4", "linear4x4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_block_out_of_the_written_order_is_refused(name, dtype, monkeypatch):
    """The load-time check can fail: a block that sums some rows in another order (float64,
    then rounded) makes `blocks_agree` false, and `Linear` refuses to load rather than give a
    step other bits than another block would."""
    uncached = {check: getattr(kernel_linear, check).__wrapped__ for check in
                ("blocks_agree", "small_rows_exact", "few_rows_exact", "remainder_rows_exact",
                 "paired_rows_exact")}
    assert uncached["blocks_agree"](96, dtype) and uncached["blocks_agree"](37, dtype)
    for check, function in uncached.items():
        monkeypatch.setattr(kernel_linear, check, function)
    monkeypatch.setattr(kernel_linear, name, _reordered(name))
    assert not kernel_linear.blocks_agree(96, dtype)
    rng = np.random.default_rng(6)
    weight = rng.standard_normal((60, 96), dtype=np.float32)
    if dtype == "bfloat16":
        weight = (weight.view(np.uint32) >> 16).astype(np.uint16)
    with pytest.raises(kernel_linear.KernelDefect, match="lanes"):
        Linear(weight, None)


# ----------------------------------------------------------------------------- exp and SiLU
@njit(cache=True)
def _exp_all(x, out):  # pragma: no cover - compiled
    for i in range(x.shape[0]):  # a loop LLVM vectorises, with a scalar remainder
        out[i] = exp32(x[i])


def test_exp32_is_accurate_to_about_one_ulp():
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-87, 88.7, 400_001, dtype=np.float32),
                        rng.standard_normal(100_000).astype(np.float32) * 4])
    out = np.empty_like(x)
    _exp_all(x, out)
    exact = np.exp(x.astype(np.float64))
    normal = (exact > 3e-38) & (exact < 3.4e38)
    ulps = np.abs(out[normal] - exact[normal]) / np.spacing(exact[normal].astype(np.float32))
    assert ulps.max() <= 1.5 and ulps.mean() < 0.5
    edges = np.array([-np.inf, -1e4, -88.0, 88.8, 1e4, np.inf, 0.0], np.float32)
    _exp_all(edges, got := np.empty_like(edges))
    assert got.tolist() == [0.0, 0.0, 0.0, np.inf, np.inf, np.inf, 1.0]


@settings(max_examples=20, deadline=None)
@given(length=st.integers(1, 70), place=st.integers(0, 69), seed=st.integers(0, 99))
def test_exp_and_silu_do_not_depend_on_where_a_value_sits(length, place, seed):
    """Vector lanes and the scalar remainder compute the same bits, so a row's SiLU (and a
    score's exp) is the same whatever the row's length, neighbours or position."""
    rng = np.random.default_rng(seed)
    place = place % length
    x = rng.standard_normal(length).astype(np.float32) * 6
    out = np.empty_like(x)
    _exp_all(x, out)
    alone = np.empty(1, np.float32)
    _exp_all(x[place:place + 1], alone)
    assert alone[0].tobytes() == out[place].tobytes()
    gate, up = x.reshape(1, -1).copy(), np.full((1, length), 0.5, np.float32)
    ops.silu_mul(gate, up, 1)
    one_gate = x[place:place + 1].reshape(1, 1).copy()
    ops.silu_mul(one_gate, np.full((1, 1), 0.5, np.float32), 1)
    assert one_gate[0, 0].tobytes() == gate[0, place].tobytes()
    expected = x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64))) * 0.5
    np.testing.assert_allclose(gate[0], expected, rtol=1e-6, atol=1e-30)


# ----------------------------------------------------------------------------- against stock
@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_logits_agree_closely_with_stock(name, dtype):
    """Not exactness: the same numbers up to float rounding (a wrong RoPE, bias or mask
    would be far off)."""
    target = load_target(name, dtype)
    inputs = _prompt(target)
    tree = _random_tree(np.random.default_rng(2), 10, 1000)
    rows = {}
    for kernels in ("stock", "fast"):
        target.use_kernels(kernels)
        target.prefill(inputs)
        step = target.verify(7, tree)
        rows[kernels] = step.topk_logits
        target.release()
    target.use_kernels("auto")
    scale = np.abs(rows["stock"]).max()
    tolerance = 1e-4 if dtype == "float32" else 0.05
    assert np.abs(rows["fast"] - rows["stock"]).max() <= tolerance * scale


@pytest.mark.parametrize("name", TINY_MODELS)
def test_fast_greedy_output_agrees_with_generate_on_tiny_models(name):
    """The tiny models' logits are far apart, so here the two paths agree on every token."""
    target = load_target(name)
    inputs = _prompt(target, "Write a story about a cat")
    assert target.kernels == "fast"
    assert reference_generate(target, inputs, 24) == target.stock_generate(inputs, 24)


def test_kernel_selection_and_errors():
    target = recap.load("tiny-llama", kernels="stock")
    assert target.kernels == "stock" and target.decoder is None
    assert target.use_kernels("fast") == "fast"
    fast_key = profile_key(target)
    assert target.use_kernels("stock") == "stock"
    assert profile_key(target) != fast_key and fast_key["kernels"] == "fast"
    with pytest.raises(InputError, match="unknown kernels"):
        target.use_kernels("turbo")
    from transformers import MistralConfig, MistralForCausalLM

    mistral = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               sliding_window=16))
    assert "mistral" in unsupported(mistral)
    wrapped = recap.verifier.wrap(mistral, target.tokenizer)
    assert wrapped.kernels == "stock"
    with pytest.raises(InputError, match="--kernels fast does not support"):
        wrapped.use_kernels("fast")


def test_ancestor_lists_follow_paths():
    tree = DraftTree([5, 6, 7, 8], [-1, 0, -1, 1])
    starts, paths = tree.ancestor_lists()
    got = [paths[starts[i]:starts[i + 1]].tolist() for i in range(len(tree) + 1)]
    assert got == [[0], [0, 1], [0, 1, 2], [0, 3], [0, 1, 2, 4]]
