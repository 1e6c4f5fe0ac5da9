"""Fixed-point twins: layers trained in MuPPET fixed point in place, at any
depth.

A layer inside a custom layer, a subclassed model, a keras-hub backbone or
a `MultiHeadAttention` has no place in a layer graph that a wrapper could
take. It is switched to fixed point where it is instead: its class becomes
its fixed-point twin (`fixed_point_twin_class`), a subclass of its own
class whose `call` runs the float `call` on fixed-point copies of the
layer's trainable weights (through a `keras.StatelessScope`) and quantizes
its outputs; the layer keeps its name, its variables and every reference
to it. Its MuPPET state (word length, random stream, gradient records) is
a `FixedPointState` layer it owns (`_models.own`), saved beside its
weights. Twin classes are never saved: the float model's config is, with
the record of `keras_mp.muppet.record`. Guide: `docs/muppet.md`.
"""

import contextlib
import random

import keras
import numpy as np
from keras import ops

from keras_mp import _keras, _models
from keras_mp.muppet.layers import PrecisionState, _check_seed, _SeedStream
from keras_mp.muppet.quantizer import fixed_point_ste
from keras_mp.quantization import op_sites


def _seed_variable(layer, name, seed):
    return layer.add_weight(
        name=name,
        shape=(2,),
        initializer=keras.initializers.Constant([seed, 0]),
        trainable=False,
        dtype="int64",
    )


@keras.saving.register_keras_serializable(package="keras_mp")
class FixedPointState(keras.layers.Layer):
    """The MuPPET state of one fixed-point layer, owned by that layer.

    Variables, in this order (the weights file stores them so): `word_length`
    (0 = float32); with `weight_shapes`, one `last_gradients` entry per
    trainable weight (on-read synchronized: under `tf.distribute` it reads
    as the replica mean), one `gradient_sums` entry per weight,
    `gradient_square_sums` and `seed_state` (the weights', outputs' and
    op sites' random stream; with `sites` alone, only that); with
    `inputs`, `input_seed_state` (the stream of the
    per-sample input quantization). It is built on construction.

    Args:
        weight_shapes: list of shapes, one per trainable weight the layer
            runs in fixed point; empty for a layer that only quantizes
            model inputs. Defaults to `()`.
        inputs: list of int. Positions, in the flattened positional call
            arguments, of the model inputs quantized per sample. Defaults
            to `()`.
        sites: bool. The layer has op sites (`attach`): a random stream
            even without weights. Defaults to False.
        seed: int or None. Initial seed of the random streams; None draws
            one at random. Defaults to None.
        **kwargs: base layer arguments (`name`).

    Raises:
        ValueError: `seed` is not an int or None.
    """

    def __init__(
        self, weight_shapes=(), inputs=(), seed=None, sites=False, **kwargs
    ):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        self.sites = bool(sites)
        self.weight_shapes = tuple(
            tuple(int(d) for d in s) for s in weight_shapes
        )
        self.inputs = tuple(int(i) for i in inputs)
        seed = _check_seed(seed)
        self.seed = seed if seed is not None else random.randint(1, int(1e9))
        self._loss_scale = None  # set by `unscale_recorded_gradients`
        self.precision_state = None
        self.build()

    def build(self, input_shape=None):
        self.word_length = self.add_weight(
            name="word_length",
            shape=(),
            initializer="zeros",
            trainable=False,
            dtype="float32",
        )
        self.last_gradients = [
            keras.Variable(
                np.zeros(shape, "float32"),
                trainable=False,
                name=f"weight_{i}_last_gradient",
                synchronization="on_read",
                aggregation="mean",
            )
            for i, shape in enumerate(self.weight_shapes)
        ]
        self.gradient_sums = [
            self.add_weight(
                name=f"weight_{i}_gradient_sum",
                shape=shape,
                initializer="zeros",
                trainable=False,
            )
            for i, shape in enumerate(self.weight_shapes)
        ]
        self.gradient_square_sums = None
        self.seed_state = self.seed_generator = None
        if self.weight_shapes:
            self.gradient_square_sums = self.add_weight(
                name="gradient_square_sums",
                shape=(len(self.weight_shapes),),
                initializer="zeros",
                trainable=False,
            )
        if self.weight_shapes or self.sites:
            self.seed_state = _seed_variable(self, "seed_state", self.seed)
            self.seed_generator = _SeedStream(self.seed_state)
        self.input_seed_state = self.input_seed_generator = None
        if self.inputs:
            self.input_seed_state = _seed_variable(
                self, "input_seed_state", self.seed
            )
            self.input_seed_generator = _SeedStream(self.input_seed_state)
        self.built = True

    def hold_precision_state(self):
        """Creates the model's `PrecisionState` here (one per model)."""
        with _keras.unlocked(self):
            self.precision_state = PrecisionState(name="precision_state")
            self.precision_state.build()
        return self.precision_state

    def call(self, inputs):
        return inputs

    def get_config(self):
        return {
            **super().get_config(),
            "weight_shapes": [list(s) for s in self.weight_shapes],
            "inputs": list(self.inputs),
            "seed": self.seed,
            "sites": self.sites,
        }


def _is_float(x):
    return (
        x is not None
        and hasattr(x, "dtype")
        and keras.backend.is_float_dtype(x.dtype)
    )


class FixedPointLayer:
    """What every fixed-point twin adds to its float class.

    State: `fixed_point` (`FixedPointState`, owned). The layer's own
    trainable weights (`fixed_point_weights`; a recurrent layer's cell's)
    are read as fixed-point
    copies with stochastic rounding, straight-through gradients and
    quantized weight gradients, recorded in `last_gradients`; its outputs
    are quantized forward and their gradients backward. A layer that
    receives a model input quantizes it per sample first (one exponent per
    sample, gradient not quantized), as MuPPET does for network inputs; a
    layer without weights of its own can be a twin for that alone.
    """

    float_class = None  # the class the twin derives from
    # Op sites run in fixed point whenever the layer does (`CallScope`).
    enabled = True

    def _calibrating(self):
        return False

    def _site_scope(self):
        """The op-level scope of this call, when the layer has op sites."""
        if getattr(self, "op_sites", None):
            return op_sites.scope(self)
        return contextlib.nullcontext()

    @property
    def word_length(self):
        """The word length variable (0 = float32)."""
        return self.fixed_point.word_length

    @property
    def last_gradients(self):
        return self.fixed_point.last_gradients

    @property
    def gradient_sums(self):
        return self.fixed_point.gradient_sums

    @property
    def gradient_square_sums(self):
        return self.fixed_point.gradient_square_sums

    @property
    def seed_state(self):
        return self.fixed_point.seed_state

    def fixed_point_weights(self):
        """The weights run in fixed point (`fixed_point_variables`)."""
        if not self.fixed_point.weight_shapes:
            return []
        return fixed_point_variables(self)

    def _quantize_model_inputs(self, args, word_length):
        state = self.fixed_point
        flat = keras.tree.flatten(args)
        for i in state.inputs:
            if i < len(flat) and _is_float(flat[i]):
                x = flat[i]
                flat[i] = fixed_point_ste(
                    x,
                    word_length,
                    state.input_seed_generator,
                    per_sample=True,
                    quantize_gradient=False,
                )
                _keras.copy_mask(x, flat[i])
        return keras.tree.pack_sequence_as(args, flat)

    def call(self, *args, **kwargs):
        state = self.fixed_point
        word_length = ops.convert_to_tensor(state.word_length)
        if state.inputs:
            args = self._quantize_model_inputs(args, word_length)
        if not state.weight_shapes:
            with self._site_scope():
                return super().call(*args, **kwargs)
        variables = self.fixed_point_weights()
        mapping = [
            (
                v,
                fixed_point_ste(
                    _keras.float_value(v),
                    word_length,
                    state.seed_generator,
                    record=record,
                    loss_scale=state._loss_scale,
                ),
            )
            for v, record in zip(variables, state.last_gradients, strict=True)
        ]
        with (
            keras.StatelessScope(
                state_mapping=mapping, collect_losses=True
            ) as scope,
            self._site_scope(),
        ):
            outputs = super().call(*args, **kwargs)
        self._apply_updates(scope, {id(v) for v in variables})

        def quantize(t):
            if not _is_float(t):
                return t
            q = fixed_point_ste(t, word_length, state.seed_generator)
            _keras.copy_mask(t, q)
            return q

        return keras.tree.map_structure(quantize, outputs)

    def _apply_updates(self, scope, mapped):
        """Applies what the float call assigned inside the scope (e.g.
        BatchNormalization's moving statistics, the random streams of
        fixed-point sublayers) and re-adds its losses."""
        for variable in self.variables:
            if id(variable) in mapped:
                continue
            value = scope.get_current_value(variable)
            if value is not None:
                variable.assign(value)
        for loss in scope.losses:
            self.add_loss(loss)


def fixed_point_twin_class(cls):
    """The fixed-point twin of layer class `cls`: a subclass of it and of
    `FixedPointLayer`, with `float_class = cls` (`_models.twin_type`, the
    factory quantized twins come from too)."""
    return _models.twin_type("FixedPoint", FixedPointLayer, cls)


def is_fixed_point(layer):
    """Whether `layer` is a fixed-point twin."""
    return isinstance(layer, FixedPointLayer)


def fixed_point_variables(layer):
    """The trainable weights `layer` runs in fixed point: its own (a
    sublayer's are its own twin's); for a recurrent layer, its cell's at
    any depth, since the cell runs once per time step inside a loop."""
    if isinstance(layer, keras.layers.RNN):
        return [v for v in layer.trainable_variables]
    return [v for v in _keras.own_variables(layer) if v.trainable]


def runs_in_fixed_point(layer, parents):
    """Whether `layer` (below `parents`) runs its weights in fixed point:
    it holds trainable weights (`fixed_point_variables`) and is not inside
    a recurrent layer (whose cell runs in the recurrent layer's twin)."""
    if any(isinstance(p, keras.layers.RNN) for p in parents):
        return False
    return layer.trainable and bool(fixed_point_variables(layer))


def attach(layer, seed, inputs=(), weights=True, sites=(), path=None):
    """Turns `layer` into its fixed-point twin, in place.

    Args:
        layer: a built layer, not a `keras.Model`.
        seed: int. Initial seed of its random streams.
        inputs: positions (in the flattened positional call arguments) of
            the model inputs it quantizes per sample. Defaults to `()`.
        weights: bool. Run its own trainable weights and its outputs in
            fixed point (False: only the model inputs). Defaults to True.
        sites: list of dicts. The op sites of the layer's own code
            (`quantization.op_probe.probe`): their activation operands are
            run in fixed point too, through the op-level mechanism of
            quantization (`quantization/op_sites.py`). Defaults to `()`.
        path: str or None. The layer's path, for errors.

    Returns:
        The layer's `FixedPointState`.
    """
    shapes = (
        [tuple(v.shape) for v in fixed_point_variables(layer)]
        if weights
        else []
    )
    state = FixedPointState(
        shapes,
        inputs,
        seed=seed,
        sites=bool(sites),
        name=f"{layer.name}_fixed_point",
    )
    with _keras.unlocked(layer):
        layer.fixed_point = state
    _attach_sites(layer, list(sites), path or layer.name)
    _models.switch(layer, fixed_point_twin_class(type(layer)), [state])
    return state


class _SiteQuantizer:
    """An activation operand of a fixed-point layer's op site: MuPPET's
    stochastic fixed point at the layer's word length, from its stream."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x):
        state = self.layer.fixed_point
        word_length = ops.convert_to_tensor(state.word_length)
        return fixed_point_ste(x, word_length, state.seed_generator)


def _attach_sites(layer, sites, path):
    """What `op_sites.CallScope` reads of a layer: its `sites`, their
    index, and a fixed-point quantizer per activation operand (weights are
    fixed point already: the layer's variables are read as fixed-point
    copies)."""
    quantizer = _SiteQuantizer(layer)
    by_site = {
        k: {
            i: quantizer
            for i, spec in enumerate(site["operands"])
            if spec["role"] in ("input", "probs")
        }
        for k, site in enumerate(sites)
        # an attention call stays Keras' own (its quantized form is not
        # the float op's math at word length 0)
        if site["op"] != "dot_product_attention"
    }
    object.__setattr__(layer, "op_sites", sites)
    object.__setattr__(layer, "op_site_index", op_sites.site_index(sites))
    object.__setattr__(layer, "op_quantizers_by_site", by_site)
    object.__setattr__(layer, "quantize_path", path)
