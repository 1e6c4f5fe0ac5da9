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
from keras_mp.quantization.formats import number_format

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


def _kl_threshold(num_bits, unsigned=False, values=ABS):
    """TensorRT's entropy calibration, as its reference implementation
    (pytorch-quantization `_compute_amax_entropy`, `start_bin=128`,
    `stride=1`) spaces the merged bins: for each candidate threshold of i
    bins from bin 128, P = the first i bins with the outliers added to the
    last, Q = those i bins merged into `1 << (bits - 1 + unsigned)` groups
    (edges `linspace(0, i, levels + 1)`) and spread back over each group's
    non-empty bins; the threshold of least KL(P || Q), the largest on ties.
    Bin 0 takes bin 1's count, as there (it only matters for ReLU spikes)."""
    hist, edges = np.histogram(values, bins=NUM_BINS, range=(0, values.max()))
    hist = hist.astype(np.float64)
    hist[0] = hist[1]
    levels = 1 << (num_bits - 1 + int(unsigned))
    divergences = []
    for i in range(128, NUM_BINS + 1):
        p = hist[:i].copy()
        p[-1] += hist[i:].sum()
        group = np.digitize(np.arange(i), np.linspace(0, i, levels + 1)) - 1
        full = hist[:i] > 0
        # each group's count spread over its non-empty bins
        counts = np.bincount(group, weights=hist[:i], minlength=levels)
        nonempty = np.bincount(group, weights=full, minlength=levels)
        q = np.where(full, counts[group] / np.maximum(nonempty[group], 1), 0)
        p, q = p / p.sum(), q / q.sum()
        with np.errstate(divide="ignore"):  # mass where Q has none: inf
            kl = np.sum(p[p > 0] * np.log(p[p > 0] / q[p > 0]))
        divergences.append(kl)
    divergences = np.array(divergences)
    best = len(divergences) - 1 - int(np.argmin(divergences[::-1]))
    return edges[best + 128]


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


def test_unsigned_entropy_matches_the_reference():
    relu = np.maximum(X, 0.0)
    want = _kl_threshold(8, unsigned=True, values=relu)
    calibrator = EntropyCalibrator(unsigned=True)
    calibrator.collect(relu)
    got = calibrator.compute_amax(8)
    width = float(relu.max()) / NUM_BINS
    assert abs(got - want) <= width, (got, want)
    # 256 levels, not 128: the reference's signed answer differs
    assert abs(_kl_threshold(8, values=relu) - want) > width


def test_fp8_entropy_groups_bins_by_the_fp8_grid():
    """On the FP8 grid (3 mantissa bits, finer near zero) the KL search
    keeps more of a Gaussian's tail than on INT8's 128 even levels, and its
    range's FP8 error is no worse than the max's."""
    calibrator = EntropyCalibrator()
    calibrator.collect(X)
    fp8 = calibrator.compute_amax("float8")
    int8 = calibrator.compute_amax(8)
    assert fp8 != int8
    assert calibrator.quantization_error(
        number_format("float8"), fp8
    ) <= calibrator.quantization_error(
        number_format("float8"), float(ABS.max())
    )


@pytest.mark.parametrize("fmt", [8, "float8"])
def test_auto_picks_the_least_error_candidate(fmt):
    """Heavy-tailed data (a Laplace sample, where max clips badly): auto's
    range has the least error of every method's, measured independently
    here on the sample itself, within 1% of the best."""
    laplace = np.random.default_rng(1).laplace(size=200_000)
    laplace = laplace.astype(np.float32)
    auto = CALIBRATORS["auto"]()
    auto.collect(laplace)
    got = auto.compute_amax(fmt)
    row = number_format(fmt)

    def sample_mse(amax):
        scale = amax / row.qmax
        q = row.encode(np.abs(laplace) / scale).astype(np.float64) * scale
        return float(np.mean((np.abs(laplace) - q) ** 2))

    assert set(auto.ranges) == {
        "max",
        "percentile 99.9",
        "percentile 99.99",
        "percentile 99.999",
        "entropy",
        "mse",
    }
    assert auto.ranges[auto.choice] == got
    errors = {m: sample_mse(a) for m, a in auto.ranges.items()}
    assert sample_mse(got) <= 1.01 * min(errors.values()), errors
    assert auto.choice != "max"


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


def _bfloat16(x):
    """`x` rounded to bfloat16 (8-bit mantissa, ties to even), as float32."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.view(np.float32)


def _relu_sample(seed=0):
    return np.maximum(
        np.random.default_rng(seed).standard_normal(200_000), 0.0
    ).astype(np.float32)


def test_entropy_reads_a_bfloat16_comb_like_the_reference():
    """Activations computed under mixed_bfloat16 lie on bfloat16's grid:
    past |x| = 1 their 2,048-bin histogram is a comb of full and empty
    bins. The empty bins are read as TensorRT's reference reads them (left
    out of the merged levels; a candidate whose last bin is empty while
    outliers fall there has infinite divergence), so the range is the
    reference's, and stays near the float32 sample's on this one."""
    relu = _relu_sample()
    comb = _bfloat16(relu)
    hist, _ = np.histogram(comb, bins=NUM_BINS, range=(0, comb.max()))
    assert np.mean(hist[NUM_BINS // 2 :] == 0) > 0.5  # a comb indeed
    calibrator = EntropyCalibrator()
    calibrator.collect(comb)
    got = calibrator.compute_amax(8)
    width = float(comb.max()) / NUM_BINS
    assert abs(got - _kl_threshold(8, values=comb)) <= width
    smooth = EntropyCalibrator()
    smooth.collect(relu)
    assert abs(got - smooth.compute_amax(8)) <= 0.05 * smooth.compute_amax(8)


def test_entropy_stops_past_a_spike_like_the_reference():
    """The demo's CNN: background pixels are 0, so after the stem's conv,
    BatchNorm and ReLU each channel's background is one constant, a spike
    in the histogram (nine of them up to 0.83, 2.2% of the values each,
    11.5% of the values above them). The KL search, TensorRT's as ours,
    stops just past the largest spike: merged into wide levels the spikes
    cost every large candidate divergence, and the one whose last bin
    holds a spike absorbs the outliers added there cheaply. ModelOpt's
    calibrator gives the same range on those activations. Pinned here on
    a ReLU'd Laplace sample with nine such spikes: the behavior
    `docs/quantization.md` reports is the method's, not a slip of this
    port."""
    rng = np.random.default_rng(0)
    relu = 0.6 * np.maximum(rng.laplace(size=200_000), 0.0)
    spikes = np.repeat(np.linspace(0.1, 0.8, 9), 4_400)  # 2.2% each
    values = np.concatenate([relu, spikes]).astype(np.float32)
    calibrator = EntropyCalibrator()
    calibrator.collect(values)
    got = calibrator.compute_amax(8)
    width = float(values.max()) / NUM_BINS
    assert abs(got - _kl_threshold(8, values=values)) <= width
    assert 0.8 < got <= 0.8 + 2 * width, got  # just past the last spike
    plain = EntropyCalibrator()
    plain.collect(relu.astype(np.float32))
    assert plain.compute_amax(8) > 5 * got  # without them: most of the range


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
