"""Reliability: bad inputs, non-finite values, atomic outputs, safe loading.

Bad-input catalogue: 139 cases, 112 through the Python API (`BAD_INPUTS`)
and 27 through the `keras-mp` command line (`BAD_CLI`). Each is a mistake a
user will make (wrong types, tf_keras or subclassed models, unsupported
layers, empty / NaN / wrongly shaped data, uncalibrated or already-quantized
models, bad paths, corrupt `.keras` / `.onnx` / `.npy` / IDX files,
conflicting options) and asserts the exception type (for the CLI: exit code
2 and one error line, no traceback) and that the message says what was
wrong. All 139 are handled. A case for a bug not fixed yet carries a `bug=`
reason and runs as xfail(strict), so the marker cannot outlive the fix; the
19 found when the catalogue was written are all fixed.
"""

import dataclasses
import gzip
import json
import os
import re
import signal
import struct
import subprocess
import sys
import zipfile

import keras
import numpy as np
import onnx
import pytest
import tensorflow as tf
from onnx import helper

import keras_mp
from keras_mp import cli, datasets
from keras_mp.muppet.model import fixed_point_layers, precision_state
from keras_mp.quantization.layers import QuantizeWrapper, iter_quantize_layers
from keras_mp.sparsity.masks import (
    is_2_4_sparse,
    magnitude_mask,
    sparse_layers,
)

L = keras.layers
SHAPE = (8, 8, 4)


def cnn(name="cnn"):
    """Conv (4 input channels: 2:4-prunable) -> pool -> Dense head."""
    return keras.Sequential(
        [
            keras.Input(SHAPE),
            L.Conv2D(8, 3, activation="relu", name="conv"),
            L.GlobalAveragePooling2D(name="pool"),
            L.Dense(4, name="head"),
        ],
        name=name,
    )


def images(n=32, seed=0):
    return np.random.default_rng(seed).random((n,) + SHAPE, dtype=np.float32)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="subclassed")
        self.dense = L.Dense(4)

    def call(self, x):
        return self.dense(x)


def tf_keras_like(name="Sequential", module="tf_keras.src.engine.sequential"):
    """An object that looks like a tf_keras (Keras 2) model or optimizer:
    tf_keras is not installed here, and only its type matters."""
    return type(name, (), {"__module__": module})()


def write_idx(path, array, type_code=0x08):
    header = bytes([0, 0, type_code, array.ndim])
    header += struct.pack(f">{array.ndim}I", *array.shape)
    data = header + np.ascontiguousarray(array).tobytes()
    with open(path, "wb") as f:
        f.write(gzip.compress(data) if str(path).endswith(".gz") else data)


def tiny_onnx(path):
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    onnx.save(helper.make_model(graph), path)
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Models and files the bad inputs are made from (built once)."""
    d = tmp_path_factory.mktemp("bad_inputs")
    e = dataclasses.make_dataclass("Env", [])()
    e.dir = d
    e.x = images()
    keras.utils.set_random_seed(0)
    e.float_model = cnn()
    e.float_model(e.x[:1])
    e.quantized = keras_mp.quantize_model(cnn("q"))
    keras_mp.calibrate(e.quantized, e.x, verbose=0)
    e.uncalibrated = keras_mp.quantize_model(cnn("u"))
    e.subclassed = Subclassed()
    e.subclassed(np.ones((2, 8), "float32"))
    e.fixed = keras_mp.fixed_point_model(
        keras.Sequential([keras.Input((6,)), L.Dense(3)])
    )
    e.fixed.compile("sgd", "mse")
    e.float_model.save(d / "m.keras")
    e.quantized.save(d / "q.keras")
    keras.Sequential([keras.Input((4,)), L.Lambda(lambda v: 2 * v)]).save(
        d / "lambda.keras"
    )
    (d / "junk.keras").write_bytes(b"not a zip file")
    with zipfile.ZipFile(d / "noconfig.keras", "w") as z:
        z.writestr("metadata.json", json.dumps({"keras_version": "3.15.1"}))
    np.save(d / "x.npy", e.x)
    np.save(d / "x3d.npy", e.x[..., 0])
    np.save(d / "pickled.npy", np.array([{"a": 1}], dtype=object))
    (d / "existing.onnx").write_bytes(b"previous")
    (d / "junk.onnx").write_bytes(b"\x08\x07junk, not protobuf \xff\xfe")
    (d / "empty.onnx").write_bytes(b"")
    valid = tiny_onnx(str(d / "valid.onnx"))
    with open(valid, "rb") as f:
        (d / "truncated.onnx").write_bytes(f.read()[:20])
    os.makedirs(d / "report")
    (d / "report" / "report.md").write_text("an earlier report")
    os.makedirs(d / "existing_sm")
    return e


@dataclasses.dataclass
class Bad:
    """One bad input: `call(env)` must raise `error` matching `match`."""

    id: str
    call: object
    error: type
    match: str
    bug: str = None


def _fit(model, callbacks, x=None, y=None):
    x = images(16) if x is None else x
    y = np.zeros((len(x), 4), "float32") if y is None else y
    model.compile("sgd", "mse")
    return model.fit(x, y, epochs=1, verbose=0, callbacks=callbacks)


def _gray_model():
    """A first conv on 1 channel, a head on 6 features: nothing is 2:4."""
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            L.Conv2D(6, 3),
            L.GlobalAveragePooling2D(),
            L.Dense(3),
        ]
    )


def _resume_with_shorter_schedule(e):
    model = keras_mp.fixed_point_model(
        keras.Sequential([keras.Input((6,)), L.Dense(3)])
    )
    precision_state(model).stage.assign(3.0)
    model.compile("sgd", "mse")
    switching = keras_mp.PrecisionSwitching(schedule=(8, None))
    model.fit(
        np.ones((4, 6)), np.ones((4, 3)), verbose=0, callbacks=[switching]
    )


def _nan_inside(e):
    model = keras_mp.quantize_model(cnn("nan_inside"))
    conv = model.get_layer("quant_conv").layer
    conv.kernel.assign(np.full(conv.kernel.shape, np.nan, "float32"))
    keras_mp.calibrate(model, e.x, verbose=0)


def _mismatched_fashion_mnist(e):
    folder = e.dir / "fashion_mismatch"
    os.makedirs(folder, exist_ok=True)
    files = datasets._FILES
    write_idx(folder / files["x_train"], np.zeros((3, 28, 28), np.uint8))
    write_idx(folder / files["y_train"], np.zeros((2,), np.uint8))
    write_idx(folder / files["x_test"], np.zeros((2, 28, 28), np.uint8))
    write_idx(folder / files["y_test"], np.zeros((2,), np.uint8))
    datasets.load_fashion_mnist(path=str(folder))


def _idx(e, name, data):
    path = e.dir / name
    path.write_bytes(data)
    return datasets.read_idx(str(path))


def _calibrate_inf_in_second_batch(e):
    x = e.x.copy()
    x[20, 1, 2, 3] = np.inf
    keras_mp.calibrate(e.quantized, x, batch_size=16, verbose=0)


BAD_INPUTS = [
    # -- mixed precision
    Bad(
        "policy_unknown_name",
        lambda e: keras_mp.enable_mixed_precision("fp16"),
        ValueError,
        r"Unknown mixed-precision policy.*mixed_float16.*Received: "
        r"policy='fp16'",
    ),
    Bad(
        "policy_not_a_string",
        lambda e: keras_mp.enable_mixed_precision(16),
        ValueError,
        "Received: policy=16",
    ),
    Bad(
        "apply_policy_unknown",
        lambda e: keras_mp.apply_mixed_precision(cnn(), "float16"),
        ValueError,
        "`policy` must be one of.*Received: policy='float16'",
    ),
    Bad(
        "apply_tf_keras_model",
        lambda e: keras_mp.apply_mixed_precision(tf_keras_like()),
        TypeError,
        r"tf_keras \(Keras 2\) models are not supported",
    ),
    Bad(
        "apply_subclassed_model",
        lambda e: keras_mp.apply_mixed_precision(e.subclassed),
        TypeError,
        "subclassed.*Functional",
    ),
    Bad(
        "audit_not_a_model",
        lambda e: keras_mp.mixed_precision_audit("model.keras"),
        TypeError,
        r"Keras 3 `keras.Model`. Received: builtins.str",
    ),
    Bad(
        "audit_unbuilt_model",
        lambda e: keras_mp.mixed_precision_audit(
            keras.Sequential([L.Dense(2)])
        ),
        ValueError,
        "is not built.*call `model.build",
    ),
    Bad(
        "lso_inner_is_a_string",
        lambda e: keras_mp.LossScaleOptimizer("adam"),
        TypeError,
        r"Keras 3 optimizer, e.g. `keras.optimizers.Adam\(\)`",
    ),
    Bad(
        "lso_inner_is_tf_keras",
        lambda e: keras_mp.LossScaleOptimizer(
            tf_keras_like("Adam", "tf_keras.src.optimizers.adam")
        ),
        TypeError,
        "Received: tf_keras.src.optimizers.adam.Adam",
    ),
    Bad(
        "lso_wraps_lso",
        lambda e: keras_mp.LossScaleOptimizer(
            keras_mp.LossScaleOptimizer(keras.optimizers.SGD())
        ),
        ValueError,
        r"already a LossScaleOptimizer.*opt.inner_optimizer",
    ),
    Bad(
        "lso_bounds_reversed",
        lambda e: keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(), min_scale=8.0, max_scale=2.0
        ),
        ValueError,
        "0 < min_scale <= max_scale. Received: min_scale=8.0",
    ),
    Bad(
        "lso_initial_outside_bounds",
        lambda e: keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(), initial_scale=2.0**30
        ),
        ValueError,
        r"`initial_scale` must lie within \[min_scale, max_scale\]",
    ),
    Bad(
        "lso_growth_steps_zero",
        lambda e: keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(), dynamic_growth_steps=0
        ),
        ValueError,
        "dynamic_growth_steps` must be a positive integer",
    ),
    Bad(
        "lso_scale_not_a_number",
        lambda e: keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(), initial_scale="big"
        ),
        ValueError,
        "initial_scale='big'",
    ),
    Bad(
        "monitor_log_every_zero",
        lambda e: keras_mp.LossScaleMonitor(log_every=0),
        ValueError,
        "`log_every` must be >= 1. Received: log_every=0",
    ),
    # -- quantization: annotate / apply / config
    Bad(
        "quantize_path_instead_of_model",
        lambda e: keras_mp.quantize_model("model.keras"),
        TypeError,
        r"Keras 3 `keras.Model`. Received: builtins.str",
    ),
    Bad(
        "quantize_tf_keras_model",
        lambda e: keras_mp.quantize_model(tf_keras_like()),
        TypeError,
        r"tf_keras \(Keras 2\) models are not supported",
    ),
    Bad(
        "quantize_subclassed_model",
        lambda e: keras_mp.quantize_model(Subclassed()),
        TypeError,
        r"subclassed.*keras_mp.QuantizeWrapper\(layer\)",
    ),
    Bad(
        "quantize_nothing_quantizable",
        lambda e: keras_mp.quantize_model(
            keras.Sequential([keras.Input((4,)), L.ReLU()])
        ),
        ValueError,
        "No quantizable layer.*Supported types",
    ),
    Bad(
        "quantize_selection_matches_nothing",
        lambda e: keras_mp.quantize_model(cnn(), layers="dense_.*"),
        ValueError,
        r"matches layers='dense_\.\*'",
    ),
    Bad(
        "quantize_selection_wrong_type",
        lambda e: keras_mp.quantize_model(cnn(), layers=3),
        TypeError,
        r"`layers` selects layers by name or regex.*Received: 3",
    ),
    Bad(
        "quantize_unsupported_layer_by_name",
        lambda e: keras_mp.quantize_model(
            keras.Sequential(
                [keras.Input((4, 4)), L.Flatten(name="flat"), L.Dense(2)]
            ),
            layers="flat",
        ),
        ValueError,
        "'flat' of type Flatten cannot be quantized. Supported types",
    ),
    Bad(
        "quantize_config_wrong_type",
        lambda e: keras_mp.quantize_model(cnn(), config=8),
        TypeError,
        "`config` must be a QuantizeConfig or a dict.*Received: int",
    ),
    Bad(
        "quantize_already_quantized",
        lambda e: keras_mp.quantize_model(e.quantized),
        ValueError,
        "already quantized.*strip_quantization",
    ),
    Bad(
        "annotate_subclassed_model",
        lambda e: keras_mp.quantize_annotate_model(Subclassed()),
        TypeError,
        "subclassed.*rebuild it as a Functional or Sequential model",
    ),
    Bad(
        "apply_without_annotation",
        lambda e: keras_mp.quantize_apply(cnn()),
        ValueError,
        "no annotated layer.*quantize_annotate_model",
    ),
    Bad(
        "annotate_layer_not_a_layer",
        lambda e: keras_mp.quantize_annotate_layer("dense"),
        TypeError,
        "Expected a Keras 3 layer. Received: str",
    ),
    Bad(
        "annotate_unsupported_layer",
        lambda e: keras_mp.quantize_annotate_layer(L.Flatten(name="flat")),
        ValueError,
        "'flat' of type Flatten cannot be quantized. Supported types",
    ),
    Bad(
        "wrapper_unsupported_layer",
        lambda e: keras_mp.QuantizeWrapper(L.LSTM(4, name="lstm")),
        ValueError,
        "'lstm' of type LSTM cannot be quantized.*QuantizeConfig",
    ),
    Bad(
        "config_16_bits",
        lambda e: keras_mp.QuantizeConfig(num_bits=16),
        ValueError,
        r"integer in \[2, 8\] \(TensorRT runs 8\). Received: num_bits=16",
    ),
    Bad(
        "config_float_bits",
        lambda e: keras_mp.QuantizeConfig(num_bits=8.0),
        ValueError,
        "Received: num_bits=8.0",
    ),
    Bad(
        "activation_zero_bits",
        lambda e: keras_mp.QuantizeActivation(num_bits=0),
        ValueError,
        "Received: num_bits=0",
    ),
    # -- calibration
    Bad(
        "calibrate_float_model",
        lambda e: keras_mp.calibrate(
            e.float_model, e.x, verbose=0
        ),
        ValueError,
        "no activation quantizer.*keras_mp.quantize_model",
    ),
    Bad(
        "calibrate_unknown_method",
        lambda e: keras_mp.calibrate(
            e.quantized, e.x, method="kl"
        ),
        ValueError,
        "Unknown calibration method.*'entropy'.*Received: method='kl'",
    ),
    Bad(
        "calibrate_percentile_zero",
        lambda e: keras_mp.calibrate(
            e.quantized, e.x, method="percentile", percentile=0
        ),
        ValueError,
        r"`percentile` must be in \(0, 100\]. Received: 0",
    ),
    Bad(
        "calibrate_empty_array",
        lambda e: keras_mp.calibrate(
            e.quantized, e.x[:0], verbose=0
        ),
        ValueError,
        "Calibration data is empty",
    ),
    Bad(
        "calibrate_empty_dataset",
        lambda e: keras_mp.calibrate(
            e.quantized,
            tf.data.Dataset.from_tensor_slices(e.x[:0]).batch(4),
            verbose=0,
        ),
        ValueError,
        "Calibration data is empty",
    ),
    Bad(
        "calibrate_wrong_shape",
        lambda e: keras_mp.calibrate(
            e.quantized, e.x[..., :1], verbose=0
        ),
        ValueError,
        r"shape \(32, 8, 8, 1\), but model 'q' expects \(None, 8, 8, 4\)",
    ),
    Bad(
        "calibrate_missing_batch_axis",
        lambda e: keras_mp.calibrate(
            e.quantized, list(e.x), verbose=0
        ),
        ValueError,
        r"shape \(8, 8, 4\).*batch first",
    ),
    Bad(
        "calibrate_nan_in_data",
        lambda e: keras_mp.calibrate(
            e.quantized, np.where(e.x > 0.999, np.nan, e.x), verbose=0
        ),
        ValueError,
        r"NaN/Inf \(batch 0, first at index \(",
    ),
    Bad(
        "calibrate_inf_in_second_batch",
        _calibrate_inf_in_second_batch,
        ValueError,
        r"NaN/Inf \(batch 1, first at index \(4, 1, 2, 3\)\)",
    ),
    Bad(
        "calibrate_nan_inside_model",
        _nan_inside,
        ValueError,
        r"non-finite value\(s\) at the input of 'quant_head/input_0' "
        r"\(batch 0\)",
    ),
    Bad(
        "calibrate_path_instead_of_data",
        lambda e: keras_mp.calibrate(e.quantized, "x.npy"),
        TypeError,
        "`data` must be a NumPy array, a tf.data.Dataset.*Received: str",
    ),
    Bad(
        "calibrate_dict_data",
        lambda e: keras_mp.calibrate(e.quantized, {"x": e.x}),
        TypeError,
        "Received: dict",
    ),
    Bad(
        "calibrate_number_as_data",
        lambda e: keras_mp.calibrate(e.quantized, 5),
        TypeError,
        "Received: int",
    ),
    Bad(
        "calibrate_path_instead_of_model",
        lambda e: keras_mp.calibrate(
            "model.keras", e.x, verbose=0
        ),
        TypeError,
        "keras.Model",
    ),
    Bad(
        "calibrate_batch_size_zero",
        lambda e: keras_mp.calibrate(
            e.quantized, e.x, batch_size=0
        ),
        ValueError,
        "batch_size",
    ),
    Bad(
        "calibrate_num_batches_zero",
        lambda e: keras_mp.calibrate(
            e.quantized, e.x, num_batches=0
        ),
        ValueError,
        "num_batches",
    ),
    Bad(
        "report_not_a_model",
        lambda e: keras_mp.quantization_report("model.keras"),
        TypeError,
        "keras.Model",
    ),
    Bad(
        "enable_quantization_not_a_model",
        lambda e: keras_mp.set_quantization_enabled("model.keras", False),
        TypeError,
        "keras.Model",
    ),
    # -- 2:4 sparsity
    Bad(
        "sparsity_m_not_below_n",
        lambda e: keras_mp.StructuredSparsity(m=4),
        ValueError,
        "0 < m < n, e.g. m=2, n=4. Received: m=4, n=4",
    ),
    Bad(
        "sparsity_unknown_schedule",
        lambda e: keras_mp.StructuredSparsity(schedule="linear"),
        ValueError,
        r"one of \('one_shot', 'gradual'\). Received: schedule='linear'",
    ),
    Bad(
        "sparsity_gradual_without_end",
        lambda e: keras_mp.StructuredSparsity(schedule="gradual"),
        ValueError,
        "needs an integer `end_step` greater than `begin_step`",
    ),
    Bad(
        "sparsity_one_shot_with_end",
        lambda e: keras_mp.StructuredSparsity(end_step=5),
        ValueError,
        "`end_step` only applies to schedule='gradual'",
    ),
    Bad(
        "sparsity_negative_begin",
        lambda e: keras_mp.StructuredSparsity(begin_step=-1),
        ValueError,
        "`begin_step` must be an integer >= 0",
    ),
    Bad(
        "sparsity_selection_matches_nothing",
        lambda e: _fit(cnn(), [keras_mp.StructuredSparsity(layers="fc.*")]),
        ValueError,
        r"`layers='fc\.\*'` matches no weighted layer.*conv, head",
    ),
    Bad(
        "sparsity_nothing_prunable",
        lambda e: _fit(
            _gray_model(),
            [keras_mp.StructuredSparsity()],
            x=np.ones((4, 8, 8, 1), "float32"),
            y=np.ones((4, 3), "float32"),
        ),
        ValueError,
        r"not a multiple of 4.*pad=True",
    ),
    Bad(
        "strip_sparsity_not_a_model",
        lambda e: keras_mp.strip_sparsity("model.keras"),
        TypeError,
        "`strip_sparsity` expects a Keras 3 `keras.Model`",
    ),
    Bad(
        "strip_sparsity_subclassed",
        lambda e: keras_mp.strip_sparsity(e.subclassed),
        TypeError,
        "subclassed",
    ),
    Bad(
        "is_2_4_axis_out_of_range",
        lambda e: keras_mp.is_2_4_sparse(np.ones((4, 2)), axis=3),
        ValueError,
        r"`axis` must index the kernel's 2 dimensions. Received: axis=3",
    ),
    Bad(
        "mask_channels_not_multiple",
        lambda e: magnitude_mask(np.ones((6, 2)), axis=0),
        ValueError,
        "6 input channels on axis 0, not a multiple of n=4. Pass pad=True",
    ),
    Bad(
        "mask_axis_out_of_range",
        lambda e: magnitude_mask(np.ones((4, 2)), axis=2),
        ValueError,
        "Received: axis=2, kernel shape",
    ),
    Bad(
        "sparsity_report_selection_type",
        lambda e: keras_mp.sparsity.report(e.float_model, layers=42),
        TypeError,
        "Received: 42 of type int",
    ),
    Bad(
        "sparsity_report_not_a_model",
        lambda e: keras_mp.sparsity.report(tf_keras_like()),
        TypeError,
        r"tf_keras \(Keras 2\) model must be rebuilt",
    ),
    Bad(
        "plot_sparsity_missing_folder",
        lambda e: keras_mp.plot_sparsity(e.float_model, e.dir / "no" / "s.png"),
        FileNotFoundError,
        "folder .*no does not exist. Create it first",
    ),
    # -- MuPPET
    Bad(
        "fixed_point_subclassed",
        lambda e: keras_mp.fixed_point_model(Subclassed()),
        ValueError,
        r"Functional API \(keras.Model\(inputs, outputs\)\)",
    ),
    Bad(
        "fixed_point_frozen_model",
        lambda e: keras_mp.fixed_point_model(
            keras.Sequential([keras.Input((4,)), L.Dense(2, trainable=False)])
        ),
        ValueError,
        "no trainable weights.*check `layer.trainable`",
    ),
    Bad(
        "fixed_point_unbuilt",
        lambda e: keras_mp.fixed_point_model(keras.Sequential([L.Dense(2)])),
        ValueError,
        r"not built. Start it with keras.Input\(shape\)",
    ),
    Bad(
        "fixed_point_tf_keras_model",
        lambda e: keras_mp.fixed_point_model(tf_keras_like()),
        TypeError,
        "tf_keras",
    ),
    Bad(
        "switching_schedule_without_float32",
        lambda e: keras_mp.PrecisionSwitching(schedule=(8, 16)),
        ValueError,
        "must end with None.*Append None",
    ),
    Bad(
        "switching_schedule_decreasing",
        lambda e: keras_mp.PrecisionSwitching(schedule=(16, 8, None)),
        ValueError,
        "strictly increase",
    ),
    Bad(
        "switching_resolution_one",
        lambda e: keras_mp.PrecisionSwitching(resolution=1),
        ValueError,
        "one-epoch window is always 1",
    ),
    Bad(
        "switching_epoch_schedule_length",
        lambda e: keras_mp.PrecisionSwitching(
            schedule=(8, None), epoch_schedule=(2, 4)
        ),
        ValueError,
        r"one strictly increasing epoch >= 1 per switch \(1 for",
    ),
    Bad(
        "switching_on_a_float_model",
        lambda e: _fit(cnn(), [keras_mp.PrecisionSwitching()]),
        ValueError,
        "needs a model built by keras_mp.fixed_point_model",
    ),
    Bad(
        "switching_resumed_with_shorter_schedule",
        _resume_with_shorter_schedule,
        ValueError,
        "stage 3, past the end of schedule.*Resume with the schedule",
    ),
    Bad(
        "fixed_point_wrapper_weightless_layer",
        lambda e: keras_mp.FixedPointWrapper(L.Flatten(name="flat"))(
            np.ones((2, 3))
        ),
        ValueError,
        "layer 'flat' has none. Leave it unwrapped",
    ),
    Bad(
        "word_length_40_bits",
        lambda e: keras_mp.muppet.set_word_length(e.fixed, 40),
        ValueError,
        r"integer bit width in 2\.\.32, or None for float32",
    ),
    Bad(
        "speedup_unknown_gpu",
        lambda e: keras_mp.estimate_speedup([8], gpu="cpu"),
        ValueError,
        r"Unknown `gpu`: 'cpu'. Choose one of \['rtx2080ti', 't4'\]",
    ),
    Bad(
        "speedup_no_epochs",
        lambda e: keras_mp.estimate_speedup([]),
        ValueError,
        "at least one epoch",
    ),
    Bad(
        "speedup_fraction_above_one",
        lambda e: keras_mp.estimate_speedup([8], compute_fraction=2),
        ValueError,
        r"`compute_fraction` must be in \[0, 1\]",
    ),
    Bad(
        "speedup_40_bits",
        lambda e: keras_mp.estimate_speedup([40]),
        ValueError,
        r"2\.\.32, or None for float32. Received: word_length=40",
    ),
    Bad(
        "plot_precision_without_history",
        lambda e: keras_mp.plot_precision([8, 8], e.dir / "p.png"),
        ValueError,
        "needs a PrecisionSwitching callback, or the History",
    ),
    Bad(
        "plot_precision_missing_folder",
        lambda e: keras_mp.plot_precision(
            {"precision": [8, 8]}, str(e.dir / "no" / "p.png")
        ),
        FileNotFoundError,
        "folder .*no does not exist",
    ),
    # -- export
    Bad(
        "export_tf_keras_model",
        lambda e: keras_mp.export_onnx(tf_keras_like(), e.dir / "o.onnx"),
        TypeError,
        r"tf_keras \(Keras 2\) models are not supported",
    ),
    Bad(
        "export_uncalibrated",
        lambda e: keras_mp.export_onnx(e.uncalibrated, e.dir / "u.onnx"),
        keras_mp.ExportError,
        "Uncalibrated.*quant_conv/input_0.*keras_mp.calibrate",
    ),
    Bad(
        "export_existing_file",
        lambda e: keras_mp.export_onnx(e.quantized, e.dir / "existing.onnx"),
        keras_mp.ExportError,
        r"existing.onnx exists. Pass overwrite=True \(CLI: --overwrite\)",
    ),
    Bad(
        "export_old_opset",
        lambda e: keras_mp.export_onnx(e.quantized, e.dir / "o.onnx", opset=11),
        keras_mp.ExportError,
        "Per-channel Q/DQ needs opset >= 13. Received: opset=11",
    ),
    Bad(
        "export_missing_folder",
        lambda e: keras_mp.export_onnx(e.quantized, e.dir / "no" / "q.onnx"),
        FileNotFoundError,
        "folder .*no does not exist. Create it first",
    ),
    Bad(
        "export_never_called",
        lambda e: keras_mp.export_onnx(
            keras.Sequential([L.Dense(3)]), e.dir / "n.onnx"
        ),
        keras_mp.ExportError,
        r"never been called.*keras.Input",
    ),
    Bad(
        "export_empty_verify_data",
        lambda e: keras_mp.export_onnx(
            e.float_model, e.dir / "v.onnx", verify_data=e.x[:0]
        ),
        keras_mp.ExportError,
        "`verify_data` is empty",
    ),
    Bad(
        "export_verify_data_wrong_shape",
        lambda e: keras_mp.export_onnx(
            e.float_model, e.dir / "w.onnx", verify_data=e.x[..., 0]
        ),
        keras_mp.ExportError,
        r"verify_data.*\(32, 8, 8\)",
    ),
    Bad(
        "export_subclassed",
        lambda e: keras_mp.export_onnx(e.subclassed, e.dir / "s.onnx"),
        keras_mp.ExportError,
        "subclassed",
    ),
    Bad(
        "saved_model_existing_folder",
        lambda e: keras_mp.export_saved_model(
            e.quantized, e.dir / "existing_sm"
        ),
        keras_mp.ExportError,
        "existing_sm exists. Pass overwrite=True",
    ),
    Bad(
        "saved_model_never_called",
        lambda e: keras_mp.export_saved_model(
            keras.Sequential([L.Dense(3)]), e.dir / "n_sm"
        ),
        keras_mp.ExportError,
        "never been called. Call it once first",
    ),
    Bad(
        "saved_model_subclassed",
        lambda e: keras_mp.export_saved_model(e.subclassed, e.dir / "s_sm"),
        keras_mp.ExportError,
        "subclassed",
    ),
    Bad(
        "verify_missing_onnx_file",
        lambda e: keras_mp.verify_onnx(e.float_model, e.dir / "none.onnx", e.x),
        (FileNotFoundError, keras_mp.ExportError),
        "none.onnx",
    ),
    Bad(
        "strip_quantization_not_a_model",
        lambda e: keras_mp.strip_quantization("model.keras"),
        TypeError,
        "keras.Model",
    ),
    # -- TensorRT lint
    Bad(
        "lint_missing_file",
        lambda e: keras_mp.check_tensorrt(str(e.dir / "none.onnx")),
        ValueError,
        "No ONNX file at .*none.onnx",
    ),
    Bad(
        "lint_folder",
        lambda e: keras_mp.check_tensorrt(str(e.dir)),
        ValueError,
        "No ONNX file at",
    ),
    Bad(
        "lint_junk_bytes",
        lambda e: keras_mp.check_tensorrt(str(e.dir / "junk.onnx")),
        ValueError,
        "junk.onnx' is not a readable ONNX model",
    ),
    Bad(
        "lint_empty_file",
        lambda e: keras_mp.check_tensorrt(str(e.dir / "empty.onnx")),
        ValueError,
        r"empty.onnx' is not an ONNX model \(no IR version or opset\)",
    ),
    Bad(
        "lint_truncated_file",
        lambda e: keras_mp.check_tensorrt(str(e.dir / "truncated.onnx")),
        ValueError,
        "truncated.onnx' is not",
    ),
    Bad(
        "lint_keras_model_instead_of_onnx",
        lambda e: keras_mp.check_tensorrt(e.float_model),
        TypeError,
        "ONNX file path or an onnx.ModelProto. Received: Sequential",
    ),
    Bad(
        "trtexec_command_missing_file",
        lambda e: keras_mp.trtexec_command(str(e.dir / "none.onnx")),
        ValueError,
        "No ONNX file at .*none.onnx",
    ),
    Bad(
        "lint_check_sparsity_typo",
        lambda e: keras_mp.check_tensorrt(
            str(e.dir / "valid.onnx"), check_sparsity="yes"
        ),
        ValueError,
        "check_sparsity must be 'auto', True or False",
    ),
    # -- data sets
    Bad(
        "fashion_mnist_missing_folder",
        lambda e: keras_mp.load_fashion_mnist(path=str(e.dir / "none")),
        datasets.DatasetError,
        "train-images-idx3-ubyte.gz.*apt-get install dataset-fashion-mnist",
    ),
    Bad(
        "fashion_mnist_mismatched_files",
        _mismatched_fashion_mnist,
        datasets.DatasetError,
        r"train files .* do not match: images \(3, 28, 28\), labels \(2,\)",
    ),
    Bad(
        "idx_bad_magic",
        lambda e: _idx(e, "magic.idx", b"\x01\x02\x08\x01" + b"\0" * 8),
        datasets.DatasetError,
        r"not an IDX file \(bad magic number\)",
    ),
    Bad(
        "idx_unknown_type",
        lambda e: _idx(e, "type.idx", b"\0\0\x42\x01\0\0\0\x01x"),
        datasets.DatasetError,
        "unknown IDX element type 0x42",
    ),
    Bad(
        "idx_truncated",
        lambda e: _idx(e, "short.idx", b"\0\0\x08\x01\0\0\0\x09abc"),
        datasets.DatasetError,
        r"truncated or corrupt: header says shape \(9,\) \(9 bytes\)",
    ),
    Bad(
        "idx_broken_gzip",
        lambda e: _idx(e, "broken.idx.gz", gzip.compress(b"\0" * 64)[:20]),
        datasets.DatasetError,
        "broken.idx.gz.*corrupt; reinstall",
    ),
    Bad(
        "digits_test_fraction_one_and_a_half",
        lambda e: keras_mp.load_digits(test_fraction=1.5),
        ValueError,
        r"`test_fraction` must be in \(0, 1\). Received: 1.5",
    ),
]


def _param(case):
    marks = (
        [pytest.mark.xfail(strict=True, reason=case.bug)] if case.bug else []
    )
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in BAD_INPUTS])
def test_bad_input_raises_a_clear_error(env, case):
    with pytest.raises(case.error, match=case.match):
        case.call(env)


# (id, argv built from the fixture folder, message on stderr, bug)
BAD_CLI = [
    ("no_subcommand", lambda d: [], "required: command", None),
    ("export_no_model", lambda d: ["export"], "required: model", None),
    (
        "export_opset_not_a_number",
        lambda d: ["export", f"{d}/m.keras", "--opset", "x"],
        "invalid int value: 'x'",
        None,
    ),
    (
        "export_nothing_to_do",
        lambda d: ["export", f"{d}/m.keras"],
        "Nothing to do: pass --onnx OUT.onnx and/or --saved-model DIR",
        None,
    ),
    (
        "export_missing_model",
        lambda d: ["export", f"{d}/none.keras", "--onnx", f"{d}/o.onnx"],
        "Could not load .*none.keras",
        None,
    ),
    (
        "export_junk_model",
        lambda d: ["export", f"{d}/junk.keras", "--onnx", f"{d}/o.onnx"],
        "Could not load .*junk.keras",
        None,
    ),
    (
        "export_zip_without_config",
        lambda d: ["export", f"{d}/noconfig.keras", "--onnx", f"{d}/o.onnx"],
        "Could not load .*noconfig.keras",
        None,
    ),
    (
        "export_unsafe_lambda_model",
        lambda d: ["export", f"{d}/lambda.keras", "--onnx", f"{d}/o.onnx"],
        "Could not load .*lambda.keras.*Lambda",
        None,
    ),
    (
        "export_calibration_file_missing",
        lambda d: [
            "export",
            f"{d}/m.keras",
            "--onnx",
            f"{d}/o.onnx",
            "--calibrate",
            f"{d}/none.npy",
        ],
        "Could not read .*none.npy as a .npy array",
        None,
    ),
    (
        "export_calibration_file_pickled",
        lambda d: [
            "export",
            f"{d}/m.keras",
            "--onnx",
            f"{d}/o.onnx",
            "--calibrate",
            f"{d}/pickled.npy",
        ],
        "Could not read .*pickled.npy as a .npy array.*allow_pickle",
        None,
    ),
    (
        "export_calibration_wrong_shape",
        lambda d: [
            "export",
            f"{d}/m.keras",
            "--onnx",
            f"{d}/o.onnx",
            "--calibrate",
            f"{d}/x3d.npy",
        ],
        r"Calibration batch has shape \(32, 8, 8\).*expects",
        None,
    ),
    (
        "export_unknown_method",
        lambda d: [
            "export",
            f"{d}/m.keras",
            "--onnx",
            f"{d}/o.onnx",
            "--calibrate",
            f"{d}/x.npy",
            "--method",
            "kl",
        ],
        "Unknown calibration method",
        None,
    ),
    (
        "export_calibrate_quantized_model",
        lambda d: [
            "export",
            f"{d}/q.keras",
            "--onnx",
            f"{d}/o.onnx",
            "--calibrate",
            f"{d}/x.npy",
        ],
        "already quantized",
        None,
    ),
    (
        "export_old_opset",
        lambda d: [
            "export",
            f"{d}/m.keras",
            "--onnx",
            f"{d}/o.onnx",
            "--opset",
            "11",
        ],
        "opset >= 13",
        None,
    ),
    (
        "export_existing_output",
        lambda d: ["export", f"{d}/m.keras", "--onnx", f"{d}/existing.onnx"],
        "existing.onnx exists.*--overwrite",
        None,
    ),
    (
        "export_missing_output_folder",
        lambda d: ["export", f"{d}/m.keras", "--onnx", f"{d}/no/o.onnx"],
        "folder .*no does not exist",
        None,
    ),
    (
        "export_verify_missing",
        lambda d: [
            "export",
            f"{d}/m.keras",
            "--onnx",
            f"{d}/o.onnx",
            "--verify",
            f"{d}/none.npy",
        ],
        "Could not read .*none.npy",
        None,
    ),
    (
        "export_verify_wrong_shape",
        lambda d: [
            "export",
            f"{d}/m.keras",
            "--onnx",
            f"{d}/vw.onnx",
            "--verify",
            f"{d}/x3d.npy",
        ],
        r"verify.*\(32, 8, 8\)",
        None,
    ),
    (
        "export_saved_model_existing",
        lambda d: [
            "export",
            f"{d}/m.keras",
            "--saved-model",
            f"{d}/existing_sm",
        ],
        "existing_sm exists",
        None,
    ),
    (
        "lint_missing_file",
        lambda d: ["lint", f"{d}/none.onnx"],
        "No ONNX file at",
        None,
    ),
    (
        "lint_junk_file",
        lambda d: ["lint", f"{d}/junk.onnx"],
        "not a readable ONNX model",
        None,
    ),
    (
        "lint_empty_file",
        lambda d: ["lint", f"{d}/empty.onnx"],
        "not an ONNX model",
        None,
    ),
    (
        "lint_keras_file",
        lambda d: ["lint", f"{d}/m.keras"],
        "m.keras' is not",
        None,
    ),
    (
        "demo_existing_report",
        lambda d: ["demo", "--output", f"{d}/report"],
        "already holds a report. Pass --overwrite",
        None,
    ),
    (
        "info_unknown_option",
        lambda d: ["info", "--gpu"],
        "unrecognized arguments: --gpu",
        None,
    ),
    (
        "unknown_subcommand",
        lambda d: ["frobnicate"],
        "invalid choice: 'frobnicate'",
        None,
    ),
    (
        "lint_two_files",
        lambda d: ["lint", f"{d}/valid.onnx", f"{d}/junk.onnx"],
        "unrecognized arguments",
        None,
    ),
]


def _cli_param(case):
    name, argv, match, bug = case
    marks = [pytest.mark.xfail(strict=True, reason=bug)] if bug else []
    return pytest.param(argv, match, id=name, marks=marks)


@pytest.mark.parametrize("argv, match", [_cli_param(c) for c in BAD_CLI])
def test_bad_command_line_exits_2_with_one_error_line(env, capsys, argv, match):
    try:
        code = cli.main(argv(env.dir))
    except SystemExit as exit_:  # argparse usage errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert re.search(match, err, re.S), err


# -- non-finite values


def _qat_model(x):
    model = keras_mp.quantize_model(cnn("qat"))
    keras_mp.calibrate(model, x, verbose=0)
    return model


def _ranges(model):
    out = {}
    for layer in iter_quantize_layers(model):
        if isinstance(layer, QuantizeWrapper):
            for q in layer.input_quantizers:
                out[f"{layer.name}/{q.name}"] = q.amax.numpy().copy()
            for attr, _, amax in layer.weight_ranges:
                out[f"{layer.name}/{attr}"] = amax.numpy().copy()
    return out


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
    model.get_layer("quant_conv").layer.bias.assign(np.full(8, 0.5))
    zeros = np.zeros((16,) + SHAPE, "float32")
    report = keras_mp.calibrate(model, zeros, verbose=0)
    # all-zero inputs: the conv's input range collapses; its bias keeps the
    # head's input alive
    assert report.collapsed == ["quant_conv/input_0"]
    assert "quant_conv/input_0: range collapsed to 0" in str(report)
    notes = {
        r["layer"]: r["note"]
        for r in keras_mp.quantization_report(model, verbose=False)
    }
    assert "uncalibrated input range (0)" in notes["quant_conv"]
    path = tmp_path / "collapsed.onnx"
    with pytest.raises(
        keras_mp.ExportError, match="collapsed, amax 0.*quant_conv/input_0"
    ):
        keras_mp.export_onnx(model, path)
    assert not path.exists()


def test_non_finite_range_is_reported_not_exported(tmp_path):
    model = keras_mp.quantize_model(cnn("nan_range"))
    keras_mp.calibrate(model, images(), verbose=0)
    model.get_layer("quant_head").input_quantizers[0].amax.assign(np.nan)
    path = tmp_path / "nan.onnx"
    with pytest.raises(keras_mp.ExportError, match="quant_head/input_0"):
        keras_mp.export_onnx(model, path)
    assert not path.exists()


def test_all_zero_weight_channel_exports_with_a_positive_scale(tmp_path):
    model = keras_mp.quantize_model(cnn("pruned_channel"))
    head = model.get_layer("quant_head")
    kernel = head.layer.kernel.numpy()
    kernel[:, 2] = 0.0  # a fully pruned output channel
    head.layer.kernel.assign(kernel)
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
    for name in ("QuantizeWrapper", "SparsityMask", "LossScaleOptimizer"):
        assert f'"registered_name": "keras_mp>{name}"' in config, name
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
    for name in ("FixedPointWrapper", "FixedPointInput", "PrecisionState"):
        assert f'"registered_name": "keras_mp>{name}"' in config, name
    words = [float(v.word_length.numpy()) for v in fixed_point_layers(loaded)]
    assert words == [8.0] * 3  # still in 8-bit fixed point, as saved
    # Fixed point rounds stochastically; in float32 both compute the same.
    for m in (model, loaded):
        keras_mp.muppet.set_word_length(m, None)
    np.testing.assert_array_equal(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0)
    )
