"""`auto_quantize` on a trained network (scikit-learn's digits): the drop
it reports is the one measured here, its choices are the model's, the
Lagrangian list of configurations, the bits cost, and bad input."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.precision.search import lagrangian_configs
from keras_mp.precision.sensitivity import precision_tuple
from keras_mp.quantization.twins import quantized_layers


@pytest.fixture(scope="module")
def trained(digits):
    (x, y), (xt, yt) = digits
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(64, activation="relu", name="fc")(h)
    model = keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))
    model.compile(
        keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, epochs=5, batch_size=64, verbose=0)
    return model, (x[:512], y[:512]), (xt, yt)


def _top1(model, x, y):
    return float(np.mean(np.argmax(model.predict(x, verbose=0), -1) == y))


def _search(trained, **kwargs):
    model, (x, y), (xt, yt) = trained
    kwargs.setdefault("max_drop", 0.01)
    return keras_mp.auto_quantize(
        model,
        x,
        y,
        eval_data=xt,
        eval_labels=yt,
        num_batches=2,
        calibration_batches=4,
        verbose=0,
        **kwargs,
    )


@pytest.fixture(scope="module")
def searched(trained):
    return _search(trained)


def test_the_reported_metric_is_the_returned_models(trained, searched):
    model, _, (xt, yt) = trained
    qmodel, report = searched
    assert report.metric_float == pytest.approx(_top1(model, xt, yt))
    assert report.metric == pytest.approx(_top1(qmodel, xt, yt))
    assert report.drop <= report.max_drop
    assert report.tried and all("drop" in t for t in report.tried)
    # each layer is quantized as chosen, in its format; the rest float
    formats = {
        layer.name: {q.format.name for q in layer.owned_quantizers()}
        for layer in quantized_layers(qmodel)
    }
    for choice in report.choices:
        for path in choice.layers:
            got = formats.get(path.rsplit("/", 1)[-1], {"float"})
            if choice.precision == "float8" and got == {"int8"}:
                continue  # a thin convolution TensorRT runs in INT8
            assert got == {choice.precision}, (choice, got)
    assert 0.0 <= report.quantized_flops <= 1.0
    assert report.predicted["float"] / report.predicted["chosen"] == (
        pytest.approx(report.speedup_over_fp16)
    )
    assert "predicted speed-up over float16" in str(report)


def test_a_loose_budget_takes_the_cheapest_configuration(trained):
    _, report = _search(trained, max_drop=1.0, precisions=("int8", "float"))
    assert min(t["index"] for t in report.tried) == 0
    assert report.tried[0]["cost"] == pytest.approx(report.predicted["chosen"])
    assert report.predicted["chosen"] <= report.predicted["all int8"]
    assert report.quantized_flops > 0.9


def test_bits_cost_is_weight_bits(trained):
    _, report = _search(trained, max_drop=1.0, cost="bits")
    weights = {c.name: c.costs["float"] / 16 for c in report.choices}
    bits = sum(
        weights[c.name] * (16 if c.precision == "float" else 8)
        for c in report.choices
    )
    assert report.effective_bits == pytest.approx(bits / sum(weights.values()))
    assert report.effective_bits == pytest.approx(8.0)


def test_the_returned_model_saves_and_loads(trained, searched, tmp_path):
    _, (x, _), _ = trained
    qmodel, _ = searched
    path = str(tmp_path / "auto.keras")
    qmodel.save(path)
    loaded = keras.models.load_model(path, safe_mode=True)
    np.testing.assert_allclose(
        loaded.predict(x[:64], verbose=0),
        qmodel.predict(x[:64], verbose=0),
        atol=1e-5,
    )


def test_lagrangian_configurations_run_from_cheapest_to_safest():
    options = [
        {"float": (0.0, 10.0), "int8": (1.0, 5.0), "float8": (3.0, 4.0)},
        {"float": (0.0, 10.0), "int8": (0.5, 9.0)},
        {"float": (0.0, 1.0), "int8": (2.0, 3.0)},  # int8 never pays
    ]
    configs = lagrangian_configs(options)
    assert configs[0] == ["float8", "int8", "float"]
    assert configs[-1] == ["float", "float", "float"]
    costs = [sum(o[p][1] for o, p in zip(options, c)) for c in configs]
    scores = [sum(o[p][0] for o, p in zip(options, c)) for c in configs]
    assert costs == sorted(costs) and scores == sorted(scores, reverse=True)
    assert ["int8", "int8", "float"] in configs  # fp8 -> int8 at lam 0.5
    assert len(configs) == len({tuple(c) for c in configs}) == 4


def test_old_precision_spellings_warn_and_name_the_new_ones():
    allowed = ("int8", "float8", "float")
    with pytest.warns(DeprecationWarning) as caught:
        got = precision_tuple(("int8", "fp8", "float16"), allowed, "auto")
    assert got == ("int8", "float8", "float")
    messages = [str(w.message) for w in caught]
    assert any("'fp8' is deprecated" in m and "'float8'" in m for m in messages)
    assert any("'float16'" in m and "use 'float'" in m for m in messages)
    with pytest.raises(ValueError, match=r"one of \['int8', 'float8'"):
        precision_tuple(("int4",), allowed, "auto")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_drop": -0.1}, "max_drop` must be a number >= 0"),
        ({"max_drop": "0.1"}, "max_drop` must be a number >= 0"),
        ({"max_drop": float("nan")}, "max_drop` must be a number >= 0"),
        ({"gpu": "GTX1080"}, "Known GPUs: T4, A100, L4, L40S, H100"),
        ({"gpu": "T4"}, "float8 cannot run on T4"),
        ({"cost": "energy"}, "`cost` must be one of"),
        ({"precisions": ("float",)}, "no quantized format"),
        ({"metric": lambda y, p: float("nan")}, "not a\\s+finite number"),
    ],
)
def test_bad_input(trained, kwargs, match):
    model, (x, y), _ = trained
    with pytest.raises(ValueError, match=match):
        keras_mp.auto_quantize(model, x, y, verbose=0, **kwargs)


def test_labels_of_another_length(trained):
    model, (x, y), _ = trained
    with pytest.raises(ValueError, match="512 samples in `data` but 100"):
        keras_mp.auto_quantize(model, x, y[:100], verbose=0)


def test_a_quantizer_without_a_calibrated_twin_is_calibrated(trained):
    """`_build` copies ranges from the per-precision models; a quantizer
    they lack is calibrated on the data, the others keep the copies."""
    from keras_mp.precision.search import _build
    from keras_mp.precision.sensitivity import score_layers

    model, (x, y), _ = trained
    report, _ = score_layers(
        model,
        x,
        y,
        ("int8",),
        num_batches=1,
        calibration_batches=2,
        verbose=0,
    )
    partial = keras_mp.quantize_model(model, layers="fc")  # only fc
    keras_mp.calibrate(partial, x, verbose=0)
    calls = []

    def recalibrate(qmodel):
        calls.append(qmodel)
        keras_mp.calibrate(qmodel, x[:128], method="max", verbose=0)

    config = ["int8"] * len(report.rows)
    qmodel = _build(model, report.rows, config, {"int8": partial}, recalibrate)
    assert len(calls) == 1
    ranges = {
        q.name: float(q.quantizer.amax.numpy().max())
        for q in keras_mp.quantization.twins.quantizers(qmodel)
    }
    source = {
        q.name: float(q.quantizer.amax.numpy().max())
        for q in keras_mp.quantization.twins.quantizers(partial)
    }
    assert ranges["fc/input_0"] == source["fc/input_0"]
    assert all(v > 0 for v in ranges.values()), ranges


def test_reasons_tell_ties_from_cheaper_options():
    from keras_mp.precision.reports import SensitivityRow
    from keras_mp.precision.search import _choices

    row = SensitivityRow("fc", ("fc",), "Dense", {}, {"int8": "int8"})
    options = [{"float": (0.0, 2.0), "int8": (3.0, 1.0), "float8": (1.0, 1.0)}]
    (tie,) = _choices([row], options, ["float8"])
    assert tie.reason == (
        "cheapest option, within the budget (as cheap as int8, and less "
        "sensitive)"
    )
    options = [{"float": (0.0, 2.0), "int8": (3.0, 1.0), "float8": (1.0, 1.5)}]
    (dearer,) = _choices([row], options, ["float8"])
    assert dearer.reason.startswith("int8 is cheaper but more sensitive")
    (safe,) = _choices([row], options, ["float"])
    assert safe.reason == "too sensitive for the budget (int8 score 3)"
