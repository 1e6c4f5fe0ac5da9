"""Load-only classes of files saved before every model was quantized in
place, and `upgrade`, which turns a model loaded from such a file into the
current form.

Until keras_mp 0.1 a Sequential or Functional model was quantized by a
graph copy with each quantized layer in a `QuantizeWrapper` (renamed
`quant_<name>`), and `quantize_annotate_layer` returned a `QuantizeAnnotate`
wrapper. Both stay registered so that those `.keras` files load with
`safe_mode=True` and compute what they did (Keras names weight-file groups
after class and attribute names, so these classes keep theirs); keras_mp
never creates them any more, and its functions ask for `upgrade` first.
Migration notes: `docs/migration.md`.
"""

import keras
import tensorflow as tf

from keras_mp import _models, layer_table
from keras_mp._compat import require_tensorflow
from keras_mp._load_only import LoadOnly
from keras_mp.layer_table import ALL_INPUTS, NO_INPUTS
from keras_mp.quantization.activation import QuantizeActivation, quantizable_row
from keras_mp.quantization.config import QuantizeConfig
from keras_mp.quantization.fake_quant import fake_quant
from keras_mp.quantization.separable import separable_conv
from keras_mp.quantization.tensor_quantizer import (
    _channel_view,
    _num_channels,
    tensor_amax,
    widen_saved_ranges,
)

LEGACY_HINT = (
    "holds layers saved by an earlier keras_mp ({names}): call "
    "`model = keras_mp.upgrade(model)` first (same outputs, the layers' "
    "own names, the current quantized layers)."
)


@keras.saving.register_keras_serializable(package="keras_mp")
class QuantizeAnnotate(LoadOnly, keras.layers.Wrapper):
    """Load-only: the annotation wrapper of earlier keras_mp files.

    Constructing one outside Keras loading raises a `TypeError`:
    `keras_mp.quantize_annotate_layer(layer)` marks a layer.

    Computes exactly like the layer; `keras_mp.upgrade` turns a model
    holding it into a float model whose layers carry the annotation.

    Args:
        layer: the layer to quantize.
        config: `QuantizeConfig` or None.
    """

    REPLACEMENT = (
        "Mark a layer with `keras_mp.quantize_annotate_layer(layer)` (it "
        "returns the layer itself), then `keras_mp.quantize_apply(model)`."
    )

    def __init__(self, layer, config=None, **kwargs):
        kwargs.setdefault("dtype", layer.dtype_policy)
        kwargs.setdefault("name", f"annotate_{layer.name}")
        super().__init__(layer, **kwargs)
        if isinstance(config, dict):
            config = QuantizeConfig.from_config(config)
        self.config = config

    def call(self, inputs, *args, **kwargs):
        return self.layer(inputs, *args, **kwargs)

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def get_config(self):
        config = super().get_config()
        config["config"] = self.config.get_config() if self.config else None
        return config


@keras.saving.register_keras_serializable(package="keras_mp")
class QuantizeWrapper(LoadOnly, keras.layers.Wrapper):
    """Load-only: the quantize wrapper of earlier keras_mp files.

    Models saved before every model was quantized in place hold it (named
    `quant_<name>`); it computes what it did, and `keras_mp.upgrade`
    converts such a model to the current form. What it computes:

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
        TypeError: constructed outside Keras loading (`keras_mp.legacy.
            loading()`): quantize with `keras_mp.quantize_model`.
        ValueError: the layer type is not supported.

    Example:

    >>> with keras_mp.legacy.loading():  # as Keras loading does
    ...     layer = keras_mp.legacy.QuantizeWrapper(keras.layers.Dense(10))
    """

    REPLACEMENT = (
        "Quantize with `keras_mp.quantize_model(model)` (every layer "
        "quantized in place, at any depth)."
    )

    def __init__(
        self,
        layer,
        config=None,
        input_indices=None,
        pointwise_input=None,
        **kwargs,
    ):
        require_tensorflow("keras_mp.QuantizeWrapper")
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
                format=self.config.format,
                learned_range=self.config.learned_range,
                name=f"input_{i}",
                dtype="float32",
            )
            for i in self.input_indices
        ]
        if self.pointwise_input:
            self.inner_quantizers = [
                QuantizeActivation(
                    format=self.config.format,
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
        return tensor_amax(kernel, axes)

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
                format=self.config.format,
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


LEGACY_CLASSES = (QuantizeWrapper, QuantizeAnnotate)


def legacy_layers(model, layers=None):
    """The `QuantizeWrapper` and `QuantizeAnnotate` layers inside `model`
    (among `layers`, its walk, when given)."""
    if layers is None:
        layers = _models.walk_layers(model, include_models=True)
    return [layer for layer in layers if isinstance(layer, LEGACY_CLASSES)]


def check_current(model, caller, layers=None):
    """Raises a ValueError naming `caller` when `model` holds load-only
    layers of an earlier keras_mp (among `layers`, its walk, when
    given)."""
    found = legacy_layers(model, layers)
    if found:
        names = ", ".join(repr(layer.name) for layer in found[:4])
        raise ValueError(
            f"`{caller}`: model {model.name!r} "
            + LEGACY_HINT.format(names=names)
        )
