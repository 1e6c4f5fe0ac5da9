"""`auto_quantize`: a precision per layer under an accuracy budget.

The search, in three steps (guide: `docs/precision.md`):

1. `score_layers` calibrates the model once per quantized precision and
   scores each layer (or coupled group) for each precision
   (`sensitivity.py`); "not quantized" (`"float"`: the graph's float
   type, float16 in TensorRT) scores 0.
2. Each layer's options are priced by the cost model (`cost.py`): latency
   on the chosen GPU, or ModelOpt's weight bits. Minimizing the summed cost
   under a bound on the summed score is a multiple-choice knapsack; its
   Lagrangian relaxation (each layer takes `argmin cost + lam * score`)
   gives every configuration on the convex hull of (score, cost) as `lam`
   runs from 0 (the cheapest choice everywhere) to infinity (nothing
   quantized that hurts at all).
3. A bisection over that list, measuring the metric of each configuration
   tried, finds the cheapest one within `max_drop` of float (it assumes
   the measured drop grows with the summed score; the report lists every
   configuration measured).
"""

import math
import numbers
import time
import warnings

import numpy as np

from keras_mp import _inputs, _models
from keras_mp._compat import require_tensorflow
from keras_mp.precision import cost as cost_model
from keras_mp.precision import metrics
from keras_mp.precision.copies import float_copy, paths_in, quantizers_by_path
from keras_mp.precision.reports import AutoQuantizeReport, Choice
from keras_mp.precision.sensitivity import precision_tuple, score_layers
from keras_mp.quantization.calibrate import calibrate
from keras_mp.quantization.config import PRECISIONS, QuantizeConfig
from keras_mp.quantization.names import NOT_QUANTIZED
from keras_mp.quantization.quantize import quantize_model

FLOAT = NOT_QUANTIZED  # TensorRT runs the layer in float16
COSTS = ("latency", "bits")


def auto_quantize(
    model,
    data,
    labels=None,
    max_drop=0.01,
    precisions=("int8", "float8", "float"),
    cost="latency",
    gpu="H100",
    metric=None,
    loss=None,
    calibration="auto",
    eval_data=None,
    eval_labels=None,
    num_batches=4,
    batch_size=64,
    calibration_batches=16,
    verbose=1,
):
    """Chooses INT8, FP8 or float per layer: least cost within a budget.

    Scores every quantizable layer for each precision
    (`keras_mp.layer_sensitivity`, one calibration per precision), prices
    each choice with the cost model (`cost="latency"`: a roofline of each
    layer's FLOPs and bytes on `gpu` with TensorRT's rules, see
    `docs/latency_model.md`; `cost="bits"`: weight bits, ModelOpt's
    effective bits), and searches the cheapest configuration whose metric
    is within `max_drop` of the float model's.

    Args:
        model: a built float `keras.Model`.
        data: calibration and scoring inputs, as `layer_sensitivity`'s.
        labels: labels of array `data`, or None (then the scores are the
            output KL divergence and the metric is the agreement with the
            float model's decisions: its top-1 class, or its thresholded
            output for a one-unit output).
        max_drop: float >= 0. The largest metric drop allowed, in the
            metric's units (top-1 accuracy as a fraction: 0.001 is 0.1
            point). Defaults to 0.01.
        precisions: tuple of `"int8"`, `"float8"`, `"float"`. The
            options; `"float"` (not quantized: the layer runs in the
            graph's float type, float16 in TensorRT) is always one. The
            old spellings `"fp8"` and `"float16"` (for `"float"`) work
            with a `DeprecationWarning`. Defaults to all three.
        cost: str. `"latency"` or `"bits"`. Defaults to `"latency"`.
        gpu: str or `keras_mp.precision.GPU`. The GPU the latency model
            prices (`keras_mp.precision.GPUS`). Defaults to `"H100"`.
        metric: callable `metric(y_true, y_pred) -> float`, higher is
            better. Defaults to top-1 accuracy; for a one-unit output (a
            binary classifier), `keras_mp.precision.threshold_accuracy`
            at 0.5 on probabilities (a last layer ending in a sigmoid) or
            0 on logits (no activation; for any other last layer, told
            apart by the float outputs lying in [0, 1] or not). Without
            labels, both compare with the float model's decisions. The
            report names the metric (`metric_name`).
        loss: callable for the gradient scores (`layer_sensitivity`).
        calibration: str. The `keras_mp.calibrate` method. Defaults to
            `"auto"`.
        eval_data: inputs the metric is measured on. Defaults to `data`.
        eval_labels: their labels. Defaults to `labels`.
        num_batches: int. Scoring batches. Defaults to 4.
        batch_size: int. Defaults to 64.
        calibration_batches: int. Defaults to 16.
        verbose: int. 1 shows progress. Defaults to 1.

    Returns:
        `(quantized_model, AutoQuantizeReport)`: the model calibrated, as
        `keras_mp.quantize_model` returns it (the float model itself when
        nothing is worth quantizing, with a warning).

    Raises:
        ValueError: `max_drop` negative or not a number, an unknown cost,
            GPU or precision, a precision the GPU cannot run (FP8 on T4 or
            A100), labels whose length is not the data's, a model with
            nothing quantizable, or a metric that is not a finite number.

    Example:

    >>> qmodel, report = keras_mp.auto_quantize(
    ...     model, x_val, y_val, max_drop=0.005, gpu="L40S")
    >>> print(report)
    """
    require_tensorflow("keras_mp.auto_quantize")
    start = time.perf_counter()
    caller = "auto_quantize"
    _models.check_model(model, caller)
    if (
        isinstance(max_drop, bool)
        or not isinstance(max_drop, numbers.Real)
        or not math.isfinite(max_drop)
        or max_drop < 0
    ):
        raise ValueError(
            "`max_drop` must be a number >= 0 (the metric drop allowed, "
            f"e.g. 0.01 for one point of accuracy). Received: {max_drop!r}"
        )
    if cost not in COSTS:
        raise ValueError(
            f"`cost` must be one of {list(COSTS)}. Received: {cost!r}"
        )
    precisions = precision_tuple(precisions, (*PRECISIONS, FLOAT), caller)
    quantized = tuple(p for p in precisions if p != FLOAT)
    if not quantized:
        raise ValueError(
            "`precisions` holds no quantized format: add 'int8' or 'float8'."
        )
    gpu_row = cost_model.gpu_spec(gpu)
    cost_model.check_precisions(gpu_row, precisions)
    if eval_data is None:
        eval_data, eval_labels = data, labels
    specs = _inputs.input_specs(model, caller)
    evaluation = _Evaluation(
        model, eval_data, eval_labels, metric, batch_size, specs, caller
    )
    sensitivity, qmodels = score_layers(
        model,
        data,
        labels,
        quantized,
        loss=loss,
        calibration=calibration,
        num_batches=num_batches,
        batch_size=batch_size,
        calibration_batches=calibration_batches,
        verbose=verbose,
        caller=caller,
    )
    options = [
        _options(row, quantized, cost, gpu_row) for row in sensitivity.rows
    ]
    configs = lagrangian_configs(options)
    recalibrations = []

    def recalibrate(qmodel):
        found = calibrate(
            qmodel,
            data,
            method=calibration,
            num_batches=calibration_batches,
            batch_size=batch_size,
            verbose=0,
        )
        recalibrations.append(found.batches)

    tried, best = [], None
    lo, hi = 0, len(configs) - 1
    built = {}

    def measure(index):
        if index not in built:
            qmodel = _build(
                model, sensitivity.rows, configs[index], qmodels, recalibrate
            )
            value = evaluation.metric_of(qmodel) if qmodel else evaluation.base
            built[index] = (qmodel, value)
            tried.append(
                {
                    "index": index,
                    "score": _total(options, configs[index], 0),
                    "cost": _total(options, configs[index], 1),
                    "drop": evaluation.base - value,
                }
            )
            if verbose:
                quantized_layers = sum(p != FLOAT for p in configs[index])
                print(
                    f"auto_quantize: configuration {index} of "
                    f"{len(configs) - 1} ({quantized_layers} of "
                    f"{len(configs[index])} layers quantized): drop "
                    f"{evaluation.base - value:.4g} (budget {max_drop})"
                )
        return built[index]

    # bisection for the first (cheapest) configuration within the budget
    while lo < hi:
        mid = (lo + hi) // 2
        _, value = measure(mid)
        if evaluation.base - value <= max_drop:
            hi = mid
        else:
            lo = mid + 1
    best = lo
    qmodel, value = measure(best)
    if evaluation.base - value > max_drop:
        warnings.warn(
            f"auto_quantize: even the most careful configuration drops the "
            f"metric by {evaluation.base - value:.4g} > max_drop="
            f"{max_drop}. Returned it anyway; raise max_drop, give more "
            "calibration data, or try QAT.",
            stacklevel=2,
        )
    choices = _choices(sensitivity.rows, options, configs[best])
    if qmodel is None:
        warnings.warn(
            "auto_quantize: no layer is worth quantizing within the budget "
            "and cost model; the float model is returned.",
            stacklevel=2,
        )
        qmodel = model
    predicted = _predicted(sensitivity.rows, configs[best], quantized, gpu_row)
    passes = dict(sensitivity.passes)
    passes["evaluation"] = evaluation.passes
    passes["calibration"] += sum(recalibrations)
    report = AutoQuantizeReport(
        rows=choices,
        metric_float=evaluation.base,
        metric=value,
        max_drop=float(max_drop),
        cost=cost,
        gpu=gpu_row.name,
        predicted=predicted,
        speedup_over_fp16=predicted[FLOAT] / predicted["chosen"],
        quantized_flops=_quantized_flops(sensitivity.rows, configs[best]),
        effective_bits=cost_model.effective_bits(
            [
                (row.work, p)
                for row, p in zip(sensitivity.rows, configs[best])
                if row.work is not None
            ]
        ),
        tried=sorted(tried, key=lambda t: t["index"]),
        passes=passes,
        seconds=time.perf_counter() - start,
        sensitivity=sensitivity,
        metric_name=evaluation.name,
    )
    return qmodel, report


def _options(row, quantized, cost, gpu):
    """`{precision: (score, cost)}` of one row; an FP8 request a layer
    takes as INT8 is the INT8 option (dropped when INT8 is one too)."""
    found = {FLOAT: (0.0, _price(row, FLOAT, cost, gpu))}
    for p in quantized:
        if row.formats.get(p) != p and "int8" in quantized and p != "int8":
            continue
        found[p] = (row.scores[p], _price(row, p, cost, gpu))
    return found


def _price(row, precision, cost, gpu):
    """The cost of `row` at `precision`. Latency: a quantized layer's
    input Q is fused into the kernel producing it (TensorRT fuses Q into
    convolution epilogues and pointwise kernels) except where the layer
    reads a model input, which pays a stand-alone Quantize kernel."""
    if row.work is None:
        return 0.0
    if cost == "bits":
        return cost_model.bits_cost(row.work, precision)
    fused = not row.reads_input
    return cost_model.latency(row.work, precision, gpu, fused_input=fused)


def lagrangian_configs(options):
    """Every configuration `argmin cost + lam * score` (per row) as `lam`
    runs from 0 to infinity: the convex hull of the multiple-choice
    knapsack, cheapest first. A configuration is a list of precisions,
    one per row; ties go to the lower score, then the lower cost."""
    breaks = {0.0}
    for row in options:
        items = list(row.values())
        for sa, ca in items:
            for sb, cb in items:
                if sa < sb and ca > cb:
                    breaks.add((ca - cb) / (sb - sa))
    lams = sorted(breaks)
    points = (
        [0.0]
        + [(a + b) / 2 for a, b in zip(lams, lams[1:])]
        + [lams[-1] * 2 + 1.0, math.inf]
    )
    configs = []
    for lam in points:
        config = [_pick(row, lam) for row in options]
        if not configs or config != configs[-1]:
            configs.append(config)
    return configs


def _pick(row, lam):
    def key(p):
        score, cost = row[p]
        total = score if math.isinf(lam) else cost + lam * score
        return (total, score, cost)

    return min(row, key=key)


def _total(options, config, k):
    return float(sum(row[p][k] for row, p in zip(options, config)))


def _choices(rows, options, config):
    out = []
    for row, opts, p in zip(rows, options, config):
        least = min(cost for _, cost in opts.values())
        # among the cheapest options, the least sensitive one
        cheapest = min(
            (q for q in opts if opts[q][1] == least), key=lambda q: opts[q][0]
        )
        twins_ = [
            q for q in opts if q != p and q != FLOAT and opts[q][1] == least
        ]
        if p == FLOAT and opts[FLOAT][1] == least:
            reason = "quantizing it saves nothing here (cost model)"
        elif p == FLOAT:
            reason = (
                f"too sensitive for the budget ({cheapest} score "
                f"{opts[cheapest][0]:.3g})"
            )
        elif opts[p][1] == least:
            reason = "cheapest option, within the budget"
            if twins_:
                reason += (
                    f" (as cheap as {', '.join(twins_)}, and less sensitive)"
                )
        else:
            reason = (
                f"{cheapest} is cheaper but more sensitive (score "
                f"{opts[cheapest][0]:.3g} vs {opts[p][0]:.3g})"
            )
        if p != FLOAT and row.formats.get(p, p) != p:
            reason += f"; TensorRT runs it as {row.formats[p]}"
        out.append(
            Choice(
                row.name,
                row.layers,
                p,
                {q: v[0] for q, v in opts.items()},
                {q: v[1] for q, v in opts.items()},
                0.0 if row.work is None else float(row.work.flops),
                reason,
            )
        )
    return out


def _predicted(rows, config, quantized, gpu):
    """Predicted latency (seconds, one scoring batch) of the chosen
    configuration, of float everywhere and of each quantized precision
    everywhere (whatever the cost the search minimized)."""

    def total(choose):
        return float(
            sum(
                _price(row, choose(row, p), "latency", gpu)
                for row, p in zip(rows, config)
            )
        )

    out = {"chosen": total(lambda row, p: p), FLOAT: total(lambda r, p: FLOAT)}
    for q in quantized:
        out[f"all {q}"] = total(lambda row, p, q=q: q)
    return out


def _quantized_flops(rows, config):
    total = sum(row.work.flops for row in rows if row.work is not None)
    done = sum(
        row.work.flops
        for row, p in zip(rows, config)
        if row.work is not None and p != FLOAT
    )
    return float(done / total) if total else 0.0


def _build(model, rows, config, qmodels, recalibrate):
    """The model quantized as `config` says, its ranges copied from the
    calibrated model of each layer's precision (calibrated afresh only
    when a quantizer has no counterpart there). None when nothing is
    quantized."""
    by_path = {}
    for row, p in zip(rows, config):
        for path in row.layers:
            by_path[path] = p
    if all(p == FLOAT for p in config):
        return None

    copy, paths = float_copy(model, "auto_quantize")
    ids = {FLOAT: set(), **{p: set() for p in qmodels}}
    for layer in _models.walk_layers(copy):
        path = paths[id(layer)]
        if path in by_path:
            ids[by_path[path]].add(id(layer))
    configs = {
        _member_of(found): (
            QuantizeConfig(skip=True)
            if p == FLOAT
            else QuantizeConfig(precision=p)
        )
        for p, found in ids.items()
    }
    qmodel = quantize_model(
        copy,
        config=configs,
        layers=_member_of(set().union(*ids.values())),
        in_place=True,
    )
    # quantizers named by the paths of `model`: each copy's layers may
    # have other names (sublayers a layer makes in `build`)
    sources = {
        p: quantizers_by_path(m, paths_in(model, m)) for p, m in qmodels.items()
    }
    mine = quantizers_by_path(qmodel, paths)
    if _copy_ranges(mine, sources, by_path, paths):
        # a quantizer the per-precision models do not have (a placement
        # that depends on the neighbours' choice): calibrate this model,
        # then keep the shared ranges identical to theirs
        recalibrate(qmodel)
        _copy_ranges(mine, sources, by_path, paths)
    _models.reset_compiled_functions(qmodel)
    return qmodel


def _copy_ranges(mine, sources, by_path, paths):
    """Copies the range of each quantizer of `mine` (`{name: Quantizer}`)
    from the calibrated model of its layer's precision (`sources`:
    `{precision: {name: Quantizer}}`; `paths`: the layers' paths, as
    `copies.paths_in`); returns the names it found no range for."""
    missing = []
    for name, q in mine.items():
        p = by_path.get(paths.get(id(q.layer)))
        source = sources.get(p, {}).get(name)
        if source is None or tuple(source.quantizer.amax.shape) != tuple(
            q.quantizer.amax.shape
        ):
            missing.append(name)
            continue
        q.quantizer.amax.assign(source.quantizer.amax)
    return missing


def _member_of(ids):
    return lambda layer: id(layer) in ids


class _Evaluation:
    """The metric of a model on the evaluation data, its float value,
    and its name (the default: `metrics.default_metric`)."""

    def __init__(self, model, data, labels, metric, batch_size, specs, caller):
        self.batches = list(
            _inputs.batches(data, specs, caller, batch_size, None, labels)
        )
        self.specs, self.caller = specs, caller
        self.passes = 0
        predictions = self._predict(model)
        with_labels = self.batches[0][1] is not None
        threshold, why = metrics.binary_threshold(model, predictions[0])
        if metric is None:
            metric, self.name = metrics.default_metric(
                threshold, why, with_labels
            )
        else:
            self.name = metrics.metric_name(metric)
        self.metric = metric
        self.labels = (
            [y for _, y in self.batches]
            if with_labels
            else [metrics.reference_labels(p, threshold) for p in predictions]
        )
        self.base = self._score(predictions, "the float model")

    def _predict(self, model):
        out = []
        for x, _ in self.batches:
            y = model(_inputs.call_arg(model, x, self.specs), training=False)
            out.append(np.asarray(y))
            self.passes += 1
        return out

    def _score(self, predictions, what):
        return metrics.metric_value(
            self.metric,
            np.concatenate(self.labels),
            np.concatenate(predictions),
            what,
            self.caller,
        )

    def metric_of(self, qmodel):
        return self._score(self._predict(qmodel), "a quantized model")
