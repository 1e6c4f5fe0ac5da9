"""Quantization-aware training of a keras.applications MobileNetV2.

`keras.applications.MobileNetV2(weights=None, alpha=0.35)` is a real
architecture: inverted residual blocks with depthwise convolutions,
BatchNormalization, ReLU6 and residual Adds. No pretrained weights are
downloaded; the model is trained here from scratch on real Fashion-MNIST,
its 28x28 gray images padded to 32x32 and repeated to 3 channels (the
smallest input MobileNetV2 accepts).

The steps:

1. train the float32 model;
2. `keras_mp.quantize_model`: Q/DQ on the inputs of every Conv, depthwise
   Conv and Dense, and on the skip input of each residual Add, as TensorRT
   wants them;
3. `keras_mp.calibrate` (PTQ) from 2,048 training images;
4. QAT: `fit` the quantized model for one epoch at a tenth of the learning
   rate with cosine decay (activation ranges stay frozen);
5. `keras_mp.export_onnx(..., verify_data=...)` and `keras_mp.check_tensorrt`
   (the lint), then the `trtexec` command.

Compare QAT with a float32 model fine-tuned for the same extra epoch before
crediting QAT with any gain: an extra epoch alone moves top-1.

Run:

    python examples/qat_keras_applications.py          # ~7 min, 2 cores
    python examples/qat_keras_applications.py --quick  # smoke run, ~3 min
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mp  # noqa: E402

SIZE = 32  # the smallest input keras.applications.MobileNetV2 accepts


def load_data(quick):
    """Fashion-MNIST when installed, else scikit-learn's 8x8 digits."""
    name, (x, y), (xt, yt) = keras_mp.datasets.load_images()
    if quick:
        x, y, xt, yt = x[:512], y[:512], xt[:256], yt[:256]
    else:
        x, y = x[:30000], y[:30000]
    return name, (to_rgb32(x), y), (to_rgb32(xt), yt)


def to_rgb32(images):
    """(N, H, W, 1) in [0, 1] -> (N, 32, 32, 3) in [-1, 1], MobileNetV2's
    input range: zero-padded when smaller by at most 4 pixels (28x28),
    resized otherwise (8x8 digits)."""
    height, width = images.shape[1:3]
    if SIZE - 4 <= height <= SIZE and SIZE - 4 <= width <= SIZE:
        top, left = (SIZE - height) // 2, (SIZE - width) // 2
        images = np.pad(
            images,
            (
                (0, 0),
                (top, SIZE - height - top),
                (left, SIZE - width - left),
                (0, 0),
            ),
        )
    else:
        images = keras.ops.convert_to_numpy(
            keras.ops.image.resize(images, (SIZE, SIZE))
        )
    return np.repeat(images * 2.0 - 1.0, 3, axis=-1).astype("float32")


def compile_model(model, learning_rate):
    model.compile(
        keras.optimizers.Adam(learning_rate),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny smoke run (a few minutes: tracing MobileNetV2)",
    )
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument(
        "--output",
        default=os.path.join("example-output", "qat_keras_applications"),
        help="folder for the ONNX file",
    )
    args = parser.parse_args(argv)
    epochs = 1 if args.quick else args.epochs
    batch_size = 128
    keras.utils.set_random_seed(0)
    os.makedirs(args.output, exist_ok=True)
    name, (x, y), (xt, yt) = load_data(args.quick)
    print(
        f"Data: {name}, {len(x)} training and {len(xt)} test images, "
        f"as {x.shape[1:]} in [-1, 1]."
    )
    if args.quick:
        print("--quick: a smoke run on a slice; accuracy means nothing here.")

    model = keras.applications.MobileNetV2(
        weights=None,
        input_shape=x.shape[1:],
        alpha=0.35,
        classes=10,
        classifier_activation=None,  # logits
    )
    # keras.applications sets BatchNormalization momentum to 0.999, made
    # for long ImageNet runs: after a few epochs from scratch the moving
    # statistics are still far from the batch statistics, and inference
    # (and calibration, which runs in inference mode) sees wrong
    # activations. 0.9 suits a short run.
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.momentum = 0.9
    print(f"{model.name}: {model.count_params():,} parameters.")
    compile_model(model, 1e-3)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=2)
    _, float_top1 = model.evaluate(xt, yt, batch_size=512, verbose=0)
    print(
        f"float32 test top-1 after {epochs} epoch(s): {100 * float_top1:.2f}%"
    )

    qmodel = keras_mp.quantize_model(model)
    rows = keras_mp.quantization_report(qmodel, verbose=False).rows
    quantized = [r for r in rows if r["quantized"]]
    kinds = sorted({r["type"] for r in quantized})
    print(
        f"quantize_model: {len(quantized)} of {len(rows)} layers get Q/DQ "
        f"({', '.join(kinds)})."
    )
    keras_mp.calibrate(qmodel, x[:2048], method="max", verbose=0)
    compile_model(qmodel, 1e-3)
    _, ptq_top1 = qmodel.evaluate(xt, yt, batch_size=512, verbose=0)
    print(f"PTQ (max calibration) test top-1: {100 * ptq_top1:.2f}%")

    qat_epochs = 1
    steps = qat_epochs * int(np.ceil(len(x) / batch_size))
    schedule = keras.optimizers.schedules.CosineDecay(1e-4, steps)
    compile_model(qmodel, schedule)
    qmodel.fit(x, y, batch_size=batch_size, epochs=qat_epochs, verbose=2)
    _, qat_top1 = qmodel.evaluate(xt, yt, batch_size=512, verbose=0)
    print(f"QAT test top-1 after {qat_epochs} epoch: {100 * qat_top1:.2f}%")

    path = os.path.join(args.output, "mobilenetv2_qat.onnx")
    # The default parity tolerance (top-1 agreement >= 99.9%, relative L2
    # <= 1%) suits shallow networks. Here TensorFlow and ONNX Runtime
    # compute the float convolutions in different orders, so an INT8 code
    # now and then lands one step apart (about 1 in 10^6 at the first
    # layer), and through MobileNetV2's 17 blocks such flips compound.
    # Measured on this model: 98.0% top-1 agreement, relative L2 3.3%, and
    # the ONNX file scored 83.14% on the 10,000 test images against Keras'
    # 83.33%: noise, not a broken export. TensorRT's kernels will differ
    # from both in the same way.
    parity = keras_mp.export_onnx(
        qmodel,
        path,
        verify_data=xt[:500],
        overwrite=True,
        min_top1_agreement=0.95,
        max_rel_l2=0.1,
    )
    print(f"\nWrote {path}. {parity}")
    lint = keras_mp.check_tensorrt(path)
    print(f"\n{lint}")
    print("\nBuild the TensorRT engine (TensorRT 10 or 11, on a GPU machine):")
    print(f"  {keras_mp.trtexec_command(path, lint)}")
    print(
        f"\nTest top-1: float32 {100 * float_top1:.2f}%, PTQ "
        f"{100 * ptq_top1:.2f}%, QAT {100 * qat_top1:.2f}%."
    )
    return {
        "float_top1": float(float_top1),
        "ptq_top1": float(ptq_top1),
        "qat_top1": float(qat_top1),
        "onnx": path,
        "lint_ok": lint.ok,
    }


if __name__ == "__main__":
    main()
