"""m:n masks, the 2:4 check and the `SparsityMask` constraint."""

import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keras_mp import layer_table
from keras_mp.sparsity.masks import SparsityMask, is_2_4_sparse, magnitude_mask

IN, OUT = 8, 12
L = keras.layers

# One line per supported layer type: (layer, input shape, expected axis).
LAYER_CASES = {
    "Dense": (lambda: L.Dense(OUT), (IN,), 0),
    "Conv1D": (lambda: L.Conv1D(OUT, 3), (6, IN), 1),
    "Conv2D": (lambda: L.Conv2D(OUT, 3), (6, 6, IN), 2),
    "Conv3D": (lambda: L.Conv3D(OUT, 2), (4, 4, 4, IN), 3),
    "SeparableConv2D": (
        lambda: L.SeparableConv2D(OUT, 3, depth_multiplier=2),
        (6, 6, IN // 2),
        2,
    ),
    "Conv2DTranspose": (lambda: L.Conv2DTranspose(OUT, 3), (5, 5, IN), 3),
    "EinsumDense": (
        lambda: L.EinsumDense("abc,cd->abd", (None, OUT)),
        (5, IN),
        0,
    ),
    "EinsumDense2": (
        lambda: L.EinsumDense("abcd,cde->abe", (None, OUT)),
        (5, 2, IN),
        1,
    ),
}


def _built(case):
    make, shape, _ = LAYER_CASES[case]
    layer = make()
    layer.build((None,) + shape)
    return layer


def _groups(kernel, axis, n):
    w = np.moveaxis(np.asarray(kernel), axis, -1)
    return w.reshape(-1, n)


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_axis_is_the_input_channel_axis(case):
    layer = _built(case)
    weight = layer_table.prunable_weight(layer).value
    axis = weight.in_axis
    shape = getattr(layer, weight.attr).shape
    assert axis % len(shape) == LAYER_CASES[case][2]
    assert shape[axis] == IN


kernel_values = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.floats(0.0, 0.9),  # share of exact zeros
    st.sampled_from([None, 1, 0]),  # round to create ties
    st.sampled_from([(2, 4), (1, 4), (3, 4), (1, 2), (4, 8)]),
)


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
@settings(max_examples=25, deadline=None)
@given(values=kernel_values)
def test_mask_keeps_m_largest_per_group(case, values):
    seed, zeros, decimals, (m, n) = values
    layer = _built(case)
    weight = layer_table.prunable_weight(layer).value
    axis = weight.in_axis
    shape = getattr(layer, weight.attr).shape
    rng = np.random.default_rng(seed)
    w = rng.normal(size=shape) * (rng.random(shape) >= zeros)
    if decimals is not None:
        w = np.round(w, decimals)
    mask = magnitude_mask(w, axis, m, n)
    assert mask.shape == tuple(shape)
    g_mask, g_w = _groups(mask, axis, n), np.abs(_groups(w, axis, n))
    assert np.all(g_mask.sum(-1) == m)
    kept = np.count_nonzero(g_w * g_mask, axis=-1)
    assert np.array_equal(kept, np.minimum(m, np.count_nonzero(g_w, axis=-1)))
    smallest_kept = np.where(g_mask > 0, g_w, np.inf).min(-1)
    largest_pruned = np.where(g_mask > 0, -np.inf, g_w).max(-1)
    assert np.all(smallest_kept >= largest_pruned)
    assert is_2_4_sparse(w * mask, axis, m, n)
    assert np.array_equal(mask, magnitude_mask(w, axis, m, n))


def test_ties_go_to_lower_index():
    mask = magnitude_mask(np.ones((8, 1)), axis=0)
    assert mask[:, 0].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 11), st.integers(0, 1000))
def test_pad_keeps_at_most_m_in_short_group(channels, seed):
    w = np.random.default_rng(seed).normal(size=(3, 3, channels, 5))
    mask = magnitude_mask(w, -2, pad=True)
    assert is_2_4_sparse(w * mask, -2, pad=True)
    tail = mask[:, :, channels - channels % 4 :, :].sum(axis=2)
    assert np.all(tail == min(2, channels % 4))
    assert is_2_4_sparse(w * mask, -2) == (channels % 4 == 0)


def test_is_2_4_sparse():
    k = np.array([[0.0, 1], [1, 0], [2, 0], [0, 3]])
    assert is_2_4_sparse(k, axis=0)
    assert is_2_4_sparse(k.T, axis=1)
    assert not is_2_4_sparse(k.T, axis=0)  # 2 channels: not groups of 4
    square = np.array([[1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 1], [0, 0, 0, 1]])
    assert is_2_4_sparse(square, axis=0)
    assert not is_2_4_sparse(square, axis=1)
    assert not is_2_4_sparse(np.ones((4, 2)), axis=0)
    assert not is_2_4_sparse(np.ones((3, 2)), axis=0)
    assert is_2_4_sparse(np.zeros((3, 2)), axis=0, pad=True)


def test_sparsity_mask_serializes():
    mask = SparsityMask((8, 4), 0, constraint="non_neg")
    config = keras.constraints.serialize(mask)
    assert config["registered_name"] == "keras_mp>SparsityMask"
    clone = keras.constraints.get(config)
    assert clone.shape == (8, 4) and clone.m == 2
    assert isinstance(clone.constraint, keras.constraints.NonNeg)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: magnitude_mask(np.ones((6, 2)), axis=0),
            "6 input channels on axis 0, not a multiple of n=4. Pass pad=True",
        ),
        (
            lambda: magnitude_mask(np.ones((4, 2)), axis=2),
            r"`axis` must index the kernel's 2 dimensions. Received: "
            r"axis=2, kernel shape \(4, 2\)",
        ),
        (
            lambda: is_2_4_sparse(np.ones((4, 2)), axis=3),
            r"`axis` must index the kernel's 2 dimensions. Received: axis=3",
        ),
        (
            lambda: is_2_4_sparse(np.ones((4, 2)), 0, m=5),
            r"0 < m < n, e.g. m=2, n=4. Received: m=5, n=4",
        ),
        (
            lambda: SparsityMask((8, 4), 0, n=0),
            r"`n` \(group size\) must be a positive integer, e.g. 4. "
            "Received: n=0",
        ),
    ],
)
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()
