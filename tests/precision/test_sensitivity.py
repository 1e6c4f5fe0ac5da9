"""`layer_sensitivity` on trained networks (scikit-learn's digits): its
scores against the definitions computed here by hand, coupled attention
projections, the report, and bad input."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.precision.sensitivity import score_layers


def _mlp():
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(32, activation="relu", name="hidden")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(x))


def _cnn():
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x), name="cnn")


def _attention():
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Reshape((8, 8))(inputs)
    x = keras.layers.Dense(32, name="embed")(x)
    x = x + keras.layers.MultiHeadAttention(2, 16, name="mha")(x, x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x), name="block")


def _train(model, x, y):
    model.compile(
        keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, epochs=4, batch_size=64, verbose=0)
    return model


@pytest.fixture(scope="module")
def trained(digits):
    (x, y), _ = digits
    keras.utils.set_random_seed(0)
    return (
        {
            "mlp": _train(_mlp(), x, y),
            "cnn": _train(_cnn(), x, y),
            "attention": _train(_attention(), x, y),
        },
        x[:256],
        y[:256],
    )


def _by_name(report):
    return {row.name: row for row in report.rows}


def test_gradient_score_is_the_definition(trained):
    """Score of `logits` (the output layer): sum over the batches of
    (dL/dy * (y_quantized - y))^2, dL/dy the cross-entropy's gradient at
    the float logits, computed here without the probe."""
    models, x, y = trained
    report, qmodels = score_layers(
        models["mlp"],
        x,
        y,
        ("int8",),
        num_batches=2,
        batch_size=64,
        calibration_batches=4,
        verbose=0,
    )
    qmodel = qmodels["int8"]
    keras_mp.set_quantization_enabled(qmodel, False)
    logits_layer = qmodel.get_layer("logits")
    want = 0.0
    for start in (0, 64):
        xb, yb = x[start : start + 64], y[start : start + 64]
        logits = tf.constant(qmodel(xb))
        with tf.GradientTape() as tape:
            tape.watch(logits)
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(
                    yb, logits, from_logits=True
                )
            )
        g = tape.gradient(loss, logits)
        logits_layer.enabled = True
        delta = qmodel(xb) - logits
        logits_layer.enabled = False
        want += float(tf.reduce_sum(tf.square(g * delta)))
    got = _by_name(report)["logits"].scores["int8"]
    assert want > 0
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert report.method == "gradient"
    assert report.passes == {"calibration": 4, "forward": 2, "backward": 2}


def test_kl_score_is_the_definition(trained):
    """Without labels: mean over samples of KL(softmax(float) ||
    softmax(only `hidden` quantized)), summed over the batches."""
    models, x, _ = trained
    report, qmodels = score_layers(
        models["mlp"],
        x,
        None,
        ("int8",),
        num_batches=2,
        batch_size=64,
        calibration_batches=4,
        verbose=0,
    )
    qmodel = qmodels["int8"]
    keras_mp.set_quantization_enabled(qmodel, False)
    want = 0.0
    for start in (0, 64):
        xb = x[start : start + 64]
        p = tf.nn.softmax(qmodel(xb)).numpy().astype(np.float64)
        qmodel.get_layer("hidden").enabled = True
        q = tf.nn.softmax(qmodel(xb)).numpy().astype(np.float64)
        qmodel.get_layer("hidden").enabled = False
        want += float(np.mean(np.sum(p * np.log(p / q), axis=-1)))
    assert report.method == "kl"
    # The score is a small difference of float32 log-probabilities (about
    # 1e-5 here): its last bits follow the CPU's kernels. Each log(p / q)
    # carries a few float32 roundings, so the mean over samples is good to
    # a few float32 steps absolute (4 * 2**-23 = 4.8e-7; 3.2e-8 measured
    # between oneDNN on and off).
    np.testing.assert_allclose(
        _by_name(report)["hidden"].scores["int8"],
        want,
        rtol=1e-3,
        atol=4 * np.finfo(np.float32).eps,
    )


def _log_likelihood(y_true, y_pred):
    """Higher is better: the mean log-softmax of the label (continuous, so
    quantizing any layer changes it)."""
    z = np.asarray(y_pred, np.float64)
    z = z - z.max(-1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(np.mean(np.take_along_axis(log_p, y_true[:, None], -1)))


@pytest.mark.parametrize("with_labels", [True, False], ids=["labels", "agree"])
def test_metric_score_is_the_metric_drop(trained, tmp_path, with_labels):
    """With a metric: metric(float) - metric(only that layer quantized),
    on the labels or on the float model's top-1."""
    models, x, y = trained
    report, qmodels = score_layers(
        models["mlp"],
        x,
        y if with_labels else None,
        ("int8",),
        metric=_log_likelihood,
        num_batches=2,
        batch_size=64,
        calibration_batches=4,
        verbose=0,
    )
    qmodel = qmodels["int8"]
    keras_mp.set_quantization_enabled(qmodel, False)
    xb = x[:128]
    float_out = qmodel(xb).numpy()
    labels = y[:128] if with_labels else np.argmax(float_out, -1)
    for name in ("hidden", "logits"):
        qmodel.get_layer(name).enabled = True
        quantized = qmodel(xb).numpy()
        qmodel.get_layer(name).enabled = False
        want = _log_likelihood(labels, float_out) - _log_likelihood(
            labels, quantized
        )
        assert want != 0
        np.testing.assert_allclose(
            _by_name(report)[name].scores["int8"], want, rtol=1e-4
        )
    assert report.method == "metric"
    assert "drop of _log_likelihood" in report.to_table()
    report.plot(tmp_path / "metric.png")
    assert (tmp_path / "metric.png").stat().st_size > 0


def test_fp8_on_a_thin_convolution_is_scored_as_int8(trained):
    models, x, y = trained
    report = keras_mp.layer_sensitivity(
        models["cnn"], x, y, num_batches=1, calibration_batches=2, verbose=0
    )
    rows = list(report.rows)
    thin = [r for r in rows if r.work.kind == "conv" and r.work.gemm_k == 9]
    assert len(thin) == 1  # the 1-channel stem: no FP8 kernel in TensorRT
    assert thin[0].formats == {"int8": "int8", "float8": "int8"}
    assert thin[0].scores["float8"] == pytest.approx(thin[0].scores["int8"])
    wide = [r for r in rows if r.formats["float8"] == "float8"]
    assert wide and all(r.scores["float8"] != r.scores["int8"] for r in wide)
    # most sensitive first
    top = [max(r.scores.values()) for r in rows]
    assert top == sorted(top, reverse=True)


def test_query_key_value_are_one_group(trained):
    models, x, y = trained
    report = keras_mp.layer_sensitivity(
        models["attention"],
        x,
        y,
        precisions=("int8",),
        num_batches=1,
        calibration_batches=2,
        verbose=0,
    )
    names = [row.name for row in report.rows]
    assert "mha/{query,key,value}" in names, names
    group = _by_name(report)["mha/{query,key,value}"]
    assert group.layers == ("mha/query", "mha/key", "mha/value")
    assert not any(n in names for n in ("mha/query", "mha/key"))
    # attention matmuls and output projection stay separate units
    assert "mha" in names and "mha/attention_output" in names
    # one scoring batch of 64: three 32x32 projections of 8 tokens
    assert group.work.flops == 3 * 2 * 64 * 8 * 32 * 32
    assert group.work.calls == 3


def test_report_table_dict_and_plot(trained, tmp_path):
    models, x, y = trained
    report = keras_mp.layer_sensitivity(
        models["mlp"], x, y, num_batches=1, calibration_batches=2, verbose=0
    )
    table = str(report)
    assert "hidden" in table and "logits" in table and "float8" in table
    raw = json.loads(json.dumps(report.to_dict()))
    assert [r["name"] for r in raw["rows"]] == [r.name for r in report.rows]
    assert raw["rows"][0]["work"]["flops"] > 0
    path = tmp_path / "sensitivity.png"
    report.plot(str(path))
    assert path.stat().st_size > 1000
    assert not list(tmp_path.glob("*.tmp*"))


def test_bad_input(trained):
    models, x, y = trained
    model = models["mlp"]
    with pytest.raises(ValueError, match="256 samples in `data` but 255"):
        keras_mp.layer_sensitivity(model, x, y[:-1], verbose=0)
    with pytest.raises(ValueError, match="precisions"):
        keras_mp.layer_sensitivity(model, x, y, precisions=("int4",))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    with pytest.raises(ValueError, match="labels` go with array data"):
        keras_mp.layer_sensitivity(model, dataset, y, verbose=0)
    with pytest.raises(ValueError, match="already quantized"):
        keras_mp.layer_sensitivity(keras_mp.quantize_model(model), x, y)
    with pytest.raises(ValueError, match="a `metric`.*or a `loss`.*not both"):
        keras_mp.layer_sensitivity(
            model, x, y, metric=_log_likelihood, loss=max
        )
    with pytest.raises(TypeError, match="`metric` must be a callable"):
        keras_mp.layer_sensitivity(model, x, y, metric="accuracy")
    with pytest.raises(ValueError, match="metric of the float model is nan"):
        keras_mp.layer_sensitivity(
            model, x, y, metric=lambda t, p: np.nan, verbose=0
        )
    only_norm = keras.Sequential(
        [keras.Input((4,)), keras.layers.LayerNormalization()]
    )
    with pytest.raises(ValueError, match="No quantizable layer"):
        keras_mp.layer_sensitivity(only_norm, np.ones((8, 4), "float32"))


@pytest.mark.parametrize(
    "labels, match",
    [
        (
            np.arange(32) % 12,
            r"class indices from 0 to 11, but model '.*' has 10 classes "
            r"\(its output's last axis, shape \(None, 10\)\). Pass labels "
            r"in 0..9",
        ),
        (
            -np.ones(32, "int64"),
            r"class indices from -1 to -1, but model .* has 10 classes",
        ),
        (
            np.eye(12, dtype="float32")[np.arange(32) % 12],
            r"labels of shape \(None, 12\) and dtype float32 do not fit the "
            r"10 classes .* one-hot rows of 10; or a `loss`",
        ),
        (np.arange(32) % 10 * 1.0, r"labels of shape \(None,\) and dtype"),
    ],
    ids=["index_past_the_classes", "negative", "one_hot_12", "float_indices"],
)
def test_labels_that_do_not_fit_the_classes_are_refused(labels, match):
    """Before any copy is quantized (a TensorFlow error deep inside the
    loss, or a silent broadcast, before)."""
    model = _mlp()
    x = np.random.default_rng(0).random((32, 8, 8, 1), dtype=np.float32)
    with pytest.raises(ValueError, match=match):
        keras_mp.layer_sensitivity(model, x, labels, verbose=0)
    dataset = tf.data.Dataset.from_tensor_slices((x, labels)).batch(16)
    with pytest.raises(ValueError, match=match):
        keras_mp.layer_sensitivity(model, dataset, verbose=0)


def test_dataset_labels_give_the_gradient_score(trained):
    models, x, y = trained
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    report = keras_mp.layer_sensitivity(
        models["mlp"],
        dataset,
        precisions=("int8",),
        num_batches=2,
        calibration_batches=2,
        verbose=0,
    )
    arrays = keras_mp.layer_sensitivity(
        models["mlp"],
        x,
        y,
        precisions=("int8",),
        num_batches=2,
        calibration_batches=2,
        verbose=0,
    )
    assert report.method == "gradient"
    for a, b in zip(report.rows, arrays.rows):
        assert a.name == b.name
        assert a.scores["int8"] == pytest.approx(b.scores["int8"], rel=1e-5)


def test_a_loss_without_labels_gives_the_gradient_score(trained):
    """A label-free loss (here: the logits' squared norm) is
    differentiated as given; the KL path is not taken."""
    models, x, _ = trained
    report = keras_mp.layer_sensitivity(
        models["mlp"],
        x,
        precisions=("int8",),
        loss=lambda y, out: tf.reduce_mean(tf.square(out)),
        num_batches=1,
        calibration_batches=2,
        verbose=0,
    )
    assert report.method == "gradient"
    assert all(r.scores["int8"] > 0 for r in report.rows)
    assert report.passes == {"calibration": 2, "forward": 1, "backward": 1}


class _Unregistered(keras.Model):
    """Subclassed, not registered: Keras cannot rebuild it from its
    config."""

    def __init__(self):
        super().__init__(name="unregistered")
        self.fc = keras.layers.Dense(32)

    def call(self, x):
        return self.fc(keras.ops.reshape(x, (-1, 64)))


def test_a_model_that_cannot_be_copied_says_how_to_fix_it(trained):
    _, x, y = trained
    model = _Unregistered()
    model(x[:1])
    with pytest.raises(ValueError, match="get_config.*quantize copies"):
        keras_mp.layer_sensitivity(model, x, y, verbose=0)
    with pytest.raises(ValueError, match="get_config.*quantize copies"):
        keras_mp.auto_quantize(model, x, y, verbose=0)


def test_a_layer_inside_time_distributed_gets_a_score():
    # TimeDistributed calls its layer's `call`: scored there (it scored 0,
    # silently, when only `__call__` was probed)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5, 128))
    h = keras.layers.TimeDistributed(
        keras.layers.Dense(64, activation="relu", name="inner"), name="td"
    )(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(inputs, keras.layers.Dense(10, name="head")(h))
    x = np.random.default_rng(0).normal(size=(64, 5, 128)).astype("f4")
    y = np.random.default_rng(1).integers(0, 10, 64)
    report = keras_mp.layer_sensitivity(
        model, x, y, num_batches=1, calibration_batches=1, verbose=0
    )
    row = next(r for r in report.rows if r.name == "td/inner")
    assert row.scores["int8"] > 0 and row.work.flops > 0
