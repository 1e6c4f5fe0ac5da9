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

from keras_mp import _keras, _models, layer_table
from keras_mp.layer_table import ALL_INPUTS, NO_INPUTS
from keras_mp.quantization.config import QuantizeConfig
from keras_mp.quantization.quantizers import (
    channel_amax,
    fake_quant,
    fake_quant_learned,
)
from keras_mp.quantization.separable import separable_conv


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


@keras.saving.register_keras_serializable(package="keras_mp")
class QuantizeWrapper(keras.layers.Wrapper):
    """Fake-quantizes a layer's inputs and weights the way TensorRT wants.

    Weights: per-channel (or per-tensor) symmetric, narrow range
    [-127, 127], over the weight's output-channel axes (their product for
    a depthwise kernel or an attention projection `(hidden, heads,
    head_dim)`), ranges `max|w|` recomputed from the weights at each
    training step and stored, so an export reads constants. Inputs: one
    `QuantizeActivation` per input the layer type's table row names. The
    wrapped layer runs with the fake-quantized weights swapped in through a
    `keras.StatelessScope`.

    Args:
        layer: `keras.layers.Layer` of a quantizable type of
            `keras_mp.layer_table` (`layer_table.quantizable_names()`).
        config: `QuantizeConfig`. Defaults to `QuantizeConfig()`.
        input_indices: list of int. Which inputs get a Q/DQ; defaults to the
            table row (all inputs of weighted layers, none for pooling and
            Concatenate). `quantize_apply` resolves the residual-Add rule here.
        pointwise_input: bool or None. For a separable convolution, a Q/DQ
            on the pointwise input (the depthwise output); None follows the
            table row. Files saved before it existed load without it.
        **kwargs: Base layer arguments.

    Raises:
        ValueError: the layer type is not supported.

    Example:

    >>> layer = keras_mp.QuantizeWrapper(keras.layers.Dense(10))
    """

    def __init__(
        self,
        layer,
        config=None,
        input_indices=None,
        pointwise_input=None,
        **kwargs,
    ):
        row = quantizable_row(layer)
        if row is None:
            supported = ", ".join(layer_table.quantizable_names())
            raise ValueError(
                f"Layer {layer.name!r} of type {type(layer).__name__} cannot "
                f"be quantized. Supported types: {supported}. Leave it out "
                "of the selection or give it `QuantizeConfig(skip=True)`."
            )
        if row.attention:
            raise ValueError(
                f"Layer {layer.name!r} of type {type(layer).__name__} keeps "
                "its weights in sublayers, which a wrapper cannot reach. "
                "Quantize the model that holds it with "
                "keras_mp.quantize_model(model), which quantizes it in place."
            )
        kwargs.setdefault("dtype", layer.dtype_policy)
        kwargs.setdefault("name", f"quant_{layer.name}")
        super().__init__(layer, **kwargs)
        if isinstance(config, dict):
            config = QuantizeConfig.from_config(config)
        self.config = config or QuantizeConfig()
        self.row = row
        self.input_indices = input_indices
        self.pointwise_input = (
            row.separable if pointwise_input is None else bool(pointwise_input)
        )
        self.input_quantizers = []
        self.inner_quantizers = []
        self._weights_enabled = True

    def _resolve_indices(self, input_shape):
        placement = self.row.inputs
        if self.config.quantize_inputs is not None:
            placement = ALL_INPUTS if self.config.quantize_inputs else NO_INPUTS
        if placement != ALL_INPUTS:
            return []  # the residual-Add rule needs the graph: quantize_apply
        multi = bool(input_shape) and isinstance(input_shape[0], (list, tuple))
        return list(range(len(input_shape))) if multi else [0]

    def build(self, input_shape):
        if self.input_indices is None:
            self.input_indices = self._resolve_indices(input_shape)
        self.input_indices = [int(i) for i in self.input_indices]
        self.input_quantizers = [
            QuantizeActivation(
                num_bits=self.config.num_bits,
                learned_range=self.config.learned_range,
                name=f"input_{i}",
                dtype="float32",
            )
            for i in self.input_indices
        ]
        if self.pointwise_input:
            self.inner_quantizers = [
                QuantizeActivation(
                    num_bits=self.config.num_bits,
                    learned_range=self.config.learned_range,
                    name="pointwise_input",
                    dtype="float32",
                )
            ]
        if not self.layer.built:
            self.layer.build(input_shape)
        for q in self.input_quantizers + self.inner_quantizers:
            q.build(())
        self.weight_ranges = []
        for weight in self.row.weights:
            kernel = getattr(self.layer, weight.attr)
            axes = weight.out_axes if self.config.per_channel else ()
            amax = self.add_weight(
                name=f"{weight.attr}_amax",
                shape=_num_channels(kernel.shape, axes),
                initializer="zeros",
                dtype="float32",
                trainable=False,
                aggregation="only_first_replica",
            )
            self.weight_ranges.append((weight.attr, axes, amax))
        self.built = True

    def load_own_variables(self, store):
        super().load_own_variables(widen_saved_ranges(self, store))

    def update_weight_ranges(self):
        """Sets each weight range to the weights' per-channel `max|w|`."""
        for attr, axes, amax in self.weight_ranges:
            amax.assign(self._weight_amax(getattr(self.layer, attr), axes))

    def _weight_amax(self, kernel, axes):
        return weight_amax(kernel, axes)

    @property
    def enabled(self):
        return self._weights_enabled

    @enabled.setter
    def enabled(self, value):
        for q in self.input_quantizers + self.inner_quantizers:
            q.enabled = value
        self._weights_enabled = value

    def _quantized_weights(self, training):
        mapping = []
        for attr, axes, amax_var in self.weight_ranges:
            kernel = getattr(self.layer, attr)
            amax = amax_var
            if training:
                amax = self._weight_amax(kernel, axes)
                amax_var.assign(amax)
            view, axis, back = _channel_view(tf.convert_to_tensor(kernel), axes)
            q = fake_quant(
                view,
                amax,
                axis=axis,
                narrow_range=True,
                num_bits=self.config.num_bits,
            )
            mapping.append((kernel, back(q)))
        return mapping

    def call(self, inputs, training=None):
        if self.input_quantizers:
            many = isinstance(inputs, (list, tuple))
            values = list(inputs) if many else [inputs]
            for i, q in zip(self.input_indices, self.input_quantizers):
                values[i] = q(values[i], training=training)
            inputs = values if many else values[0]
        calibrating = any(
            q.collector is not None
            for q in self.input_quantizers + self.inner_quantizers
        )
        if not self.weight_ranges or not self._weights_enabled or calibrating:
            return self._layer_call(inputs, training)
        mapping = self._quantized_weights(training)
        with keras.StatelessScope(state_mapping=mapping):
            return self._layer_call(inputs, training)

    def _layer_call(self, inputs, training):
        if not self.inner_quantizers or not self._weights_enabled:
            return self.layer(inputs)  # turned off: the float layer exactly
        (q,) = self.inner_quantizers
        return separable_conv(
            self.layer, inputs, lambda x: q(x, training=training)
        )

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            config=self.config.get_config(),
            input_indices=self.input_indices,
            pointwise_input=self.pointwise_input,
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # Saved before the pointwise Q/DQ existed: its weights lack it.
        config = {"pointwise_input": False, **config}
        return super().from_config(config, custom_objects)


def iter_quantize_layers(model):
    """Yields every QuantizeWrapper, stand-alone QuantizeActivation and
    quantized twin (`twins.py`) in `model`, at any depth; the activation
    quantizers inside wrappers and twins are not repeated."""
    from keras_mp.quantization import twins  # imports this module

    owned = twins.owned_quantizers(model)
    stop = (QuantizeWrapper, QuantizeActivation)
    for layer in _models.walk_layers(model, stop_at=stop):
        if twins.is_quantized(layer) or (
            isinstance(layer, stop) and id(layer) not in owned
        ):
            yield layer


def set_quantization_enabled(model, enabled):
    """Turns every fake-quant in `model` on or off (off: float outputs).

    Resets the model's compiled functions so `predict`/`fit` retrace.

    Args:
        model: `keras.Model`, quantized (e.g. by `keras_mp.quantize_model`).
        enabled: bool. False runs the float model.

    Raises:
        TypeError: `model` is not a Keras 3 model.

    Example:

    >>> keras_mp.set_quantization_enabled(qmodel, False)  # float outputs
    """
    _models.check_model(model, "set_quantization_enabled")
    for layer in iter_quantize_layers(model):
        layer.enabled = bool(enabled)
    _models.reset_compiled_functions(model)
