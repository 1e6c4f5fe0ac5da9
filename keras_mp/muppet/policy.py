"""MuPPET's switching rule: gradient diversity, threshold, policy.

MuPPET (Rajagopal et al., ICML 2020, arXiv 2006.09049) moves up one
precision when the gradients of successive epochs stop carrying new
information: their diversity drops well below the best seen at this
precision. This module holds that rule as plain Python (no Keras state);
`keras_mp.PrecisionSwitching` runs it during `fit`.
"""

import dataclasses
import math

import numpy as np

from keras_mp.muppet.quantizer import check_word_length

DEFAULT_SCHEDULE = (8, 12, 14, 16, None)


def switching_threshold(epoch):
    """MuPPET's threshold `T(e) = 1 + 1.5 exp(-0.1 e)` at global epoch `e`."""
    return 1.0 + 1.5 * math.exp(-0.1 * epoch)


def tensor_diversities(sums, square_sums):
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
    values = tensor_diversities(sums, squares)
    return float(np.mean(values)) if values else math.nan


def check_schedule(schedule):
    """Returns `schedule` as a tuple, or raises a ValueError saying why not."""
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
