"""Shared models and checks for the sparsity tests."""

import keras
import numpy as np

from keras_mp.sparsity import is_2_4_sparse, sparse_layers

L = keras.layers


def sparse_model(input_shape=(8, 8, 4), extra=None):
    layers = [
        keras.Input(input_shape),
        L.Conv2D(8, 3, padding="same", name="conv_a"),
        L.BatchNormalization(),
        L.ReLU(),
        L.SeparableConv2D(8, 3, padding="same", name="sep"),
        L.Conv2DTranspose(8, 3, strides=2, padding="same", name="deconv"),
        L.DepthwiseConv2D(3, name="dw"),
        L.GlobalAveragePooling2D(),
        L.Dense(16, activation="relu", name="fc"),
        L.Dense(4, name="head"),
    ]
    return keras.Sequential(layers + (extra or []))


def data(n=64, shape=(8, 8, 4), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n,) + shape).astype("float32")
    return x, rng.integers(0, 4, n)


def compile_model(model, **kwargs):
    model.compile(
        keras.optimizers.Adam(1e-2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **kwargs,
    )
    return model


def layer_masks(model):
    return {
        layer.name: (
            keras.ops.convert_to_numpy(c.mask),
            keras.ops.convert_to_numpy(k),
            c.axis,
        )
        for layer, k, c in sparse_layers(model)
    }


def assert_sparse(model, names=("conv_a", "sep", "deconv", "fc", "head")):
    found = layer_masks(model)
    assert sorted(found) == sorted(names)
    for name, (mask, kernel, axis) in found.items():
        assert is_2_4_sparse(mask, axis), name
        assert np.all(kernel[mask == 0] == 0), name
        assert np.count_nonzero(kernel) > 0.4 * kernel.size, name
