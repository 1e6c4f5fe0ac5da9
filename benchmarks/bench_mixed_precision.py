"""float32 vs mixed_bfloat16 vs mixed_float16 on Fashion-MNIST.

The same reference CNN, same seed, same batches and epochs under each
policy: test top-1 of each, and the training step time relative to float32
measured side by side (interleaved rounds). On a CPU without native 16-bit
math the ratio is a slowdown, reported as measured.

    python benchmarks/bench_mixed_precision.py [--quick]
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    bench_parser,
    markdown_table,
    median_step_time,
    write_results,
)

import keras_mp  # noqa: E402
from keras_mp.reference import compile_classifier, reference_cnn  # noqa: E402

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


def build(policy, width):
    keras.utils.set_random_seed(0)
    model = keras_mp.apply_mixed_precision(reference_cnn(width=width), policy)
    opt = keras.optimizers.Adam(1e-3)
    if policy == "mixed_float16":
        opt = keras_mp.LossScaleOptimizer(opt)
    return compile_classifier(model, optimizer=opt)


def main():
    parser = bench_parser(__doc__, "smoke run: 1,024 images, 1 epoch")
    parser.add_argument("--train-images", type=int, default=12000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=16)
    args = parser.parse_args()
    if args.quick:
        args.train_images, args.epochs = 1024, 1
    (x, y), (xt, yt) = keras_mp.datasets.load_fashion_mnist()
    x, y = x[: args.train_images], y[: args.train_images]
    batch = 128
    models, results = {}, {}
    for policy in POLICIES:
        model = build(policy, args.width)
        monitor = keras_mp.LossScaleMonitor()
        history = model.fit(
            x,
            y,
            batch_size=batch,
            epochs=args.epochs,
            shuffle=False,
            verbose=2,
            callbacks=[monitor],
        )
        _, acc = model.evaluate(xt, yt, batch_size=1000, verbose=0)
        results[policy] = {
            "test_top1": round(100 * float(acc), 2),
            "final_loss": round(float(history.history["loss"][-1]), 4),
        }
        if monitor.scale_history:
            results[policy]["final_loss_scale"] = monitor.scale_history[-1][1]
            results[policy]["skipped_steps"] = history.history["skipped_steps"][
                -1
            ]
        models[policy] = model
    # Step time, interleaved rounds so machine noise hits every policy alike.
    xb, yb = x[:batch], y[:batch]
    times = {p: [] for p in POLICIES}
    for _ in range(3):
        for policy in POLICIES:
            model = models[policy]
            times[policy].append(
                median_step_time(lambda m=model: m.train_on_batch(xb, yb), 5)
            )
    base = float(np.median(times["float32"]))
    rows = []
    for policy in POLICIES:
        step = float(np.median(times[policy]))
        results[policy]["step_seconds"] = round(step, 4)
        results[policy]["step_time_ratio_to_float32"] = round(step / base, 2)
        delta = results[policy]["test_top1"] - results["float32"]["test_top1"]
        results[policy]["top1_delta_points"] = round(delta, 2)
        rows.append(
            (
                policy,
                f"{results[policy]['test_top1']:.2f}",
                f"{delta:+.2f}",
                f"{step * 1000:.0f}",
                f"{step / base:.2f}x",
            )
        )
    md = (
        f"Reference CNN (width {args.width}), {len(x)} Fashion-MNIST training "
        f"images, {args.epochs} epochs, batch {batch}, 10,000 test images. "
        "Step-time ratio >1 means slower than float32: this CPU has no "
        "native float16/bfloat16 math, so it is not a speed-up claim.\n\n"
        + markdown_table(
            (
                "policy",
                "test top-1 %",
                "vs float32",
                "step ms",
                "step time / fp32",
            ),
            rows,
        )
    )
    results["config"] = vars(args)
    write_results("mixed_precision", results, md, quick=args.quick)


if __name__ == "__main__":
    main()
