"""Quantized twins: layers quantized in place, at any depth.

A layer inside a custom layer, a subclassed model, a keras-hub backbone or a
`MultiHeadAttention` has no place in a layer graph that a wrapper could
take. It is quantized where it is instead: its class becomes its quantized
twin, a subclass of its own class (`twin_class`) that owns the
fake-quantizers and overrides `call`; the layer keeps its name, its
variables and every reference to it. The twin classes are never saved:
`QuantizedModel` saves the float model's config and the recipe, and applies
the recipe again on load (`recipe.py`). Guide: `docs/quantization.md`.
"""

import contextlib
import functools
import inspect

import keras

from keras_mp import _keras, _models
from keras_mp.quantization.config import QuantizeConfig
from keras_mp.quantization.layers import (
    QuantizeActivation,
    _channel_view,
    _num_channels,
    weight_amax,
)
from keras_mp.quantization.quantizers import fake_quant
from keras_mp.quantization.separable import separable_conv

# The inputs of a MultiHeadAttention call that feed its projections.
ATTENTION_INPUTS = ("query", "value", "key")
# The inputs of its two matmuls: scaled query and key, softmax output and
# value.
ATTENTION_MATMUL_INPUTS = ("query", "key", "probs", "value")


@keras.saving.register_keras_serializable(package="keras_mp")
class WeightQuantizer(keras.layers.Layer):
    """Fake-quantizes one weight of the layer that owns it.

    Symmetric, narrow range [-127, 127], per output channel (the product of
    `out_axes`) or per tensor. The range `amax` (a float32 variable) is the
    weight's `max|w|`, recomputed at each training step and stored, so an
    export reads constants.

    Args:
        out_axes: tuple of int. The weight's output-channel axes; `()` for
            one range per tensor. Defaults to `()`.
        num_bits: int. Defaults to 8.
        **kwargs: Base layer arguments (`name`).

    Example:

    >>> quantizer = WeightQuantizer(out_axes=(-1,), name="kernel_q")
    >>> quantizer.build(dense.kernel.shape)
    >>> fake_quantized = quantizer(dense.kernel)
    """

    def __init__(self, out_axes=(), num_bits=8, **kwargs):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        QuantizeConfig(num_bits=num_bits)  # validates num_bits
        self.out_axes = tuple(int(a) for a in out_axes)
        self.num_bits = num_bits

    def build(self, kernel_shape):
        self.amax = self.add_weight(
            name="amax",
            shape=_num_channels(kernel_shape, self.out_axes),
            initializer="zeros",
            dtype="float32",
            trainable=False,
            aggregation="only_first_replica",
        )

    def update(self, kernel):
        """Sets the range to `kernel`'s `max|w|`."""
        self.amax.assign(weight_amax(kernel, self.out_axes))

    def call(self, kernel, training=None):
        amax = self.amax
        if training:
            amax = weight_amax(kernel, self.out_axes)
            self.amax.assign(amax)
        view, axis, back = _channel_view(kernel, self.out_axes)
        q = fake_quant(
            view, amax, axis=axis, narrow_range=True, num_bits=self.num_bits
        )
        return back(q)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(out_axes=self.out_axes, num_bits=self.num_bits)
        return config


def _like(quantized, x):
    """`quantized` in `x`'s dtype, with `x`'s Keras mask."""
    if quantized.dtype != x.dtype:
        quantized = keras.ops.cast(quantized, x.dtype)
    _keras.copy_mask(x, quantized)
    return quantized


class QuantizedLayer:
    """What every quantized twin adds to its float class.

    State, set by `attach`: `quantize_config` (`QuantizeConfig`),
    `input_indices` and `input_quantizers` (one `QuantizeActivation` per
    quantized input), `weight_quantizers` (one `WeightQuantizer` per weight
    of the layer's table row), `inner_quantizers` (the pointwise input of a
    separable convolution) and `quantize_path` (the layer's path of names,
    for reports).
    """

    float_class = None  # the class the twin derives from

    @property
    def enabled(self):
        return self._quantize_enabled

    @enabled.setter
    def enabled(self, value):
        for q in self.named_quantizers().values():
            q.enabled = value
        self._quantize_enabled = value

    @property
    def weight_ranges(self):
        """`(attr, out_axes, amax)` per quantized weight, as
        `QuantizeWrapper.weight_ranges`."""
        return [
            (attr, q.out_axes, q.amax)
            for attr, q in zip(self.weight_attrs, self.weight_quantizers)
        ]

    def named_quantizers(self):
        """The activation quantizers by name (`input_0`, ...)."""
        named = {
            f"input_{i}": q
            for i, q in zip(self.input_indices, self.input_quantizers)
        }
        for q in self.inner_quantizers:
            named["pointwise_input"] = q
        return named

    def update_weight_ranges(self):
        """Sets each weight range to the weights' per-channel `max|w|`."""
        for attr, q in zip(self.weight_attrs, self.weight_quantizers):
            q.update(getattr(self, attr))

    def _calibrating(self):
        return any(
            q.collector is not None for q in self.named_quantizers().values()
        )

    def _quantize_inputs(self, args, kwargs):
        if not self.input_quantizers:
            return args, kwargs
        if args:
            x, rest = args[0], args[1:]
        else:
            name = _first_parameter(self.float_class)
            x, rest = kwargs.pop(name), ()
        many = isinstance(x, (list, tuple))
        values = list(x) if many else [x]
        for i, q in zip(self.input_indices, self.input_quantizers):
            values[i] = _like(q(values[i]), values[i])
        x = type(x)(values) if many else values[0]
        return (x,) + tuple(rest), kwargs

    def _weight_mapping(self):
        """`(variable, fake-quantized value)` pairs for a StatelessScope."""
        mapping = []
        for attr, q in zip(self.weight_attrs, self.weight_quantizers):
            variable = getattr(self, attr)
            mapping.append((variable, q(_keras.float_value(variable))))
        return mapping

    def call(self, *args, **kwargs):
        args, kwargs = self._quantize_inputs(args, kwargs)
        pointwise = self.inner_quantizers[0] if self.inner_quantizers else None
        if not self.enabled:  # turned off: the float layer exactly
            pointwise = None
        if (
            not self.weight_quantizers
            or not self.enabled
            or self._calibrating()
        ):
            return self._float_call(args, kwargs, pointwise)
        with keras.StatelessScope(state_mapping=self._weight_mapping()):
            return self._float_call(args, kwargs, pointwise)

    def _float_call(self, args, kwargs, pointwise):
        if pointwise is None:
            return super().call(*args, **kwargs)
        return separable_conv(self, args[0], pointwise)


class QuantizedAttention(QuantizedLayer):
    """The quantized twin of a `keras.layers.MultiHeadAttention` (or of a
    subclass calling `_compute_attention`, as keras-hub's
    `CachedMultiHeadAttention` does).

    Its call inputs are fake-quantized once per distinct tensor before the
    query, key and value projections (`input_names`: which of `query`,
    `value`, `key` own a `QuantizeActivation`; a self-attention call feeds
    one shared Q/DQ to all three), so TensorRT can fuse that one DQ into
    each GEMM. With `quantize_config.attention`, the attention takes the
    einsum path and `attention_quantizers` fake-quantize the scaled query,
    the key, the softmax output and the value.
    """

    def named_quantizers(self):
        named = {
            f"input_{name}": q
            for name, q in zip(self.input_names, self.input_quantizers)
        }
        for name, q in zip(ATTENTION_MATMUL_INPUTS, self.attention_quantizers):
            named[f"attention_{name}"] = q
        return named

    def __call__(self, *args, **kwargs):
        # The inputs' identity, before Keras casts them (a cast makes two
        # tensors of one): which call inputs are one tensor.
        arguments = bind_call(self.float_class, self, args, kwargs)
        self._input_sources = attention_sources(arguments)
        return super().__call__(*args, **kwargs)

    def call(self, *args, **kwargs):
        if not self.input_quantizers:
            return super(QuantizedLayer, self).call(*args, **kwargs)
        arguments = bind_call(self.float_class, self, args, kwargs)
        sources = getattr(self, "_input_sources", None)
        sources = sources or attention_sources(arguments)
        quantized = {}
        for name in ATTENTION_INPUTS:
            if arguments.get(name) is None:
                continue
            source = name if name in self.input_names else sources[name]
            if source not in self.input_names:
                raise ValueError(
                    f"Layer {self.name!r} was quantized with one input Q/DQ "
                    f"for {', '.join(self.input_names)} (as it was called "
                    f"then), but is now called with a `{name}` tensor of "
                    "its own. Quantize the model again from the float "
                    "model, calling the layer as it will be used."
                )
            if source not in quantized:
                q = self.input_quantizers[self.input_names.index(source)]
                quantized[source] = _like(
                    q(arguments[source]), arguments[source]
                )
            arguments[name] = quantized[source]
        return super(QuantizedLayer, self).call(**arguments)

    def _compute_attention(
        self,
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
        use_causal_mask=False,
    ):
        if not self.attention_quantizers or not self.enabled:
            kwargs = {"use_causal_mask": True} if use_causal_mask else {}
            return super()._compute_attention(
                query,
                key,
                value,
                attention_mask,
                training,
                return_attention_scores,
                **kwargs,
            )
        if use_causal_mask:
            causal = _keras.causal_mask(self, query, value)
            attention_mask = (
                causal
                if attention_mask is None
                else keras.ops.logical_and(
                    keras.ops.cast(attention_mask, "bool"), causal
                )
            )
        hooks = {
            name: functools.partial(_quantize_like, q)
            for name, q in zip(
                ATTENTION_MATMUL_INPUTS, self.attention_quantizers
            )
        }
        return _keras.einsum_attention(
            self, query, key, value, attention_mask, training, hooks
        )


def _quantize_like(quantizer, x):
    return _like(quantizer(x), x)


def attention_sources(arguments):
    """For `query`, `value` and `key` of a MultiHeadAttention call: the
    first of them that is the same tensor (`key` defaults to `value`)."""
    query, value, key = (arguments.get(n) for n in ATTENTION_INPUTS)
    sources = {"query": "query"}
    sources["value"] = "query" if value is query else "value"
    if key is None or key is value:
        sources["key"] = sources["value"]
    else:
        sources["key"] = "query" if key is query else "key"
    return sources


def bind_call(cls, layer, args, kwargs):
    bound = _signature(cls).bind(layer, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(arguments)))  # self
    return arguments


@functools.cache
def _signature(cls):
    return inspect.signature(cls.call)


def _first_parameter(cls):
    return list(_signature(cls).parameters)[1]


@functools.cache
def twin_class(cls):
    """The quantized twin of layer class `cls`: a subclass of it and of
    `QuantizedLayer` (`QuantizedAttention` for attention layers)."""
    base = (
        QuantizedAttention
        if issubclass(cls, keras.layers.MultiHeadAttention)
        else QuantizedLayer
    )
    return type(
        f"Quantized{cls.__name__}",
        (base, cls),
        {"float_class": cls, "__module__": __name__},
    )


def is_quantized(layer):
    """Whether `layer` is a quantized twin."""
    return isinstance(layer, QuantizedLayer)


def _activation(config, name):
    q = QuantizeActivation(
        num_bits=config.num_bits,
        learned_range=config.learned_range,
        name=name,
        dtype="float32",
    )
    q.build(())
    return q


def attach(layer, row, config, inputs, path):
    """Turns `layer` into its quantized twin, in place.

    Args:
        layer: a built layer of a quantizable table row.
        row: its `layer_table.LayerRow`.
        config: `QuantizeConfig`.
        inputs: the inputs that get a Q/DQ: indices, or for an attention
            layer the names (`ATTENTION_INPUTS`) that own one.
        path: str. The layer's path of names below the model.
    """
    with _keras.unlocked(layer):
        layer.quantize_config = config
        layer.quantize_path = path
        layer._quantize_enabled = True
        layer.weight_attrs = [w.attr for w in row.weights]
        layer.weight_quantizers = []
        for weight in row.weights:
            axes = weight.out_axes if config.per_channel else ()
            q = WeightQuantizer(
                axes, config.num_bits, name=f"{layer.name}_{weight.attr}_q"
            )
            q.build(getattr(layer, weight.attr).shape)
            layer.weight_quantizers.append(q)
        if row.attention:
            layer.input_names = list(inputs)
            layer.input_indices = []
            layer.input_quantizers = [
                _activation(config, f"{layer.name}_{name}_input")
                for name in inputs
            ]
            layer.attention_quantizers = (
                [
                    _activation(config, f"{layer.name}_attention_{name}")
                    for name in ATTENTION_MATMUL_INPUTS
                ]
                if config.attention
                else []
            )
        else:
            layer.input_indices = [int(i) for i in inputs]
            layer.input_quantizers = [
                _activation(config, f"{layer.name}_input_{i}") for i in inputs
            ]
        layer.inner_quantizers = (
            [_activation(config, f"{layer.name}_pointwise_input")]
            if row.separable
            else []
        )
    object.__setattr__(layer, "__class__", twin_class(type(layer)))
    layer.update_weight_ranges()


def quantized_layers(model):
    """The quantized twins inside `model`, at any depth."""
    return [
        layer for layer in _models.walk_layers(model) if is_quantized(layer)
    ]


def owned_quantizers(model):
    """Ids of the quantizer layers that twins inside `model` own."""
    owned = set()
    for layer in quantized_layers(model):
        owned.update(id(q) for q in layer.named_quantizers().values())
        owned.update(id(q) for q in layer.weight_quantizers)
    return owned


@contextlib.contextmanager
def float_classes(model):
    """Within the block, every twin inside `model` has its float class back,
    so Keras serializes the float model (its config holds no twin)."""
    twins = quantized_layers(model)
    for layer in twins:
        object.__setattr__(layer, "__class__", type(layer).float_class)
    try:
        yield
    finally:
        for layer in twins:
            object.__setattr__(layer, "__class__", twin_class(type(layer)))
