"""Which layers are pruned (`check_eligible`) and `strip_sparsity`."""

import keras
import numpy as np
import pytest

from keras_mp import layer_table
from keras_mp.sparsity import (
    StructuredSparsity,
    is_2_4_sparse,
    sparse_layers,
    sparsity_report,
    strip_sparsity,
)
from keras_mp.sparsity.model import check_eligible
from tests.conftest import Subclassed
from tests.sparsity.conftest import compile_model, data, sparse_model

L = keras.layers


def test_strip_sparsity_outputs_equal_and_plain():
    x, y = data()
    model = compile_model(sparse_model())
    model.fit(x, y, epochs=1, verbose=0, callbacks=[StructuredSparsity()])
    stripped = strip_sparsity(model)
    np.testing.assert_allclose(
        stripped.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )
    assert sparse_layers(stripped) == []
    assert "SparsityMask" not in str(stripped.get_config())
    for name in ("conv_a", "fc"):
        kernel = keras.ops.convert_to_numpy(stripped.get_layer(name).kernel)
        weight = layer_table.prunable_weight(model.get_layer(name)).value
        assert is_2_4_sparse(kernel, weight.in_axis)


def test_layer_selection():
    model = sparse_model()
    by = {
        "name": "fc",
        "regex": "conv_.*|head",
        "class": L.Dense,
        "callable": lambda layer: layer.name.startswith("s"),
        "list": ["fc", L.Conv2DTranspose],
    }
    expected = {
        "name": ["fc"],
        "regex": ["conv_a", "head"],
        "class": ["fc", "head"],
        "callable": ["sep"],
        "list": ["deconv", "fc"],
    }
    for key, selection in by.items():
        rows = sparsity_report(model, layers=selection).rows
        assert sorted(r.name for r in rows) == expected[key], key


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda o: L.Dense(o), (16,)),
        (lambda o: L.Conv2D(o, 3), (6, 6, 16)),
        # kernel (3, 3, out, in): the output channels are axis -2
        (lambda o: L.Conv2DTranspose(o, 3), (5, 5, 16)),
        # pointwise kernel (1, 1, in, out)
        (lambda o: L.SeparableConv2D(o, 3), (6, 6, 16)),
        # kernel (out, in): the output axis comes first
        (lambda o: L.EinsumDense("ab,cb->ac", o), (16,)),
        # kernel (2, in, out): two contracted axes, only `e` reaches the output
        (lambda o: L.EinsumDense("abcd,cde->abe", (None, o)), (5, 2, 16)),
    ],
)
def test_skip_unaligned_reads_output_channels_per_layer_type(make, shape):
    # NVIDIA ASP's rule: output channels % 8 and input channels % 16.
    for out, aligned in ((8, True), (12, False), (4, False)):
        layer = make(out)
        layer.build((None,) + shape)
        verdict = check_eligible(layer, skip_unaligned=True)
        assert verdict.ok == aligned, (out, verdict)
        if not aligned:
            assert f"16 input / {out} output channels" in verdict.reason
        assert check_eligible(layer).ok  # default: pruned


def test_layers_not_pruned_say_why():
    unbuilt = L.Dense(8)
    assert check_eligible(unbuilt).reason == (
        "layer is not built (call the model on data first)"
    )
    dense = L.Dense(8)
    dense.build((None, 6))
    assert check_eligible(dense).reason == (
        "6 input channels, not a multiple of 4 (pass pad=True to zero-pad)"
    )
    assert check_eligible(dense, pad=True).ok
    depthwise = L.DepthwiseConv2D(3)
    depthwise.build((None, 6, 6, 8))
    assert "depthwise conv" in check_eligible(depthwise).reason
    flatten = L.Flatten()
    assert check_eligible(flatten).reason == (
        "Flatten is not a supported layer type"
    )


def test_selection_that_matches_nothing_lists_the_weighted_layers():
    x, y = data()
    model = compile_model(sparse_model())
    with pytest.raises(
        ValueError,
        match=r"`layers='nope'` matches no weighted layer of model "
        r"'\w+'. Its weighted layers are: conv_a, sep, deconv, dw, fc, "
        r"head\.",
    ):
        model.fit(
            x,
            y,
            epochs=1,
            verbose=0,
            callbacks=[StructuredSparsity(layers="nope")],
        )
    with pytest.raises(TypeError, match="Received: 42 of type int"):
        sparsity_report(model, layers=42)


def test_layers_inside_nested_models_are_found():
    inner = keras.Sequential(
        [keras.Input((8,)), L.Dense(8, name="inner_a"), L.Dense(4)],
        name="inner",
    )
    model = keras.Sequential(
        [keras.Input((8,)), L.Dense(8, name="outer"), inner]
    )
    names = [r.name for r in sparsity_report(model).rows]
    # a nested model's layers are named by path
    assert names == ["outer", "inner/inner_a", f"inner/{inner.layers[1].name}"]


def test_strip_sparsity_bad_models():
    with pytest.raises(
        TypeError, match=r"`strip_sparsity` expects a Keras 3 `keras.Model`"
    ):
        strip_sparsity("model.keras")
    subclassed = Subclassed()
    subclassed(np.ones((2, 8), "float32"))
    with pytest.raises(
        ValueError,
        match=r"`strip_sparsity` works on a copy of Subclassed 'subclassed' "
        r"rebuilt from its config.*Give Subclassed a `get_config\(\)`",
    ):
        strip_sparsity(subclassed)
