"""Conformance: every row of the layer table, through every feature.

A new layer type is one row in `keras_mp/layer_table.py` plus one entry in
`SAMPLES` here: a builder of a small model around the layer. Quantizable
rows are quantized, calibrated, exported to ONNX, run by ONNX Runtime and
linted against TensorRT's rules; prunable rows are pruned 2:4 in `fit`;
float32 rows stay float32 under `apply_mixed_precision`; channel-wise rows
let `permute_for_sparsity` reorder through them without changing outputs.
"""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import _keras, layer_table
from keras_mp.quantization import placement, twins

L = keras.layers


_GLOBAL_POOL = {3: L.GlobalAveragePooling1D, 4: L.GlobalAveragePooling2D}
_GLOBAL_POOL[5] = L.GlobalAveragePooling3D


# The head's outputs: 16, the smallest N the small-GEMM rule quantizes
# (`placement.gemm_too_small`), so that the golden placement test, which
# runs the rule as users get it, sees a quantized head after each sample.
HEAD = 16


def _around(layer, shape, before=None):
    """`Input(shape) -> [before] -> layer -> [global pool] -> Dense(HEAD)`:
    the pool keeps channels, so a permutation can pass through."""
    inputs = keras.Input(shape)
    x = before(inputs) if before is not None else inputs
    x = layer(x)
    if len(x.shape) > 2:
        x = _GLOBAL_POOL[len(x.shape)]()(x)
    return keras.Model(inputs, L.Dense(HEAD, name="head")(x))


def _residual(shape):
    inputs = keras.Input(shape)
    x = L.Conv2D(shape[-1], 3, padding="same", name="conv")(inputs)
    x = L.Add(name="sample")([x, inputs])
    x = L.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, L.Dense(HEAD, name="head")(x))


def _concat(shape):
    inputs = keras.Input(shape)
    a = L.Conv2D(8, 1, name="a")(inputs)
    b = L.Conv2D(8, 1, name="b")(inputs)
    x = L.Concatenate(name="sample")([a, b])
    x = L.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, L.Dense(HEAD, name="head")(x))


def _attention(shape):
    inputs = keras.Input(shape)
    x = L.MultiHeadAttention(2, 8, name="sample")(inputs, inputs)
    x = L.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, L.Dense(HEAD, name="head")(x))


def _grouped_attention(shape):
    inputs = keras.Input(shape)
    x = L.GroupQueryAttention(8, 4, 2, name="sample")(inputs, inputs)
    x = L.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, L.Dense(HEAD, name="head")(x))


def _two_projections(layer):
    """Query and value projections of one sequence, attended by `layer`
    (Attention, AdditiveAttention: no projection of their own)."""

    def make(shape):
        inputs = keras.Input(shape)
        query = L.Dense(16, name="query")(inputs)
        value = L.Dense(16, name="value")(inputs)
        x = layer(name="sample")([query, value])
        x = L.GlobalAveragePooling1D()(x)
        return keras.Model(inputs, L.Dense(HEAD, name="head")(x))

    return make


def _dot(shape):
    """Two projections of one sequence, their `Dot` over features (a
    batched matmul of two activations, as attention's scores)."""
    inputs = keras.Input(shape)
    a = L.Dense(16, name="a")(inputs)
    b = L.Dense(16, name="b")(inputs)
    x = L.Dot(axes=2, name="sample")([a, b])
    x = L.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, L.Dense(HEAD, name="head")(x))


def _pooled(cls, rank):
    """`Conv(8, 1) -> cls -> ...`: pooling of a conv's output."""
    conv = (L.Conv1D, L.Conv2D, L.Conv3D)[rank - 1]
    args = () if cls.__name__.startswith("Global") else (2,)
    shape = (8,) * rank + (8,) if rank < 3 else (4, 4, 4, 8)

    def make(shape):
        feed = conv(32, 1, name="feed")
        return _around(cls(*args, name="sample"), shape, feed)

    return make, shape


# Class -> (model builder, input shape). Every class of the table has one.
SAMPLES = {
    L.Conv1D: (lambda s: _around(L.Conv1D(8, 3, name="sample"), s), (10, 8)),
    L.Conv2D: (
        lambda s: _around(L.Conv2D(8, 3, name="sample"), s),
        (8, 8, 8),
    ),
    L.Conv3D: (
        lambda s: _around(L.Conv3D(8, 3, name="sample"), s),
        (5, 5, 5, 8),
    ),
    L.Conv1DTranspose: (
        lambda s: _around(L.Conv1DTranspose(8, 3, name="sample"), s),
        (6, 8),
    ),
    L.Conv2DTranspose: (
        lambda s: _around(L.Conv2DTranspose(8, 3, name="sample"), s),
        (5, 5, 8),
    ),
    L.Conv3DTranspose: (
        lambda s: _around(L.Conv3DTranspose(8, 3, name="sample"), s),
        (4, 4, 4, 8),
    ),
    L.DepthwiseConv1D: (
        lambda s: _around(L.DepthwiseConv1D(3, name="sample"), s),
        (10, 8),
    ),
    L.DepthwiseConv2D: (
        lambda s: _around(L.DepthwiseConv2D(3, name="sample"), s),
        (8, 8, 8),
    ),
    L.SeparableConv1D: (
        lambda s: _around(L.SeparableConv1D(8, 3, name="sample"), s),
        (10, 8),
    ),
    L.SeparableConv2D: (
        lambda s: _around(L.SeparableConv2D(8, 3, name="sample"), s),
        (8, 8, 8),
    ),
    L.Dense: (lambda s: _around(L.Dense(16, name="sample"), s), (16,)),
    L.EinsumDense: (
        lambda s: _around(
            L.EinsumDense("abc,cd->abd", (5, 16), name="sample"), s
        ),
        (5, 16),
    ),
    # attention and Dot samples 16 wide: their projections and head are
    # quantized under the small-GEMM rule too (golden placement test)
    L.MultiHeadAttention: (_attention, (6, 16)),
    L.GroupQueryAttention: (_grouped_attention, (6, 16)),
    L.Attention: (_two_projections(L.Attention), (6, 16)),
    L.AdditiveAttention: (_two_projections(L.AdditiveAttention), (6, 16)),
    L.Add: (_residual, (6, 6, 8)),
    L.Concatenate: (_concat, (6, 6, 8)),
    L.Dot: (_dot, (6, 16)),
    **{
        cls: _pooled(cls, rank)
        for rank, classes in (
            (1, ("MaxPooling1D", "AveragePooling1D", "GlobalAveragePooling1D")),
            (2, ("MaxPooling2D", "AveragePooling2D", "GlobalAveragePooling2D")),
            (3, ("MaxPooling3D", "AveragePooling3D", "GlobalAveragePooling3D")),
        )
        for cls in (getattr(L, name) for name in classes)
    },
    **{
        getattr(L, f"GlobalMaxPooling{rank}D"): _pooled(
            getattr(L, f"GlobalMaxPooling{rank}D"), rank
        )
        for rank in (1, 2, 3)
    },
    L.Activation: (
        lambda s: _around(L.Activation("relu", name="sample"), s, L.Dense(32)),
        (16,),
    ),
    L.ReLU: (lambda s: _around(L.ReLU(name="sample"), s, L.Dense(32)), (16,)),
    L.LeakyReLU: (
        lambda s: _around(L.LeakyReLU(name="sample"), s, L.Dense(32)),
        (16,),
    ),
    L.ELU: (lambda s: _around(L.ELU(name="sample"), s, L.Dense(32)), (16,)),
    L.Dropout: (
        lambda s: _around(L.Dropout(0.5, name="sample"), s, L.Dense(32)),
        (16,),
    ),
    L.BatchNormalization: (
        lambda s: _around(L.BatchNormalization(name="sample"), s, L.Dense(32)),
        (16,),
    ),
    L.LayerNormalization: (
        lambda s: _around(L.LayerNormalization(name="sample"), s),
        (16,),
    ),
    L.GroupNormalization: (
        lambda s: _around(L.GroupNormalization(4, name="sample"), s),
        (16,),
    ),
    L.UnitNormalization: (
        lambda s: _around(L.UnitNormalization(name="sample"), s),
        (16,),
    ),
    L.Normalization: (
        lambda s: _around(
            L.Normalization(mean=0.5, variance=2.0, name="sample"), s
        ),
        (16,),
    ),
    L.Softmax: (lambda s: _around(L.Softmax(name="sample"), s), (16,)),
}

CLASSES = sorted(layer_table.TABLE, key=lambda c: c.__name__)


def _build(cls, n=32):
    make, shape = SAMPLES[cls]
    keras.utils.set_random_seed(0)
    model = make(shape)
    x = np.random.default_rng(0).normal(size=(n, *shape)).astype("float32")
    model(x[:1])
    return model, x


def test_every_row_has_a_sample():
    assert sorted(SAMPLES, key=lambda c: c.__name__) == CLASSES


def _sample_row(cls):
    row = layer_table.TABLE[cls]
    if callable(row):  # rows computed from the layer (EinsumDense)
        return row(_build(cls, n=1)[0].get_layer("sample"))
    return row


ROWS = {cls: _sample_row(cls) for cls in CLASSES}
QUANTIZABLE = [c for c in CLASSES if ROWS[c].quantizable]
PRUNABLE = [c for c in CLASSES if ROWS[c].prune is not None]
FLOAT32 = [c for c in CLASSES if ROWS[c].float32]
CHANNELWISE = [c for c in CLASSES if ROWS[c].permute == layer_table.CHANNELWISE]


# Known gaps, each a strict xfail: the marker fails once the gap is fixed.
KNOWN_EXPORT_GAPS = {}


def _with_known_gaps(classes):
    return [
        pytest.param(
            cls,
            id=cls.__name__,
            marks=pytest.mark.xfail(strict=True, reason=KNOWN_EXPORT_GAPS[cls]),
        )
        if cls in KNOWN_EXPORT_GAPS
        else pytest.param(cls, id=cls.__name__)
        for cls in classes
    ]


def quantize_sample(cls, model):
    """`quantize_model` of `cls`'s sample model, as the conformance test
    quantizes it (also used by tests/integration/test_golden_placement.py).
    """
    config = None
    if ROWS[cls].inputs == layer_table.NO_INPUTS:  # pooling: on request only
        config = {"sample": keras_mp.QuantizeConfig(quantize_inputs=True)}
        # An average pooling runs in INT8 only with its output quantized
        # too (`placement.qdq_role`): quantize the next layer's input when
        # that layer does not already (a global pool, not the Dense head).
        layer = model.get_layer("sample")
        after = _keras.outbound_nodes(layer)[0].operation
        row = layer_table.row_for(after)
        if placement.qdq_role(layer) == "fused" and not (row and row.weighted):
            config[after.name] = keras_mp.QuantizeConfig(quantize_inputs=True)
    return keras_mp.quantize_model(model, config=config)


@pytest.mark.parametrize("cls", _with_known_gaps(QUANTIZABLE))
def test_quantizable_row_exports_lint_clean(cls, tmp_path):
    model, x = _build(cls)
    qmodel = quantize_sample(cls, model)
    assert twins.is_quantized(qmodel.get_layer("sample"))
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path / "model.onnx")
    parity = keras_mp.export_onnx(qmodel, path, verify_data=x)
    assert parity.rel_l2 < 1e-2
    report = keras_mp.check_tensorrt(path)
    assert report.ok, report.to_markdown()
    # Every weighted op of the sample (and the Dense head) reads both its
    # inputs from DequantizeLinear: nothing left in float.
    assert report.weighted_ops == report.weighted_ops_quantized > 0


@pytest.mark.parametrize("cls", PRUNABLE, ids=lambda c: c.__name__)
def test_prunable_row_is_pruned_2_4_in_fit(cls):
    model, x = _build(cls)
    row = ROWS[cls]
    model.compile("sgd", "mse")
    model.fit(
        x,
        np.zeros((len(x), HEAD)),
        epochs=1,
        batch_size=16,
        verbose=0,
        callbacks=[keras_mp.StructuredSparsity()],
    )
    layer = model.get_layer("sample")
    kernel = getattr(layer, row.prune.attr).numpy()
    assert keras_mp.is_2_4_sparse(kernel, row.prune.in_axis)
    assert not keras_mp.is_2_4_sparse(
        np.ones_like(kernel), row.prune.in_axis
    )  # the axis is one that 2:4 can fail on


@pytest.mark.parametrize("cls", FLOAT32, ids=lambda c: c.__name__)
def test_float32_row_stays_float32_under_mixed_precision(cls):
    model, _ = _build(cls, n=1)
    mixed = keras_mp.apply_mixed_precision(model, "mixed_float16")
    assert mixed.get_layer("sample").compute_dtype == "float32"
    assert keras_mp.is_precision_sensitive(mixed.get_layer("sample"))


@pytest.mark.parametrize("cls", CHANNELWISE, ids=lambda c: c.__name__)
def test_channelwise_row_lets_permutation_through(cls):
    model, x = _build(cls)
    before = model.predict(x, verbose=0)
    producer = model.layers[1]
    kernel = producer.kernel.numpy().copy()
    report = keras_mp.permute_for_sparsity(model)
    head = next(row for row in report if row.name == "head")
    assert (head.producer, head.between[0]) == (producer.name, "sample")
    assert head.permuted, head
    # The producer's output channels moved through the sample layer, and
    # the model computes the same function.
    assert not np.array_equal(producer.kernel.numpy(), kernel)
    np.testing.assert_allclose(
        model.predict(x, verbose=0), before, rtol=1e-5, atol=1e-5
    )
