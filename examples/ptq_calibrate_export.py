"""Post-training INT8 quantization: calibrate, compare, export, lint.

Trains the reference CNN (conv + BN, a residual Add, a depthwise-separable
block, a Dense head) in float32 on real Fashion-MNIST, then for each of the
four calibrators (`max`, `percentile`, `entropy`, `mse`):

1. `keras_mp.quantize_model` puts TensorRT-style Q/DQ on the inputs of the
   weighted layers and on the skip input of the residual Add;
2. `keras_mp.calibrate` sets the activation ranges from 2,048 training
   images;
3. the quantized model is evaluated on held-out training images and on
   the test set.

The calibrator with the best held-out accuracy is then exported:
`keras_mp.quantization_report` shows what is quantized with which ranges,
`keras_mp.export_onnx(..., verify_data=...)` writes Q/DQ ONNX and checks
ONNX Runtime against Keras before the file lands, `keras_mp.check_tensorrt`
lints the file against TensorRT's explicit-quantization rules, and
`keras_mp.trtexec_command` prints the command that builds a TensorRT engine
from it.

Run:

    python examples/ptq_calibrate_export.py          # ~3 min on 2 cores
    python examples/ptq_calibrate_export.py --quick  # smoke run
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import keras_mp  # noqa: E402
from keras_mp.reference import compile_classifier, reference_cnn  # noqa: E402

METHODS = ("max", "percentile", "entropy", "mse")


def load_data(quick):
    """Fashion-MNIST when installed, else scikit-learn's 8x8 digits."""
    name, (x, y), (xt, yt) = keras_mp.datasets.load_images()
    # The last images of the training split are held out to choose the
    # calibrator; the test split is only reported.
    if quick:
        return (
            name,
            (x[:1024], y[:1024]),
            (x[-512:], y[-512:]),
            (xt[:256], yt[:256]),
        )
    return name, (x[:20000], y[:20000]), (x[-5000:], y[-5000:]), (xt, yt)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny smoke run (seconds)"
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--output",
        default=os.path.join("example-output", "ptq_calibrate_export"),
        help="folder for the ONNX files",
    )
    args = parser.parse_args(argv)
    epochs = 3 if args.quick else args.epochs
    keras.utils.set_random_seed(0)
    os.makedirs(args.output, exist_ok=True)
    name, (x, y), (xv, yv), (xt, yt) = load_data(args.quick)
    print(
        f"Data: {name}, {len(x)} training, {len(xv)} validation and "
        f"{len(xt)} test images."
    )
    if args.quick:
        print("--quick: a smoke run on a slice; accuracy means nothing here.")

    model = compile_classifier(reference_cnn(x.shape[1:], width=16))
    model.fit(x, y, batch_size=128, epochs=epochs, verbose=2)
    _, float_top1 = model.evaluate(xt, yt, batch_size=512, verbose=0)
    print(f"float32 test top-1: {100 * float_top1:.2f}%")

    calibration_images = x[:2048]
    results = {}
    for method in METHODS:
        qmodel = keras_mp.quantize_model(model)
        calibration = keras_mp.calibrate(
            qmodel, calibration_images, method=method, verbose=0
        )
        compile_classifier(qmodel)
        _, val_top1 = qmodel.evaluate(xv, yv, batch_size=512, verbose=0)
        _, top1 = qmodel.evaluate(xt, yt, batch_size=512, verbose=0)
        results[method] = {
            "model": qmodel,
            "val_top1": float(val_top1),
            "top1": float(top1),
        }
        print(
            f"PTQ {method:<10} validation top-1 {100 * val_top1:6.2f}%, "
            f"test top-1 {100 * top1:6.2f}% ({calibration.batches} "
            f"calibration batches, {len(calibration.ranges)} activation "
            "ranges)"
        )

    # Choose on held-out training images, never on the test set.
    best = max(METHODS, key=lambda m: results[m]["val_top1"])
    qmodel = results[best]["model"]
    print(f"\nBest calibrator on the validation images: {best}.")
    print("What is quantized, with which ranges:")
    keras_mp.quantization_report(qmodel)

    path = os.path.join(args.output, f"ptq_{best}.onnx")
    parity = keras_mp.export_onnx(
        qmodel, path, verify_data=xt[:1000], overwrite=True
    )
    print(f"\nWrote {path}. {parity}")
    lint = keras_mp.check_tensorrt(path)
    print(f"\n{lint}")
    command = keras_mp.trtexec_command(path, lint)
    print("\nBuild a TensorRT engine from it (on a machine with a GPU):")
    print(f"  {command}")
    print(
        "The same command works on TensorRT 10 and 11: --stronglyTyped takes "
        "the precisions from the Q/DQ graph (TensorRT 11 removed --int8)."
    )

    print(f"\nTest top-1: float32 {100 * float_top1:.2f}%")
    for method in METHODS:
        top1 = results[method]["top1"]
        print(
            f"  PTQ {method:<10} {100 * top1:6.2f}% "
            f"({100 * (top1 - float_top1):+.2f} points)"
        )
    return {
        "float_top1": float(float_top1),
        "top1": {m: r["top1"] for m, r in results.items()},
        "best": best,
        "onnx": path,
        "lint_ok": lint.ok,
        "trtexec": command,
    }


if __name__ == "__main__":
    main()
