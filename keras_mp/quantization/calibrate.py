"""Post-training calibration: activation ranges from real data.

Four calibrators, as TensorRT and pytorch-quantization name them: `max`
(running max of |x|), `percentile`, `entropy` (TensorRT's KL-divergence
search) and `mse`, the last three on a 2048-bin histogram of |x| whose range
grows with the data. Weights always use per-channel max. A new calibrator is
one function in `CALIBRATORS`.
"""

import dataclasses

import keras
import numpy as np

from keras_mp.mixed_precision.policy import _check_model
from keras_mp.quantization.layers import (
    QuantizeActivation,
    QuantizeWrapper,
    iter_quantize_layers,
)

NUM_BINS = 2048


class HistogramCollector:
    """Running max and histogram of |x| for one activation quantizer."""

    def __init__(self, name, num_bins=NUM_BINS):
        self.name = name
        self.num_bins = num_bins
        self.amax = 0.0
        self.hist = None
        self.bin_width = None
        self.batches = 0

    def update(self, x):
        x = np.abs(np.asarray(x, np.float32)).ravel()
        if not np.all(np.isfinite(x)):
            bad = int(np.sum(~np.isfinite(x)))
            raise ValueError(
                f"Calibration data produced {bad} non-finite value(s) at the "
                f"input of {self.name!r} (batch {self.batches}). Remove "
                "NaN/Inf from the data or fix the layers before it."
            )
        self.batches += 1
        batch_max = float(x.max()) if x.size else 0.0
        self.amax = max(self.amax, batch_max)
        if self.hist is None:
            if batch_max == 0.0:
                return
            self.bin_width = batch_max / self.num_bins
            self.hist = np.zeros(self.num_bins, np.int64)
        needed = int(np.ceil(batch_max / self.bin_width))
        if needed > len(self.hist):  # grow with bins of the same width
            self.hist = np.concatenate(
                [self.hist, np.zeros(needed - len(self.hist), np.int64)]
            )
        idx = np.minimum(
            (x / self.bin_width).astype(np.int64), len(self.hist) - 1
        )
        self.hist += np.bincount(idx, minlength=len(self.hist))

    @property
    def edges(self):
        return np.arange(len(self.hist) + 1) * self.bin_width


def _max(collector, **_):
    return collector.amax


def _percentile(collector, percentile=99.99, **_):
    cdf = np.cumsum(collector.hist) / collector.hist.sum()
    idx = int(np.searchsorted(cdf, percentile / 100.0))
    return float(collector.edges[min(idx + 1, len(collector.hist))])


def _entropy(collector, num_bits=8, stride=1, **_):
    """TensorRT's calibration: the clip threshold whose 128-level quantized
    distribution has the least KL divergence from the clipped reference."""
    hist = collector.hist.astype(np.float64)
    # ReLU outputs put half their mass in bin 0; that spike would dominate
    # the divergence and pick a tiny range. TensorRT's reference
    # implementation (pytorch-quantization) flattens it the same way.
    hist[0] = hist[1]
    levels = 2 ** (num_bits - 1)
    best, best_i = np.inf, len(hist)
    for i in range(levels, len(hist) + 1, stride):
        ref = hist[:i].copy()
        ref[-1] += hist[i:].sum()
        nonzero = hist[:i] != 0
        # merge i bins into `levels` groups, spread each group's mass back
        # over its non-empty bins
        group = (np.arange(i) * levels) // i
        sums = np.bincount(group, weights=hist[:i], minlength=levels)
        counts = np.bincount(group, weights=nonzero, minlength=levels)
        q = np.where(nonzero, sums[group] / np.maximum(counts[group], 1), 0.0)
        p_sum, q_sum = ref.sum(), q.sum()
        if q_sum == 0:
            continue
        p, q = ref / p_sum, q / q_sum
        mask = p > 0
        with np.errstate(divide="ignore"):
            kl = np.sum(p[mask] * np.log(p[mask] / np.maximum(q[mask], 1e-12)))
        if kl <= best:  # ties: the larger range, as TensorRT does
            best, best_i = kl, i
    return float(collector.edges[best_i])


def _mse(collector, num_bits=8, candidates=256, **_):
    """The range that minimizes the histogram-weighted quantization MSE."""
    hist = collector.hist.astype(np.float64)
    centers = (collector.edges[:-1] + collector.edges[1:]) / 2
    qmax = 2 ** (num_bits - 1) - 1
    amaxes = np.linspace(
        collector.amax / candidates, collector.amax, candidates
    )
    errors = []
    for amax in amaxes:
        scale = amax / qmax
        q = np.clip(np.round(centers / scale), -qmax - 1, qmax) * scale
        errors.append(np.sum(hist * (centers - q) ** 2))
    return float(amaxes[int(np.argmin(errors))])


CALIBRATORS = {
    "max": _max,
    "percentile": _percentile,
    "entropy": _entropy,
    "mse": _mse,
}


@dataclasses.dataclass
class CalibrationReport:
    """What calibration found: one row per activation quantizer."""

    method: str
    batches: int
    samples: int
    ranges: dict
    observed_max: dict
    collapsed: list

    def to_table(self):
        rows = [
            f"Calibration ({self.method}, {self.batches} batches, "
            f"{self.samples} samples):"
        ]
        for name, amax in self.ranges.items():
            seen = self.observed_max[name]
            rows.append(f"  {name:<40} amax={amax:.5g} (max seen {seen:.5g})")
        for name in self.collapsed:
            rows.append(f"  {name}: range collapsed to 0 (all inputs zero)")
        return "\n".join(rows)

    def __str__(self):
        return self.to_table()


def _input_names(model):
    try:
        return [t.name for t in model.inputs] if model.inputs else [None]
    except AttributeError:  # subclassed: one input assumed
        return [None]


def _as_inputs(batch, names):
    """One batch as a list of arrays, one per model input."""
    n = len(names)
    if isinstance(batch, dict):
        batch = [batch[name] for name in names]
    elif isinstance(batch, (tuple, list)):
        first = batch[0]
        if isinstance(first, (tuple, list, dict)) or n == 1:
            return _as_inputs(first, names)  # (x, y) or (x,): keep x
        batch = list(batch)[:n] if len(batch) >= n else batch
    else:
        batch = [batch]
    if len(batch) != n:
        raise ValueError(
            f"Calibration batch holds {len(batch)} array(s), but the model "
            f"has {n} inputs {names}: give one array per input (a list or a "
            "dict by input name)."
        )
    return [keras.ops.convert_to_numpy(b) for b in batch]


def _batches(data, batch_size, num_batches, names):
    """Yields batches (a list of arrays, one per model input) from an array
    (or a list / dict of arrays for several inputs), a tf.data.Dataset or an
    iterable; `(x, y)` tuples give their `x`."""
    arrays = None
    if isinstance(data, np.ndarray):
        arrays = [data]
    elif len(names) > 1 and isinstance(data, dict):
        arrays = _as_inputs(data, names)
    elif (
        len(names) > 1
        and isinstance(data, (list, tuple))
        and len(data) == len(names)
        and all(isinstance(a, np.ndarray) and a.ndim >= 1 for a in data)
    ):
        arrays = list(data)
    if arrays is not None:
        if any(a.size == 0 for a in arrays):
            raise ValueError(
                "Calibration data is empty: pass some real inputs."
            )
        if len({len(a) for a in arrays}) > 1:
            raise ValueError(
                "Calibration arrays have different lengths "
                f"{[len(a) for a in arrays]}: give every input the same "
                "number of samples."
            )
        for n, start in enumerate(range(0, len(arrays[0]), batch_size)):
            if num_batches is not None and n >= num_batches:
                return
            yield [a[start : start + batch_size] for a in arrays]
        return
    if isinstance(data, (str, bytes, dict)) or not hasattr(data, "__iter__"):
        raise TypeError(
            "`data` must be a NumPy array, a tf.data.Dataset or an iterable "
            f"of batches. Received: {type(data).__name__}"
        )
    for n, batch in enumerate(data):
        if num_batches is not None and n >= num_batches:
            return
        yield _as_inputs(batch, names)


def _check_input(model, batch, index=0):
    try:
        expected = model.inputs[index].shape if model.inputs else None
    except AttributeError:  # subclassed model: no symbolic inputs
        expected = None
    if expected is not None and (
        batch.ndim != len(expected)
        or any(
            e is not None and e != b
            for e, b in zip(expected[1:], batch.shape[1:])
        )
    ):
        raise ValueError(
            f"Calibration batch has shape {batch.shape}, but model "
            f"{model.name!r} expects {tuple(expected)}. Pass inputs shaped "
            "like the model's (batch first)."
        )


def calibrate(
    model,
    data,
    method="max",
    num_batches=None,
    batch_size=128,
    percentile=99.99,
    verbose=1,
):
    """Sets activation ranges from real data (post-training quantization).

    Runs the model in float (fake quant off) over `data`, collecting the
    running max and a histogram of |x| at each activation quantizer, then
    writes the range each method picks. Weight ranges are set to their
    per-channel `max|w|`.

    Args:
        model: a quantized model (`keras_mp.quantize_model`).
        data: NumPy array of inputs, `tf.data.Dataset` or iterable of
            batches (`(x, y)` tuples are fine: `y` is ignored). For a model
            with several inputs: a list (in `model.inputs` order) or dict
            (by input name) of arrays, or batches shaped that way.
        method: str. `"max"`, `"percentile"`, `"entropy"` or `"mse"`.
            Defaults to `"max"`.
        num_batches: int. Stop after this many batches. Defaults to all.
        batch_size: int. Batch size for array data. Defaults to 128.
        percentile: float. For `"percentile"`. Defaults to 99.99.
        verbose: int. 1 shows a progress bar. Defaults to 1.

    Returns:
        `CalibrationReport` with each quantizer's range.

    Raises:
        ValueError: unknown method, a model with nothing to calibrate, empty
            or wrongly shaped data, or NaN/Inf met at a quantizer (named).

    Example:

    >>> qmodel = keras_mp.quantize_model(model)
    >>> report = keras_mp.calibrate(qmodel, x_train[:4096], method="entropy")
    """
    _check_model(model)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"`batch_size` must be a positive integer. Received: {batch_size!r}"
        )
    if num_batches is not None and (
        not isinstance(num_batches, int) or num_batches < 1
    ):
        raise ValueError(
            "`num_batches` must be a positive integer, or None for all the "
            f"data. Received: {num_batches!r}"
        )
    if method not in CALIBRATORS:
        raise ValueError(
            f"Unknown calibration method. Expected one of "
            f"{sorted(CALIBRATORS)}. Received: method={method!r}"
        )
    if not 0 < percentile <= 100:
        raise ValueError(
            f"`percentile` must be in (0, 100]. Received: {percentile}"
        )
    quantizers = _activation_quantizers(model)
    if not quantizers:
        raise ValueError(
            f"Model {model.name!r} has no activation quantizer to calibrate. "
            "Quantize it first with keras_mp.quantize_model(model)."
        )
    collectors = {}
    for name, q in quantizers.items():
        collectors[name] = q.collector = HistogramCollector(name)
    samples = batches = 0
    progbar = keras.utils.Progbar(
        num_batches, verbose=verbose, unit_name="batch"
    )
    try:
        names = _input_names(model)
        for batch in _batches(data, batch_size, num_batches, names):
            batch = [np.asarray(b, np.float32) for b in batch]
            for i, b in enumerate(batch):
                _check_input(model, b, i)
                if not np.all(np.isfinite(b)):
                    where = np.argwhere(~np.isfinite(b))[0]
                    which = f"input {names[i]!r}, " if len(batch) > 1 else ""
                    raise ValueError(
                        f"Calibration data holds NaN/Inf ({which}batch "
                        f"{batches}, first at index "
                        f"{tuple(int(i) for i in where)}). Clean the data."
                    )
            model(batch if len(batch) > 1 else batch[0], training=False)
            batches += 1
            samples += len(batch[0])
            progbar.update(batches)
    finally:
        for q in quantizers.values():
            q.collector = None
    if batches == 0:
        raise ValueError("Calibration data is empty: pass some real inputs.")
    ranges, observed, collapsed = {}, {}, []
    for name, q in quantizers.items():
        c = collectors[name]
        observed[name] = c.amax
        if c.hist is None:
            collapsed.append(name)
            amax = 0.0
        else:
            amax = CALIBRATORS[method](c, percentile=percentile)
        q.amax.assign(amax)
        ranges[name] = amax
    for layer in iter_quantize_layers(model):
        if isinstance(layer, QuantizeWrapper):
            layer.update_weight_ranges()
    for attr in ("train_function", "test_function", "predict_function"):
        setattr(model, attr, None)
    return CalibrationReport(
        method, batches, samples, ranges, observed, collapsed
    )


def _activation_quantizers(model):
    out = {}
    for layer in iter_quantize_layers(model):
        if isinstance(layer, QuantizeWrapper):
            for i, q in zip(layer.input_indices, layer.input_quantizers):
                out[f"{layer.name}/input_{i}"] = q
        elif isinstance(layer, QuantizeActivation):
            out[layer.name] = layer
    return out


def quantization_report(model, verbose=True):
    """Per layer: what is quantized, with which ranges, what is skipped, why.

    Args:
        model: a `keras.Model`, quantized or not.
        verbose: bool. Print the table. Defaults to True.

    Returns:
        A list of dicts: `layer`, `type`, `quantized` (bool), `inputs`
        (activation ranges), `weights` (per-channel range min/max), `note`.
    """
    from keras_mp.quantization.config import layer_spec

    _check_model(model)
    rows = []

    def walk(m):
        for layer in m.layers:
            if isinstance(layer, keras.Model):
                walk(layer)
                continue
            if isinstance(layer, keras.layers.InputLayer):
                continue
            row = {"layer": layer.name, "type": type(layer).__name__}
            if isinstance(layer, QuantizeWrapper):
                row["type"] = type(layer.layer).__name__
                amaxes = [float(q.amax.numpy()) for q in layer.input_quantizers]
                row["quantized"] = True
                row["inputs"] = dict(zip(layer.input_indices, amaxes))
                row["weights"] = {
                    attr: (float(np.min(v.numpy())), float(np.max(v.numpy())))
                    for attr, _, v in layer.weight_ranges
                }
                row["note"] = (
                    "uncalibrated input range (0): run keras_mp.calibrate"
                    if any(a == 0 for a in amaxes)
                    else ""
                )
            elif isinstance(layer, QuantizeActivation):
                row.update(
                    quantized=True, inputs={0: float(layer.amax.numpy())}
                )
                row.update(weights={}, note="stand-alone Q/DQ")
            else:
                spec = layer_spec(layer)
                row.update(quantized=False, inputs={}, weights={})
                if spec is None:
                    row["note"] = "not a quantizable type: runs in float"
                elif not spec.weights and spec.inputs == "none":
                    row["note"] = "no Q/DQ needed (TensorRT propagates scales)"
                else:
                    row["note"] = "not selected, or skipped by QuantizeConfig"
            rows.append(row)

    walk(model)
    if verbose:
        for r in rows:
            ins = ", ".join(f"in{i}={a:.4g}" for i, a in r["inputs"].items())
            ws = ", ".join(
                f"{k}=[{lo:.3g}..{hi:.3g}]"
                for k, (lo, hi) in r["weights"].items()
            )
            flag = "Q" if r["quantized"] else "-"
            name, kind = r["layer"], r["type"]
            print(f"{flag} {name:<24} {kind:<22} {ins} {ws} {r['note']}")
    return rows
