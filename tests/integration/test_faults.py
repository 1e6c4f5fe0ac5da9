"""Faults: non-finite values, interrupted writes, safe loading.

Cross-cutting checks of what keras_mp does when a gradient or a range goes
non-finite, when a write is interrupted, and when a `.keras` file is loaded
with `safe_mode=True`. Bad inputs to each public function are tested beside
its module (`tests/<feature>/`).
"""

import json
import os
import signal
import subprocess
import sys
import zipfile

import keras
import numpy as np
import onnx
import pytest

import keras_mp
from keras_mp.muppet.model import fixed_point_layers
from keras_mp.quantization.twins import quantizers
from keras_mp.sparsity.masks import is_2_4_sparse
from keras_mp.sparsity.model import sparse_layers
from tests.quantization.conftest import SHAPE, cnn, images

L = keras.layers

# -- non-finite values


def _qat_model(x):
    model = keras_mp.quantize_model(cnn("qat"))
    keras_mp.calibrate(model, x, verbose=0)
    return model


def _ranges(model):
    return {q.name: q.quantizer.amax.numpy().copy() for q in quantizers(model)}


def test_non_finite_step_is_skipped_leaving_weights_ranges_and_masks():
    """A NaN batch under loss scaling equals training without that batch."""
    x, y = images(64), np.random.default_rng(1).integers(0, 4, 64)
    poisoned = x.copy()
    poisoned[2 * 16 + 5, 0, 0, 0] = np.nan  # in batch 2

    def train(data, labels):
        keras.utils.set_random_seed(0)
        model = _qat_model(x)
        optimizer = keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9)
        )
        model.compile(
            optimizer,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(
            data,
            labels,
            batch_size=16,
            shuffle=False,
            verbose=0,
            callbacks=[keras_mp.StructuredSparsity(begin_step=1)],
        )
        return model, optimizer

    keep = np.r_[0:32, 48:64]
    model, optimizer = train(poisoned, y)
    clean, clean_optimizer = train(x[keep], y[keep])
    assert optimizer.skipped_steps == 1 and clean_optimizer.skipped_steps == 0
    assert optimizer.loss_scale == clean_optimizer.loss_scale / 2
    for a, b in zip(model.weights, clean.weights, strict=True):
        assert np.all(np.isfinite(a.numpy())), a.path
        np.testing.assert_allclose(
            a.numpy(), b.numpy(), rtol=1e-6, err_msg=a.path
        )
    ranges, clean_ranges = _ranges(model), _ranges(clean)
    for name in clean_ranges:
        np.testing.assert_array_equal(ranges[name], clean_ranges[name], name)
    masks = {layer.name: c.mask.numpy() for layer, _, c in sparse_layers(model)}
    assert set(masks) == {"conv", "head"}
    for layer, kernel, constraint in sparse_layers(clean):
        np.testing.assert_array_equal(
            masks[layer.name], constraint.mask.numpy()
        )
        assert is_2_4_sparse(kernel.numpy(), constraint.axis)


def test_float16_overflow_skips_the_step_under_qat():
    keras_mp.enable_mixed_precision("mixed_float16")
    x, y = images(16), np.arange(16) % 4
    model = _qat_model(x)
    before = [w.numpy().copy() for w in model.trainable_weights]
    ranges = _ranges(model)
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0**24
    )
    model.compile(
        optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    # 2**24 times a gradient overflows float16 (max 65504): skipped
    assert optimizer.skipped_steps == 1 and optimizer.loss_scale == 2.0**23
    for a, b in zip(model.trainable_weights, before, strict=True):
        np.testing.assert_array_equal(a.numpy(), b, a.path)
    for name, value in _ranges(model).items():
        if name.endswith("input_0"):  # calibrated: frozen
            np.testing.assert_array_equal(value, ranges[name], name)
        else:  # max|w| of the unchanged kernel, read as float16 in training
            np.testing.assert_allclose(value, ranges[name], rtol=2**-10)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_nan_batch_in_qat_is_skipped_with_and_without_xla(jit_compile):
    # Under XLA the fake-quant op maps NaN to a finite code; the quantizer
    # lets non-finite inputs through in training so the step is skipped.
    rng = np.random.default_rng(0)
    inputs = keras.Input((8,))
    hidden = L.Dense(4, name="hidden")(inputs)
    model = keras.Model(inputs, L.Dense(3, name="out")(hidden))
    x, y = rng.random((32, 8), np.float32), np.arange(32) % 3
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    ranges = [v.numpy() for v in qmodel.weights if "amax" in v.path]
    x[3, 0] = np.nan
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.05))
    qmodel.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    before = [w.numpy() for w in qmodel.trainable_weights]
    qmodel.fit(x[:16], y[:16], batch_size=16, shuffle=False, verbose=0)
    assert int(optimizer.skipped_steps) == 1
    for a, b in zip(before, qmodel.trainable_weights):
        np.testing.assert_array_equal(a, b.numpy())
    after = [v.numpy() for v in qmodel.weights if "amax" in v.path]
    for a, b in zip(ranges, after):
        np.testing.assert_array_equal(a, b)


def test_uncalibrated_qat_survives_a_nan_batch_under_loss_scaling():
    x, y = images(32), np.arange(32) % 4
    x[3, 0, 0, 0] = np.nan  # first batch
    model = keras_mp.quantize_model(cnn("uncalibrated"))
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.05))
    model.compile(
        optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert optimizer.skipped_steps == 1
    for name, value in _ranges(model).items():
        assert np.all(np.isfinite(value)) and np.all(value > 0), name
    for w in model.weights:
        assert np.all(np.isfinite(w.numpy())), w.path


def _fixed_point_run(x, y, optimizer, epochs=2):
    keras.utils.set_random_seed(0)
    base = keras.Sequential(
        [keras.Input((16,)), L.Dense(16, activation="relu"), L.Dense(3)]
    )
    model = keras_mp.fixed_point_model(base, seed=0)
    model.compile(
        optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    switching = keras_mp.PrecisionSwitching(
        schedule=(8, None), resolution=2, patience=5
    )
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[switching],
    )
    return model, history.history


def _vectors():
    rng = np.random.default_rng(1)
    return rng.normal(size=(64, 16)).astype("float32"), rng.integers(0, 3, 64)


def test_skipped_step_does_not_poison_precision_switching():
    x, y = _vectors()
    x[-1, 0] = np.nan  # the last batch of every epoch
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.05))
    model, history = _fixed_point_run(x, y, optimizer)
    assert optimizer.skipped_steps == 2
    for layer in fixed_point_layers(model):
        for v in getattr(layer, "gradient_sums", []):
            assert np.all(np.isfinite(v.numpy())), v.path
    assert np.isfinite(history["diversity"][1])


def test_loss_scaling_does_not_change_the_measured_diversity():
    x, y = _vectors()
    plain, plain_history = _fixed_point_run(x, y, keras.optimizers.SGD(0.05))
    scaled, history = _fixed_point_run(
        x,
        y,
        keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(0.05),
            initial_scale=1.0,
            dynamic_growth_steps=1,
        ),
    )
    for a, b in zip(plain.trainable_weights, scaled.trainable_weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # same training
    np.testing.assert_allclose(
        history["diversity"][1], plain_history["diversity"][1], rtol=1e-6
    )


def test_collapsed_range_is_reported_and_not_exported(tmp_path):
    model = keras_mp.quantize_model(cnn("collapsed"))
    model.get_layer("conv").bias.assign(np.full(8, 0.5))
    zeros = np.zeros((16,) + SHAPE, "float32")
    report = keras_mp.calibrate(model, zeros, verbose=0)
    # all-zero inputs: the conv's input range collapses; its bias keeps the
    # head's input alive
    assert report.collapsed == ["conv/input_0"]
    assert "conv/input_0: range collapsed to 0" in str(report)
    notes = {
        r["layer"]: r["note"]
        for r in keras_mp.quantization_report(model, verbose=False).rows
    }
    assert "uncalibrated input range (0)" in notes["conv"]
    path = tmp_path / "collapsed.onnx"
    with pytest.raises(
        keras_mp.ExportError, match="collapsed, amax 0.* conv/input_0"
    ):
        keras_mp.export_onnx(model, path)
    assert not path.exists()


def test_non_finite_range_is_reported_not_exported(tmp_path):
    model = keras_mp.quantize_model(cnn("nan_range"))
    keras_mp.calibrate(model, images(), verbose=0)
    model.get_layer("head").input_quantizers[0].amax.assign(np.nan)
    path = tmp_path / "nan.onnx"
    with pytest.raises(keras_mp.ExportError, match=" head/input_0"):
        keras_mp.export_onnx(model, path)
    assert not path.exists()


def test_all_zero_weight_channel_exports_with_a_positive_scale(tmp_path):
    model = keras_mp.quantize_model(cnn("pruned_channel"))
    head = model.get_layer("head")
    kernel = head.kernel.numpy()
    kernel[:, 2] = 0.0  # a fully pruned output channel
    head.kernel.assign(kernel)
    keras_mp.calibrate(model, images(), verbose=0)
    path = tmp_path / "pruned.onnx"
    keras_mp.export_onnx(model, path, verify_data=images(64, seed=1))
    report = keras_mp.check_tensorrt(str(path))
    assert report.ok, str(report)
    scales = [
        onnx.numpy_helper.to_array(init)
        for init in onnx.load(str(path)).graph.initializer
        if init.name.endswith("_scale")
    ]
    assert scales and all(np.all(s > 0) for s in scales)


# -- atomic outputs


def _listing(folder):
    return sorted(os.listdir(folder))


def test_onnx_export_interrupted_mid_write_keeps_the_previous_file(
    tmp_path, monkeypatch
):
    model = keras_mp.quantize_model(cnn("atomic"))
    keras_mp.calibrate(model, images(), verbose=0)
    path = tmp_path / "model.onnx"
    path.write_bytes(b"previous export")

    def half_save(proto, target, *args, **kwargs):
        with open(target, "wb") as f:
            f.write(proto.SerializeToString()[:100])
        raise KeyboardInterrupt  # Ctrl-C in the middle of the write

    monkeypatch.setattr(onnx, "save", half_save)
    with pytest.raises(KeyboardInterrupt):
        keras_mp.export_onnx(model, path, overwrite=True)
    assert path.read_bytes() == b"previous export"
    assert _listing(tmp_path) == ["model.onnx"]  # no temporary left


def test_saved_model_failure_keeps_the_previous_folder(tmp_path, monkeypatch):
    model = cnn("atomic_sm")
    model(images(1))
    path = tmp_path / "serving"
    keras_mp.export_saved_model(model, path)
    (path / "marker").write_text("previous")
    export = keras.Model.export

    def export_then_fail(self, filepath, *args, **kwargs):
        export(self, filepath, *args, **kwargs)  # files written, then...
        raise OSError("No space left on device")

    monkeypatch.setattr(keras.Model, "export", export_then_fail)
    with pytest.raises(OSError, match="No space left"):
        keras_mp.export_saved_model(model, path, overwrite=True)
    assert (path / "marker").read_text() == "previous"
    assert _listing(tmp_path) == ["serving"]
    monkeypatch.undo()
    diff = keras_mp.export_saved_model(
        model, path, overwrite=True, verify_data=images(4)
    )
    assert diff < 1e-5
    assert not (path / "marker").exists()  # replaced whole, not merged
    assert _listing(tmp_path) == ["serving"]


@pytest.mark.parametrize("plot", ["sparsity", "precision"])
def test_plot_failure_keeps_the_previous_png(tmp_path, monkeypatch, plot):
    from matplotlib.figure import Figure

    path = tmp_path / "plot.png"
    path.write_bytes(b"previous png")

    def half_savefig(self, target, *args, **kwargs):
        with open(target, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", half_savefig)
    with pytest.raises(OSError, match="disk full"):
        if plot == "sparsity":
            model = cnn("plot")
            keras_mp.plot_sparsity(model, str(path))
        else:
            history = {"precision": [8, 8, 12], "p": [1, 1, 1], "T": [2, 2, 2]}
            keras_mp.plot_precision(history, str(path))
    assert path.read_bytes() == b"previous png"
    assert _listing(tmp_path) == ["plot.png"]


def test_report_text_failure_keeps_the_previous_report(tmp_path, monkeypatch):
    from keras_mp.io import atomic_write_text

    path = tmp_path / "report.md"
    atomic_write_text(path, "# previous report\n")

    class Full:
        """A file that fills up after five characters."""

        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[:5])
            raise OSError("No space left on device")

    real_open = open

    def failing_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return Full(f) if "w" in mode else f

    import keras_mp.io as io_module

    monkeypatch.setattr(io_module, "open", failing_open, raising=False)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_text(path, "# new report\n" * 100)
    monkeypatch.undo()
    assert path.read_text() == "# previous report\n"
    assert _listing(tmp_path) == ["report.md"]


_KILLED_WRITER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("kmp_io", sys.argv[1])
io = importlib.util.module_from_spec(spec)
spec.loader.exec_module(io)
with io.atomic_path(sys.argv[2]) as tmp:
    with open(tmp, "wb") as f:
        f.write(b"half of the new file")
        f.flush()
        print("writing", flush=True)
        time.sleep(60)
"""


def test_sigkill_mid_write_never_exposes_a_partial_file(tmp_path):
    """A real process killed while writing (no Python cleanup runs)."""
    path = tmp_path / "model.onnx"
    path.write_bytes(b"previous export")
    io_path = os.path.join(os.path.dirname(keras_mp.__file__), "io.py")
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, io_path, str(path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert path.read_bytes() == b"previous export"
    # What remains is a hidden temporary folder beside it, never the target.
    leftovers = [n for n in _listing(tmp_path) if n != "model.onnx"]
    assert all(n.startswith(".model.onnx.") for n in leftovers)


# -- safe loading


def _config(path):
    with zipfile.ZipFile(path) as z:
        return json.loads(z.read("config.json"))


def _class_names(config):
    if isinstance(config, dict):
        names = [config["class_name"]] if "class_name" in config else []
        return names + [n for v in config.values() for n in _class_names(v)]
    if isinstance(config, list):
        return [n for v in config for n in _class_names(v)]
    return []


def _assert_safe_round_trip(model, path):
    """Saves, checks the config holds no Lambda, loads with safe_mode=True
    (no custom_objects) and compares every weight."""
    model.save(path)
    config = _config(path)
    assert "Lambda" not in _class_names(config)
    assert "__lambda__" not in json.dumps(config)
    loaded = keras.saving.load_model(path, safe_mode=True)
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), a.path)
    return loaded, json.dumps(config)


def test_quantized_sparse_loss_scaled_model_loads_in_safe_mode(tmp_path):
    x, y = images(64), np.arange(64) % 4
    model = keras_mp.quantize_model(cnn("deploy"))
    keras_mp.calibrate(model, x, method="entropy", verbose=0)
    model.compile(
        keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(
        x,
        y,
        batch_size=16,
        verbose=0,
        callbacks=[keras_mp.StructuredSparsity()],
    )
    loaded, config = _assert_safe_round_trip(model, tmp_path / "deploy.keras")
    for name in ("RecordedModel", "SparsityMask", "LossScaleOptimizer"):
        assert f'"registered_name": "keras_mp>{name}"' in config, name
    assert "QuantizeWrapper" not in config  # load-only: never saved
    np.testing.assert_array_equal(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0)
    )
    assert _ranges(loaded).keys() == _ranges(model).keys()
    for name, value in _ranges(model).items():
        np.testing.assert_array_equal(_ranges(loaded)[name], value, name)
    masks = {layer.name: c.mask.numpy() for layer, _, c in sparse_layers(model)}
    assert set(masks) == {"conv", "head"}
    for layer, kernel, constraint in sparse_layers(loaded):
        np.testing.assert_array_equal(
            constraint.mask.numpy(), masks[layer.name]
        )
        assert is_2_4_sparse(kernel.numpy(), constraint.axis)
    assert isinstance(loaded.optimizer, keras_mp.LossScaleOptimizer)
    assert loaded.optimizer.loss_scale == model.optimizer.loss_scale


def test_muppet_model_loads_in_safe_mode(tmp_path):
    x, y = _vectors()
    model, _ = _fixed_point_run(x, y, keras.optimizers.SGD(0.05), epochs=3)
    loaded, config = _assert_safe_round_trip(model, tmp_path / "muppet.keras")
    # The float model's config plus the "muppet" record section.
    assert '"registered_name": "keras_mp>RecordedModel"' in config
    assert '"muppet": {' in config and "FixedPoint" not in config
    words = [float(v.word_length.numpy()) for v in fixed_point_layers(loaded)]
    assert words == [8.0] * 2  # still in 8-bit fixed point, as saved
    # Fixed point rounds stochastically; in float32 both compute the same.
    for m in (model, loaded):
        keras_mp.muppet.set_word_length(m, None)
    np.testing.assert_array_equal(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0)
    )
