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
        `NumberFormat` row (`"float8"`) (0.0 when every input seen was 0)."""
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

    def share_histogram(self, other):
        """Takes the inputs `other` has seen (its histogram and max)."""
        self.hist, self.bin_width = other.hist, other.bin_width
        self.observed_max, self.batches = other.observed_max, other.batches

    def saturated(self, amax):
        """The fraction of the inputs seen beyond `amax` (those clipped to
        it), by bin centers."""
        centers = (self.edges[:-1] + self.edges[1:]) / 2
        total = self.hist.sum()
        return float(self.hist[centers > amax].sum() / total) if total else 0.0

    def quantization_error(self, fmt, amax):
        """The mean squared error of the inputs seen rounded to `fmt`'s
        grid over `[-amax, amax]`, each bin's center standing for its
        inputs (exact to half a bin, `max|x| / 4096`)."""
        hist = self.hist.astype(np.float64)
        centers = (self.edges[:-1] + self.edges[1:]) / 2
        scale = amax / fmt.qmax
        q = fmt.encode(centers / scale).astype(np.float64) * scale
        return float(np.sum(hist * (centers - q) ** 2) / hist.sum())


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
    """TensorRT's entropy calibration, as pytorch-quantization and ModelOpt
    implement it: the clip threshold whose quantized distribution is
    closest (least KL divergence) to the clipped reference distribution.

    Candidates are the histogram's bin edges from `start_bin` (of the
    `NUM_BINS`-bin histogram) to the largest input, every `stride` bins;
    for each, the first `i` bins are merged into the format's levels
    (`2 ** (num_bits - 1)`, twice that for an `unsigned` quantizer; for a
    floating-point row such as FP8, the bins sharing one code of its grid),
    each level's mass is spread back over its non-empty bins, and the
    outliers past the threshold are added to the reference's last bin. The
    last of equal divergences wins (the larger range, as TensorRT does).

    A spike in the histogram (one value many inputs share, such as a
    ReLU'd BatchNorm of a zero background) draws the search, TensorRT's
    and ModelOpt's alike: it tends to stop just past the largest one and
    clip everything above (the demo's CNN: `docs/quantization.md`).

    Args:
        name: str. The quantizer's name. Defaults to "".
        unsigned: bool. The quantizer uses all its levels on one side
            (TensorRT's quantizers are signed: keras_mp's are). Defaults to
            False.
        start_bin: int. The first candidate bin. Defaults to 128.
        stride: int. Bins between candidates. Defaults to 1.
    """

    def __init__(self, name="", unsigned=False, start_bin=128, stride=1):
        super().__init__(name)
        self.unsigned = bool(unsigned)
        self.start_bin = int(start_bin)
        self.stride = int(stride)

    def _compute_amax(self, fmt):
        divergences = self.divergences(fmt)
        best = len(divergences) - 1 - int(np.argmin(divergences[::-1]))
        return float(self.edges[self._candidates()[best]])

    def _candidates(self):
        stop = len(self.hist)
        return list(range(min(self.start_bin, stop), stop + 1, self.stride))

    def divergences(self, fmt):
        """The KL divergence of each candidate threshold (numpy array, in
        the order of the bin edges they stand at)."""
        hist = self.hist.astype(np.float64)
        # ReLU outputs put half their mass in bin 0; that spike would
        # dominate the divergence and pick a tiny range. TensorRT's
        # reference implementation flattens it the same way.
        hist[0] = hist[1]
        centers = (self.edges[:-1] + self.edges[1:]) / 2
        out = []
        for i in self._candidates():
            group = self._levels(fmt, i, centers[:i])
            nonzero = hist[:i] != 0
            sums = np.bincount(group, weights=hist[:i])
            counts = np.bincount(group, weights=nonzero)
            q = np.where(
                nonzero, sums[group] / np.maximum(counts[group], 1), 0.0
            )
            ref = hist[:i].copy()
            ref[-1] += hist[i:].sum()
            if q.sum() == 0:
                out.append(np.inf)
                continue
            p, q = ref / ref.sum(), q / q.sum()
            mask = p > 0
            with np.errstate(divide="ignore"):
                out.append(float(np.sum(p[mask] * np.log(p[mask] / q[mask]))))
        return np.asarray(out)

    def _levels(self, fmt, i, centers):
        """The level (group) index of each of the first `i` bins when the
        range ends at bin `i`."""
        if fmt.kind == "int":  # TensorRT: i bins -> nbins equal groups
            nbins = 1 << (fmt.bits - 1 + int(self.unsigned))
            return (np.arange(i) * nbins) // i
        # a floating-point grid: the bins that round to one code
        scale = self.edges[i] / fmt.qmax
        codes = fmt.encode(centers / scale).astype(np.float64)
        return np.unique(codes, return_inverse=True)[1]


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
        top = self.observed_max
        amaxes = np.linspace(top / self.candidates, top, self.candidates)
        errors = [self.quantization_error(fmt, a) for a in amaxes]
        return float(amaxes[int(np.argmin(errors))])


class AutoCalibrator(HistogramCalibrator):
    """Per tensor, the best range of every method: among the max, the
    99.9th, 99.99th and 99.999th percentiles, the entropy and the MSE
    ranges, the one with the least quantization error of that tensor
    (`quantization_error`: the mean squared error of its inputs rounded to
    the format's grid, INT8 or FP8, over the range). After
    `compute_amax`, `ranges` holds every method's range and `choice` the
    winner.
    """

    def candidates(self):
        """The histogram calibrators whose ranges compete with the max, by
        method."""
        found = {}
        for p in (99.9, 99.99, 99.999):
            found[f"percentile {p}"] = PercentileCalibrator(percentile=p)
        found["entropy"] = EntropyCalibrator()
        found["mse"] = MseCalibrator()
        return found

    def _compute_amax(self, fmt):
        self.ranges = {"max": self.observed_max}
        for method, calibrator in self.candidates().items():
            calibrator.share_histogram(self)
            self.ranges[method] = calibrator.compute_amax(fmt)
        errors = {
            method: self.quantization_error(fmt, amax)
            for method, amax in self.ranges.items()
        }
        self.choice = min(errors, key=errors.get)
        return float(self.ranges[self.choice])


CALIBRATORS = {
    "max": MaxCalibrator,
    "percentile": PercentileCalibrator,
    "entropy": EntropyCalibrator,
    "mse": MseCalibrator,
    "auto": AutoCalibrator,
}
