"""One-unit (binary) outputs, on scikit-learn's breast cancer data: the
default metric is the accuracy at a threshold (0.5 on probabilities, 0 on
logits), which `max_drop` binds; top-1 of one column would be the share of
label 0 whatever the model does. The gradient score's default loss is the
binary cross-entropy."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.precision import metrics, threshold_accuracy, top1_accuracy
from keras_mp.quantization import twins


def _data():
    from sklearn.datasets import load_breast_cancer

    found = load_breast_cancer()
    x = found.data.astype("float32")
    x = (x - x.mean(0)) / x.std(0)
    order = np.random.default_rng(0).permutation(len(x))
    return x[order], found.target[order].astype("int32")


def _model(activation):
    inputs = keras.Input((30,))
    x = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
    x = keras.layers.Dense(32, activation="relu", name="hidden2")(x)
    out = keras.layers.Dense(1, activation=activation, name="head")(x)
    return keras.Model(inputs, out)


@pytest.fixture(scope="module")
def trained():
    keras.utils.set_random_seed(0)
    x, y = _data()
    models = {}
    for activation in ("sigmoid", None):
        model = _model(activation)
        model.compile(
            "adam", keras.losses.BinaryCrossentropy(from_logits=not activation)
        )
        model.fit(x, y, epochs=4, batch_size=32, verbose=0)
        models[activation or "logits"] = model
    return models, x[:256], y[:256]


def _search(model, x, y, **kwargs):
    return keras_mp.auto_quantize(
        model, x, y, num_batches=1, calibration_batches=2, verbose=0, **kwargs
    )


@pytest.mark.parametrize(
    "last, outputs, threshold, why",
    [
        ("sigmoid", [0.9, 0.1], 0.5, "sigmoid"),
        (None, [0.9, 0.1], 0.0, "no activation"),
        ("hard_sigmoid", [1.0, 0.0], 0.5, "in [0, 1]"),
        ("tanh", [0.9, -0.8], 0.0, "outside [0, 1]"),
    ],
)
def test_the_threshold_is_told_by_the_last_activation(
    last, outputs, threshold, why
):
    model = _model(last)
    found, reason = metrics.binary_threshold(model, np.array([outputs]).T)
    assert found == threshold
    assert why in reason
    ten = np.zeros((2, 10))
    assert metrics.binary_threshold(model, ten) == (None, "")


def test_default_metric_is_the_thresholded_accuracy(trained):
    models, x, y = trained
    for name, model in models.items():
        _, report = _search(model, x, y, max_drop=1.0)
        out = np.asarray(model(x)).reshape(-1)
        cut = 0.5 if name == "sigmoid" else 0.0
        assert report.metric_float == pytest.approx(np.mean((out > cut) == y))
        assert report.metric_name.startswith(f"accuracy at threshold {cut:g}")
        assert report.metric_name in str(report)


@pytest.mark.filterwarnings("ignore:auto_quantize")
@pytest.mark.gemm_rule  # as users get it: the one-unit head stays float
def test_max_drop_binds_on_a_one_unit_output(trained):
    """Evaluated on points around one whose logit is 0 (the bias moved
    there): quantizing shifts their logits by about one offset, larger
    than their spread, and flips decisions, so the loosest budget drops
    the agreement with the float model and a zero budget keeps fewer
    layers quantized. Top-1 of the one column would agree always."""
    models, x, _ = trained
    model = models["logits"]
    head = model.get_layer("head")
    head.bias.assign(head.bias - np.asarray(model(x[:1]))[0])
    noise = np.random.default_rng(1).normal(size=(256, 30))
    near = (x[:1] + 1e-4 * noise).astype("float32")
    with pytest.raises(ValueError, match="one column"):
        top1_accuracy(np.zeros(len(near)), model(near))
    kwargs = dict(eval_data=near)
    _, loose = _search(model, x, None, max_drop=1.0, **kwargs)
    _, tight = _search(model, x, None, max_drop=0.0, **kwargs)
    assert loose.metric_name.startswith("agreement at threshold 0")
    assert loose.metric_float == 1.0
    assert loose.drop > 0.05
    assert tight.drop <= 0

    def quantized(report):
        return sum(c.precision != "float" for c in report.choices)

    assert quantized(tight) < quantized(loose)


def test_gradient_score_is_the_binary_cross_entropys(trained):
    models, x, y = trained
    model = models["sigmoid"]
    kwargs = dict(num_batches=1, calibration_batches=2, verbose=0)
    default = keras_mp.layer_sensitivity(model, x, y, **kwargs)

    def bce(y_true, y_pred):
        y_true = tf.reshape(tf.cast(y_true, tf.float32), tf.shape(y_pred))
        return tf.reduce_mean(keras.losses.binary_crossentropy(y_true, y_pred))

    given = keras_mp.layer_sensitivity(model, x, y, loss=bce, **kwargs)
    want = {row.name: row.scores for row in given.rows}
    for row in default.rows:
        for p, score in row.scores.items():
            assert score == pytest.approx(want[row.name][p], rel=1e-4)
            assert score > 0


def test_metric_scores_without_labels_use_the_thresholded_output(trained):
    models, x, _ = trained
    metric = functools.partial(threshold_accuracy, threshold=0.5)
    report, qmodels = keras_mp.precision.sensitivity.score_layers(
        models["sigmoid"],
        x,
        None,
        ("int8",),
        metric=metric,
        num_batches=1,
        calibration_batches=2,
        verbose=0,
    )
    assert report.metric == "threshold_accuracy on the float model's decisions"
    assert report.metric in str(report)
    qmodel = qmodels["int8"]
    twins.set_quantization_enabled(qmodel, False)
    labels = np.asarray(qmodel(x[:64])) > 0.5
    for row in report.rows:
        layer = qmodel.get_layer(row.name)
        layer.enabled = True
        got = threshold_accuracy(labels, qmodel(x[:64]))
        layer.enabled = False
        assert row.scores["int8"] == pytest.approx(1.0 - got)


def test_threshold_accuracy_refuses_other_labels():
    with pytest.raises(ValueError, match=r"labels must be 0 or 1.*regression"):
        threshold_accuracy(np.array([0.3, 2.0]), np.array([0.1, 0.9]))
    with pytest.raises(ValueError, match="2 labels for 3 outputs"):
        threshold_accuracy(np.array([0, 1]), np.array([0.1, 0.9, 0.4]))
