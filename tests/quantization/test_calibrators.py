"""Each calibrator against a value computed here, independently, on a
seeded Gaussian sample of 200,000 values (one `collect`: the histogram then
spans [0, max|x|] in 2,048 bins, like `np.histogram` below)."""

import numpy as np
import pytest

from keras_mp.quantization.calibrators import (
    CALIBRATORS,
    NUM_BINS,
    EntropyCalibrator,
    MaxCalibrator,
    MseCalibrator,
    PercentileCalibrator,
)

X = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)
ABS = np.abs(X)
BIN = float(ABS.max()) / NUM_BINS  # the calibrators' histogram resolution


def _amax(calibrator, num_bits=8):
    calibrator.collect(X)
    return calibrator.compute_amax(num_bits)


def _fake_quant_mse(x, clip, num_bits):
    """MSE of symmetric fake quantization `[-qmax, qmax]` at `clip`: the
    calibrators model |x|, so the extra negative level is not in play."""
    qmax = 2 ** (num_bits - 1) - 1
    scale = clip / qmax
    q = np.clip(np.round(x / scale), -qmax, qmax) * scale
    return float(np.mean((x - q) ** 2))


def _brute_force_mse(num_bits, candidates=400):
    clips = np.linspace(ABS.max() / candidates, ABS.max(), candidates)
    errors = [_fake_quant_mse(X, c, num_bits) for c in clips]
    best = int(np.argmin(errors))
    return clips[best], errors[best]


def _kl_threshold(num_bits):
    """TensorRT's entropy calibration, as its reference implementation
    (pytorch-quantization) spaces the merged bins: for each candidate
    threshold of i bins, P = the first i bins with the outliers added to the
    last, Q = those i bins merged into 2**(bits-1) groups (edges
    `linspace(0, i, levels + 1)`) and spread back over each group's
    non-empty bins; the threshold of least KL(P || Q), the largest on ties.
    Bin 0 takes bin 1's count, as there (it only matters for ReLU spikes)."""
    hist, edges = np.histogram(ABS, bins=NUM_BINS, range=(0, ABS.max()))
    hist = hist.astype(np.float64)
    hist[0] = hist[1]
    levels = 2 ** (num_bits - 1)
    divergences = []
    for i in range(levels, NUM_BINS + 1):
        p = hist[:i].copy()
        p[-1] += hist[i:].sum()
        group = np.digitize(np.arange(i), np.linspace(0, i, levels + 1)) - 1
        full = hist[:i] > 0
        q = np.zeros(i)
        for g in range(levels):
            members = (group == g) & full
            if members.any():
                q[members] = hist[:i][group == g].sum() / members.sum()
        p, q = p / p.sum(), q / q.sum()
        with np.errstate(divide="ignore"):  # mass where Q has none: inf
            kl = np.sum(p[p > 0] * np.log(p[p > 0] / q[p > 0]))
        divergences.append(kl)
    divergences = np.array(divergences)
    best = len(divergences) - 1 - int(np.argmin(divergences[::-1]))
    return edges[best + levels]


def test_max_is_the_largest_magnitude():
    assert _amax(MaxCalibrator()) == float(ABS.max())


def test_percentile_matches_numpy_within_one_bin():
    want = np.percentile(ABS, 99.99)
    got = _amax(PercentileCalibrator(percentile=99.99))
    assert abs(got - want) <= BIN, (got, want, BIN)
    got_99 = _amax(PercentileCalibrator(percentile=99.0))
    assert abs(got_99 - np.percentile(ABS, 99.0)) <= BIN


@pytest.mark.parametrize("num_bits", [8, 4])
def test_mse_matches_the_brute_force_optimum(num_bits):
    clip, best = _brute_force_mse(num_bits)
    got = _amax(MseCalibrator(), num_bits)
    # 256 candidate ranges on a histogram against 400 clips on the sample:
    # the range within 2%, its error within 1% of the optimum.
    assert abs(got - clip) <= 0.02 * clip, (got, clip)
    assert _fake_quant_mse(X, got, num_bits) <= 1.01 * best


@pytest.mark.parametrize("num_bits", [8, 4])
def test_entropy_matches_the_kl_optimal_threshold(num_bits):
    want = _kl_threshold(num_bits)
    got = _amax(EntropyCalibrator(), num_bits)
    assert abs(got - want) <= BIN, (got, want)


@pytest.mark.parametrize("method", ["entropy", "mse"])
def test_fewer_bits_pick_a_smaller_range(method):
    eight = _amax(CALIBRATORS[method](), 8)
    four = _amax(CALIBRATORS[method](), 4)
    assert four < 0.9 * eight, (four, eight)


def test_entropy_is_not_fooled_by_relu_zeros():
    rng = np.random.default_rng(0)
    relu = np.maximum(rng.standard_normal(200_000), 0.0)  # half exact zeros
    calibrator = EntropyCalibrator("relu")
    calibrator.collect(relu)
    amax = calibrator.compute_amax(8)
    # KL keeps most of the range of a half-normal: not the 10% the zero
    # spike would pick, not the outlier max either
    assert 0.5 * calibrator.observed_max < amax < calibrator.observed_max


@pytest.mark.parametrize("method", ["percentile"])
def test_histogram_grows_with_later_batches(method):
    """Two batches, the second wider: the same range as one batch of both,
    to the resolution of the two histograms (entropy and MSE search over the
    bins, so their answer depends on the bin width itself)."""
    small, large = X[:100_000] * 0.5, X[100_000:]
    split = CALIBRATORS[method]()
    split.collect(small)
    split.collect(large)
    whole = CALIBRATORS[method]()
    whole.collect(np.concatenate([small, large]))
    width = float(np.abs(small).max()) / NUM_BINS
    assert split.observed_max == whole.observed_max
    assert abs(split.compute_amax(8) - whole.compute_amax(8)) <= 2 * width


@pytest.mark.parametrize("method", sorted(CALIBRATORS))
def test_all_zero_inputs_give_a_zero_range(method):
    calibrator = CALIBRATORS[method]()
    calibrator.collect(np.zeros(100, np.float32))
    assert calibrator.compute_amax(8) == 0.0
