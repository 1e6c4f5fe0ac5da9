"""`PrecisionState` (the switching state of a MuPPET model), the random
stream and loss-scale helpers of the fixed-point layers, and the load-only
layers of earlier keras_mp: `FixedPointWrapper` (a weighted layer in fixed
point) and `FixedPointInput` (a network input). Their state is in weights,
so saved files and checkpoints resume it. The fixed-point layers
`fixed_point_model` makes are twins (`keras_mp.muppet.twins`). Guide:
`docs/muppet.md`.
"""

import inspect
import random

import keras
import numpy as np
from keras import ops

from keras_mp import _keras
from keras_mp._compat import require_tensorflow
from keras_mp._load_only import LoadOnly
from keras_mp.muppet.quantizer import fixed_point_ste


def _check_seed(seed):
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(
            f"`seed` must be an int or None. Received: seed={seed!r}"
        )
    return int(seed)


class _SeedStream:
    """`keras.random.SeedGenerator.next()` over a weight of the layer.

    A `SeedGenerator`'s state is not a weight, so files and checkpoints
    would not save it and a resumed run would draw different noise.
    """

    def __init__(self, state):
        self.state = state

    def next(self):
        seed = self.state.value * 1  # a copy: the value before the increment
        self.state.assign(
            self.state.value + ops.convert_to_tensor([0, 1], self.state.dtype)
        )
        return seed


class _RandomStateMixin:
    """Seeded stochastic rounding whose random state is a layer weight.

    `__init__` draws the initial seed (a random one for `seed=None`, as
    `keras.random.SeedGenerator` does); `build` must call
    `_build_seed_stream()` last, so files saved before the state was a
    weight (one variable fewer, at the end) still load.
    """

    def _init_seed(self, seed):
        self.seed = _check_seed(seed)
        self._initial_seed = (
            self.seed if self.seed is not None else random.randint(1, int(1e9))
        )

    def _build_seed_stream(self):
        self.seed_state = self.add_weight(
            name="seed_state",
            shape=(2,),
            initializer=keras.initializers.Constant([self._initial_seed, 0]),
            trainable=False,
            dtype="int64",
        )
        self.seed_generator = _SeedStream(self.seed_state)

    def load_own_variables(self, store):
        own = _keras.own_variables(self)
        if len(store.keys()) == len(own) - 1:
            # Saved by keras_mp 0.1.0, before the random state was a weight:
            # load the rest and keep the fresh state.
            for i, variable in enumerate(own[:-1]):
                variable.assign(store[f"{i}"])
            return
        super().load_own_variables(store)


class _LossScale:
    """The current loss scale of `optimizer`, read in the training graph.

    A plain object, not tracked, so the optimizer does not become a
    dependency of the layer in checkpoints or SavedModels.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __call__(self):
        return self.optimizer.scale_loss(1.0)


def _scales_loss(optimizer):
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or (
        getattr(optimizer, "loss_scale_factor", None) is not None
    )


def _word_length_variable(layer):
    return layer.add_weight(
        name="word_length",
        shape=(),
        initializer="zeros",
        trainable=False,
        dtype="float32",
    )


@keras.saving.register_keras_serializable(package="keras_mp")
class FixedPointWrapper(LoadOnly, _RandomStateMixin, keras.layers.Wrapper):
    """Trains a weighted layer in MuPPET dynamic fixed point.

    Load-only: `fixed_point_model` built it until layers were switched to
    fixed point in place; it stays registered (with its class and
    attribute names, which name its weight-file groups) so that those
    files load and train on. `keras_mp.upgrade` converts such a model to
    the current form; constructing one outside Keras loading raises a
    `TypeError` (`keras_mp.fixed_point_model` is the current way).

    The wrapped layer keeps float32 master weights. Each call runs it on
    fixed-point copies of its trainable weights (stochastic rounding,
    straight-through gradient, weight gradients quantized) and quantizes its
    outputs forward and the gradients flowing back through them. The word
    length is the non-trainable variable `word_length` (0 = float32, the
    default), set by `keras_mp.PrecisionSwitching`. The state of the
    rounding's random stream is the non-trainable weight `seed_state`, so a
    saved and reloaded or resumed model draws the same noise.

    For the switching policy the wrapper records the last minibatch
    gradient of every trainable weight in `last_gradients` (an on-read
    synchronized variable: under `tf.distribute` it reads as the replica
    mean; divided by the loss scale once `PrecisionSwitching` has seen the
    optimizer; non-finite gradients, from steps loss scaling skips, are not
    recorded) and holds the policy's running window sums in
    `gradient_sums` and `gradient_square_sums`, so they are saved with the
    model.

    Args:
        layer: `keras.layers.Layer` with trainable weights.
        seed: int or None. Seed of the stochastic rounding; None draws one
            at random. Defaults to None.
        **kwargs: base layer arguments (`name`, ...).

    Raises:
        ValueError: `seed` is not an int or None; at build time, `layer`
            has no trainable weights.

    Example:

    >>> with keras_mp.legacy.loading():  # as Keras loading does
    ...     layer = FixedPointWrapper(keras.layers.Dense(4))
    >>> layer(np.ones((2, 3))).shape
    TensorShape([2, 4])
    """

    REPLACEMENT = (
        "Train in fixed point with `keras_mp.fixed_point_model(model)` "
        "(layers switched to fixed point in place)."
    )

    def __init__(self, layer, seed=None, **kwargs):
        require_tensorflow("keras_mp.FixedPointWrapper")
        super().__init__(layer, **kwargs)
        self._init_seed(seed)
        self._loss_scale = None
        params = inspect.signature(layer.call).parameters
        any_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
        self._pass_training = "training" in params or any_keyword
        # A Functional graph records `mask=` for layers whose call takes one
        # (BatchNormalization does) and replays it on the clone.
        self._pass_mask = "mask" in params or any_keyword

    def build(self, input_shape=None):
        super().build(input_shape)
        targets = self.layer.trainable_variables
        if not targets:
            raise ValueError(
                f"FixedPointWrapper wraps layers with trainable weights; "
                f"layer '{self.layer.name}' has none. Leave it unwrapped."
            )
        self.word_length = _word_length_variable(self)
        self.last_gradients = [
            keras.Variable(
                np.zeros(v.shape, "float32"),
                trainable=False,
                name=f"{v.name}_last_gradient",
                synchronization="on_read",
                aggregation="mean",
            )
            for v in targets
        ]
        self.gradient_sums = [
            self.add_weight(
                name=f"{v.name}_gradient_sum",
                shape=v.shape,
                initializer="zeros",
                trainable=False,
            )
            for v in targets
        ]
        self.gradient_square_sums = self.add_weight(
            name="gradient_square_sums",
            shape=(len(targets),),
            initializer="zeros",
            trainable=False,
        )
        self._build_seed_stream()
        self.built = True

    def call(self, inputs, training=None, mask=None, **kwargs):
        word_length = ops.convert_to_tensor(self.word_length)
        weights = [
            fixed_point_ste(
                v.value,
                word_length,
                self.seed_generator,
                record=record,
                loss_scale=self._loss_scale,
            )
            for v, record in zip(
                self.layer.trainable_variables, self.last_gradients, strict=True
            )
        ]
        state = [v.value for v in self.layer.non_trainable_variables]
        if self._pass_training:
            kwargs["training"] = training
        if self._pass_mask and mask is not None:
            kwargs["mask"] = mask
        outputs, new_state = self.layer.stateless_call(
            weights, state, inputs, **kwargs
        )
        for variable, old, new in zip(
            self.layer.non_trainable_variables, state, new_state, strict=True
        ):
            if new is not old:  # e.g. BatchNormalization moving statistics
                variable.assign(new)
        return keras.tree.map_structure(
            lambda t: fixed_point_ste(t, word_length, self.seed_generator),
            outputs,
        )

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def compute_output_spec(self, inputs, training=None, mask=None, **kwargs):
        return self.layer.compute_output_spec(inputs, **kwargs)

    def compute_mask(self, inputs, mask=None):
        return self.layer.compute_mask(inputs, mask)

    def get_config(self):
        return {**super().get_config(), "seed": self.seed}


def unscale_recorded_gradients(layers, optimizer):
    """Makes `layers` record gradients divided by `optimizer`'s loss scale.

    The scale is read in the training graph at each step, so a training
    function traced before this call keeps the old behaviour.

    Args:
        layers: iterable of fixed-point layers that record gradients
            (fixed-point twins, `FixedPointWrapper`s).
        optimizer: the model's optimizer, or None.

    Returns:
        bool. Whether any layer changed: the training function must then
        be traced again (`keras_mp._models.reset_compiled_functions`).
    """
    source = optimizer if _scales_loss(optimizer) else None
    changed = False
    for layer in layers:
        # A twin keeps the setting in its state layer.
        wrapper = getattr(layer, "fixed_point", layer)
        current = wrapper._loss_scale
        if (current.optimizer if current else None) is not source:
            wrapper._loss_scale = _LossScale(source) if source else None
            changed = True
    return changed


@keras.saving.register_keras_serializable(package="keras_mp")
class FixedPointInput(LoadOnly, _RandomStateMixin, keras.layers.Layer):
    """Quantizes a network input to fixed point, one exponent per sample.

    Load-only, like `FixedPointWrapper`: the layers that receive a model
    input now quantize it themselves (`keras_mp.fixed_point_model`).

    Args:
        seed: int or None. Seed of the stochastic rounding; None draws one
            at random. Defaults to None.
        **kwargs: base layer arguments.

    Raises:
        ValueError: `seed` is not an int or None.

    Example:

    >>> with keras_mp.legacy.loading():  # as Keras loading does
    ...     layer = FixedPointInput()
    >>> layer(np.ones((2, 3))).shape
    TensorShape([2, 3])
    """

    REPLACEMENT = FixedPointWrapper.REPLACEMENT

    def __init__(self, seed=None, **kwargs):
        require_tensorflow("keras_mp.FixedPointInput")
        super().__init__(**kwargs)
        self._init_seed(seed)

    def build(self, input_shape=None):
        self.word_length = _word_length_variable(self)
        self._build_seed_stream()
        self.built = True

    def call(self, inputs):
        if not keras.backend.is_float_dtype(inputs.dtype):
            return inputs
        return fixed_point_ste(
            inputs,
            ops.convert_to_tensor(self.word_length),
            self.seed_generator,
            per_sample=True,
            quantize_gradient=False,
        )

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "seed": self.seed}

    @classmethod
    def from_config(cls, config):
        # Keras rewraps an error of a layer's constructor as a TypeError
        # about deserialization; refused here, the backend error stays one.
        require_tensorflow("Loading a keras_mp model")
        return super().from_config(config)


@keras.saving.register_keras_serializable(package="keras_mp")
class PrecisionState(keras.layers.Layer):
    """Identity layer holding the precision-switching state of a model.

    Keeping the state in variables of the model means `.keras` files and
    `keras.callbacks.BackupAndRestore` checkpoints carry it: a resumed run
    continues at the same precision with the same violation count.

    Variables: `stage` (index into the callback's schedule), `violations`,
    `max_diversity` (maximum since the last switch), `window_epochs`
    (epochs recorded in the current window), `held_learning_rate` (-1 when
    none is held).
    """

    def build(self, input_shape=None):
        def scalar(name, value):
            return self.add_weight(
                name=name,
                shape=(),
                initializer=keras.initializers.Constant(value),
                trainable=False,
                dtype="float32",
            )

        self.stage = scalar("stage", 0.0)
        self.violations = scalar("violations", 0.0)
        self.max_diversity = scalar("max_diversity", 0.0)
        self.window_epochs = scalar("window_epochs", 0.0)
        self.held_learning_rate = scalar("held_learning_rate", -1.0)
        self.built = True

    def call(self, inputs):
        return inputs

    def compute_output_shape(self, input_shape):
        return input_shape
