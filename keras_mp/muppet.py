"""MuPPET precision switching: gradient diversity policy, callback, cost model.

MuPPET (Rajagopal et al., ICML 2020, arXiv 2006.09049) trains a network in
8-, 12-, 14- and 16-bit dynamic fixed point before finishing in float32, and
decides at run time when to move up: when the gradients of successive
epochs stop carrying new information (their diversity drops well below the
best seen at this precision). `keras_mp.fixed_point` holds the quantizer and
the layers; this module holds the policy (`SwitchingPolicy`), the
`PrecisionSwitching` callback, a GPU cost model (`estimate_speedup`) and
`plot_precision`.

How the policy sees gradients: every `FixedPointWrapper` writes the weight
gradient of each training step into a variable (`last_gradients`) from
inside the backward pass, so after an epoch those variables hold that
epoch's last-minibatch gradients, as in the authors' code. Per step this
costs one extra write of each weight gradient (the size of the weights, no
extra FLOPs, no extra forward or backward pass); per epoch the callback
reads them once into the window sums.
"""

import dataclasses
import math
import os
import tempfile
import warnings

import keras
import numpy as np

from keras_mp._compat import optional_import
from keras_mp.fixed_point import (
    FixedPointInput,
    FixedPointWrapper,
    PrecisionState,
    check_word_length,
    fixed_point_layers,
    fixed_point_model,
    fixed_point_quantize,
    precision_state,
    set_word_length,
)

__all__ = [
    "FixedPointInput",
    "FixedPointWrapper",
    "GPU_THROUGHPUT",
    "PrecisionState",
    "PrecisionSwitching",
    "SwitchingPolicy",
    "estimate_speedup",
    "fixed_point_model",
    "fixed_point_quantize",
    "gradient_diversity",
    "plot_precision",
    "set_word_length",
    "switching_threshold",
]

DEFAULT_SCHEDULE = (8, 12, 14, 16, None)


def switching_threshold(epoch):
    """MuPPET's threshold `T(e) = 1 + 1.5 exp(-0.1 e)` at global epoch `e`."""
    return 1.0 + 1.5 * math.exp(-0.1 * epoch)


def _tensor_diversities(sums, square_sums):
    """Per-tensor `sum_e ||g_e||^2 / ||sum_e g_e||^2`, skipping zero sums."""
    out = []
    for total, square in zip(sums, square_sums, strict=True):
        norm = float(np.sum(np.square(total, dtype="float64")))
        if norm > 0.0:
            out.append(float(square) / norm)
    return out


def gradient_diversity(gradients):
    """Gradient diversity of a window of epochs, averaged over tensors.

    For each parameter tensor, `sum_e ||g_e||^2 / ||sum_e g_e||^2` over the
    epochs `e` of the window (1 / r when all r gradients are equal, large
    when they point in different directions), then the mean over tensors.
    Tensors whose gradients sum to zero are left out.

    Args:
        gradients: list over epochs of lists over parameter tensors (arrays).

    Returns:
        float, or NaN when every tensor's gradient sum is zero.

    Example:

    >>> gradient_diversity([[np.array([1.0, 0.0])], [np.array([0.0, 1.0])]])
    1.0
    """
    if not gradients:
        raise ValueError("gradient_diversity() needs at least one epoch.")
    per_epoch = [[np.asarray(g, "float64") for g in gs] for gs in gradients]
    sums = [sum(gs) for gs in zip(*per_epoch, strict=True)]
    squares = [
        sum(np.sum(g * g) for g in gs) for gs in zip(*per_epoch, strict=True)
    ]
    values = _tensor_diversities(sums, squares)
    return float(np.mean(values)) if values else math.nan


def _check_schedule(schedule):
    if isinstance(schedule, (str, bytes)) or not hasattr(schedule, "__len__"):
        raise ValueError(
            f"`schedule` must be a sequence of bit widths ending with None "
            f"(float32), e.g. {DEFAULT_SCHEDULE}. Received: "
            f"schedule={schedule!r}"
        )
    schedule = tuple(schedule)
    if len(schedule) < 1 or schedule[-1] is not None:
        raise ValueError(
            "`schedule` must end with None (float32) so that training "
            f"finishes in float32. Received: schedule={schedule!r}. Append "
            "None, e.g. schedule=(8, 12, 14, 16, None)."
        )
    bits = [check_word_length(b, "schedule entry") for b in schedule[:-1]]
    if any(b == 0 for b in bits) or any(
        a >= b for a, b in zip(bits, bits[1:], strict=False)
    ):
        raise ValueError(
            "`schedule` bit widths must strictly increase, with None "
            f"(float32) only at the end. Received: schedule={schedule!r}"
        )
    return schedule


@dataclasses.dataclass
class SwitchingPolicy:
    """MuPPET's switching rule, one check per window of epochs.

    At a check at global epoch `e` with window diversity `d`: the maximum
    diversity since the last switch becomes `max(max, d)`, `p = max / d`,
    and the check is a violation when `p > T(e)`. After `patience`
    violations at one precision, training moves to the next precision and
    the maximum and the violation count reset. Once at the last stage
    (float32) `p` and `T` are still reported but nothing switches.

    Attributes:
        schedule: tuple of bit widths ending with None.
        patience: int. Violations that trigger a switch (gamma).
        stage: int. Index of the current precision in `schedule`.
        violations: int. Violations at the current precision.
        max_diversity: float. Maximum diversity since the last switch.

    Example:

    >>> policy = SwitchingPolicy((8, None), patience=1)
    >>> policy.update(2.0, epoch=2)[2]  # p = 1 <= T(2) = 2.23
    False
    >>> policy.update(1.0, epoch=5)[2]  # p = 2.0 > T(5) = 1.91: switch
    True
    >>> policy.stage
    1
    """

    schedule: tuple = DEFAULT_SCHEDULE
    patience: int = 2
    stage: int = 0
    violations: int = 0
    max_diversity: float = 0.0

    @property
    def final(self):
        return self.stage >= len(self.schedule) - 1

    def update(self, diversity, epoch):
        """Records one check. Returns `(p, T, switched)`."""
        threshold = switching_threshold(epoch)
        if not math.isfinite(diversity) or diversity <= 0.0:
            return math.nan, threshold, False
        self.max_diversity = max(self.max_diversity, diversity)
        p = self.max_diversity / diversity
        if self.final:
            return p, threshold, False
        if p > threshold:
            self.violations += 1
        if self.violations >= self.patience:
            self.stage += 1
            self.violations = 0
            self.max_diversity = 0.0
            return p, threshold, True
        return p, threshold, False


def _positive_int(value, name):
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

    Gradients: each `FixedPointWrapper` records every step's weight
    gradients (one write per step, no extra pass; see `keras_mp.muppet`),
    and at each epoch end this callback adds the last-minibatch gradients to
    the window sums kept in the model. The state (stage, violations,
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
        super().__init__()
        self.schedule = _check_schedule(schedule)
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
            if isinstance(layer, FixedPointWrapper)
        ]
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
        values = _tensor_diversities(sums, squares)
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


# Peak dense tensor throughput (TFLOPS / TOPS, no sparsity) from NVIDIA's
# Turing architecture whitepaper (RTX 2080 Ti at reference clocks) and the
# T4 datasheet. Turing has no TF32: float32 runs on CUDA cores.
GPU_THROUGHPUT = {
    "rtx2080ti": {
        "name": "NVIDIA GeForce RTX 2080 Ti (Turing TU102)",
        "fp32": 13.4,
        "fp16": 53.8,  # FP16 tensor cores with FP32 accumulation
        "int8": 215.2,
        "int4": 430.3,
    },
    "t4": {
        "name": "NVIDIA T4 (Turing TU104)",
        "fp32": 8.1,
        "fp16": 65.0,
        "int8": 130.0,
        "int4": 260.0,
    },
}


def precision_unit(word_length):
    """GPU arithmetic assumed for a MuPPET word length (None = float32).

    Up to 4 bits: INT4 tensor cores; 5-8 bits: INT8; 9-16 bits: the 16-bit
    tensor-core path at the FP16 rate (Turing has no INT16 tensor cores, so
    this assumes a 16-bit integer GEMM as fast as FP16); wider: FP32.
    """
    bits = check_word_length(word_length)
    if bits == 0 or bits > 16:
        return "fp32"
    if bits <= 4:
        return "int4"
    return "int8" if bits <= 8 else "fp16"


def estimate_speedup(precisions, gpu="rtx2080ti", compute_fraction=0.6):
    """Estimates the GPU training speed-up of a MuPPET run over float32.

    Amdahl's law per epoch: a share `compute_fraction` of a float32
    training step (convolutions and matrix products) runs on the unit that
    `precision_unit()` assigns to the epoch's word length, at the peak
    throughput of `GPU_THROUGHPUT[gpu]`; the rest (memory-bound element-wise
    ops, quantization, optimizer, input pipeline) does not speed up.
    Speed-up = epochs / sum over epochs of relative epoch time. This is an
    estimate from peak rates: it ignores the cost of quantizing and assumes
    kernels reach the same share of peak at every precision. It says
    nothing about the CPU here, where fixed point is only emulated and runs
    slower than float32.

    Args:
        precisions: sequence of per-epoch word lengths (None or 32 for
            float32), e.g. `history.history["precision"]`.
        gpu: str. Key of `GPU_THROUGHPUT`. Defaults to `"rtx2080ti"`.
        compute_fraction: float in [0, 1]. Defaults to 0.6.

    Returns:
        dict with `speedup`, `gpu`, `epochs_per_precision`,
        `relative_epoch_time` and `assumptions`.

    Example:

    >>> round(estimate_speedup([8, 8, 16, None])["speedup"], 2)
    1.65
    """
    if gpu not in GPU_THROUGHPUT:
        raise ValueError(
            f"Unknown `gpu`: {gpu!r}. Choose one of {sorted(GPU_THROUGHPUT)} "
            "or add its peak rates to keras_mp.muppet.GPU_THROUGHPUT."
        )
    if not 0.0 <= compute_fraction <= 1.0:
        raise ValueError(
            "`compute_fraction` must be in [0, 1]. Received: "
            f"compute_fraction={compute_fraction}"
        )
    if len(precisions) == 0:
        raise ValueError("estimate_speedup() needs at least one epoch.")
    rates = GPU_THROUGHPUT[gpu]
    counts, relative = {}, {}
    for bits in precisions:
        bits = None if bits is None or int(bits) in (0, 32) else int(bits)
        key = bits or 32
        counts[key] = counts.get(key, 0) + 1
        unit = precision_unit(bits)
        relative[key] = (1.0 - compute_fraction) + compute_fraction * (
            rates["fp32"] / rates[unit]
        )
    total = sum(counts[k] * relative[k] for k in counts)
    return {
        "speedup": len(precisions) / total,
        "gpu": rates["name"],
        "epochs_per_precision": counts,
        "relative_epoch_time": relative,
        "assumptions": (
            f"{compute_fraction:.0%} of a float32 step in conv/GEMM at peak "
            f"rates of {rates['name']} (FP32 {rates['fp32']}, FP16 "
            f"{rates['fp16']}, INT8 {rates['int8']} T(FL)OPS); 9-16 bits at "
            "the FP16 rate; quantization overhead ignored"
        ),
    }


def _precision_history(history_or_callback):
    if isinstance(history_or_callback, PrecisionSwitching):
        return history_or_callback.history
    logs = getattr(history_or_callback, "history", history_or_callback)
    if not isinstance(logs, dict) or "precision" not in logs:
        raise ValueError(
            "plot_precision() needs a PrecisionSwitching callback, or the "
            "History (or its dict) of a fit that used one; received "
            f"{type(history_or_callback).__name__} without 'precision'."
        )
    n = len(logs["precision"])
    return {
        "epoch": list(range(n)),
        "precision": logs["precision"],
        "p": logs.get("p", [math.nan] * n),
        "T": logs.get("T", [switching_threshold(e) for e in range(n)]),
    }


def plot_precision(history_or_callback, path):
    """Plots p(e), T(e) and the precision over epochs to a PNG file.

    Args:
        history_or_callback: a `PrecisionSwitching` callback, a `History`
            returned by `fit`, or its `.history` dict.
        path: str. Output PNG path, written atomically.

    Returns:
        `path`.

    Raises:
        ImportError: matplotlib is missing (`pip install keras-mp[plot]`).

    Example:

    >>> plot_precision(history, "precision.png")  # doctest: +SKIP
    """
    data = _precision_history(history_or_callback)
    optional_import("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    epochs = np.asarray(data["epoch"])
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 5))
    top.plot(epochs, data["T"], "-", label="T(e) = 1 + 1.5 exp(-0.1 e)")
    top.plot(epochs, data["p"], "o", label="p = max diversity / diversity")
    top.set_ylabel("p, T")
    top.legend()
    bits = [32 if b is None else b for b in data["precision"]]
    bottom.step(epochs, bits, where="post")
    bottom.set_ylabel("word length (bits)")
    bottom.set_xlabel("epoch")
    top.set_title("MuPPET precision switching")
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=folder)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
