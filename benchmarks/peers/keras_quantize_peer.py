"""Peer benchmark (main venv): Keras 3's built-in `model.quantize("int8")`.

Post-training, on a copy of the shared float model (no calibration data:
Keras quantizes weights per output channel and activations on the fly).
Records which layers it changed, Keras test top-1, then exports to ONNX,
first with `keras_mp.export_onnx`, then with Keras' own
`model.export(format="onnx")`; each failure is recorded, not hidden.

Writes `keras_quantize.json` in the work folder and, when an export
works, `keras_int8.onnx` (keras_mp.export_onnx) and/or
`keras_int8_native.onnx` (model.export).
"""

import argparse
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
from _peer_common import load_data, write_json  # noqa: E402

import keras_mp  # noqa: E402
from keras_mp.reference import compile_classifier  # noqa: E402


def top1(model, x, y):
    _, acc = model.evaluate(x, y, batch_size=1000, verbose=0)
    return round(100 * float(acc), 2)


def _error(e):
    return {
        "ok": False,
        "error": f"{type(e).__name__}: {str(e)[:1500]}",
        "traceback": traceback.format_exc()[-1500:],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", required=True)
    a = p.parse_args()
    w = a.workdir
    d = load_data(w)
    model = keras.models.load_model(os.path.join(w, "float.keras"))
    before = {
        layer.name: [v.dtype for v in layer.weights] for layer in model.layers
    }
    out = {"keras": keras.__version__}
    try:
        model.quantize("int8")
    except Exception as e:
        out["quantize"] = _error(e)
        write_json(w, "keras_quantize", out)
        return
    changed = sorted(
        layer.name
        for layer in model.layers
        if [v.dtype for v in layer.weights] != before[layer.name]
        or getattr(layer, "quantization_mode", None)
    )
    weighted = sorted(
        layer.name
        for layer in model.layers
        if any("kernel" in v.path for v in layer.weights)
    )
    out["quantize"] = {
        "ok": True,
        "layers_quantized": changed,
        "weighted_layers": weighted,
        "layers_left_float": sorted(set(weighted) - set(changed)),
    }
    compile_classifier(model)
    out["keras_test_top1"] = top1(model, d["x_test"], d["y_test"])
    exports = {}
    try:
        parity = keras_mp.export_onnx(
            model,
            os.path.join(w, "keras_int8.onnx"),
            verify_data=d["x_val"][:1000],
            overwrite=True,
        )
        lint = keras_mp.check_tensorrt(os.path.join(w, "keras_int8.onnx"))
        exports["keras_mp.export_onnx"] = {
            "ok": True,
            "onnx": "keras_int8.onnx",
            "parity": str(parity),
            "tensorrt_lint_ok": lint.ok,
            "tensorrt_violations": [str(f) for f in lint.violations[:3]],
            "num_qdq": lint.num_qdq,
        }
    except Exception as e:
        exports["keras_mp.export_onnx"] = _error(e)
    try:
        path = os.path.join(w, "keras_int8_native.onnx")
        if os.path.exists(path):
            os.remove(path)
        model.export(path, format="onnx", verbose=False)
        exports['model.export(format="onnx")'] = {
            "ok": True,
            "onnx": "keras_int8_native.onnx",
        }
    except Exception as e:
        exports['model.export(format="onnx")'] = _error(e)
    out["exports"] = exports
    write_json(w, "keras_quantize", out)


if __name__ == "__main__":
    main()
