"""The demo's ViT row: a small keras-hub `ViTBackbone` classifier trained on
the demo's images, then INT8 PTQ, INT8 QAT and a float32 control given the
same extra epoch(s), each exported to Q/DQ ONNX, linted, and checked in ONNX
Runtime; `benchmarks/bench_vit.py` runs the same row at full length.

keras-hub is optional: without it the row is left out, and the report says
how to install it.
"""

import os
import time

import keras
import numpy as np

from keras_mp import datasets
from keras_mp._compat import optional_import
from keras_mp.onnx import check_tensorrt, export_onnx
from keras_mp.onnx.graph import GraphIndex
from keras_mp.onnx.parity import ort_session, run_session
from keras_mp.quantization import calibrate, quantize_model
from keras_mp.reference import QAT_CALIBRATOR, compile_classifier, fine_tune

# 4x4 patches of each image (7x7 pixels on Fashion-MNIST) plus the class
# token; 2 encoder layers of width 64, 4 heads, MLP 128: about 72k weights.
VIT = {"num_layers": 2, "num_heads": 4, "hidden_dim": 64, "mlp_dim": 128}
PATCHES_PER_SIDE = 4
TRAIN_LEARNING_RATE = 1e-3
BATCH = 128
FULL_EPOCHS = 3
# --quick: float32 and PTQ only, on few images (tracing the train step and
# each export is most of the time).
QUICK_TRAIN_IMAGES = 2048
INSTALL_HINT = (
    "keras-hub is not installed: no ViT row. Install it with `pip install "
    '"keras-mp[hub]" && pip install --no-deps "keras-hub==0.32.0"` (its '
    "tensorflow-text requirement would pull a second TensorFlow)."
)


def keras_hub_or_none():
    """keras_hub, or None when it is not installed."""
    try:
        import keras_hub
    except ImportError:
        return None
    return keras_hub


def vit_classifier(input_shape=(28, 28, 1), num_classes=10):
    """A keras-hub `ViTBackbone` (`VIT`) with a pooled Dense(10) logits head.

    Args:
        input_shape: tuple. Image shape, channels last; height and width
            divisible by `PATCHES_PER_SIDE`. Defaults to `(28, 28, 1)`.
        num_classes: int. Number of logits. Defaults to 10.

    Returns:
        An uncompiled Functional `keras.Model` that outputs logits.

    Raises:
        ImportError: keras-hub is not installed.
        ValueError: an image side not divisible by `PATCHES_PER_SIDE`.
    """
    keras_hub = keras_hub_or_none()
    if keras_hub is None:
        raise ImportError(INSTALL_HINT)
    height, width = input_shape[:2]
    if height != width or height % PATCHES_PER_SIDE:
        raise ValueError(
            f"The demo ViT takes square images whose side is a multiple of "
            f"{PATCHES_PER_SIDE}. Received: input_shape={input_shape}"
        )
    backbone = keras_hub.models.ViTBackbone(
        image_shape=tuple(input_shape),
        patch_size=height // PATCHES_PER_SIDE,
        name="vit_backbone",
        **VIT,
    )
    inputs = keras.Input(input_shape, name="image")
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(backbone(inputs))
    logits = keras.layers.Dense(num_classes, name="logits")(pooled)
    return keras.Model(inputs, logits, name="vit")


def attention_coverage(path):
    """The attention matmuls of an ONNX file: how many, and how many have a
    DequantizeLinear on both inputs.

    An attention matmul is a MatMul whose two inputs are both computed at
    run time (Q x K^T and softmax x V); every other weighted op has a
    constant weight.

    Returns:
        dict: `attention_matmuls`, `attention_quantized`.
    """
    graph = GraphIndex(optional_import("onnx").load(path))
    attention = [
        op
        for op in graph.weighted
        if op.op_type == "MatMul"
        and all(graph.trace(t).name is None for t in op.input[:2])
    ]
    return {
        "attention_matmuls": len(attention),
        "attention_quantized": sum(
            all(graph.quantized_inputs(op)) for op in attention
        ),
    }


def onnx_row(model, path, xt, yt, latency_repeats=(20, 5)):
    """Test top-1, then (with a `path`) export, lint, coverage and ONNX
    Runtime parity of one model.

    Parity: ONNX Runtime with graph optimizations off on every test image,
    its top-1 agreement with Keras and its own test top-1, recorded for the
    caller to judge (`export_onnx`'s own check, 99.9% agreement on a
    probe, is stricter than the 99.5% goal of trained INT8 networks that
    `bench_trained_parity.py` measures against float32's noise floor).
    Latency: ORT's default optimizations, median over `latency_repeats`
    (batch 1, 64) on the first test images.
    """
    compile_classifier(model)
    keras_logits = model.predict(xt, batch_size=500, verbose=0)
    keras_top1 = keras_logits.argmax(-1)
    row = {"test_top1": round(100 * float(np.mean(keras_top1 == yt)), 2)}
    if path is None:
        return row
    export_onnx(model, path, overwrite=True)
    lint = check_tensorrt(path)
    (ort_logits,) = run_session(ort_session(path, optimized=False), [xt])
    ort_top1 = ort_logits.argmax(-1)
    session = ort_session(path)
    latency = []
    for batch, repeats in zip((1, 64), latency_repeats):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run_session(session, [xt[:batch]])
            times.append(time.perf_counter() - start)
        latency.append(1000 * float(np.median(times)))
    return {
        **row,
        "onnx": os.path.basename(path),
        "tensorrt_lint": "clean" if lint.ok else "violations",
        "qdq_nodes": lint.num_qdq,
        "weighted_ops": lint.weighted_ops,
        "weighted_quantized": lint.weighted_ops_quantized,
        **attention_coverage(path),
        "ort_test_top1": round(100 * float(np.mean(ort_top1 == yt)), 2),
        "parity_top1_agreement": round(
            100 * float(np.mean(ort_top1 == keras_top1)), 2
        ),
        "parity_max_abs_diff": float(
            f"{np.max(np.abs(ort_logits - keras_logits)):.3g}"
        ),
        "latency_ms_batch1": round(latency[0], 3),
        "latency_ms_batch64": round(latency[1], 2),
    }


def run_vit(
    x,
    y,
    xt,
    yt,
    output,
    epochs,
    qat_epochs=1,
    calibration_images=2048,
    ptq_methods=("percentile",),
    qat=True,
    export_float=True,
    latency_repeats=(20, 5),
    seed=0,
):
    """Trains the ViT, quantizes it (PTQ, QAT) and measures every variant.

    Args:
        x, y, xt, yt: training and test images and labels.
        output: str. Folder for the `vit_*.onnx` files.
        epochs: int. Float training epochs (Adam 1e-3).
        qat_epochs: int. Epochs of QAT and of the float32 control
            (`fine_tune`: cosine-decayed 1e-4). Defaults to 1.
        calibration_images: int. Training images to calibrate on.
            Defaults to 2048.
        ptq_methods: calibrators of the PTQ rows. Defaults to percentile.
        qat: bool. Add the QAT and float32 control rows. Defaults to True.
        export_float: bool. Export the float32 rows too (else their test
            top-1 only). Defaults to True.
        latency_repeats: (batch 1, batch 64) ONNX Runtime repeats.
        seed: int. Weights and batch order. Defaults to 0.

    Returns:
        dict: `params`, `train_seconds`, `qat_seconds` and
        `control_seconds` (with `qat`), `methods` (label -> `onnx_row`).
    """
    keras.utils.set_random_seed(seed)
    model = compile_classifier(
        vit_classifier(x.shape[1:]), learning_rate=TRAIN_LEARNING_RATE
    )
    start = time.perf_counter()
    model.fit(
        datasets.shuffled_batches(x, y, BATCH, seed=seed),
        epochs=epochs,
        verbose=2,
    )
    results = {
        "params": int(model.count_params()),
        "train_seconds": round(time.perf_counter() - start, 1),
    }
    calib = x[:calibration_images]
    models = {"float32": model}
    for method in ptq_methods:
        print(f"ViT PTQ, {method} calibration")
        q = quantize_model(model)
        calibrate(q, calib, method=method, verbose=0)
        models[f"ptq_{method}"] = q
    if qat:
        print(f"ViT QAT from {QAT_CALIBRATOR} calibration")
        q = quantize_model(model)
        calibrate(q, calib, method=QAT_CALIBRATOR, verbose=0)
        start = time.perf_counter()
        models["qat"] = fine_tune(q, x, y, qat_epochs, seed=seed, verbose=2)
        results["qat_seconds"] = round(time.perf_counter() - start, 1)
        control = vit_classifier(x.shape[1:])
        control.set_weights(model.get_weights())
        start = time.perf_counter()
        models["float32_control"] = fine_tune(
            control, x, y, qat_epochs, seed=seed, verbose=2
        )
        results["control_seconds"] = round(time.perf_counter() - start, 1)
    results["methods"] = {}
    for label, m in models.items():
        print(f"ViT {label}: export, lint, ONNX Runtime on {len(xt)} images")
        path = os.path.join(output, f"vit_{label}.onnx")
        if label.startswith("float32") and not export_float:
            path = None
        results["methods"][label] = onnx_row(m, path, xt, yt, latency_repeats)
    return results


def demo_vit(x, y, xt, yt, output, quick):
    """The demo's ViT row: `results["vit"]`, or the reason it is missing."""
    if keras_hub_or_none() is None:
        print(INSTALL_HINT)
        return {"skipped": INSTALL_HINT}
    if quick:
        x, y = x[:QUICK_TRAIN_IMAGES], y[:QUICK_TRAIN_IMAGES]
    epochs = 1 if quick else FULL_EPOCHS
    start = time.perf_counter()
    results = run_vit(
        x,
        y,
        xt,
        yt,
        output,
        epochs,
        calibration_images=512 if quick else 2048,
        qat=not quick,
        export_float=not quick,
        latency_repeats=(20, 5) if quick else (100, 20),
    )
    return dict(
        results,
        epochs=epochs,
        qat_epochs=1,
        patches=PATCHES_PER_SIDE**2,
        train_images=len(x),
        seconds=round(time.perf_counter() - start, 1),
    )
