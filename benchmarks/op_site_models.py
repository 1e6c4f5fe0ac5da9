"""Layers that do their GEMMs in their own code, for op-level quantization
(`keras_mp/quantization/op_sites.py`): a hand-written attention, a layer
calling `ops.dot_product_attention`, a mixture of experts, a DLRM-style
dot interaction. Shared by `bench_op_sites.py` and
`tests/quantization/test_op_sites.py`."""

import keras
import numpy as np
from keras import ops


@keras.saving.register_keras_serializable(package="keras_mp_bench")
class HandAttention(keras.layers.Layer):
    def __init__(self, dim=32, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim

    def build(self, shape):
        d = shape[-1]
        for name in ("wq", "wk", "wv"):
            setattr(self, name, self.add_weight(shape=(d, self.dim), name=name))
        self.wo = self.add_weight(shape=(self.dim, d), name="wo")

    def call(self, x):
        q, k, v = (ops.matmul(x, w) for w in (self.wq, self.wk, self.wv))
        scores = q @ ops.transpose(k, (0, 2, 1))  # the `@` operator too
        probs = ops.softmax(scores / np.sqrt(self.dim), axis=-1)
        return ops.matmul(ops.matmul(probs, v), self.wo)

    def get_config(self):
        return {**super().get_config(), "dim": self.dim}


@keras.saving.register_keras_serializable(package="keras_mp_bench")
class FusedAttention(keras.layers.Layer):
    def __init__(self, heads=2, head_dim=16, **kwargs):
        super().__init__(**kwargs)
        self.heads = heads
        self.head_dim = head_dim

    def build(self, shape):
        d = shape[-1]
        self.qkv = self.add_weight(
            shape=(d, 3, self.heads, self.head_dim), name="qkv"
        )
        self.out = self.add_weight(
            shape=(self.heads, self.head_dim, d), name="out"
        )

    def call(self, x):
        qkv = ops.einsum("btd,dkhe->kbthe", x, self.qkv)
        o = ops.dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return ops.einsum("bthe,hed->btd", o, self.out)

    def get_config(self):
        config = super().get_config()
        return {**config, "heads": self.heads, "head_dim": self.head_dim}


@keras.saving.register_keras_serializable(package="keras_mp_bench")
class Experts(keras.layers.Layer):
    def __init__(self, experts=4, hidden=32, **kwargs):
        super().__init__(**kwargs)
        self.experts = experts
        self.hidden = hidden

    def build(self, shape):
        d = shape[-1]
        self.router = keras.layers.Dense(self.experts, name="router")
        self.router.build(shape)
        e, f = self.experts, self.hidden
        self.w1 = self.add_weight(shape=(e, d, f), name="w1")
        self.w2 = self.add_weight(shape=(e, f, d), name="w2")

    def call(self, x):
        gate = ops.softmax(self.router(x), axis=-1)
        h = ops.relu(ops.einsum("btd,edf->btef", x, self.w1))
        y = ops.einsum("btef,efd->bted", h, self.w2)
        return ops.einsum("bted,bte->btd", y, gate)

    def get_config(self):
        config = super().get_config()
        return {**config, "experts": self.experts, "hidden": self.hidden}


LAYERS = {
    "hand": HandAttention,
    "fused": FusedAttention,
    "experts": Experts,
}


def layer_model(kind):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 32))
    x = LAYERS[kind](name=kind)(inputs)
    x = keras.layers.LayerNormalization()(x + inputs)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(4)(x))


def sequences(n=16):
    return np.random.default_rng(0).normal(size=(n, 8, 32)).astype("float32")


@keras.saving.register_keras_serializable(package="keras_mp_bench")
class DotInteraction(keras.layers.Layer):
    """DLRM's feature interaction (as keras-rs' `DotInteraction`): the
    pairwise dot products of the feature embeddings, upper triangle."""

    def call(self, features):
        x = ops.stack(features, axis=1)  # (batch, features, dim)
        scores = ops.matmul(x, ops.transpose(x, (0, 2, 1)))
        n = len(features)
        rows, cols = np.triu_indices(n, 1)
        flat = ops.reshape(scores, (-1, n * n))
        return ops.take(flat, rows * n + cols, axis=1)

    def compute_output_shape(self, shapes):
        n = len(shapes)
        return (shapes[0][0], n * (n - 1) // 2)


def dlrm(features=4, dim=32):
    """A small DLRM: per-feature Dense towers, the dot interaction,
    concatenated with the dense features, a top MLP."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((features, 16))
    towers = [
        keras.layers.Dense(dim, activation="relu", name=f"bottom_{i}")(
            inputs[:, i]
        )
        for i in range(features)
    ]
    x = DotInteraction(name="interaction")(towers)
    x = keras.layers.Concatenate()([x, towers[0]])
    x = keras.layers.Dense(32, activation="relu", name="top")(x)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(x))


def dlrm_data(n=16):
    return np.random.default_rng(0).normal(size=(n, 4, 16)).astype("float32")
