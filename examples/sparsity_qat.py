"""2:4 structured sparsity, then INT8 QAT that keeps the sparsity.

TensorRT runs a Conv or MatMul on sparse Tensor Cores (Ampere and newer)
when, in every group of 4 consecutive input channels, at least 2 weights
are zero, and the engine is built with `--sparsity=enable`. On real
Fashion-MNIST this example:

1. trains the reference CNN in float32;
2. reorders channels with `keras_mp.permute_for_sparsity` (same outputs,
   more weight magnitude kept by 2:4), then fine-tunes with the
   `keras_mp.StructuredSparsity(skip_unaligned=True)` callback, which
   prunes every eligible kernel to 2:4 and keeps it 2:4 on every step
   (layers left dense are listed: the first conv sees 1 input channel, a
   depthwise conv has no channel groups, and the 10-way logits have a
   shape sparse Tensor Cores do not take, NVIDIA ASP's rule);
3. prints `keras_mp.sparsity_report` and bakes the zeros in with
   `keras_mp.strip_sparsity`;
4. quantizes the sparse model (`keras_mp.quantize_model` +
   `keras_mp.calibrate`) and runs QAT with the same callback again:
   its masks are recomputed from the kernels, whose zeros are already 2:4,
   so QAT keeps the same pattern (symmetric INT8 maps 0 to 0);
5. exports Q/DQ ONNX, where `keras_mp.check_tensorrt` finds the 2:4 sparse
   INT8 weights, and prints the `trtexec ... --sparsity=enable` command.

Run:

    python examples/sparsity_qat.py          # ~4 min on 2 cores
    python examples/sparsity_qat.py --quick  # smoke run
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import keras_mp  # noqa: E402
from keras_mp.reference import (  # noqa: E402
    compile_classifier,
    fine_tune,
    reference_cnn,
)


def load_data(quick):
    """Fashion-MNIST when installed, else scikit-learn's 8x8 digits."""
    name, (x, y), (xt, yt) = keras_mp.datasets.load_images()
    if quick:
        return name, (x[:1024], y[:1024]), (xt[:256], yt[:256])
    return name, (x[:20000], y[:20000]), (xt, yt)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny smoke run (seconds)"
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--fine-tune-epochs", type=int, default=1)
    parser.add_argument(
        "--output",
        default=os.path.join("example-output", "sparsity_qat"),
        help="folder for the ONNX file and the sparsity plot",
    )
    args = parser.parse_args(argv)
    epochs = 2 if args.quick else args.epochs
    tune_epochs = 1 if args.quick else args.fine_tune_epochs
    keras.utils.set_random_seed(0)
    os.makedirs(args.output, exist_ok=True)
    name, (x, y), (xt, yt) = load_data(args.quick)
    print(f"Data: {name}, {len(x)} training and {len(xt)} test images.")
    if args.quick:
        print("--quick: a smoke run on a slice; accuracy means nothing here.")

    def top1(model):
        compile_classifier(model)
        return float(model.evaluate(xt, yt, batch_size=512, verbose=0)[1])

    model = compile_classifier(reference_cnn(x.shape[1:], width=16))
    model.fit(x, y, batch_size=128, epochs=epochs, verbose=2)
    dense_top1 = top1(model)
    print(f"Dense float32 test top-1: {100 * dense_top1:.2f}%")

    print("\n2:4 sparse fine-tune")
    # NVIDIA's ASP recipe: permute channels, prune once (aligned layers
    # only), retrain at the original learning rate.
    keras_mp.permute_for_sparsity(model)
    sparsity = keras_mp.StructuredSparsity(skip_unaligned=True, verbose=1)
    fine_tune(model, x, y, tune_epochs, 1e-3, callbacks=[sparsity], verbose=2)
    report = keras_mp.sparsity_report(model, skip_unaligned=True)
    print(report)
    plot = keras_mp.plot_sparsity(
        report, os.path.join(args.output, "sparsity.png")
    )
    sparse_top1 = top1(model)
    print(f"2:4 sparse float32 test top-1: {100 * sparse_top1:.2f}%")
    sparse = keras_mp.strip_sparsity(model)  # zeros baked in, no masks

    print("\nINT8 QAT of the sparse model, 2:4 kept by StructuredSparsity")
    qmodel = keras_mp.quantize_model(sparse)
    keras_mp.calibrate(qmodel, x[:2048], method="max", verbose=0)
    ptq_top1 = top1(qmodel)
    # QAT: a tenth of the learning rate.
    fine_tune(
        qmodel,
        x,
        y,
        tune_epochs,
        1e-4,
        callbacks=[keras_mp.StructuredSparsity(skip_unaligned=True)],
        verbose=2,
    )
    qat_top1 = top1(qmodel)
    after = keras_mp.sparsity_report(qmodel, skip_unaligned=True)
    valid = [r.name for r in after.rows if r.eligible and r.pattern_valid]
    eligible = [r.name for r in after.rows if r.eligible]
    print(f"After QAT, 2:4 holds in {len(valid)}/{len(eligible)} kernels.")

    path = os.path.join(args.output, "sparse_qat.onnx")
    parity = keras_mp.export_onnx(
        qmodel, path, verify_data=xt[:500], overwrite=True
    )
    print(f"\nWrote {path}. {parity}")
    lint = keras_mp.check_tensorrt(path)
    print(f"\n{lint}")
    command = keras_mp.trtexec_command(path, lint)
    print("\nBuild the sparse INT8 engine (TensorRT 10 or 11, Ampere+ GPU):")
    print(f"  {command}")
    print(
        f"\nTest top-1: dense {100 * dense_top1:.2f}%, 2:4 sparse "
        f"{100 * sparse_top1:.2f}%, sparse PTQ {100 * ptq_top1:.2f}%, "
        f"sparse QAT {100 * qat_top1:.2f}%. Sparsity plot: {plot}"
    )
    return {
        "dense_top1": dense_top1,
        "sparse_top1": sparse_top1,
        "qat_top1": qat_top1,
        "sparse_weights": list(lint.sparse_weights),
        "onnx": path,
        "trtexec": command,
    }


if __name__ == "__main__":
    main()
