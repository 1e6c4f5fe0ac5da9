"""Post-training calibration: activation ranges from real data.

`calibrate` runs a quantized model in float over the data, feeds each
activation quantizer's input to a calibrator (`calibrators.py`) and writes
the ranges it picks. Guide: `docs/quantization.md`.
"""

import dataclasses
import warnings

import keras
import numpy as np

from keras_mp import _inputs, _keras, _models
from keras_mp.quantization.calibrate_weights import (
    WEIGHT_METHODS,
    block_quantizers,
    calibrate_blocks,
    mse_block_ranges,
)
from keras_mp.quantization.calibrators import (
    CALIBRATORS,
    HistogramCalibrator,
    PercentileCalibrator,
)
from keras_mp.quantization.packed import check_unpacked
from keras_mp.quantization.twins import block_weight_quantizers
from keras_mp.quantization.twins import quantizers as all_quantizers

# A range that clips more than this fraction of a tensor's calibration
# inputs is named in a warning (percentile 99.99 clips 0.01% by design;
# the KL threshold on the demo CNN's stem clipped 11.5%).
SATURATION_WARNING = 0.01


@dataclasses.dataclass
class CalibrationReport:
    """What `calibrate` found: one row per activation quantizer.

    `print(report)` shows one line per quantizer (its range, the largest
    input seen, how the method chose the range and how much of the inputs
    it clips), `report.rows` the same as dicts, `report.to_dict()` the
    whole report as plain Python.

    Attributes:
        method: str. The calibration method (`"max"`, `"entropy"`,
            `"gptq"`, ...).
        batches: int. Batches seen.
        samples: int. Samples seen.
        ranges: dict. Quantizer name -> the range set (`amax`).
        observed_max: dict. Quantizer name -> the largest |input| seen.
        collapsed: list of str. Quantizers whose inputs were all zero.
        chosen: dict. Quantizer name -> how a histogram method chose.
        saturated: dict. Quantizer name -> fraction of its inputs beyond
            its range (histogram methods).
        weight_errors: dict. Weight name -> (before, after) relative output
            error of a weight method (`"gptq"`).

    Example:

    >>> report = keras_mp.calibrate(qmodel, x_train[:512], method="entropy")
    >>> print(report)  # one line per activation quantizer
    >>> [r["quantizer"] for r in report.rows if r["saturated"] > 0.01]
    """

    method: str
    batches: int
    samples: int
    ranges: dict
    observed_max: dict
    collapsed: list
    chosen: dict = dataclasses.field(default_factory=dict)
    # name -> fraction of its inputs beyond its range (histogram methods)
    saturated: dict = dataclasses.field(default_factory=dict)
    # weight name -> (before, after) relative output error (`"gptq"`,
    # `"awq"`), or relative weight error (`"mse"`, INT4 block ranges)
    weight_errors: dict = dataclasses.field(default_factory=dict)

    def to_table(self):
        rows = [
            f"Calibration ({self.method}, {self.batches} batches, "
            f"{self.samples} samples):"
        ]
        for name, amax in self.ranges.items():
            seen = self.observed_max[name]
            how = f", {self.chosen[name]}" if name in self.chosen else ""
            clipped = self.saturated.get(name, 0.0)
            if clipped > SATURATION_WARNING:
                how += f", saturates {clipped:.1%} of its inputs"
            rows.append(
                f"  {name:<40} amax={amax:.5g} (max seen {seen:.5g}{how})"
            )
        for name in self.collapsed:
            rows.append(f"  {name}: range collapsed to 0 (all inputs zero)")
        return "\n".join(rows)

    @property
    def rows(self):
        """One dict per activation quantizer: `quantizer` (its name),
        `amax`, `observed_max`, `chosen` (how a histogram method chose, or
        ""), `saturated` (fraction of inputs beyond the range), `collapsed`
        (all inputs were zero)."""
        names = list(self.ranges) + [
            n for n in self.collapsed if n not in self.ranges
        ]
        return [
            {
                "quantizer": name,
                "amax": _plain(self.ranges.get(name, 0.0)),
                "observed_max": _plain(self.observed_max.get(name, 0.0)),
                "chosen": str(self.chosen.get(name, "")),
                "saturated": _plain(self.saturated.get(name, 0.0)),
                "collapsed": name in self.collapsed,
            }
            for name in names
        ]

    def to_dict(self):
        """The report as plain Python (JSON-ready)."""
        return {
            "method": self.method,
            "batches": int(self.batches),
            "samples": int(self.samples),
            "rows": self.rows,
            "weight_errors": {
                k: [_plain(v) for v in pair]
                for k, pair in self.weight_errors.items()
            },
        }

    def __str__(self):
        return self.to_table()


def _plain(value):
    """A float from a NumPy or TensorFlow scalar."""
    return float(np.asarray(value))


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

    Runs the model in float (fake quant off) over `data`, feeding the input
    of each activation quantizer to a calibrator of `method`, then writes
    the range it picks for that quantizer's `num_bits`. Weight ranges are
    set to their per-channel `max|w|`.

    Args:
        model: a quantized model (`keras_mp.quantize_model`).
        data: NumPy array of inputs, `tf.data.Dataset` or iterable of
            batches (`(x, y)` tuples are fine: `y` is ignored). For a model
            with several inputs: a list (in `model.inputs` order) or dict
            (by input name, as the ONNX export names its inputs) of
            arrays, or batches shaped that way. Integer inputs (token ids,
            masks) take integer arrays and keep their dtype.
        method: str. `"max"`, `"percentile"`, `"entropy"` (TensorRT's
            KL-divergence search), `"mse"` (also the INT4 block ranges:
            per block the one with the least squared weight error; the
            report's `weight_errors` gives each weight's relative error
            with max and MSE ranges) or `"auto"` (per quantizer, the
            range of any of these with the least quantization error of its
            inputs on its format's grid; the report's `chosen` says which).
            `"gptq"`: GPTQ rounding of the INT4 (block-scaled) weights on
            their layers' inputs (`calibrate_weights`; activation ranges of
            the other layers by `"max"`); the report's `weight_errors`
            gives each weight's relative output error with max scales and
            with GPTQ. `"awq"`: AWQ scaling of the block-scaled (INT4,
            NVFP4, MXFP8) weights (ModelOpt's `awq_lite`): per input
            channel `s = mean|x| ** alpha / mean|w| ** (1 - alpha)`, alpha
            searched per layer for the least output error; the kernel
            becomes `s * W` and the layer gets an input pre-scale `1 / s`
            (a saved variable, a Mul before the MatMul in ONNX), or is left
            as it was when that does not lower its error. Defaults to
            `"max"`.
        num_batches: int. Stop after this many batches. Defaults to all.
        batch_size: int. Batch size for array data. Defaults to 128.
        percentile: float. For `"percentile"`. Defaults to 99.99.
        verbose: int. 1 shows a progress bar. Defaults to 1.

    Returns:
        `CalibrationReport` with each quantizer's range and, for the
        histogram methods, the fraction of its inputs beyond it
        (`saturated`). A range that clips more than 1% of its inputs is
        named in a `UserWarning`: check accuracy, or use `"auto"`.

    Raises:
        ValueError: unknown method, a model with nothing to calibrate or
            never called, empty or wrongly shaped data, an infinite
            `tf.data.Dataset` (`repeat()`) without `num_batches`, a dict
            missing an input or with an extra key, float data for an
            integer input, or NaN/Inf met at a quantizer (named).

    Integer images (uint8 pixels) for a float input of a model without a
    `Rescaling` or `Normalization` layer get a `UserWarning`: the ranges
    will fit 0..255, not the scaled values the model was trained on.

    Example:

    >>> qmodel = keras_mp.quantize_model(model)
    >>> report = keras_mp.calibrate(qmodel, x_train[:4096], method="entropy")
    """
    _models.check_model(model, "calibrate")
    check_unpacked(model, "calibrate")
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
    if method not in CALIBRATORS and method not in WEIGHT_METHODS:
        raise ValueError(
            f"Unknown calibration method. Expected one of "
            f"{sorted(CALIBRATORS) + list(WEIGHT_METHODS)}. Received: "
            f"method={method!r}"
        )
    weight_method = method if method in WEIGHT_METHODS else None
    if weight_method:  # activations (INT8/FP8 layers) by max
        method = "max"
    if not 0 < percentile <= 100:
        raise ValueError(
            f"`percentile` must be in (0, 100]. Received: {percentile}"
        )
    specs = _inputs.input_specs(model, "calibrate")
    _check_data(model, data, specs, num_batches)
    quantizers = activation_quantizers(model, "calibrate")
    fixed = [n for n, q in quantizers.items() if q.fixed_range is not None]
    if weight_method:
        block_quantizers(model)  # none: an error before anything runs
        report = None
        if quantizers:
            report = calibrate(
                model, data, "max", num_batches, batch_size, verbose=verbose
            )

        def run_batches():
            for batch, _ in _inputs.batches(
                data, specs, "calibrate", batch_size, num_batches
            ):
                model(_inputs.call_arg(model, batch, specs), training=False)

        errors = calibrate_blocks(model, run_batches, weight_method)
        _models.reset_compiled_functions(model)
        if report is None:
            report = CalibrationReport(weight_method, 0, 0, {}, {}, [], {}, {})
        report.method, report.weight_errors = weight_method, errors
        return report
    if not quantizers and method == "mse":  # INT4 weight-only: the blocks
        errors = mse_block_ranges(model)
        if errors:
            _models.reset_compiled_functions(model)
            return CalibrationReport(
                "mse", 0, 0, {}, {}, [], weight_errors=errors
            )
    if not quantizers and block_weight_quantizers(model, "calibrate"):
        # weight-only (INT4, NVFP4, MXFP8): the pipeline quantize ->
        # calibrate -> export runs as for INT8, with nothing to observe
        warnings.warn(
            f"Model {model.name!r} is weight-only quantized: its block "
            f"ranges come from the weights, so calibrate(method={method!r}) "
            'has nothing to observe. calibrate(method="gptq") or '
            'method="awq" round the block-scaled weights on this data '
            'instead ("mse" searches INT4 block ranges).',
            UserWarning,
            stacklevel=2,
        )
        return CalibrationReport(method, 0, 0, {}, {}, [], {}, {})
    if not quantizers:
        raise ValueError(
            f"Model {model.name!r} has no activation quantizer to calibrate. "
            "Quantize it first with keras_mp.quantize_model(model)."
        )
    quantizers = {n: q for n, q in quantizers.items() if n not in fixed}
    calibrators = {}
    for name, q in quantizers.items():
        if method == "percentile":
            calibrator = PercentileCalibrator(name, percentile)
        else:
            calibrator = CALIBRATORS[method](name)
        calibrators[name] = q.collector = calibrator
    samples = batches = 0
    progbar = keras.utils.Progbar(
        num_batches, verbose=verbose, unit_name="batch"
    )
    try:
        for batch, _ in _inputs.batches(
            data, specs, "calibrate", batch_size, num_batches
        ):
            for i, b in enumerate(batch):
                if b.dtype.kind == "f" and not np.all(np.isfinite(b)):
                    where = np.argwhere(~np.isfinite(b))[0]
                    which = (
                        f"input {specs[i].name!r}, " if len(batch) > 1 else ""
                    )
                    raise ValueError(
                        f"Calibration data holds NaN/Inf ({which}batch "
                        f"{batches}, first at index "
                        f"{tuple(int(i) for i in where)}). Clean the data."
                    )
            model(_inputs.call_arg(model, batch, specs), training=False)
            batches += 1
            samples += len(batch[0])
            progbar.update(batches)
    finally:
        for q in quantizers.values():
            q.collector = None
    if batches == 0:
        raise ValueError("`calibrate` data is empty: pass some real inputs.")
    ranges, observed, collapsed, chosen = {}, {}, [], {}
    for name, q in quantizers.items():
        calibrator = calibrators[name]
        observed[name] = calibrator.observed_max
        amax = calibrator.compute_amax(q.format)
        if calibrator.observed_max == 0.0:
            collapsed.append(name)
        elif getattr(calibrator, "choice", None):
            chosen[name] = calibrator.choice
        q.amax.assign(amax)
        ranges[name] = amax
    owners = {}
    for q in all_quantizers(model, "calibrate"):
        owners[id(q.layer)] = q.layer
        if q.weight is not None and not q.site:  # a site's: set in the pass
            q.quantizer.update(getattr(q.layer, q.weight))
    for layer in owners.values():
        if getattr(layer, "shared_input_range", False):
            layer.tie_input_ranges()  # a Concatenate's inputs: one range
    weight_errors = mse_block_ranges(model) if method == "mse" else {}
    ranges = {
        name: float(_keras.to_numpy(quantizers[name].amax)) for name in ranges
    }
    # From the final ranges: tying a Concatenate's inputs can widen them.
    saturated = {
        name: calibrators[name].saturated(amax)
        for name, amax in ranges.items()
        if name not in collapsed
        and isinstance(calibrators[name], HistogramCalibrator)
    }
    _warn_saturation(method, saturated, ranges, observed)
    _models.reset_compiled_functions(model)
    return CalibrationReport(
        method,
        batches,
        samples,
        ranges,
        observed,
        collapsed,
        chosen,
        saturated,
        weight_errors,
    )


def _check_data(model, data, specs, num_batches):
    """Before anything runs: a ValueError for an endless `tf.data.Dataset`
    without `num_batches`; a warning for integer images given to a float
    input of a model that does not rescale them itself."""
    import tensorflow as tf

    if isinstance(data, tf.data.Dataset):
        if num_batches is None and (
            int(data.cardinality()) == int(tf.data.INFINITE_CARDINALITY)
        ):
            raise ValueError(
                "`calibrate` data is an infinite tf.data.Dataset (`repeat()` "
                "without a count), and `num_batches` is None: calibration "
                "would never end. Pass `num_batches=` (e.g. 32), or "
                "`data.take(n)`. Received: data with cardinality "
                "INFINITE, num_batches=None"
            )
        element = data.element_spec
        if isinstance(element, tuple) and len(element) == 2:  # (x, y)
            element = element[0]
        given = [
            (e.dtype.name, len(e.shape), None)
            for e in _by_input(element, specs)
            if isinstance(e, tf.TensorSpec)
        ]
    else:
        given = [
            (x.dtype.name, x.ndim, x)
            for x in _by_input(data, specs)
            if isinstance(x, np.ndarray)
        ]
    if specs is None or len(given) != len(specs):
        return
    # integer images (a batch axis and 2 or 3 more) for a float input
    suspect = [
        (spec, dtype, x)
        for spec, (dtype, ndim, x) in zip(specs, given)
        if np.dtype(spec.dtype).kind == "f"
        and np.dtype(dtype).kind in "iu"
        and ndim >= 3
        and (x is None or (x.size and x.max() > 1))
    ]
    if not suspect or any(
        isinstance(layer, (keras.layers.Rescaling, keras.layers.Normalization))
        for layer in _models.walk_layers(model)
    ):
        return
    spec, dtype, x = suspect[0]
    seen = f", max {x.max()}" if x is not None else ""
    warnings.warn(
        f"calibrate: input {spec.name!r} of model {model.name!r} is "
        f"{spec.dtype}, but the data for it is {dtype}{seen}, and the model "
        "has no Rescaling or Normalization layer: the ranges will fit raw "
        "integer values (0..255 for pixels). If the model was trained on "
        "scaled inputs (e.g. `x / 255`), calibrate on data scaled the same "
        "way; if it takes raw values, ignore this.",
        UserWarning,
        stacklevel=3,
    )


def _by_input(element, specs):
    """The parts of one data element for each of `specs` (a dict by input
    name, a list or tuple in order, else the element itself), or []."""
    if specs is None:
        return []
    if isinstance(element, dict):
        return [element.get(s.name) for s in specs]
    if isinstance(element, (list, tuple)):
        return list(element)
    return [element]


def _warn_saturation(method, saturated, ranges, observed):
    """One warning naming the tensors whose range clips more than
    `SATURATION_WARNING` of their inputs (a KL threshold drawn to a spike
    can clip 10%: docs/quantization.md)."""
    worst = sorted(
        (n for n, f in saturated.items() if f > SATURATION_WARNING),
        key=lambda n: -saturated[n],
    )
    if not worst:
        return
    named = "; ".join(
        f"{n!r} {saturated[n]:.1%} (range {ranges[n]:.4g}, max seen "
        f"{observed[n]:.4g})"
        for n in worst[:5]
    )
    more = f" and {len(worst) - 5} more" if len(worst) > 5 else ""
    warnings.warn(
        f"calibrate(method={method!r}) saturates more than "
        f"{SATURATION_WARNING:.0%} of the inputs of {len(worst)} "
        f"quantizer(s): {named}{more}. Such a clip can cost accuracy: "
        "check the quantized model on held-out data, or try "
        'method="auto" (per tensor, the range with the least quantization '
        'error) or "mse". The report\'s `saturated` has every fraction.',
        stacklevel=3,
    )


def activation_quantizers(model, caller="activation_quantizers"):
    """Every activation quantizer of `model` by name (the ones `calibrate`
    sets and its report lists).

    Names: `<layer path>/<name>` for a quantized layer (`input_0`,
    `input_query`, `attention_probs`, `pointwise_input`, ...), the layer
    path of a stand-alone `QuantizeActivation`. Layer paths are the float
    model's layer names.

    Args:
        model: a quantized `keras.Model`.
        caller: str. The public function asking, for errors.

    Returns:
        dict of name -> quantizer (its range is `quantizer.amax`).

    Example:

    >>> {k: float(q.amax) for k, q in activation_quantizers(qmodel).items()}
    """
    return {
        q.name: q.quantizer
        for q in all_quantizers(model, caller)
        if q.weight is None
    }
