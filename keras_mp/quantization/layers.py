"""Quantize layers: the activation Q/DQ layer and the one quantize wrapper.

`QuantizeActivation` fake-quantizes one tensor per-tensor; `QuantizeWrapper`
wraps any quantizable type of `keras_mp.layer_table`. Guide:
`docs/quantization.md`.
"""

import math
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_mp import _keras, layer_table
from keras_mp.quantization.config import QuantizeConfig
from keras_mp.quantization.quantizers import (
    channel_amax,
    fake_quant,
    fake_quant_learned,
)


@keras.saving.register_keras_serializable(package="keras_mp")
class QuantizeActivation(keras.layers.Layer):
    """Per-tensor symmetric fake quantization of an activation (Q/DQ).

    The range `amax` is a float32 variable: set by `keras_mp.calibrate`, or,
    if still 0 at the first training step, by that batch's `max|x|` (over
    the global batch under a `tf.distribute` strategy; a batch holding NaN
    or Inf is passed over, as the loss scale optimizer skips its step). It
    stays frozen afterwards unless `learned_range=True` (PACT-style
    gradient). Full INT8 range [-128, 127], as ONNX QuantizeLinear.

    Args:
        num_bits: int. Defaults to 8.
        learned_range: bool. Train `amax`. Defaults to False.
        **kwargs: Base layer arguments (`name`, `dtype`).

    Example:

    >>> qdq = keras_mp.QuantizeActivation(name="skip_qdq")
    >>> y = keras.layers.Add()([conv_out, qdq(skip)])
    """

    def __init__(self, num_bits=8, learned_range=False, **kwargs):
        super().__init__(**kwargs)
        QuantizeConfig(num_bits=num_bits)  # validates num_bits
        self.num_bits = num_bits
        self.learned_range = learned_range
        self.enabled = True
        self.collector = None  # set by keras_mp.calibrate
        self.supports_masking = True  # a Q/DQ keeps its input's mask

    def build(self, input_shape):
        self.amax = self.add_weight(
            name="amax",
            shape=(),
            initializer="zeros",
            dtype="float32",
            trainable=self.learned_range,
            aggregation="only_first_replica",
        )

    def call(self, inputs, training=None):
        if self.collector is not None:
            self.collector.collect(keras.ops.convert_to_numpy(inputs))
            return inputs
        if not self.enabled:
            return inputs
        amax = self.amax
        if training and not self.learned_range:
            # First training step without calibration: start from the batch.
            amax = _first_batch_range(self.amax, inputs)
            self.amax.assign(amax)
        if self.learned_range:
            out = fake_quant_learned(inputs, amax, num_bits=self.num_bits)
        else:
            out = fake_quant(inputs, amax, num_bits=self.num_bits)
        if training and _keras.in_xla_context():
            # Under XLA the fake-quant op turns NaN into a finite code, so a
            # non-finite batch would reach the loss looking finite and the
            # loss-scale optimizer would not skip it (without XLA the op
            # keeps NaN itself). Training only: the exported graph keeps
            # plain Q/DQ; XLA fuses this select into the fake-quant loop.
            out = tf.where(tf.math.is_finite(inputs), out, inputs)
        return out

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(num_bits=self.num_bits, learned_range=self.learned_range)
        return config


def _first_batch_range(amax, inputs):
    """`amax` when calibrated, else `max|x|` of the global batch.

    The reductions over the batch run only while `amax` is 0 (a `tf.cond`:
    a calibrated model pays nothing for them). Under a strategy the
    all-gather of the per-replica maxima stays outside the cond, as
    collectives must, on a scalar.
    """
    amax = tf.convert_to_tensor(amax)
    calibrated = amax > 0
    local = tf.cond(
        calibrated, lambda: tf.zeros((), tf.float32), lambda: _batch_max(inputs)
    )
    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        gathered = context.all_gather(tf.reshape(local, [1]), axis=0)
        local = tf.reduce_max(gathered)
    local = tf.where(tf.math.is_finite(local), local, 0.0)
    return tf.where(calibrated, amax, local)


def _batch_max(inputs):
    """`max|x|` of this replica's batch; +inf if it holds a non-finite value
    (+inf wins the max over replicas, and marks the batch as skipped)."""
    x = tf.abs(tf.cast(inputs, tf.float32))
    finite = tf.reduce_all(tf.math.is_finite(x))
    return tf.where(finite, tf.reduce_max(x), float("inf"))


def quantizable_row(layer):
    """The `layer_table.LayerRow` of `layer` if it can be wrapped, else
    None."""
    row = layer_table.row_for(layer)
    return row if row is not None and row.quantizable else None


def _channel_view(kernel, out_axes):
    """`(view, axis, back)`: `kernel` with its output-channel axes merged
    into the one axis `axis` of `view`, channel index row-major over
    `out_axes` in their order, and `back` to restore the shape. Adjacent
    axes in kernel order merge in place (a depthwise `(kh, kw, in, mult)`
    becomes `(kh, kw, in * mult)`); others (an EinsumDense kernel
    `(heads, hidden, head_dim)` whose output is `(..., heads, head_dim)`)
    are moved last first. `axis` is None for per-tensor (`out_axes ==
    ()`)."""
    if not out_axes:
        return kernel, None, lambda q: q
    rank = len(kernel.shape)
    axes = [a % rank for a in out_axes]
    if len(axes) == 1:
        return kernel, axes[0], lambda q: q
    shape = tf.shape(kernel)
    if axes == list(range(axes[0], axes[-1] + 1)):
        merged = tf.concat([shape[: axes[0]], [-1], shape[axes[-1] + 1 :]], 0)
        return (
            tf.reshape(kernel, merged),
            axes[0],
            lambda q: tf.reshape(q, shape),
        )
    perm = [a for a in range(rank) if a not in axes] + axes
    moved = tf.transpose(kernel, perm)
    rest = rank - len(axes)
    view = tf.reshape(moved, tf.concat([tf.shape(moved)[:rest], [-1]], 0))
    inverse = [perm.index(a) for a in range(rank)]
    return (
        view,
        rest,
        lambda q: tf.transpose(tf.reshape(q, tf.shape(moved)), inverse),
    )


def _num_channels(shape, out_axes):
    if not out_axes:
        return ()
    return (math.prod(int(shape[a]) for a in out_axes),)


def weight_amax(kernel, out_axes):
    """`max|w|` of `kernel` per output channel (over `out_axes`, merged), or
    over the whole tensor when `out_axes` is `()` (float32)."""
    view, axis, _ = _channel_view(kernel, out_axes)
    if axis is None:
        return tf.reduce_max(tf.abs(tf.cast(view, tf.float32)))
    return channel_amax(view, axis)


def widen_saved_ranges(layer, store):
    """`layer`'s own variables from a Keras weights `store`, as a dict, with
    a per-tensor weight range saved for a weight that is now per-channel
    repeated over its channels.

    Files written before EinsumDense kernels with several output axes
    (attention Q/K/V projections) were quantized per channel hold one range
    for them. Repeating it keeps the loaded model computing exactly what it
    computed when saved; the next training step, or `keras_mp.calibrate`,
    sets the per-channel ranges.

    Args:
        layer: the layer loading its own variables.
        store: the weights store Keras passes to `load_own_variables`.

    Returns:
        dict, the store's values by key.
    """
    values = {key: store[key] for key in store.keys()}
    for i, variable in enumerate(_keras.own_variables(layer)):
        value = values.get(f"{i}")
        if value is None or len(variable.shape) != 1:
            continue
        if np.shape(value) in ((), (1,)) and variable.shape[0] != 1:
            values[f"{i}"] = np.full(
                variable.shape, np.reshape(value, ()), np.float32
            )
            warnings.warn(
                f"Layer {layer.name!r}: the file holds one per-tensor weight "
                f"range for {variable.path!r}, saved before keras_mp "
                "quantized such weights per output channel; it is used for "
                f"each of the {variable.shape[0]} channels, "
                "so the model computes what it did when saved. Run "
                "`keras_mp.calibrate` (or train) to set per-channel ranges, "
                "then save again.",
                stacklevel=2,
            )
    return values
