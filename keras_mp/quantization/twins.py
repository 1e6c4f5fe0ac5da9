"""Quantized twins: layers quantized in place, at any depth.

A layer inside a custom layer, a subclassed model, a keras-hub backbone or a
`MultiHeadAttention` has no place in a layer graph that a wrapper could
take. It is quantized where it is instead: its class becomes its quantized
twin, a subclass of its own class (`recipe.twin_class`) that owns the
fake-quantizers and overrides `call`; the layer keeps its name, its
variables and every reference to it. The twin classes are never saved:
`keras_mp.RecordedModel` saves the float model's config and a record of
them, and applies it again on load (`recipe.py`). The attention twin is in
`attention.py`. Guide: `docs/quantization.md`.
"""

import dataclasses
import functools
import inspect

import keras

from keras_mp import _keras, _models, _record
from keras_mp._switch import Switch
from keras_mp.quantization import op_sites, packed, pre_scale
from keras_mp.quantization.legacy import check_current
from keras_mp.quantization.separable import separable_conv
from keras_mp.quantization.tensor_quantizer import TensorQuantizer


@keras.saving.register_keras_serializable(package="keras_mp")
class WeightQuantizer(TensorQuantizer):
    """Fake-quantizes one weight of the layer that owns it.

    A `TensorQuantizer` with a weight's defaults: narrow range (int8:
    `[-127, 127]`), per output channel (the product of `out_axes`) or per
    tensor, float32, and a range that is the weight's `max|w|`, recomputed
    at each training step and stored, so an export reads constants.

    Args:
        out_axes: tuple of int. The weight's output-channel axes; `()` for
            one range per tensor. Defaults to `()`.
        num_bits: int or None. Deprecated: pass `format` (`"int8"` by
            default). Defaults to None.
        **kwargs: `TensorQuantizer` arguments (`format`) and base layer
            arguments (`name`).

    Example:

    >>> quantizer = WeightQuantizer(out_axes=(-1,), name="kernel_q")
    >>> quantizer.build(dense.kernel.shape)
    >>> fake_quantized = quantizer(dense.kernel)
    """

    def __init__(self, out_axes=(), num_bits=None, **kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("narrow_range", True)
        kwargs.setdefault("track_range", True)
        super().__init__(out_axes=out_axes, num_bits=num_bits, **kwargs)


def _like(quantized, x):
    """`quantized` in `x`'s dtype, with `x`'s Keras mask."""
    if quantized.dtype != x.dtype:
        quantized = keras.ops.cast(quantized, x.dtype)
    _keras.copy_mask(x, quantized)
    return quantized


_PROBE = Switch()
# The twin whose probed `__call__` is running: its `call` is not probed a
# second time.
_PROBED = Switch()


def probing(probe):
    """While active, each call of a quantized twin runs `probe(layer, run,
    args, kwargs)` instead, `run()` being the twin's own call on those
    arguments (under its current `enabled` state):
    `keras_mp.layer_sensitivity` computes a layer's output with and
    without its quantizers there."""
    return _PROBE.set(probe)


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

    def __call__(self, *args, **kwargs):
        probe = _PROBE.value
        parent = super()
        if probe is None:
            return parent.__call__(*args, **kwargs)

        def run():
            with _PROBED.set(self):
                return parent.__call__(*args, **kwargs)

        return probe(self, run, args, kwargs)

    @property
    def enabled(self):
        return self._quantize_enabled

    @enabled.setter
    def enabled(self, value):
        for q in self.owned_quantizers():
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

    def owned_quantizers(self):
        """Every quantizer this layer owns (inputs, weights, attention
        matmuls, pointwise input, op sites)."""
        return [
            *self.input_quantizers,
            *self.weight_quantizers,
            *self.inner_quantizers,
            *getattr(self, "attention_quantizers", []),
            *getattr(self, "op_quantizers", []),
        ]

    def named_quantizers(self):
        """The activation quantizers by name (`input_0`, ...; an op site's
        `<op>_<ordinal>/<operand>`)."""
        named = {
            f"input_{i}": q
            for i, q in zip(self.input_indices, self.input_quantizers)
        }
        for q in self.inner_quantizers:
            named["pointwise_input"] = q
        named.update(
            (key, q) for key, q, weight in self.site_quantizers() if not weight
        )
        return named

    def site_quantizers(self):
        """`(key, quantizer, is_weight)` of each op-site quantizer, once
        (a quantizer shared by two operands under its first key)."""
        found, seen = [], set()
        sites = getattr(self, "op_sites", ())
        by_site = getattr(self, "op_quantizers_by_site", {})
        for k, quantizers in sorted(by_site.items()):
            for i, q in quantizers.items():
                if id(q) in seen:
                    continue
                seen.add(id(q))
                index = 3 if i == "probs" else i
                role = "probs" if i == "probs" else None
                role = role or sites[k]["operands"][i]["role"]
                key = op_sites.site_key(sites[k], k, index)
                found.append((key, q, role == "weight"))
        return found

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
            name = first_parameter(self.float_class)
            x, rest = kwargs.pop(name), ()
        many = isinstance(x, (list, tuple))
        values = list(x) if many else [x]
        if self._shares_input_range():
            self._quantize_with_one_range(values)
        else:
            for i, q in zip(self.input_indices, self.input_quantizers):
                values[i] = _like(q(values[i]), values[i])
        x = type(x)(values) if many else values[0]
        return (x,) + tuple(rest), kwargs

    def _shares_input_range(self):
        return (
            getattr(self, "shared_input_range", False)
            and len(self.input_quantizers) > 1
            and self.enabled
            and not self._calibrating()
            and all(q.enabled for q in self.input_quantizers)
        )

    def _quantize_with_one_range(self, values):
        """Quantizes the inputs of a Concatenate with one range, the largest
        of their quantizers' (each set first from its input in training),
        and stores it in each: TensorRT moves the inputs' DQs past a Concat
        only when their scales are equal (`placement.qdq_role`)."""
        training = _keras.call_training()
        pairs = list(zip(self.input_indices, self.input_quantizers))
        inputs = {i: keras.ops.cast(values[i], "float32") for i, _ in pairs}
        ranges = [q.observe(inputs[i], training) for i, q in pairs]
        amax = functools.reduce(keras.ops.maximum, ranges)
        for i, q in pairs:
            if training:
                q.amax.assign(amax)
            values[i] = _like(
                q.quantize_with(inputs[i], amax, training), values[i]
            )

    def tie_input_ranges(self):
        """Sets every input range of a layer whose inputs share one range
        to the largest of them (after calibration)."""
        if getattr(self, "shared_input_range", False):
            ranges = [q.amax for q in self.input_quantizers]
            amax = max(float(keras.ops.convert_to_numpy(a)) for a in ranges)
            for a in ranges:
                a.assign(amax)

    def _weight_mapping(self):
        """`(variable, fake-quantized value)` pairs for a StatelessScope."""
        mapping = []
        for attr, q in zip(self.weight_attrs, self.weight_quantizers):
            variable = getattr(self, attr)
            mapping.append((variable, q(_keras.float_value(variable))))
        return mapping

    def call(self, *args, **kwargs):
        probe = _PROBE.value
        if probe is not None and _PROBED.value is not self:
            # reached through `call`, not `__call__` (`TimeDistributed`
            # calls its layer's `call` once per step): probed here
            def run():
                with _PROBED.set(self):
                    return self._scoped_call(args, kwargs)

            return probe(self, run, args, kwargs)
        return self._scoped_call(args, kwargs)

    def _scoped_call(self, args, kwargs):
        if getattr(self, "op_sites", None):
            with op_sites.scope(self):
                return self._call(args, kwargs)
        return self._call(args, kwargs)

    def _call(self, args, kwargs):
        if getattr(self, "packed_weights", None) and _keras.call_training():
            packed.refuse_training(self)
        # AWQ's pre-scale: also with the quantizers off, as the kernel
        # holds `s * W` (`pre_scale.py`)
        if pre_scale.get(self) is not None:
            args, kwargs = pre_scale.scale_inputs(
                self, args, kwargs, first_parameter(self.float_class)
            )
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

    def save_own_variables(self, store):
        if getattr(self, "packed_weights", None):
            return packed.save_own_variables(
                self, store, super().save_own_variables
            )
        return super().save_own_variables(store)

    def load_own_variables(self, store):
        if getattr(self, "packed_weights", None):
            return packed.load_own_variables(
                self, store, super().load_own_variables
            )
        return super().load_own_variables(store)

    def _float_call(self, args, kwargs, pointwise):
        if pointwise is None:
            return super().call(*args, **kwargs)
        return separable_conv(self, args[0], pointwise)


def bind_call(cls, layer, args, kwargs):
    """The arguments of `layer.call(*args, **kwargs)` by name, as `cls.call`
    names them (`self` left out)."""
    bound = _signature(cls).bind(layer, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(arguments)))  # self
    return arguments


@functools.cache
def _signature(cls):
    return inspect.signature(cls.call)


def first_parameter(cls):
    return list(_signature(cls).parameters)[1]


def is_quantized(layer):
    """Whether `layer` is a quantized twin."""
    return isinstance(layer, QuantizedLayer)


def quantized_layers(model):
    """The quantized twins inside `model`, at any depth."""
    return [
        layer for layer in _models.walk_layers(model) if is_quantized(layer)
    ]


def check_float(model, caller):
    """Raises a ValueError naming `caller` when `model` is quantized
    already: it holds keras_mp's quantized layers, or layers Keras' own
    `model.quantize(...)` switched to its `quantized_call` (which a twin's
    `call` would never run in: its ranges would stay 0)."""
    layers = list(_models.walk_layers(model))
    by_keras = [
        layer
        for layer in layers
        if getattr(layer, "quantization_mode", None) is not None
    ]
    if by_keras:
        names = ", ".join(
            f"{layer.name!r} ({layer.quantization_mode})"
            for layer in by_keras[:4]
        )
        raise ValueError(
            f"`{caller}`: model {model.name!r} was quantized by Keras' own "
            f"`quantize()` (layers {names}): Keras runs those layers' "
            "`quantized_call`, so keras_mp's quantizers would never see "
            "them, and Keras' weights export no Q/DQ for TensorRT. Call "
            f"`{caller}` on the float model (before `model.quantize`, or "
            "rebuilt from its config with the float weights). Nothing was "
            "changed."
        )
    found = [layer for layer in layers if is_quantized(layer)]
    if found:
        raise ValueError(
            f"`{caller}`: model {model.name!r} is already quantized (layer "
            f"{found[0].name!r}). Call it on the float model, or get the "
            "float model back with keras_mp.strip_quantization()."
        )


@dataclasses.dataclass(frozen=True)
class Quantizer:
    """One quantizer of a model, as `quantizers` lists it.

    Attributes:
        name: str. `<layer path>/<input name>` (`input_0`, `input_query`,
            `attention_probs`, `pointwise_input`), `<layer path>/<weight
            attribute>` for a weight, the layer path of a stand-alone
            `QuantizeActivation` (or other `TensorQuantizer`).
        quantizer: the quantizer layer (its range is `quantizer.amax`).
        layer: the layer that owns it (itself when stand-alone).
        weight: str or None. The attribute of the weight it quantizes;
            None for an activation.
    """

    name: str
    quantizer: object
    layer: object
    weight: str = None
    site: bool = False  # an op site's (`op_sites`): no attribute to read


def quantizers(model, caller="keras_mp"):
    """Every quantizer inside `model`, at any depth: the one enumeration
    that calibration, reports, export and comparison read.

    Args:
        model: a `keras.Model` (or layer).
        caller: str. The public function asking, for the error.

    Returns:
        list of `Quantizer`, in walk order.

    Raises:
        ValueError: `model` holds layers saved by an earlier keras_mp
            (`keras_mp.upgrade` converts them).
    """
    root = _record.contents(model)
    walked = list(_models.walk_layers(root, with_parents=True))
    check_current(model, caller, [layer for layer, _ in walked])
    found = []
    for layer, parents in walked:
        path = _models.layer_path(layer, parents)
        if is_quantized(layer):
            for key, q in layer.named_quantizers().items():
                found.append(Quantizer(f"{path}/{key}", q, layer))
            for attr, q in zip(layer.weight_attrs, layer.weight_quantizers):
                found.append(Quantizer(f"{path}/{attr}", q, layer, attr))
            for key, q, weight in layer.site_quantizers():
                if weight:
                    found.append(
                        Quantizer(f"{path}/{key}", q, layer, key, True)
                    )
        elif isinstance(layer, TensorQuantizer):
            found.append(Quantizer(path, layer, layer))
    return found


def block_weight_quantizers(model, caller):
    """The `Quantizer` rows of `model`'s enabled block-scaled weights of a
    layer's own attribute (Dense/EinsumDense kernels; not op sites): what
    GPTQ/AWQ/MSE calibrate and `pack_weights` packs."""
    return [
        q
        for q in quantizers(model, caller)
        if q.quantizer.block_size
        and q.weight is not None
        and not q.site
        and q.quantizer.enabled
    ]


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
    owners = {
        id(q.layer): q.layer
        for q in quantizers(model, "set_quantization_enabled")
    }
    for owner in owners.values():
        owner.enabled = bool(enabled)
    _models.reset_compiled_functions(model)
