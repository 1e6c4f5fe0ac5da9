"""Channel permutations for 2:4 pruning: search, and applying it to a model."""

import warnings

import keras
import numpy as np
import pytest

from keras_mp.reference import reference_cnn
from keras_mp.sparsity.callback import StructuredSparsity
from keras_mp.sparsity.masks import magnitude_mask
from keras_mp.sparsity.permutation import (
    permute_for_sparsity,
    search_permutation,
)
from keras_mp.sparsity.report import plot_sparsity, sparsity_report
from tests.conftest import Subclassed
from tests.quantization.test_nested import Block, Net

L = keras.layers


def _kept(kernel, axis, m=2, n=4):
    kernel = np.asarray(kernel)
    mask = magnitude_mask(kernel, axis, m, n)
    return np.abs(kernel * mask).sum() / np.abs(kernel).sum()


def _randomize(model, seed=0):
    """Non-trivial weights everywhere, BatchNorm statistics included."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        w = rng.normal(size=v.shape) * rng.gamma(1.0, size=v.shape[-1:])
        if "variance" in v.path or "gamma" in v.path:
            w = np.abs(w) + 0.5
        v.assign(w.astype("float32"))
    return model


@pytest.mark.parametrize(
    "shape, axis, m",
    [
        ((16, 12), 0, 2),  # Dense (in, out)
        ((3, 3, 32, 8), -2, 2),  # Conv2D (..., in, out)
        ((3, 8, 16), -1, 2),  # Conv1DTranspose (..., out, in)
        ((3, 3, 32, 8), 2, 3),  # 3:4, the gradual schedule's middle stage
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_search_keeps_at_least_as_much_and_reports_it_exactly(
    shape, axis, m, seed
):
    rng = np.random.default_rng(seed)
    # Per-channel scales, as in trained kernels: what permutation exploits.
    scale = rng.gamma(1.0, size=shape[axis])
    kernel = np.moveaxis(
        np.moveaxis(rng.normal(size=shape), axis, -1) * scale, -1, axis
    )
    found = search_permutation(kernel, axis, m=m)
    assert sorted(found.permutation) == list(range(shape[axis]))
    assert found.kept_magnitude == pytest.approx(_kept(kernel, axis, m))
    permuted = np.take(kernel, found.permutation, axis=axis)
    assert found.kept_magnitude_permuted == pytest.approx(
        _kept(permuted, axis, m)
    )
    assert found.kept_magnitude_permuted > found.kept_magnitude
    again = search_permutation(kernel, axis, m=m)
    np.testing.assert_array_equal(again.permutation, found.permutation)


def test_search_finds_the_best_grouping_of_a_small_kernel():
    # Groups {9, 8, 7, 1} and {6, 1, 1, 1} keep 24 of 34; the best split
    # pairs two large with two small in each group and keeps 30.
    kernel = np.array([9.0, 8.0, 7.0, 1.0, 6.0, 1.0, 1.0, 1.0])[:, None]
    found = search_permutation(kernel, axis=0)
    assert found.kept_magnitude == pytest.approx(24 / 34)
    assert found.kept_magnitude_permuted == pytest.approx(30 / 34)
    assert found.swaps == 1


def test_search_edge_cases_and_bad_inputs():
    one_group = search_permutation(np.ones((4, 3)), axis=0)
    assert one_group.swaps == 0 and one_group.kept_magnitude == 0.5
    zeros = search_permutation(np.zeros((8, 3)), axis=0)
    assert zeros.kept_magnitude_permuted == 1.0
    bounded = search_permutation(
        np.random.default_rng(0).normal(size=(32, 16)), axis=0, max_swaps=2
    )
    assert bounded.swaps <= 2
    with pytest.raises(ValueError, match="6 input channels.*multiple of n=4"):
        search_permutation(np.ones((6, 2)), axis=0)
    with pytest.raises(ValueError, match="2 dimensions. Received: axis=2"):
        search_permutation(np.ones((4, 2)), axis=2)
    with pytest.raises(ValueError, match="0 < m < n"):
        search_permutation(np.ones((4, 2)), axis=0, m=4)


def _chain_models():
    """Producer -> channel-wise layers -> consumer chains, one per case."""

    def dense():
        return keras.Sequential(
            [
                keras.Input((12,)),
                L.Dense(16, name="producer"),
                L.BatchNormalization(name="bn"),
                L.ReLU(),
                L.Dropout(0.5),
                L.Dense(8, activation="tanh", name="consumer"),
            ]
        )

    def conv():
        inputs = keras.Input((10, 10, 4))
        x = L.Conv2D(16, 3, padding="same", name="producer")(inputs)
        x = L.BatchNormalization(name="bn")(x)
        x = L.Activation("swish")(x)
        x = L.MaxPooling2D()(x)
        x = L.Conv2DTranspose(8, 3, name="consumer")(x)
        x = L.GlobalAveragePooling2D()(x)
        outputs = L.Dense(4, name="head")(x)
        return keras.Model(inputs, outputs)

    def conv1d():
        return keras.Sequential(
            [
                keras.Input((12, 4)),
                L.Conv1D(16, 3, name="producer"),
                L.LeakyReLU(),
                L.AveragePooling1D(2),
                L.Conv1D(8, 3, use_bias=False, name="consumer"),
            ]
        )

    return {"dense": dense, "conv2d": conv, "conv1d": conv1d}


@pytest.mark.parametrize("case", sorted(_chain_models()))
def test_permuted_chain_computes_the_same_function(case):
    model = _randomize(_chain_models()[case]())
    x = np.random.default_rng(1).normal(
        size=(6,) + tuple(model.input_shape[1:])
    )
    before = model(x, training=False).numpy()
    consumer = model.get_layer("consumer")
    axis = -1 if isinstance(consumer, L.Conv2DTranspose) else -2
    axis = 0 if isinstance(consumer, L.Dense) else axis
    dense_kept = _kept(consumer.kernel.numpy(), axis)
    rows = {r.name: r for r in permute_for_sparsity(model)}
    row = rows["consumer"]
    assert row.permuted, row.reason
    assert row.producer == "producer"
    assert row.kept_magnitude == pytest.approx(dense_kept)
    assert row.kept_magnitude_permuted > row.kept_magnitude
    assert _kept(consumer.kernel.numpy(), axis) == pytest.approx(
        row.kept_magnitude_permuted
    )
    after = model(x, training=False).numpy()
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


def test_reference_cnn_permuted_then_pruned_keeps_more():
    keras.utils.set_random_seed(0)
    model = _randomize(reference_cnn(width=8))
    x = np.random.default_rng(2).random((4, 28, 28, 1), dtype=np.float32)
    before = model.predict(x, verbose=0)
    unpermuted = sparsity_report(model)
    rows = {r.name: r for r in permute_for_sparsity(model)}
    np.testing.assert_allclose(
        model.predict(x, verbose=0), before, rtol=1e-5, atol=1e-5
    )
    assert {n for n, r in rows.items() if r.permuted} == {
        "res_b",
        "conv3",
        "fc",
        "logits",
    }
    assert rows["conv3"].between == ["pw_bn", "pw_relu", "pool2"]
    assert "also goes to res_add" in rows["res_a"].reason
    assert "DepthwiseConv2D" in rows["pw"].reason
    assert "not a multiple of 4" in rows["stem"].reason
    assert "dw" not in rows  # depthwise: not a 2:4 layer type at all

    # One-shot prune, as StructuredSparsity does at the first batch.
    model.compile("sgd", "mse")
    sparsity = StructuredSparsity()
    sparsity.set_model(model)
    sparsity.on_train_batch_begin(0)
    pruned = {r.name: r for r in sparsity.report.rows}
    for row in unpermuted.rows:
        if not row.eligible:
            continue
        kept = pruned[row.name].kept_magnitude
        if rows[row.name].permuted:
            expected = rows[row.name].kept_magnitude_permuted
            assert kept == pytest.approx(expected, rel=1e-5)
            assert kept > row.kept_magnitude
        else:
            assert kept == pytest.approx(row.kept_magnitude, rel=1e-5)
    with pytest.raises(ValueError, match="already pruned.*before"):
        permute_for_sparsity(model)


def test_layers_that_cannot_follow_are_left_alone():
    inputs = keras.Input((8, 8, 4))
    a = L.Conv2D(8, 3, name="a")(inputs)
    b = L.Conv2D(8, 1, name="b")(a)  # a also feeds the output below
    c = L.Flatten()(L.Conv2D(8, 3, name="c")(b))
    d = L.Dense(8, name="d")(c)  # Flatten is not channel-wise
    shared = L.Dense(8, name="shared")
    e = shared(shared(d))  # called twice
    grouped = L.Conv2D(8, 1, groups=2, name="grouped")(a)
    model = _randomize(keras.Model(inputs, [e, a, grouped]))
    x = np.random.default_rng(1).normal(size=(2, 8, 8, 4))
    before = model(x)
    kernels = {n: model.get_layer(n).kernel.numpy() for n in ("b", "d")}
    rows = {r.name: r for r in permute_for_sparsity(model)}
    assert "b goes" not in str(rows) and rows["c"].producer == "b"
    assert "a also goes to the model outputs" in rows["b"].reason
    assert "Flatten" in rows["d"].reason
    assert "called more than once" in rows["shared"].reason
    assert "Conv2D is not supported" in rows["grouped"].reason
    assert [n for n, r in rows.items() if r.permuted] == ["c"]
    for name, row in rows.items():
        assert (row.kept_magnitude_permuted is None) != row.permuted, name
    # b's output channels follow c's new order; its input channels do not.
    assert not np.array_equal(model.get_layer("b").kernel.numpy(), kernels["b"])
    np.testing.assert_array_equal(model.get_layer("d").kernel, kernels["d"])
    for new, old in zip(model(x), before):
        np.testing.assert_allclose(new, old, rtol=1e-5, atol=1e-5)


def test_bad_models_and_optimizer_state():
    rows = permute_for_sparsity(Subclassed())
    assert [(r.permuted, r.reason) for r in rows] == [
        (False, "layer is not built (call the model on data first)")
    ]
    with pytest.raises(TypeError, match="Keras 3 `keras.Model`"):
        permute_for_sparsity(object())
    unbuilt = keras.Sequential([L.Dense(8), L.Dense(4)])
    with pytest.raises(ValueError, match=r"keras.Input\(shape\)"):
        permute_for_sparsity(unbuilt)
    model = _chain_models()["dense"]()
    model.compile("adam", "mse")
    model.fit(np.ones((4, 12)), np.ones((4, 8)), epochs=1, verbose=0)
    with pytest.warns(UserWarning, match="fresh optimizer"):
        permute_for_sparsity(model, layers="consumer")
    # The clone of a compiled model gets a built optimizer that never
    # stepped: nothing to permute, so no warning.
    clone = keras.models.clone_model(model)
    assert clone.optimizer.built
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        permute_for_sparsity(clone, layers="consumer")


def test_report_and_plot_show_kept_magnitude_with_permutation(tmp_path):
    keras.utils.set_random_seed(0)
    model = _randomize(reference_cnn(width=8))
    report = sparsity_report(model, permutation=True)
    for row in report.rows:
        if row.eligible:
            assert row.kept_magnitude_permuted >= row.kept_magnitude
        else:
            assert row.kept_magnitude_permuted is None
    assert "permuted" in str(report)
    assert sparsity_report(model).rows[1].kept_magnitude_permuted is None
    path = str(tmp_path / "sparsity.png")
    assert plot_sparsity(report, path) == path


def test_layers_no_graph_reaches_are_listed_with_the_reason():
    """Inside a custom layer (keras-hub's blocks are such layers) or a
    subclassed model the producer is Python code: listed, not permuted."""
    model = Net(name="net")
    model(np.ones((1, 8), "float32"))
    rows = permute_for_sparsity(model)
    assert [r.permuted for r in rows] == [False] * 3
    block = model.block.name
    assert [r.reason.split(":")[0] for r in rows] == [
        "it is called by the code of net (Net), not in a layer graph",
        f"it is called by the code of {block} (Block), not in a layer graph",
        "it is called by the code of net (Net), not in a layer graph",
    ]
    assert all(0 < r.kept_magnitude < 1 for r in rows)
    inputs = keras.Input((8,))
    h = L.Dense(8, name="stem")(inputs)
    functional = keras.Model(inputs, Block(8, name="blk")(L.ReLU()(h)))
    rows = {r.name: r for r in permute_for_sparsity(functional)}
    assert rows["stem"].reason == "its input is a model input"
    inner = functional.get_layer("blk").fc.name
    assert "called by the code of blk (Block)" in rows[inner].reason
