"""Mixed-precision training quickstart on real Fashion-MNIST.

Shows the mixed-precision part of keras_mp on one small CNN:

1. `keras_mp.enable_mixed_precision` sets Keras' global policy (and, used
   as a context manager, restores the previous one afterwards).
2. `keras_mp.apply_mixed_precision` copies a model under that policy, with
   BatchNormalization, softmax and the output layer kept in float32.
3. `keras_mp.mixed_precision_audit` lists every layer's compute and
   variable dtypes and the dimensions that are not multiples of 8 (Tensor
   Cores want them).
4. `keras_mp.LossScaleOptimizer` wraps Adam with dynamic loss scaling
   (bounded scale, counted skipped steps), and `keras_mp.LossScaleMonitor`
   puts the loss scale and skipped-step count into the `fit` logs.
5. The trained model is saved as `.keras` and reloaded with a plain
   `keras.saving.load_model`.

On a CPU without native 16-bit math (like a CI runner) float16 is emulated
and slower than float32: this example shows the mechanics, not a speed-up.
`--policy auto` picks what this machine gains from.

Run:

    python examples/mixed_precision_quickstart.py          # ~1 min, 2 cores
    python examples/mixed_precision_quickstart.py --quick  # smoke run
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mp  # noqa: E402


def load_data(quick):
    """Fashion-MNIST when installed, else scikit-learn's 8x8 digits."""
    name, (x, y), (xt, yt) = keras_mp.datasets.load_images()
    if quick:
        return name, (x[:512], y[:512]), (xt[:256], yt[:256])
    return name, (x[:12000], y[:12000]), (xt, yt)


def build_model(input_shape, num_classes=10):
    """A small CNN: conv-BN-ReLU blocks, channel counts multiples of 8."""
    inputs = keras.Input(input_shape, name="image")
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.BatchNormalization(momentum=0.9)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization(momentum=0.9)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="quickstart_cnn")


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny smoke run (a few seconds)"
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--policy",
        default="mixed_float16",
        choices=("mixed_float16", "mixed_bfloat16", "float32", "auto"),
    )
    parser.add_argument(
        "--output",
        default=os.path.join("example-output", "mixed_precision_quickstart"),
        help="folder for the saved model",
    )
    args = parser.parse_args(argv)
    epochs = 1 if args.quick else args.epochs
    keras.utils.set_random_seed(0)
    os.makedirs(args.output, exist_ok=True)
    name, (x, y), (xt, yt) = load_data(args.quick)
    print(f"Data: {name}, {len(x)} training and {len(xt)} test images.")
    if args.quick:
        print("--quick: a smoke run on a slice; accuracy means nothing here.")

    with keras_mp.enable_mixed_precision(args.policy) as previous:
        policy = keras.mixed_precision.global_policy().name
        print(f"Global policy: {policy} (was {previous})")
        if previous.reason:
            print(f"  --policy auto chose it: {previous.reason}")
        model = keras_mp.apply_mixed_precision(build_model(x.shape[1:]))
        print("\nPer-layer dtypes and Tensor Core alignment:")
        audit = keras_mp.mixed_precision_audit(model, batch_size=128)

        optimizer = keras_mp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-3), dynamic_growth_steps=200
        )
        model.compile(
            optimizer,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        monitor = keras_mp.LossScaleMonitor()
        history = model.fit(
            x,
            y,
            batch_size=128,
            epochs=epochs,
            validation_split=0.1,
            callbacks=[monitor],
            verbose=2,
        )
        _, accuracy = model.evaluate(xt, yt, batch_size=512, verbose=0)
        path = os.path.join(args.output, "model.keras")
        model.save(path)
        reloaded = keras.saving.load_model(path)
        same = np.allclose(
            model.predict(xt[:64], verbose=0),
            reloaded.predict(xt[:64], verbose=0),
            atol=1e-3,
        )

    scales = [scale for _, scale in monitor.scale_history]
    print(f"\nPolicy restored to {keras.mixed_precision.global_policy().name}.")
    print(f"Audit: {audit.summary}")
    print(
        f"Loss scale: {optimizer.initial_scale:g} at the start, "
        f"{optimizer.loss_scale:g} at the end (min {min(scales):g}, max "
        f"{max(scales):g} over {len(scales)} steps); "
        f"{optimizer.skipped_steps} step(s) skipped for non-finite gradients."
    )
    print(f"History keys: {sorted(history.history)}")
    print(f"Test top-1 after {epochs} epoch(s): {100 * accuracy:.2f}%")
    print(f"Saved {path}; reloaded with keras.saving.load_model: {same}")
    return {
        "policy": policy,
        "test_top1": float(accuracy),
        "loss_scale": optimizer.loss_scale,
        "skipped_steps": optimizer.skipped_steps,
        "model_path": path,
    }


if __name__ == "__main__":
    main()
