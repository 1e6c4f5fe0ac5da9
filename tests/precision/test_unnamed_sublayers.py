"""`layer_sensitivity` and `auto_quantize` on layers that make unnamed
sublayers in `build` (as keras-rs `FeatureCross` makes a `Dense`): every
copy they quantize names those sublayers anew (`cross1/dense_7`), yet the
rows, choices and shared ranges are the user's model's paths."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp import _models
from keras_mp.precision.copies import float_copy, paths_in
from keras_mp.quantization import twins


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class Cross(keras.layers.Layer):
    """`x0 * dense(x) + x` with its Dense made, unnamed, in `build`."""

    def build(self, input_shape):
        self.dense = keras.layers.Dense(input_shape[-1])
        self.dense.build(input_shape)

    def call(self, x0, x=None):
        x = x0 if x is None else x
        return ops.add(ops.multiply(x0, self.dense(x)), x)


def _model():
    inputs = keras.Input((16,))
    x0 = keras.layers.Dense(32, activation="relu", name="embed")(inputs)
    x1 = Cross(name="cross1")(x0)
    x2 = Cross(name="cross2")(x0, x1)
    return keras.Model(inputs, keras.layers.Dense(4, name="logits")(x2))


@pytest.fixture(scope="module")
def trained():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype("float32")
    y = np.argmax(x[:, :4] * x[:, 4:8], axis=-1)
    model = _model()
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(True))
    model.fit(x, y, epochs=3, batch_size=32, verbose=0)
    return model, x, y


def _paths(model):
    return [_models.layer_path(layer, p) for layer, p in _models.walk(model)]


def test_copies_rename_the_sublayers_and_are_mapped_back(trained):
    model, _, _ = trained
    copy, paths = float_copy(model, "test")
    ours = _paths(model)
    # Keras numbers the unnamed Dense from its per-process counter: the
    # user's is `cross1/dense_<n>`, the copy's another number
    (mine,) = [p for p in ours if p.startswith("cross1/dense")]
    assert mine not in _paths(copy)
    assert sorted(paths.values()) == sorted(ours)
    qmodel = keras_mp.quantize_model(copy, in_place=True)
    assert paths_in(model, qmodel) == paths


@pytest.mark.parametrize("labels", [True, False], ids=["gradient", "kl"])
def test_rows_are_the_models_paths(trained, labels):
    model, x, y = trained
    dense_paths = {
        _models.layer_path(layer, p)
        for layer, p in _models.walk(model)
        if isinstance(layer, keras.layers.Dense)
    }
    report = keras_mp.layer_sensitivity(
        model,
        x,
        y if labels else None,
        num_batches=1,
        calibration_batches=2,
        verbose=0,
    )
    assert {row.name for row in report.rows} == dense_paths
    for row in report.rows:
        assert set(row.scores) == {"int8", "float8"}
        assert row.work is not None and row.work.flops > 0


def test_auto_quantize_quantizes_the_sublayers(trained):
    model, x, y = trained
    qmodel, report = keras_mp.auto_quantize(
        model,
        x,
        y,
        max_drop=1.0,  # anything goes: the cheapest configuration
        num_batches=1,
        calibration_batches=2,
        verbose=0,
    )
    chosen = {c.name: c.precision for c in report.choices}
    crosses = [p for p in _paths(model) if "/dense" in p]  # the user's
    assert len(crosses) == 2
    assert all(chosen[p] != "float" for p in crosses), chosen
    quantized = {
        f"{layer.name}/{layer.dense.__class__.__name__}"
        for layer in _models.walk_layers(qmodel)
        if isinstance(layer, Cross)
    }
    assert quantized == {"cross1/QuantizedDense", "cross2/QuantizedDense"}
    # the ranges came from the per-precision models, none left at 0
    assert report.passes["calibration"] == 2 * 2
    for q in twins.quantizers(qmodel):
        assert float(np.max(q.quantizer.amax.numpy())) > 0, q.name
