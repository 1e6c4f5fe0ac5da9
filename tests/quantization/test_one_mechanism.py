"""Regression tests for issue 22: one quantization mechanism for every model.

Each test is a failure a user met on the two-mechanism design (graph copy
with `QuantizeWrapper`s for Sequential/Functional models, quantized twins in
place for the rest), written against the public API and the intended
behaviour: every model quantized in place, layers keep their names.
"""

import os
import warnings

import keras
import numpy as np
import pytest

import keras_mp

L = keras.layers
PACKAGE = "keras_mp_tests"
FIXTURES = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "integration", "fixtures"
)


def all_layers(model):
    """Every layer inside `model`, at any depth (wrapped layers included)."""
    return model._flatten_layers(include_self=False, recursive=True)


def quantized_rows(model):
    return [
        r
        for r in keras_mp.quantization_report(model, verbose=False).rows
        if r["quantized"]
    ]


@keras.saving.register_keras_serializable(package=PACKAGE)
class TwoDenseNet(keras.Model):
    """A subclassed model: Dense -> ReLU -> Dense."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.fc1 = L.Dense(units, activation="relu", name="fc1")
        self.fc2 = L.Dense(4, name="fc2")

    def call(self, x):
        return self.fc2(self.fc1(x))

    def get_config(self):
        return {"units": self.units, "name": self.name}


def test_fp16_export_of_subclassed_model_with_subnormal_scales(tmp_path):
    # Activations around 1e-3: their Q/DQ scales are below float16's
    # smallest normal, so the fp16 export raises them and says whose.
    x = np.random.default_rng(0).normal(size=(64, 16)).astype("float32")
    x *= 1.5e-3
    model = TwoDenseNet(name="two_dense")
    model(x[:2])
    q = keras_mp.quantize_model(model)
    keras_mp.calibrate(q, x, verbose=0)
    with pytest.warns(
        UserWarning, match="below float16's smallest normal"
    ) as record:
        report = keras_mp.export_onnx(
            q, tmp_path / "q16.onnx", dtype="float16", verify_data=x
        )
    assert report is not None
    raised = [
        str(w.message) for w in record if "dtype='float16'" in str(w.message)
    ]
    assert raised and "fc1" in raised[0], raised
    assert os.path.isfile(tmp_path / "q16.onnx")


def two_heads():
    inputs = keras.Input((8,), name="x")
    h = L.Dense(16, activation="relu", name="trunk")(inputs)
    cls = L.Dense(3, activation="softmax", name="cls")(h)
    reg = L.Dense(1, name="reg")(h)
    return keras.Model(inputs, [cls, reg], name="two_heads")


def test_functional_outputs_keep_their_names(tmp_path):
    import onnx

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = [rng.integers(0, 3, 32), rng.normal(size=(32, 1)).astype("float32")]
    model = two_heads()
    q = keras_mp.quantize_model(model)
    keras_mp.calibrate(q, x, verbose=0)
    q.compile(
        keras.optimizers.Adam(1e-3),
        loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
    )
    history = q.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert q.get_layer("cls").name == "cls"

    keras_mp.export_onnx(model, tmp_path / "float.onnx")
    keras_mp.export_onnx(q, tmp_path / "int8.onnx")
    names = {
        kind: [
            o.name for o in onnx.load(tmp_path / f"{kind}.onnx").graph.output
        ]
        for kind in ("float", "int8")
    }
    assert names["int8"] == names["float"] == ["cls", "reg"], names
    keys = list(keras_mp.quantization.activation_quantizers(q))
    assert keys and not any("quant_" in k for k in keys), keys


def test_sequential_output_keeps_its_name(tmp_path):
    # A Sequential model's output is named after its last layer in the
    # float export; the quantized one was named after the model.
    import onnx

    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    model = keras.Sequential(
        [keras.Input((8,)), L.Dense(4, name="fc"), L.Dense(2, name="head")],
        name="seq_names",
    )
    q = keras_mp.quantize_model(model)
    keras_mp.calibrate(q, x, verbose=0)
    assert q.output_names == ["head"]
    keras_mp.export_onnx(model, tmp_path / "float.onnx")
    keras_mp.export_onnx(q, tmp_path / "int8.onnx")
    for kind in ("float", "int8"):
        graph = onnx.load(tmp_path / f"{kind}.onnx").graph
        assert [o.name for o in graph.output] == ["head"], kind


def shared_dense():
    """One Dense (with its ReLU) called on two inputs, its two outputs
    added: the residual Add of issue 22."""
    a = keras.Input((8,), name="a")
    b = keras.Input((8,), name="b")
    proj = L.Dense(8, activation="relu", name="proj")
    added = L.Add(name="add")([proj(a), proj(b)])
    outputs = L.Dense(4, name="head")(added)
    return keras.Model([a, b], outputs, name="shared_dense")


def shared_inputs(n=32):
    """Input `a` up to 3 in magnitude, `b` up to 9.3."""
    rng = np.random.default_rng(0)
    a = rng.uniform(-3.0, 3.0, (n, 8)).astype("float32")
    b = rng.uniform(-9.3, 9.3, (n, 8)).astype("float32")
    a[0, 0], b[0, 0] = 3.0, 9.3
    return [a, b]


def test_shared_layer_is_warned_about_and_reported():
    with pytest.warns(UserWarning, match="more than once.*proj"):
        q = keras_mp.quantize_model(shared_dense())
    keras_mp.calibrate(q, shared_inputs(), verbose=0)
    rows = [r for r in quantized_rows(q) if r["layer"] == "proj"]
    assert len(rows) == 1, [r["path"] for r in quantized_rows(q)]
    assert "shared" in rows[0]["note"], rows[0]
    # One input range for both calls: it covers the larger one.
    assert rows[0]["inputs"][0] == pytest.approx(9.3, rel=1e-3)


def test_no_lint_warning_about_own_placement(tmp_path):
    x = shared_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shared-layer warning
        q = keras_mp.quantize_model(shared_dense())
    keras_mp.calibrate(q, x, verbose=0)
    path = tmp_path / "shared.onnx"
    keras_mp.export_onnx(q, path, verify_data=x)
    report = keras_mp.check_tensorrt(path)
    assert report.ok, report.to_markdown()
    assert report.warnings == [], report.to_markdown()


def test_config_for_nested_model_covers_its_layers():
    inner_in = keras.Input((8,))
    h = L.Dense(8, activation="relu", name="in_a")(inner_in)
    inner = keras.Model(inner_in, L.Dense(8, name="in_b")(h), name="inner")
    inputs = keras.Input((8,))
    h = L.Dense(8, activation="relu", name="stem")(inputs)
    outputs = L.Dense(4, name="head")(inner(h))
    model = keras.Model(inputs, outputs, name="outer")

    q = keras_mp.quantize_model(
        model, config={"inner": keras_mp.QuantizeConfig(per_channel=False)}
    )
    per_tensor = {}
    for row in quantized_rows(q):
        low, high = row["weights"]["kernel"]
        # One range per tensor: min == max; per channel (random init): not.
        per_tensor[row["path"]] = low == high
    inside = {p: v for p, v in per_tensor.items() if "inner" in p.split("/")}
    outside = {p: v for p, v in per_tensor.items() if p not in inside}
    assert len(inside) == 2 and len(outside) == 2, per_tensor
    assert all(inside.values()), per_tensor
    assert not any(outside.values()), per_tensor


def _kept(model):
    """`{layer name: (masked, kept_magnitude)}` of the sparsity report
    (nested layers by their own name)."""
    return {
        row.name.split("/")[-1]: (row.masked, row.kept_magnitude)
        for row in keras_mp.sparsity_report(model).rows
    }


def test_quantizing_a_pruned_model_keeps_its_masks():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.normal(size=(64, 8)).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((16,)),
            L.Dense(16, activation="relu", name="fc1"),
            L.Dense(8, name="fc2"),
        ],
        name="pruned",
    )
    model.compile(keras.optimizers.SGD(1e-2), "mse")
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        verbose=0,
        callbacks=[keras_mp.StructuredSparsity()],
    )
    pruned = _kept(model)
    assert sorted(pruned) == ["fc1", "fc2"]
    assert all(masked and 0 < kept < 1 for masked, kept in pruned.values())

    q = keras_mp.quantize_model(model)
    assert _kept(q) == pruned

    keras_mp.calibrate(q, x, verbose=0)
    q.compile(keras.optimizers.SGD(1e-2), "mse")
    q.fit(
        x[:32],
        y[:32],
        batch_size=16,
        epochs=1,
        verbose=0,
        callbacks=[keras_mp.StructuredSparsity()],
    )
    kernels = [v for v in q.trainable_weights if v.path.endswith("kernel")]
    assert len(kernels) == 2
    for kernel in kernels:
        assert keras_mp.is_2_4_sparse(kernel, 0), kernel.path
    assert _kept(q) == pruned


def test_mixed_float16_fake_quantizes_float32_weights():
    # Per-channel max|w| 0.7000001 and 0.6: neither is a float16 number.
    kernel = np.array(
        [[0.1, -0.2], [0.3, 0.05], [-0.7000001, 0.6], [0.01, 0.02]],
        np.float32,
    )
    amax = np.abs(kernel).max(axis=0)
    assert np.all(amax.astype(np.float16).astype(np.float32) != amax)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential(
            [keras.Input((4,)), L.Dense(2, name="fc")], name="mixed"
        )
        assert model.get_layer("fc").compute_dtype == "float16"
        model.get_layer("fc").kernel.assign(kernel)
        q = keras_mp.quantize_model(model)
        x = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")
        q(x, training=True)  # a training step sets the ranges from w
    finally:
        keras.mixed_precision.set_global_policy("float32")
    (row,) = quantized_rows(q)
    assert row["weights"]["kernel"] == (float(amax.min()), float(amax.max()))


def test_bad_input_and_upgrade_of_old_files():
    model = keras.Sequential(
        [keras.Input((4,)), L.Dense(2, name="fc")], name="small"
    )
    q = keras_mp.quantize_model(model)
    with pytest.raises(ValueError, match="already quantized"):
        keras_mp.quantize_model(q)
    with pytest.raises(ValueError, match="no_such_layer"):
        keras_mp.quantize_model(model, layers="no_such_layer")
    tokens = keras.Input((5,), dtype="int32")
    seq = L.Embedding(50, 8)(tokens)
    recurrent = keras.Model(
        tokens, L.Dense(2)(L.LSTM(8, name="lstm")(seq)), name="rnn"
    )
    with pytest.raises(ValueError, match=r"It matches lstm \(LSTM\)"):
        keras_mp.quantize_model(recurrent, layers="lstm")
    with pytest.raises(ValueError, match="nothing to upgrade"):
        keras_mp.upgrade(model)

    # A file saved before the change: QuantizeWrapper layers named quant_*.
    old = keras.saving.load_model(
        os.path.join(FIXTURES, "quantized.keras"), safe_mode=True
    )
    saved = np.load(os.path.join(FIXTURES, "quantized.npz"))
    assert any(
        isinstance(x, keras_mp.legacy.QuantizeWrapper) for x in all_layers(old)
    )
    new = keras_mp.upgrade(old)
    layers = all_layers(new)
    assert not any(
        isinstance(x, keras_mp.legacy.QuantizeWrapper) for x in layers
    )
    names = {x.name for x in layers}
    float_names = {"conv", "bn", "proj", "add", "dw", "conv2", "head"}
    assert float_names <= names, sorted(names)
    assert not {f"quant_{n}" for n in float_names} & names, sorted(names)
    np.testing.assert_allclose(
        new.predict(saved["x"], verbose=0), saved["y"], rtol=0, atol=1e-6
    )

    # Functions that read quantizers ask for `upgrade` on old wrappers.
    with pytest.raises(ValueError, match="upgrade"):
        keras_mp.compare_onnx(old, "unused.onnx", saved["x"][:2])
    with pytest.raises(ValueError, match="set_quantization_enabled.*upgrade"):
        keras_mp.set_quantization_enabled(old, False)

    # Old wrappers beside layers quantized the current way: refused, with
    # the order that works.
    a = keras.Input(old.input_shape[1:])
    b = keras.Input((4,))
    mixed = keras.Model([a, b], [old(a), q(b)], name="mixed")
    with pytest.raises(ValueError, match="nothing was changed. Upgrade the"):
        keras_mp.upgrade(mixed)


def test_concatenate_inputs_share_one_range():
    # TensorRT moves a Concat's input DQs past it only when their scales
    # are equal: a Concatenate asked to quantize its inputs gives them one
    # range, the largest, after calibration and from the first QAT batch.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    inputs = keras.Input((8,))
    small = L.Dense(4, name="small")(inputs)
    large = L.Dense(4, name="large", kernel_initializer="ones")(inputs)
    cat = L.Concatenate(name="cat")([small, large])
    model = keras.Model(inputs, L.Dense(2, name="head")(cat))
    config = {"cat": keras_mp.QuantizeConfig(quantize_inputs=True)}

    def cat_ranges(q):
        found = keras_mp.quantization.activation_quantizers(q)
        return [float(found[f"cat/input_{i}"].amax) for i in (0, 1)]

    q = keras_mp.quantize_model(model, config=config)
    report = keras_mp.calibrate(q, x, method="max", verbose=0)
    a, b = cat_ranges(q)
    assert (
        a
        == b
        == max(
            report.observed_max["cat/input_0"],
            report.observed_max["cat/input_1"],
        )
    )
    assert report.ranges["cat/input_0"] == a

    q = keras_mp.quantize_model(model, config=config)
    q.compile(keras.optimizers.SGD(0.0), "mse")
    q.fit(x, np.zeros((32, 2), "float32"), batch_size=32, verbose=0)
    a, b = cat_ranges(q)
    assert a == b > 0
