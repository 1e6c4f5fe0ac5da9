"""Dynamic loss scaling with bounds and counters, and its monitor callback."""

import math

import keras
import tensorflow as tf
from keras import ops

from keras_mp import _keras
from keras_mp._compat import require_tensorflow


def _positive_float(name, value):
    """`value` as a float, or a ValueError naming the argument."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not 0 < number < math.inf:
        raise ValueError(
            f"`{name}` must be a positive finite number. "
            f"Received: {name}={value!r}"
        )
    return number


@keras.saving.register_keras_serializable(package="keras_mp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Keras' dynamic loss scaling, with scale bounds and overflow counters.

    float16 has 5 exponent bits: gradients below ~6e-8 underflow to zero.
    The loss is multiplied by a scale before backpropagation and the
    gradients divided by it before the update. A step whose gradients are
    not finite is skipped and the scale halved; after `dynamic_growth_steps`
    finite steps the scale doubles. This subclass keeps the scale within
    `[min_scale, max_scale]` and counts skipped steps, and `compile` does not
    wrap it again under `mixed_float16`. Under `tf.distribute`, a non-finite
    gradient on any replica (or worker) skips the step on all of them.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer`. The optimizer to wrap.
        initial_scale: float. Starting loss scale. Defaults to `2**15`.
        dynamic_growth_steps: int. Finite steps before the scale doubles.
            Defaults to 2000.
        min_scale: float. Lower bound of the scale. Defaults to 1.0.
        max_scale: float. Upper bound of the scale. Defaults to `2**24`.
        name: str. Optional name.

    Raises:
        TypeError: `inner_optimizer` is not a Keras 3 optimizer.
        ValueError: `inner_optimizer` is already a `LossScaleOptimizer`, a
            scale is not a positive finite number, the bounds are not
            `min_scale <= initial_scale <= max_scale`, or
            `dynamic_growth_steps` is not a positive integer.

    Example:

    >>> keras_mp.enable_mixed_precision("mixed_float16")
    >>> opt = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    >>> model.compile(opt, "sparse_categorical_crossentropy")
    >>> model.fit(x, y, callbacks=[keras_mp.LossScaleMonitor()])
    """

    def __init__(
        self,
        inner_optimizer,
        initial_scale=2.0**15,
        dynamic_growth_steps=2000,
        min_scale=1.0,
        max_scale=2.0**24,
        name=None,
        **kwargs,
    ):
        require_tensorflow("keras_mp.LossScaleOptimizer")
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "`inner_optimizer` is already a LossScaleOptimizer; loss "
                "scaling would be applied twice. Pass its inner optimizer "
                "(`opt.inner_optimizer`) instead. Received: "
                f"{type(inner_optimizer).__name__}"
            )
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "`inner_optimizer` must be a Keras 3 optimizer, e.g. "
                "`keras.optimizers.Adam()`. Received: "
                f"{type(inner_optimizer).__module__}."
                f"{type(inner_optimizer).__name__}"
            )
        min_scale = _positive_float("min_scale", min_scale)
        max_scale = _positive_float("max_scale", max_scale)
        initial_scale = _positive_float("initial_scale", initial_scale)
        if min_scale > max_scale:
            raise ValueError(
                "Loss scale bounds must satisfy 0 < min_scale <= max_scale. "
                f"Received: min_scale={min_scale}, max_scale={max_scale}"
            )
        if not min_scale <= initial_scale <= max_scale:
            raise ValueError(
                "`initial_scale` must lie within [min_scale, max_scale]. "
                f"Received: initial_scale={initial_scale}, "
                f"min_scale={min_scale}, max_scale={max_scale}"
            )
        try:
            steps = int(dynamic_growth_steps)
        except (TypeError, ValueError, OverflowError):
            steps = 0
        if steps < 1 or steps != dynamic_growth_steps:
            raise ValueError(
                "`dynamic_growth_steps` must be a positive integer. "
                f"Received: dynamic_growth_steps={dynamic_growth_steps!r}"
            )
        super().__init__(
            inner_optimizer,
            initial_scale=initial_scale,
            dynamic_growth_steps=steps,
            name=name,
            **kwargs,
        )
        self.min_scale = min_scale
        self.max_scale = max_scale

    def build(self, var_list):
        super().build(var_list)
        # Counters aggregate with "none": `check_finite` gives every replica
        # the same finite/non-finite answer, so each takes the same branch.
        self.skipped_counter = self.add_variable(
            shape=(),
            dtype="int",
            initializer="zeros",
            aggregation="none",
            name="skipped_steps",
        )

    def _stateful_handle_finite_grads(self, grads, trainable_variables):
        super()._stateful_handle_finite_grads(grads, trainable_variables)
        self.dynamic_scale.assign(
            ops.minimum(self.dynamic_scale, self.max_scale)
        )

    def _stateful_handle_non_finite_grads(self):
        super()._stateful_handle_non_finite_grads()
        self.dynamic_scale.assign(
            ops.maximum(self.dynamic_scale, self.min_scale)
        )
        self.skipped_counter.assign_add(1)

    def check_finite(self, grads):
        """Whether the gradients of every replica are finite.

        Each replica holds the gradients of its own share of the batch; they
        are summed only inside the inner optimizer's update. So a NaN or a
        float16 overflow on one replica must skip the step on all of them:
        otherwise the others apply a sum that contains it, and (multi-worker)
        the replicas take different branches around that sum's collective
        and wait for each other forever. Keras' `apply` calls this method in
        replica context on both of its distributed paths, so the all-reduced
        answer is the one it branches on. Graph- and XLA-compatible.
        """
        finite = super().check_finite(grads)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return finite
        non_finite = context.all_reduce(
            tf.distribute.ReduceOp.SUM,
            tf.cast(tf.logical_not(finite), "float32"),
        )
        return tf.equal(non_finite, 0.0)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(
            "keras_mp.LossScaleOptimizer supports the TensorFlow backend "
            "(stateful apply). On JAX, use keras.optimizers.LossScaleOptimizer."
        )

    @property
    def loss_scale(self):
        """The current loss scale as a Python float."""
        if not self.built:
            return float(self.initial_scale)
        return float(_keras.to_numpy(self.dynamic_scale))

    @property
    def skipped_steps(self):
        """Steps skipped because gradients were not finite (each halves the
        scale)."""
        if not self.built:
            return 0
        return int(_keras.to_numpy(self.skipped_counter))

    def get_config(self):
        config = super().get_config()
        config.update(min_scale=self.min_scale, max_scale=self.max_scale)
        return config


def find_loss_scale_optimizer(optimizer):
    """Returns the Keras LossScaleOptimizer in use, or None."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer
    return None


class LossScaleMonitor(keras.callbacks.Callback):
    """Puts the loss scale and the skipped-step count into the `fit` logs.

    Adds `loss_scale` and `skipped_steps` to the batch and epoch logs, so
    `History`, `CSVLogger` and `TensorBoard` record them. Works with
    `keras_mp.LossScaleOptimizer` and with Keras' own (skipped steps are then
    counted by this callback from scale drops). Also keeps
    `self.scale_history`, one `(step, scale)` pair every `log_every` batches,
    for plotting.

    Args:
        log_every: int. Record the scale every this many batches (each read
            synchronizes with the device). Defaults to 1.

    Example:

    >>> history = model.fit(x, y, callbacks=[keras_mp.LossScaleMonitor()])
    >>> history.history["loss_scale"]
    """

    def __init__(self, log_every=1):
        super().__init__()
        if int(log_every) < 1:
            raise ValueError(
                f"`log_every` must be >= 1. Received: log_every={log_every}"
            )
        self.log_every = int(log_every)
        self.scale_history = []
        self._step = 0
        self._warned = False

    def _optimizer(self):
        opt = find_loss_scale_optimizer(getattr(self.model, "optimizer", None))
        if opt is None and not self._warned:
            self._warned = True
            print(
                "LossScaleMonitor: the model's optimizer does no loss "
                "scaling (not mixed_float16, no LossScaleOptimizer); nothing "
                "to log."
            )
        return opt

    def _values(self, opt):
        scale = float(_keras.to_numpy(opt.dynamic_scale))
        if isinstance(opt, LossScaleOptimizer):
            return scale, opt.skipped_steps
        # Keras' own optimizer has no counter: count halvings seen here.
        if self.scale_history and scale < self.scale_history[-1][1]:
            self._keras_skips = getattr(self, "_keras_skips", 0) + 1
        return scale, getattr(self, "_keras_skips", 0)

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        if self._step % self.log_every:
            return
        opt = self._optimizer()
        if opt is None or not opt.built:
            return
        scale, skipped = self._values(opt)
        self.scale_history.append((self._step, scale))
        if logs is not None:
            logs["loss_scale"] = scale
            logs["skipped_steps"] = skipped

    def on_epoch_end(self, epoch, logs=None):
        opt = self._optimizer()
        if opt is None or not opt.built or logs is None:
            return
        logs["loss_scale"], logs["skipped_steps"] = self._values(opt)
