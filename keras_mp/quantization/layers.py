"""Quantize layers: the activation Q/DQ layer and the one quantize wrapper.

`QuantizeActivation` fake-quantizes a tensor per-tensor with a float32
range variable. `QuantizeWrapper` wraps any layer type in
`config.LAYER_SPECS`: it fake-quantizes the inputs the spec names (one
`QuantizeActivation` each) and each weight per-channel on its output-channel
axis, then runs the wrapped layer with the fake-quantized weights swapped in
through a `keras.StatelessScope`. One wrapper for every type: a new type is
a table row in `config.py`.
"""

import keras
import tensorflow as tf

from keras_mp.quantization.config import (
    ALL_INPUTS,
    NO_INPUTS,
    QuantizeConfig,
    layer_spec,
)
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
            self.collector.update(keras.ops.convert_to_numpy(inputs))
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
        if training and _in_xla_context():
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


def _in_xla_context():
    """True while tracing a function compiled with XLA (`jit_compile`)."""
    try:
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # moved in a later TensorFlow: assume XLA
        return True
    return control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


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


def _kernel_view(kernel, axis):
    """Depthwise kernels (kh, kw, in, mult) have output channel in * mult:
    quantize them as (kh, kw, in * mult) on the last axis."""
    if axis == "depthwise":
        shape = tf.shape(kernel)
        flat = tf.reshape(kernel, tf.concat([shape[:-2], [-1]], 0))
        return flat, -1, lambda q: tf.reshape(q, shape)
    return kernel, axis, lambda q: q


def _num_channels(shape, axis):
    if axis == "depthwise":
        return (int(shape[-2] * shape[-1]),)
    return () if axis is None else (int(shape[axis]),)


@keras.saving.register_keras_serializable(package="keras_mp")
class QuantizeWrapper(keras.layers.Wrapper):
    """Fake-quantizes a layer's inputs and weights the way TensorRT wants.

    Weights: per-channel (or per-tensor) symmetric, narrow range
    [-127, 127], ranges `max|w|` recomputed from the weights at each
    training step and stored, so an export reads constants. Inputs: one
    `QuantizeActivation` per input the layer type's spec names.

    Args:
        layer: `keras.layers.Layer` of a type in `keras_mp.quantization.config.LAYER_SPECS`.
        config: `QuantizeConfig`. Defaults to `QuantizeConfig()`.
        input_indices: list of int. Which inputs get a Q/DQ; defaults to the
            spec (all inputs of weighted layers and Concatenate, none for
            pooling). `quantize_apply` resolves the residual-Add rule here.
        **kwargs: Base layer arguments.

    Raises:
        ValueError: the layer type is not supported.

    Example:

    >>> layer = keras_mp.QuantizeWrapper(keras.layers.Dense(10))
    """

    def __init__(self, layer, config=None, input_indices=None, **kwargs):
        spec = layer_spec(layer)
        if spec is None:
            raise ValueError(
                f"Layer {layer.name!r} of type {type(layer).__name__} cannot "
                "be quantized. Supported types: "
                f"{', '.join(supported_layer_names())}. Leave it out of the "
                "selection or give it `QuantizeConfig(skip=True)`."
            )
        kwargs.setdefault("dtype", layer.dtype_policy)
        kwargs.setdefault("name", f"quant_{layer.name}")
        super().__init__(layer, **kwargs)
        if isinstance(config, dict):
            config = QuantizeConfig.from_config(config)
        self.config = config or QuantizeConfig()
        self.spec = spec
        self.input_indices = input_indices
        self.input_quantizers = []
        self._weights_enabled = True

    def _resolve_indices(self, input_shape):
        placement = self.spec.inputs
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
        if not self.layer.built:
            self.layer.build(input_shape)
        for q in self.input_quantizers:
            q.build(())
        self.weight_ranges = []
        for attr, axis in self.spec.weights:
            kernel = getattr(self.layer, attr)
            axis = axis if self.config.per_channel else None
            amax = self.add_weight(
                name=f"{attr}_amax",
                shape=_num_channels(kernel.shape, axis),
                initializer="zeros",
                dtype="float32",
                trainable=False,
                aggregation="only_first_replica",
            )
            self.weight_ranges.append((attr, axis, amax))
        self.built = True

    def update_weight_ranges(self):
        """Sets each weight range to the weights' per-channel `max|w|`."""
        for attr, axis, amax in self.weight_ranges:
            amax.assign(self._weight_amax(getattr(self.layer, attr), axis))

    def _weight_amax(self, kernel, axis):
        view, view_axis, _ = _kernel_view(kernel, axis)
        if axis is None:
            return tf.reduce_max(tf.abs(tf.cast(view, tf.float32)))
        return channel_amax(view, view_axis)

    @property
    def enabled(self):
        return self._weights_enabled

    @enabled.setter
    def enabled(self, value):
        for q in self.input_quantizers:
            q.enabled = value
        self._weights_enabled = value

    def _quantized_weights(self, training):
        mapping = []
        for attr, axis, amax_var in self.weight_ranges:
            kernel = getattr(self.layer, attr)
            amax = amax_var
            if training:
                amax = self._weight_amax(kernel, axis)
                amax_var.assign(amax)
            view, view_axis, back = _kernel_view(
                tf.convert_to_tensor(kernel), axis
            )
            q = fake_quant(
                view,
                amax,
                axis=view_axis if axis is not None else None,
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
            q.collector is not None for q in self.input_quantizers
        )
        if not self.weight_ranges or not self._weights_enabled or calibrating:
            return self.layer(inputs)
        mapping = self._quantized_weights(training)
        with keras.StatelessScope(state_mapping=mapping):
            return self.layer(inputs)

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            config=self.config.get_config(),
            input_indices=self.input_indices,
        )
        return config


def supported_layer_names():
    from keras_mp.quantization.config import LAYER_SPECS

    return sorted(cls.__name__ for cls in LAYER_SPECS)


def iter_quantize_layers(model):
    """Yields every QuantizeWrapper / QuantizeActivation in `model`, nested
    models included (activation layers inside wrappers are not repeated)."""
    for layer in model.layers:
        if isinstance(layer, (QuantizeWrapper, QuantizeActivation)):
            yield layer
        elif isinstance(layer, keras.Model):
            yield from iter_quantize_layers(layer)


def set_quantization_enabled(model, enabled):
    """Turns every fake-quant in `model` on or off (off: float outputs).

    Resets the model's compiled functions so `predict`/`fit` retrace.
    """
    from keras_mp.mixed_precision.policy import _check_model

    _check_model(model)
    for layer in iter_quantize_layers(model):
        layer.enabled = bool(enabled)
    for name in ("train_function", "test_function", "predict_function"):
        if hasattr(model, name):
            setattr(model, name, None)
