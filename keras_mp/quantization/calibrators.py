"""Calibrators: the range of one activation quantizer from the data it sees.

Each is a small object, ModelOpt-style: `collect(x)` once per batch, then
`compute_amax(num_bits)`. The methods and their trade-offs:
`docs/quantization.md`.
"""

import numpy as np

from keras_mp.quantization.formats import number_format

# Bins of the |x| histogram the percentile, entropy and MSE methods share.
NUM_BINS = 2048


class Calibrator:
    """Running `max|x|` of one quantizer's input: the base of every method.

    Args:
        name: str. The quantizer's name, for error messages. Defaults to "".

    Example:

    >>> calibrator = MaxCalibrator("conv/input_0")
    >>> calibrator.collect(x)
    >>> amax = calibrator.compute_amax(num_bits=8)
    """

    def __init__(self, name=""):
        self.name = name
        self.observed_max = 0.0
        self.batches = 0

    def collect(self, x):
        """Adds one batch of inputs `x` (any shape).

        Raises:
            ValueError: `x` holds NaN or Inf.
        """
        x = np.abs(np.asarray(x, np.float32)).ravel()
        if not np.all(np.isfinite(x)):
            bad = int(np.sum(~np.isfinite(x)))
            raise ValueError(
                f"Calibration data produced {bad} non-finite value(s) at the "
                f"input of {self.name!r} (batch {self.batches}). Remove "
                "NaN/Inf from the data or fix the layers before it."
            )
        self.batches += 1
        self.observed_max = max(
            self.observed_max, float(x.max()) if x.size else 0.0
        )
        self._update(x)

    def _update(self, abs_x):
        """Subclass hook: one batch of `|x|`, flattened, finite."""

    def compute_amax(self, num_bits=8):
        """The range for a symmetric quantizer of `num_bits` bits, or of a
        `NumberFormat` row (`"fp8"`) (0.0 when every input seen was 0)."""
        if self.observed_max == 0.0:
            return 0.0
        return self._compute_amax(number_format(num_bits))

    def _compute_amax(self, fmt):
        raise NotImplementedError


class MaxCalibrator(Calibrator):
    """The largest `|x|` seen: nothing is clipped."""

    def _compute_amax(self, fmt):
        return self.observed_max


class HistogramCalibrator(Calibrator):
    """A `NUM_BINS`-bin histogram of `|x|`; the range of the first non-zero
    batch sets the bin width, and later batches add bins of that width."""

    def __init__(self, name=""):
        super().__init__(name)
        self.hist = None
        self.bin_width = None

    def _update(self, x):
        batch_max = float(x.max()) if x.size else 0.0
        if self.hist is None:
            if batch_max == 0.0:
                return
            self.bin_width = batch_max / NUM_BINS
            self.hist = np.zeros(NUM_BINS, np.int64)
        needed = int(np.ceil(batch_max / self.bin_width))
        if needed > len(self.hist):
            grow = np.zeros(needed - len(self.hist), np.int64)
            self.hist = np.concatenate([self.hist, grow])
        idx = np.minimum(
            (x / self.bin_width).astype(np.int64), len(self.hist) - 1
        )
        self.hist += np.bincount(idx, minlength=len(self.hist))

    @property
    def edges(self):
        """The histogram's bin edges, `len(hist) + 1` of them."""
        return np.arange(len(self.hist) + 1) * self.bin_width


class PercentileCalibrator(HistogramCalibrator):
    """The `percentile`-th percentile of `|x|`, to one bin.

    Args:
        name: str. The quantizer's name. Defaults to "".
        percentile: float in (0, 100]. Defaults to 99.99.
    """

    def __init__(self, name="", percentile=99.99):
        super().__init__(name)
        self.percentile = percentile

    def _compute_amax(self, fmt):
        cdf = np.cumsum(self.hist) / self.hist.sum()
        idx = int(np.searchsorted(cdf, self.percentile / 100.0))
        return float(self.edges[min(idx + 1, len(self.hist))])


class EntropyCalibrator(HistogramCalibrator):
    """TensorRT's calibration: the clip threshold whose `2**(num_bits-1)`
    level quantized distribution is closest (least KL divergence) to the
    clipped reference distribution."""

    def _compute_amax(self, fmt):
        hist = self.hist.astype(np.float64)
        # ReLU outputs put half their mass in bin 0; that spike would
        # dominate the divergence and pick a tiny range. TensorRT's
        # reference implementation (pytorch-quantization) flattens it too.
        hist[0] = hist[1]
        # a uniform grid of `levels` steps (for FP8 too: its grid is not
        # uniform, the max, percentile or MSE methods model it better)
        levels = 2 ** (fmt.bits - 1)
        best, best_i = np.inf, len(hist)
        for i in range(levels, len(hist) + 1):
            ref = hist[:i].copy()
            ref[-1] += hist[i:].sum()
            nonzero = hist[:i] != 0
            # merge i bins into `levels` groups, spread each group's mass
            # back over its non-empty bins
            group = (np.arange(i) * levels) // i
            sums = np.bincount(group, weights=hist[:i], minlength=levels)
            counts = np.bincount(group, weights=nonzero, minlength=levels)
            q = np.where(
                nonzero, sums[group] / np.maximum(counts[group], 1), 0.0
            )
            if q.sum() == 0:
                continue
            p, q = ref / ref.sum(), q / q.sum()
            mask = p > 0
            kl = np.sum(p[mask] * np.log(p[mask] / np.maximum(q[mask], 1e-12)))
            if kl <= best:  # ties: the larger range, as TensorRT does
                best, best_i = kl, i
        return float(self.edges[best_i])


class MseCalibrator(HistogramCalibrator):
    """The range that minimizes the histogram-weighted quantization MSE.

    Args:
        name: str. The quantizer's name. Defaults to "".
        candidates: int. Ranges tried, evenly spaced up to `max|x|`.
            Defaults to 256.
    """

    def __init__(self, name="", candidates=256):
        super().__init__(name)
        self.candidates = candidates

    def _compute_amax(self, fmt):
        hist = self.hist.astype(np.float64)
        centers = (self.edges[:-1] + self.edges[1:]) / 2
        top = self.observed_max
        amaxes = np.linspace(top / self.candidates, top, self.candidates)
        errors = []
        for amax in amaxes:  # the format's own grid (int8, FP8, ...)
            scale = amax / fmt.qmax
            q = fmt.encode(centers / scale).astype(np.float64) * scale
            errors.append(np.sum(hist * (centers - q) ** 2))
        return float(amaxes[int(np.argmin(errors))])


CALIBRATORS = {
    "max": MaxCalibrator,
    "percentile": PercentileCalibrator,
    "entropy": EntropyCalibrator,
    "mse": MseCalibrator,
}
