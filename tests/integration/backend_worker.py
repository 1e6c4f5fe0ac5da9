"""Runs keras_mp's public API under a Keras backend other than TensorFlow.

Command line (used by test_backends.py, with KERAS_BACKEND set):

    python tests/integration/backend_worker.py OUT_DIR

Every call in `REFUSED` must raise the one backend error
(`keras_mp._compat.require_tensorflow`) and write nothing to
`OUT_DIR/refused`; every call in `NEUTRAL` must work. A float model is
trained here (on JAX; the NumPy backend cannot train) and saved to
`OUT_DIR/float.keras`, for the test to quantize under TensorFlow as the
error advises. The result is `OUT_DIR/result.json`: `{"backend",
"failures": [str]}`.
"""

import json
import os
import sys
import traceback

import keras
import numpy as np

import keras_mp

FIXTURES = os.path.join(os.path.dirname(__file__), "..")
# keras_mp files of each kind: a RecordedModel, the legacy QuantizeWrapper
# and MuPPET layers, a model compiled with keras_mp.LossScaleOptimizer.
SAVED = (
    "sparsity/fixtures/sparse_model.keras",
    "integration/fixtures/quantized.keras",
    "integration/fixtures/muppet.keras",
    "integration/fixtures/loss_scaled.keras",
)
X = np.random.default_rng(0).random((32, 32), dtype=np.float32)
Y = np.arange(32) % 4


def _model():
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(4, name="logits")(hidden)
    return keras.Model(inputs, outputs)


def _onnx_of(model, path):
    """The model's ONNX graph, written with `onnx` alone (no TensorFlow),
    as a TensorFlow process would have exported it."""
    from onnx import TensorProto, helper, numpy_helper, save

    (w1, b1), (w2, b2) = (layer.get_weights() for layer in model.layers[1:])
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["h"]),
        helper.make_node("MatMul", ["h", "w2"], ["m2"]),
        helper.make_node("Add", ["m2", "b2"], ["logits"]),
    ]
    weights = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}
    graph = helper.make_graph(
        nodes,
        "float",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 4])],
        [numpy_helper.from_array(v, name) for name, v in weights.items()],
    )
    proto = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)]
    )
    proto.ir_version = 8
    save(proto, path)
    return path


def _old(cls, *args):
    """A load-only class built as Keras loading builds it."""
    with keras_mp.legacy.loading():
        return cls(*args)


def _with_policy(name):
    with keras_mp.enable_mixed_precision(name):
        return keras.config.dtype_policy().name


def refused(out, onnx_path):
    """(name, call) of every entry point that needs TensorFlow."""
    return [
        ("quantize_model", lambda: keras_mp.quantize_model(_model())),
        (
            "quantize_apply",
            lambda: keras_mp.quantize_apply(
                keras_mp.quantize_annotate_model(_model())
            ),
        ),
        ("QuantizeActivation", lambda: keras_mp.QuantizeActivation()),
        (
            "QuantizeWrapper",
            lambda: _old(
                keras_mp.legacy.QuantizeWrapper, keras.layers.Dense(32)
            ),
        ),
        ("RecordedModel", lambda: keras_mp.RecordedModel(_model())),
        ("fixed_point_model", lambda: keras_mp.fixed_point_model(_model())),
        (
            "FixedPointWrapper",
            lambda: _old(
                keras_mp.legacy.FixedPointWrapper, keras.layers.Dense(32)
            ),
        ),
        ("FixedPointInput", lambda: _old(keras_mp.legacy.FixedPointInput)),
        ("PrecisionSwitching", lambda: keras_mp.PrecisionSwitching()),
        ("StructuredSparsity", lambda: keras_mp.StructuredSparsity()),
        (
            "LossScaleOptimizer",
            lambda: keras_mp.LossScaleOptimizer(keras.optimizers.SGD()),
        ),
        ("set_tf32", lambda: keras_mp.set_tf32(False)),
        (
            'enable_mixed_precision("auto")',
            lambda: keras_mp.enable_mixed_precision("auto"),
        ),
        (
            "layer_sensitivity",
            lambda: keras_mp.layer_sensitivity(_model(), X, Y),
        ),
        ("auto_quantize", lambda: keras_mp.auto_quantize(_model(), X, Y)),
        (
            "export_onnx",
            lambda: keras_mp.export_onnx(
                _model(), os.path.join(out, "m.onnx"), verify_data=X
            ),
        ),
        (
            "export_saved_model",
            lambda: keras_mp.export_saved_model(
                _model(), os.path.join(out, "saved"), verify_data=X
            ),
        ),
        (
            "compare_onnx",
            lambda: keras_mp.compare_onnx(_model(), onnx_path, X),
        ),
    ] + [
        (
            f"load_model({path})",
            lambda path=path: keras.saving.load_model(
                os.path.join(FIXTURES, path)
            ),
        )
        for path in SAVED
    ]


def neutral(model, onnx_path):
    """(name, call) of public functions that work on any backend."""
    kernel = model.layers[1].get_weights()[0]
    return [
        (
            "mixed_precision_audit",
            lambda: keras_mp.mixed_precision_audit(model, verbose=False),
        ),
        (
            "is_precision_sensitive",
            lambda: keras_mp.is_precision_sensitive(model.layers[-1], model),
        ),
        (
            "apply_mixed_precision",
            lambda: keras_mp.apply_mixed_precision(model, "mixed_bfloat16"),
        ),
        ("enable_mixed_precision", lambda: _with_policy("mixed_bfloat16")),
        ("LossScaleMonitor", lambda: keras_mp.LossScaleMonitor()),
        (
            "quantize_annotate_model",
            lambda: keras_mp.quantize_annotate_model(model),
        ),
        (
            "quantization_report",
            lambda: keras_mp.quantization_report(model, verbose=False),
        ),
        ("estimate_speedup", lambda: keras_mp.estimate_speedup([8, 16, 32])),
        ("is_2_4_sparse", lambda: keras_mp.is_2_4_sparse(kernel, axis=0)),
        (
            "search_permutation",
            lambda: keras_mp.search_permutation(kernel, axis=0),
        ),
        ("sparsity_report", lambda: keras_mp.sparsity_report(model)),
        ("shuffled_batches", lambda: keras_mp.datasets.shuffled_batches(X, Y)),
        ("check_tensorrt", lambda: keras_mp.check_tensorrt(onnx_path)),
        ("typed_graph", lambda: keras_mp.typed_graph(onnx_path)),
        ("trtexec_command", lambda: keras_mp.trtexec_command(onnx_path)),
        ("verify_onnx", lambda: keras_mp.verify_onnx(model, onnx_path, X)),
    ]


def main(out):
    backend = keras.config.backend()
    failures = []
    given = os.path.join(out, "given")
    os.makedirs(given)
    model = _model()
    if backend == "jax":
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(True))
        model.fit(X, Y, epochs=1, verbose=0)
    model.save(os.path.join(out, "float.keras"))
    onnx_path = _onnx_of(model, os.path.join(given, "float.onnx"))

    target = os.path.join(out, "refused")
    os.makedirs(target)
    policy = keras.config.dtype_policy().name
    for name, call in refused(target, onnx_path):
        try:
            call()
        except ValueError as e:
            text = str(e)
            if not (
                f"{backend!r} backend" in text
                and "KERAS_BACKEND=tensorflow" in text
                and "keras.saving.load_model" in text
            ):
                failures.append(f"{name}: another ValueError: {text[:300]}")
        except Exception as e:
            failures.append(
                f"{name}: {type(e).__name__} instead of the backend error: "
                f"{str(e)[:300]}"
            )
        else:
            failures.append(f"{name}: ran on the {backend!r} backend")
    if os.listdir(target):
        failures.append(f"refused calls wrote {os.listdir(target)}")
    if keras.config.dtype_policy().name != policy:
        failures.append("a refused call changed the global dtype policy")

    for name, call in neutral(model, onnx_path):
        try:
            call()
        except Exception:
            failures.append(f"{name} failed: {traceback.format_exc()[-600:]}")

    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"backend": backend, "failures": failures}, f)


if __name__ == "__main__":
    main(sys.argv[1])
