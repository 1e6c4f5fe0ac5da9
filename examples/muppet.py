"""MuPPET: multi-precision fixed-point training with precision switching.

MuPPET (Rajagopal et al., ICML 2020) trains in 8-, 12-, 14- and 16-bit
dynamic fixed point and finishes in float32, moving up a precision when
the gradients of successive epochs stop carrying new information (their
diversity falls well below the best seen at this precision). On real
Fashion-MNIST this example:

1. builds a small CNN and `keras_mp.fixed_point_model(model)`, a copy whose
   weighted layers run in fixed point (float32 master weights);
2. trains it with `keras_mp.PrecisionSwitching()`, which logs `precision`,
   `p`, `T` and `switched` into the `fit` history;
3. writes `keras_mp.plot_precision` (p(e), T(e) and the word length per
   epoch) to a PNG;
4. prints `keras_mp.estimate_speedup`: a GPU cost-model estimate of the
   training speed-up over float32, not a measurement. On a CPU fixed point
   is emulated in float32 kernels and runs slower than float32.

An "epoch" here is `--steps` batches drawn from the shuffled 60,000
training images, so the policy sees enough epochs in a CPU budget.
`--fixed-schedule` switches at fixed epochs instead of adaptively;
`--quick` uses a fixed schedule so that a few epochs visit every precision.

Run:

    python examples/muppet.py          # adaptive, ~5 min on 2 cores
    python examples/muppet.py --quick  # smoke run
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_mp  # noqa: E402

SCHEDULE = (8, 12, 14, 16, None)  # word lengths, then float32


def load_data(quick):
    """Fashion-MNIST when installed, else scikit-learn's 8x8 digits."""
    name, (x, y), (xt, yt) = keras_mp.datasets.load_images()
    if quick:
        xt, yt = xt[:256], yt[:256]
    return name, (x, y), (xt, yt)


def build_model(input_shape, num_classes=10):
    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu", padding="same"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(num_classes),
        ],
        name="muppet_cnn",
    )


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny smoke run (seconds)"
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument(
        "--steps", type=int, default=50, help="batches of 128 per epoch"
    )
    parser.add_argument(
        "--fixed-schedule",
        action="store_true",
        help="switch at evenly spaced epochs instead of adaptively",
    )
    parser.add_argument(
        "--output",
        default=os.path.join("example-output", "muppet"),
        help="folder for the precision plot",
    )
    args = parser.parse_args(argv)
    epochs, steps = (6, 4) if args.quick else (args.epochs, args.steps)
    fixed = args.quick or args.fixed_schedule
    keras.utils.set_random_seed(0)
    os.makedirs(args.output, exist_ok=True)
    name, (x, y), (xt, yt) = load_data(args.quick)
    print(
        f"Data: {name}; {epochs} epochs of {steps} batches of 128 from "
        f"{len(x)} training images; {len(xt)} test images."
    )
    if args.quick:
        print("--quick: a smoke run on a slice; accuracy means nothing here.")
    train = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=0)
        .batch(128, drop_remainder=True)
        .repeat()
    )

    model = build_model(x.shape[1:])
    fp_model = keras_mp.fixed_point_model(model, seed=0)
    fp_model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    if fixed:
        # One switch every fifth of the run (at least one epoch apart).
        stages = len(SCHEDULE) - 1
        epoch_schedule = tuple(
            max(i + 1, round((i + 1) * epochs / (stages + 1)))
            for i in range(stages)
        )
        switching = keras_mp.PrecisionSwitching(
            SCHEDULE, epoch_schedule=epoch_schedule, verbose=1
        )
        print(f"Fixed schedule: switches at epochs {epoch_schedule}.")
    else:
        switching = keras_mp.PrecisionSwitching(
            SCHEDULE, resolution=3, patience=2, verbose=1
        )
        print("Adaptive schedule: gradient diversity, r=3, gamma=2.")
    history = fp_model.fit(
        train,
        epochs=epochs,
        steps_per_epoch=steps,
        callbacks=[switching],
        shuffle=False,  # the dataset is shuffled already
        verbose=2,
    )
    _, top1 = fp_model.evaluate(xt, yt, batch_size=512, verbose=0)

    precisions = history.history["precision"]
    plot = keras_mp.plot_precision(
        history, os.path.join(args.output, "precision.png")
    )
    print(f"\nWord length per epoch (32 = float32): {precisions}")
    print(f"Switch epochs: {switching.switch_epochs}")
    print(f"Test top-1 after {epochs} epochs: {100 * top1:.2f}%")
    print(f"Precision plot: {plot}")
    for gpu in sorted(keras_mp.muppet.GPU_THROUGHPUT):
        estimate = keras_mp.estimate_speedup(precisions, gpu=gpu)
        print(
            f"Estimated GPU training speed-up on {estimate['gpu']}: "
            f"{estimate['speedup']:.2f}x (cost model, not a measurement)"
        )
        print(f"  assumptions: {estimate['assumptions']}")
    return {
        "precisions": [float(p) for p in precisions],
        "switch_epochs": list(switching.switch_epochs),
        "test_top1": float(top1),
        "plot": plot,
        "speedup": estimate["speedup"],
    }


if __name__ == "__main__":
    main()
