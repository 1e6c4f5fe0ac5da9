"""Fixed-point (block floating point) quantization for MuPPET training.

MuPPET (Rajagopal et al., ICML 2020, arXiv 2006.09049) trains in dynamic
fixed point: every tensor gets one power-of-two exponent and WL-bit signed
integer mantissas. This module holds the quantizer, the layers that apply it
during training, and `fixed_point_model()`, which turns a float model into a
MuPPET-trainable copy. `keras_mp.muppet` holds the switching policy.

The word length lives in a non-trainable variable of each layer (0 means
float32), so switching precision is one `assign`: the training function is
neither retraced nor recompiled.
"""

import inspect

import keras
import numpy as np
import tensorflow as tf
from keras import ops

FLOAT32 = 0
"""Word length value meaning "no quantization" (32 means the same)."""

_MIN_WORD_LENGTH = 2
_MAX_WORD_LENGTH = 32
_MAX_EXPONENT = 126.0  # 2**s and 2**-s stay finite, normal float32 numbers


def check_word_length(word_length, name="word_length"):
    """Returns `word_length` as an int, or `FLOAT32` for None.

    Raises:
        ValueError: not None and not an integer in 2..32.
    """
    if word_length is None:
        return FLOAT32
    if (
        isinstance(word_length, bool)
        or not isinstance(word_length, (int, np.integer))
        or not _MIN_WORD_LENGTH <= word_length <= _MAX_WORD_LENGTH
    ):
        raise ValueError(
            f"`{name}` must be an integer bit width in "
            f"{_MIN_WORD_LENGTH}..{_MAX_WORD_LENGTH}, or None for float32. "
            f"Received: {name}={word_length!r}"
        )
    return int(word_length)


def _uniform(x, seed):
    """Uniform [0, 1) noise shaped like `x` from a (2,) int seed tensor."""
    return tf.random.stateless_uniform(ops.shape(x), seed, dtype="float32")


def _block_quantize(x, word_length, seed, per_sample):
    x32 = ops.cast(x, "float32")
    half = ops.power(2.0, word_length - 1.0)
    upper, lower = half - 0.5, -half - 0.5
    axes = tuple(range(1, len(x32.shape))) if per_sample else None
    x_max = ops.max(x32, axis=axes, keepdims=True)
    x_min = ops.min(x32, axis=axes, keepdims=True)
    # A side with no values of its sign (one-signed or all-zero tensors)
    # puts no bound on the exponent.
    ratio_up = ops.where(
        x_max > 0, upper / ops.where(x_max > 0, x_max, 1.0), np.inf
    )
    ratio_low = ops.where(
        x_min < 0, lower / ops.where(x_min < 0, x_min, -1.0), np.inf
    )
    ratio = ops.minimum(ratio_up, ratio_low)
    ratio = ops.where(ops.isfinite(ratio), ratio, 1.0)
    s = ops.floor(ops.log2(ratio))
    # log2 is not exact at powers of two: fix s so 2**s <= ratio < 2**(s+1).
    s = ops.where(ops.power(2.0, s + 1.0) <= ratio, s + 1.0, s)
    s = ops.where(ops.power(2.0, s) > ratio, s - 1.0, s)
    scale = ops.power(2.0, ops.clip(s, -_MAX_EXPONENT, _MAX_EXPONENT))
    scaled = x32 * scale
    if seed is None:
        q = ops.round(scaled)
    else:
        # floor(y + u), u ~ U[0, 1), is round(y + u - 0.5): the paper's
        # stochastic rounding, unbiased: E[q] = y.
        q = ops.floor(scaled + _uniform(scaled, seed))
    q = ops.clip(q, -half, half - 1.0)
    return ops.cast(q / scale, x.dtype)


def _as_seed(seed):
    if isinstance(seed, keras.random.SeedGenerator):
        return seed.next()
    if isinstance(seed, (int, np.integer)):
        return ops.convert_to_tensor([int(seed), 0], dtype="int32")
    return seed


def fixed_point_quantize(x, word_length, seed=None, per_sample=False):
    """Quantizes `x` to dynamic fixed point (block floating point).

    One power-of-two exponent per tensor (or per sample):
    `s = floor(log2(min(|U / max x|, |L / min x|)))` with
    `U = 2**(WL-1) - 0.5` and `L = -2**(WL-1) - 0.5`; the mantissas
    `q = round(2**s x + noise)` are clamped to the signed WL-bit range
    `[-2**(WL-1), 2**(WL-1) - 1]` and the result is `q / 2**s`. All-zero
    tensors stay zero; one-signed tensors use the bound of their sign only.

    Args:
        x: float tensor.
        word_length: int or scalar tensor. Bits per value, sign included.
            0 or >= 32 means float32: `x` is returned unchanged.
        seed: `keras.random.SeedGenerator`, int, or (2,) int32 tensor for
            stochastic rounding; None rounds to nearest. Defaults to None.
        per_sample: bool. One exponent per entry of the first axis, as
            MuPPET does for network inputs. Defaults to False.

    Returns:
        A tensor like `x` holding the fixed-point values.

    Example:

    >>> fixed_point_quantize([0.3, -1.0, 0.9], 4).numpy()  # s = 3
    array([ 0.25 , -1.   ,  0.875], dtype=float32)
    """
    x = ops.convert_to_tensor(x)
    word_length = ops.cast(word_length, "float32")
    seed = _as_seed(seed)
    enabled = ops.logical_and(word_length > 0, word_length < 32)
    return ops.cond(
        enabled,
        lambda: _block_quantize(x, word_length, seed, per_sample),
        lambda: x,
    )


def fixed_point_ste(
    x,
    word_length,
    seed_generator,
    per_sample=False,
    quantize_gradient=True,
    record=None,
):
    """Fixed-point forward pass with a straight-through, quantized backward.

    Forward: `fixed_point_quantize(x)` with stochastic rounding. Backward:
    the incoming gradient passes straight through the rounding and, when
    `quantize_gradient`, is itself quantized to `word_length` bits
    (MuPPET quantizes the gradients flowing between layers and the weight
    gradients). With `record`, the (quantized) gradient is also written into
    that variable, which is how `PrecisionSwitching` sees each step's
    gradients.

    Args:
        x: float tensor.
        word_length: scalar tensor; 0 means float32 (exact pass-through in
            both directions).
        seed_generator: `keras.random.SeedGenerator` for both roundings.
        per_sample: bool. One exponent per sample in the forward pass.
        quantize_gradient: bool. Quantize the gradient too.
        record: optional variable shaped like `x` receiving the gradient.

    Returns:
        The quantized tensor.
    """
    forward_seed = seed_generator.next()
    backward_seed = seed_generator.next()

    @tf.custom_gradient
    def _ste(value):
        out = fixed_point_quantize(value, word_length, forward_seed, per_sample)

        def grad(upstream):
            if quantize_gradient:
                upstream = fixed_point_quantize(
                    upstream, word_length, backward_seed
                )
            if record is None:
                return upstream
            with tf.control_dependencies([record.assign(upstream)]):
                return tf.identity(upstream)

        return out, grad

    return _ste(x)


def _word_length_variable(layer):
    return layer.add_weight(
        name="word_length",
        shape=(),
        initializer="zeros",
        trainable=False,
        dtype="float32",
    )


@keras.saving.register_keras_serializable(package="keras_mp")
class FixedPointWrapper(keras.layers.Wrapper):
    """Trains a weighted layer in MuPPET dynamic fixed point.

    The wrapped layer keeps float32 master weights. Each call runs it on
    fixed-point copies of its trainable weights (stochastic rounding,
    straight-through gradient, weight gradients quantized) and quantizes its
    outputs forward and the gradients flowing back through them. The word
    length is the non-trainable variable `word_length` (0 = float32, the
    default), set by `keras_mp.PrecisionSwitching`.

    For the switching policy the wrapper records the last minibatch
    gradient of every trainable weight in `last_gradients` (an on-read
    synchronized variable: under `tf.distribute` it reads as the replica
    mean) and holds the policy's running window sums in `gradient_sums` and
    `gradient_square_sums`, so they are saved with the model.

    Args:
        layer: `keras.layers.Layer` with trainable weights.
        seed: int or None. Seed of the stochastic rounding. Defaults to None.
        **kwargs: base layer arguments (`name`, ...).

    Example:

    >>> layer = FixedPointWrapper(keras.layers.Dense(4))
    >>> layer(np.ones((2, 3))).shape
    TensorShape([2, 4])
    """

    def __init__(self, layer, seed=None, **kwargs):
        super().__init__(layer, **kwargs)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)
        params = inspect.signature(layer.call).parameters
        self._pass_training = "training" in params or any(
            p.kind is p.VAR_KEYWORD for p in params.values()
        )

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
        self.built = True

    def call(self, inputs, training=None):
        word_length = ops.convert_to_tensor(self.word_length)
        weights = [
            fixed_point_ste(
                v.value, word_length, self.seed_generator, record=record
            )
            for v, record in zip(
                self.layer.trainable_variables, self.last_gradients, strict=True
            )
        ]
        state = [v.value for v in self.layer.non_trainable_variables]
        kwargs = {"training": training} if self._pass_training else {}
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

    def compute_output_spec(self, inputs, training=None):
        return self.layer.compute_output_spec(inputs)

    def get_config(self):
        return {**super().get_config(), "seed": self.seed}


@keras.saving.register_keras_serializable(package="keras_mp")
class FixedPointInput(keras.layers.Layer):
    """Quantizes a network input to fixed point, one exponent per sample.

    Args:
        seed: int or None. Seed of the stochastic rounding. Defaults to None.
        **kwargs: base layer arguments.

    Example:

    >>> FixedPointInput()(np.ones((2, 3))).shape
    TensorShape([2, 3])
    """

    def __init__(self, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)

    def build(self, input_shape=None):
        self.word_length = _word_length_variable(self)
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


def _is_graph_model(model):
    from keras.src.models.functional import Functional

    return isinstance(model, (keras.Sequential, Functional))


def _wrap_layer(layer, seed):
    copy = layer.__class__.from_config(layer.get_config())
    if not layer.trainable_weights:
        return copy
    copy.build_from_config(layer.get_build_config())
    copy.set_weights(layer.get_weights())
    return FixedPointWrapper(copy, seed=seed, name=f"fixed_point_{layer.name}")


def fixed_point_model(model, seed=None):
    """Returns a MuPPET-trainable copy of a Sequential or Functional model.

    Every layer with trainable weights is wrapped in `FixedPointWrapper`
    (weights copied over; nested Sequential/Functional models are walked),
    every input goes through a per-sample `FixedPointInput`, and a
    `PrecisionState` layer carries the switching state. The copy starts in
    float32 (word length 0) and computes exactly what `model` computes
    until `keras_mp.PrecisionSwitching` lowers the precision.

    Args:
        model: built `keras.Sequential` or Functional `keras.Model`.
        seed: int or None. Seed of the stochastic rounding. Defaults to None.

    Returns:
        A new, uncompiled `keras.Model` whose first inputs and outputs match
        `model`'s.

    Raises:
        ValueError: `model` is subclassed, not built, or has no trainable
            weights.

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> fp = fixed_point_model(model)
    >>> fp.compile("sgd", "mse")
    """
    if not isinstance(model, keras.Model):
        raise ValueError(
            f"fixed_point_model() expects a keras.Model. Received: "
            f"{type(model).__name__}"
        )
    if not _is_graph_model(model):
        raise ValueError(
            "fixed_point_model() needs a Sequential or Functional model to "
            f"copy its layers; received the subclassed model "
            f"'{type(model).__name__}'. Rebuild it with the Functional API "
            "(keras.Model(inputs, outputs)), or wrap its weighted layers in "
            "keras_mp.FixedPointWrapper, add keras_mp.FixedPointInput on its "
            "inputs and a keras_mp.PrecisionState layer yourself."
        )
    if not model.built or not model.inputs:
        raise ValueError(
            f"fixed_point_model() needs a built model with known inputs; "
            f"'{model.name}' is not built. Start it with keras.Input(shape) "
            "or call it on data first."
        )
    if not model.trainable_weights:
        raise ValueError(
            f"Model '{model.name}' has no trainable weights: there is "
            "nothing to train in fixed point. Pass a model with trainable "
            "layers (check `layer.trainable`)."
        )
    clone = keras.models.clone_model(
        model,
        clone_function=lambda layer: _wrap_layer(layer, seed),
        recursive=True,
    )
    inputs = [
        keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t.name)
        for t in model.inputs
    ]
    quantized = [PrecisionState(name="precision_state")(inputs[0])]
    quantized += inputs[1:]
    quantized = [
        FixedPointInput(seed=seed, name=f"fixed_point_input_{i}")(t)
        for i, t in enumerate(quantized)
    ]
    if len(inputs) == 1:
        inputs, quantized = inputs[0], quantized[0]
    return keras.Model(
        inputs, clone(quantized), name=f"{model.name}_fixed_point"
    )


def fixed_point_layers(model):
    """Yields the layers of `model` that hold a `word_length` variable."""
    for layer in model.layers:
        if isinstance(layer, (FixedPointWrapper, FixedPointInput)):
            yield layer
        elif isinstance(layer, keras.Model):
            yield from fixed_point_layers(layer)


def precision_state(model):
    """Returns the `PrecisionState` layer of `model`, or None."""
    for layer in model.layers:
        if isinstance(layer, PrecisionState):
            return layer
        if isinstance(layer, keras.Model):
            found = precision_state(layer)
            if found is not None:
                return found
    return None


def set_word_length(model, word_length):
    """Sets every fixed-point layer of `model` to `word_length` bits.

    Args:
        model: a model from `fixed_point_model()`.
        word_length: int in 2..32, or None for float32.

    Raises:
        ValueError: bad `word_length`.
    """
    value = float(check_word_length(word_length))
    for layer in fixed_point_layers(model):
        layer.word_length.assign(value)
