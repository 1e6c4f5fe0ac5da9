"""The reference CNN used by the demo, the benchmarks and the examples.

It holds every pattern the TensorRT placement rules care about: conv + BN +
ReLU, a residual Add, a depthwise-separable block, pooling and a Dense head.
Channel counts are multiples of 8 (Tensor Core alignment) and of 4 (2:4
sparsity).
"""

import keras
from keras import layers

from keras_mp.datasets import shuffled_batches

# Calibration QAT starts from: percentile 99.99, not the best PTQ
# calibrator (benchmarks/bench_quantization.py, docs/quantization.md).
QAT_CALIBRATOR = "percentile"


def reference_cnn(input_shape=(28, 28, 1), num_classes=10, width=32):
    """Builds the reference CNN (Functional, about 30k parameters at width 32).

    Args:
        input_shape: tuple. Image shape, channels last. Defaults to
            `(28, 28, 1)` (Fashion-MNIST).
        num_classes: int. Number of output logits. Defaults to 10.
        width: int. Channels of the first block; must be a multiple of 8
            (Tensor Core alignment). At width 8 the residual convs have 8
            input channels, which `StructuredSparsity(skip_unaligned=True)`
            leaves dense (it wants 16); from width 16 every conv but the
            stem and the depthwise one is 2:4-eligible under that rule.
            Defaults to 32.

    Returns:
        An uncompiled `keras.Model` that outputs logits (float32).
    """
    if width < 8 or width % 8:
        raise ValueError(
            f"`width` must be a positive multiple of 8. Received: width={width}"
        )
    inputs = keras.Input(input_shape, name="image")
    x = layers.Conv2D(width, 3, padding="same", use_bias=False, name="stem")(
        inputs
    )
    x = layers.BatchNormalization(momentum=0.9, name="stem_bn")(x)
    x = layers.ReLU(name="stem_relu")(x)
    # Residual block: conv-BN-ReLU-conv-BN + skip.
    y = layers.Conv2D(width, 3, padding="same", use_bias=False, name="res_a")(x)
    y = layers.BatchNormalization(momentum=0.9, name="res_a_bn")(y)
    y = layers.ReLU(name="res_a_relu")(y)
    y = layers.Conv2D(width, 3, padding="same", use_bias=False, name="res_b")(y)
    y = layers.BatchNormalization(momentum=0.9, name="res_b_bn")(y)
    x = layers.Add(name="res_add")([x, y])
    x = layers.ReLU(name="res_relu")(x)
    x = layers.MaxPooling2D(name="pool1")(x)
    # Depthwise-separable block.
    x = layers.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw")(x)
    x = layers.BatchNormalization(momentum=0.9, name="dw_bn")(x)
    x = layers.ReLU(name="dw_relu")(x)
    x = layers.Conv2D(2 * width, 1, use_bias=False, name="pw")(x)
    x = layers.BatchNormalization(momentum=0.9, name="pw_bn")(x)
    x = layers.ReLU(name="pw_relu")(x)
    x = layers.MaxPooling2D(name="pool2")(x)
    x = layers.Conv2D(2 * width, 3, padding="same", name="conv3")(x)
    x = layers.ReLU(name="conv3_relu")(x)
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    x = layers.Dense(2 * width, activation="relu", name="fc")(x)
    outputs = layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name="reference_cnn")


def compile_classifier(model, learning_rate=1e-3, optimizer=None, **kwargs):
    """Compiles `model` for integer labels and logits, with accuracy."""
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **kwargs,
    )
    return model


def cosine_adam(steps, learning_rate=1e-4):
    """Adam with the learning rate cosine-decayed to 0 over `steps`.

    The schedule of the demo's and the benchmarks' fine-tunes: QAT and the
    float control it is compared with (rate 1e-4, about 10% of the
    original epochs); `bench_sparsity.py` also trains and retrains with it
    at the original rate.

    Args:
        steps: int. Training steps of the whole run.
        learning_rate: float. Initial learning rate. Defaults to 1e-4.

    Returns:
        A `keras.optimizers.Adam`.
    """
    schedule = keras.optimizers.schedules.CosineDecay(learning_rate, steps)
    return keras.optimizers.Adam(schedule)


def fine_tune(
    model,
    x,
    y,
    epochs,
    learning_rate=1e-4,
    callbacks=(),
    seed=0,
    batch_size=128,
    verbose="auto",
):
    """Compiles `model` with `cosine_adam` and fits it on shuffled batches.

    The one training loop of the demo and `bench_sparsity.py`: the
    learning rate decays to 0 over the run, so every figure is taken at a
    low rate; `shuffled_batches` drops the ragged last batch, so `fit`
    traces one batch shape.

    Args:
        model: a `keras.Model` (compiled here, with a fresh optimizer).
        x: array. Training inputs.
        y: array. Integer labels.
        epochs: int. Epochs of the run.
        learning_rate: float. Initial learning rate. Defaults to 1e-4.
        callbacks: callbacks for `fit`. Defaults to none.
        seed: int. Batch order; also seeds Keras (`set_random_seed`).
            Defaults to 0.
        batch_size: int. Defaults to 128.
        verbose: passed to `fit`. Defaults to `"auto"`.

    Returns:
        `model`, trained.
    """
    keras.utils.set_random_seed(seed)
    steps = epochs * max(1, len(x) // batch_size)
    compile_classifier(model, optimizer=cosine_adam(steps, learning_rate))
    model.fit(
        shuffled_batches(x, y, batch_size, seed),
        epochs=epochs,
        callbacks=list(callbacks),
        verbose=verbose,
    )
    return model
