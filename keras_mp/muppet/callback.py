"""`PrecisionSwitching`: runs MuPPET's precision schedule during `fit`.

The switching rule is in `keras_mp.muppet.policy`, the fixed-point model in
`keras_mp.muppet.model`. Guide: `docs/muppet.md`.
"""

import math
import warnings

import keras
import numpy as np

from keras_mp import _models
from keras_mp._compat import require_tensorflow
from keras_mp.muppet.layers import unscale_recorded_gradients
from keras_mp.muppet.model import fixed_point_layers, precision_state
from keras_mp.muppet.policy import (
    DEFAULT_SCHEDULE,
    SwitchingPolicy,
    check_schedule,
    switching_threshold,
    tensor_diversities,
)
from keras_mp.muppet.quantizer import check_word_length


def _positive_int(value, name):
    """`value` as an int, or a ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(
            f"`{name}` must be a positive int. Received: {value!r}"
        )
    if value < 1:
        raise ValueError(f"`{name}` must be >= 1. Received: {name}={value}")
    return int(value)


class PrecisionSwitching(keras.callbacks.Callback):
    """Runs MuPPET's precision schedule during `model.fit`.

    The model must come from `keras_mp.fixed_point_model()`. Training starts
    at `schedule[0]` bits and moves up one precision at a time, either
    adaptively (MuPPET's gradient-diversity rule, see `SwitchingPolicy`) or
    at fixed epochs (`epoch_schedule`). Each epoch adds to the `fit` logs:
    `precision` (bits used in that epoch, 32 for float32), `p` and
    `diversity` (NaN except at checks, which come every `resolution`
    epochs), `T` (the threshold T(e)) and `switched` (1.0 in the epoch
    after which the precision went up). `switch_epochs` lists the epochs
    that started a new precision.

    Gradients: each fixed-point layer records every step's weight
    gradients (one write per step, no extra pass; see `docs/muppet.md`),
    divided by the optimizer's loss scale and only when finite (a step that
    loss scaling skips leaves the previous step's gradients), and at each
    epoch end this callback adds the last-minibatch gradients to the window
    sums kept in the model. The state (stage, violations,
    maximum diversity, window sums, held learning rate) lives in model
    variables, so `.keras` files and `keras.callbacks.BackupAndRestore`
    resume it; list this callback *before* `BackupAndRestore` so its
    epoch-end update is in the checkpoint, and resume with the same
    `schedule`.

    Learning rate: while in fixed point the learning rate is held at its
    value when training started in fixed point; it is re-assigned at each
    epoch start, overriding `ReduceLROnPlateau` and, if this callback is
    listed after it, `LearningRateScheduler`. In float32 those apply as
    usual. A `LearningRateSchedule` object (a function of the step) cannot
    be held: a warning says so.

    Args:
        schedule: sequence of bit widths in 2..32, strictly increasing,
            ending with None (float32). Defaults to `(8, 12, 14, 16, None)`.
        resolution: int >= 2. Epochs per diversity window (r). Defaults
            to 3.
        patience: int. Violations at one precision before switching
            (gamma). Defaults to 2.
        epoch_schedule: None or a strictly increasing sequence of
            `len(schedule) - 1` epochs; precision `schedule[i + 1]` starts
            at epoch `epoch_schedule[i]`. Replaces the adaptive rule.
            Defaults to None.
        hold_learning_rate: bool. Hold the learning rate while in fixed
            point. Defaults to True.
        verbose: int. 1 prints each switch. Defaults to 0.

    Raises:
        ValueError: a bad schedule, resolution, patience or epoch_schedule;
            at `fit` time, a model without fixed-point layers.

    Example:

    ```python
    fp = keras_mp.fixed_point_model(model)
    fp.compile("sgd", "sparse_categorical_crossentropy")
    switching = keras_mp.PrecisionSwitching()
    history = fp.fit(x, y, epochs=30, callbacks=[switching])
    history.history["precision"], switching.switch_epochs
    ```
    """

    def __init__(
        self,
        schedule=DEFAULT_SCHEDULE,
        resolution=3,
        patience=2,
        epoch_schedule=None,
        hold_learning_rate=True,
        verbose=0,
    ):
        require_tensorflow("keras_mp.PrecisionSwitching")
        super().__init__()
        self.schedule = check_schedule(schedule)
        self.resolution = _positive_int(resolution, "resolution")
        if self.resolution < 2 and epoch_schedule is None:
            raise ValueError(
                "`resolution` must be >= 2: the diversity of a one-epoch "
                "window is always 1, so the policy could never switch. "
                f"Received: resolution={resolution}. Use the default 3, or "
                "`epoch_schedule` for fixed switch epochs."
            )
        self.patience = _positive_int(patience, "patience")
        if epoch_schedule is not None:
            epoch_schedule = tuple(epoch_schedule)
            bad = any(
                isinstance(e, bool) or not isinstance(e, (int, np.integer))
                for e in epoch_schedule
            )
            if (
                bad
                or len(epoch_schedule) != len(self.schedule) - 1
                or any(e < 1 for e in epoch_schedule)
                or any(
                    a >= b
                    for a, b in zip(
                        epoch_schedule, epoch_schedule[1:], strict=False
                    )
                )
            ):
                raise ValueError(
                    "`epoch_schedule` must hold one strictly increasing epoch "
                    f">= 1 per switch ({len(self.schedule) - 1} for "
                    f"schedule={self.schedule}). Received: "
                    f"epoch_schedule={epoch_schedule!r}"
                )
        self.epoch_schedule = epoch_schedule
        self.hold_learning_rate = hold_learning_rate
        self.verbose = verbose
        self.switch_epochs = []
        self.history = {"epoch": [], "precision": [], "p": [], "T": []}
        self._warned_schedule = False

    def _layers(self):
        state = precision_state(self.model)
        layers = list(fixed_point_layers(self.model))
        if state is None or not layers:
            raise ValueError(
                "PrecisionSwitching needs a model built by "
                "keras_mp.fixed_point_model(model); model "
                f"'{self.model.name}' has no PrecisionState and fixed-point "
                "layers."
            )
        return state, layers

    def _set_precision(self, stage):
        bits = float(check_word_length(self.schedule[stage]))
        for layer in self._fixed_layers:
            if float(layer.word_length.numpy()) != bits:
                layer.word_length.assign(bits)

    def _hold_learning_rate(self, final):
        optimizer = self.model.optimizer
        if final or not self.hold_learning_rate or optimizer is None:
            return
        held = float(self._state.held_learning_rate.numpy())
        try:
            if held < 0:
                held = float(np.asarray(optimizer.learning_rate))
                self._state.held_learning_rate.assign(held)
            optimizer.learning_rate = held
        except TypeError:
            if not self._warned_schedule:
                warnings.warn(
                    "PrecisionSwitching cannot hold a LearningRateSchedule "
                    "object during fixed-point training; pass a float "
                    "learning rate (with LearningRateScheduler) or "
                    "hold_learning_rate=False.",
                    stacklevel=2,
                )
                self._warned_schedule = True

    def on_train_begin(self, logs=None):
        self._state, self._fixed_layers = self._layers()
        self._wrappers = [
            layer
            for layer in self._fixed_layers
            if getattr(layer, "last_gradients", None)
        ]
        # Record gradients divided by the loss scale: the policy compares
        # epochs, which loss scaling would otherwise weigh by their scale.
        if unscale_recorded_gradients(self._wrappers, self.model.optimizer):
            _models.reset_compiled_functions(self.model)
        stage = int(self._state.stage.numpy())
        if stage >= len(self.schedule):
            raise ValueError(
                f"The model's saved precision state is at stage {stage}, "
                f"past the end of schedule={self.schedule}. Resume with the "
                "schedule the model was trained with."
            )

    def _stage(self, epoch):
        if self.epoch_schedule is not None:
            return sum(epoch >= e for e in self.epoch_schedule)
        return int(self._state.stage.numpy())

    def on_epoch_begin(self, epoch, logs=None):
        stage = self._stage(epoch)
        self._state.stage.assign(float(stage))
        self._set_precision(stage)
        self._hold_learning_rate(stage >= len(self.schedule) - 1)

    def _accumulate(self):
        for wrapper in self._wrappers:
            squares = wrapper.gradient_square_sums.numpy()
            for i, (last, total) in enumerate(
                zip(wrapper.last_gradients, wrapper.gradient_sums, strict=True)
            ):
                g = np.asarray(last.numpy(), "float64")
                total.assign(total.numpy() + g)
                squares[i] += float(np.sum(g * g))
            wrapper.gradient_square_sums.assign(squares)

    def _window_diversity(self):
        """Mean per-tensor diversity of the window; resets the sums."""
        sums, squares = [], []
        for wrapper in self._wrappers:
            sums += [total.numpy() for total in wrapper.gradient_sums]
            squares += list(wrapper.gradient_square_sums.numpy())
            for total in wrapper.gradient_sums:
                total.assign(np.zeros(total.shape, "float32"))
            wrapper.gradient_square_sums.assign(
                np.zeros(wrapper.gradient_square_sums.shape, "float32")
            )
        values = tensor_diversities(sums, squares)
        return float(np.mean(values)) if values else math.nan

    def _policy_check(self, epoch):
        state = self._state
        policy = SwitchingPolicy(
            self.schedule,
            self.patience,
            int(state.stage.numpy()),
            int(state.violations.numpy()),
            float(state.max_diversity.numpy()),
        )
        self._accumulate()
        window = int(state.window_epochs.numpy()) + 1
        if window < self.resolution:
            state.window_epochs.assign(float(window))
            return math.nan, math.nan, False
        state.window_epochs.assign(0.0)
        diversity = self._window_diversity()
        p, threshold, switched = policy.update(diversity, epoch)
        state.stage.assign(float(policy.stage))
        state.violations.assign(float(policy.violations))
        state.max_diversity.assign(policy.max_diversity)
        return diversity, p, switched

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        stage = int(self._state.stage.numpy())
        bits = self.schedule[stage] or 32
        diversity, p, switched = math.nan, math.nan, False
        if self.epoch_schedule is not None:
            switched = self._stage(epoch + 1) > stage
        elif stage < len(self.schedule) - 1:
            diversity, p, switched = self._policy_check(epoch)
        threshold = switching_threshold(epoch)
        if switched:
            self.switch_epochs.append(epoch + 1)
            if self.verbose:
                new = self.schedule[stage + 1] or 32
                print(
                    f"\nPrecisionSwitching: {bits} -> {new} bits at epoch "
                    f"{epoch + 1}"
                )
        logs.update(
            precision=float(bits),
            p=p,
            T=threshold,
            diversity=diversity,
            switched=float(switched),
        )
        for key, value in (("epoch", epoch), ("precision", bits), ("p", p)):
            self.history[key].append(value)
        self.history["T"].append(threshold)

    def get_config(self):
        return {
            "schedule": self.schedule,
            "resolution": self.resolution,
            "patience": self.patience,
            "epoch_schedule": self.epoch_schedule,
            "hold_learning_rate": self.hold_learning_rate,
            "verbose": self.verbose,
        }
