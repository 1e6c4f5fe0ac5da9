"""Per-layer quantization sensitivity: which layers hurt when quantized.

`layer_sensitivity` quantizes a model once per precision, calibrates it
once, and scores every quantized layer (or coupled group: the query, key
and value projections of one attention layer) in one pass:

- with labels (or a loss): ModelOpt AutoQuantize's gradient score, the sum
  over the scoring batches of `(dL/dy * delta_y) ** 2`, `delta_y` the
  change of the layer's output when it alone is quantized (a second-order
  Taylor expansion of the loss with the Fisher information in place of
  the Hessian). Every layer's `delta_y` and `dL/dy` come from one forward
  (each layer computed with and without its quantizers, the float output
  passed on) and one backward pass per batch.
- without labels: the KL divergence of the model's output distribution
  when that layer alone is quantized, from the float model's (ModelOpt's
  label-free searcher); one forward pass per layer and batch.
- with a `metric`: its drop (float minus quantized) when that layer alone
  is quantized, on labels or, without, on agreement with the float
  model's top-1; one forward pass per layer and batch.

Guide: `docs/precision.md`.
"""

import functools
import re
import time

import keras
import numpy as np
import tensorflow as tf

from keras_mp import _inputs, _keras, _models, _record
from keras_mp._compat import require_tensorflow
from keras_mp.precision import cost as cost_model
from keras_mp.precision import metrics
from keras_mp.precision.copies import float_copy
from keras_mp.precision.reports import SensitivityReport, SensitivityRow
from keras_mp.quantization import twins
from keras_mp.quantization.calibrate import calibrate
from keras_mp.quantization.config import PRECISIONS
from keras_mp.quantization.names import canonical_names
from keras_mp.quantization.quantize import quantize_model

# Sibling layers decided together: one attention layer's projections read
# one tensor (ModelOpt shares its input quantizer among them).
_COUPLED = re.compile(r"(query|key|value)")


def layer_sensitivity(
    model,
    data,
    labels=None,
    precisions=("int8", "float8"),
    metric=None,
    loss=None,
    calibration="auto",
    num_batches=4,
    batch_size=64,
    calibration_batches=16,
    verbose=1,
):
    """How much quantizing each layer alone would hurt, per precision.

    Quantizes a copy of `model` once per precision, calibrates it once on
    `data`, then scores every quantized layer (the query, key and value
    projections of one attention layer as one group) on the first
    `num_batches` batches: with `labels` or `loss`, ModelOpt
    AutoQuantize's gradient score (one forward and one backward pass per
    batch for all layers); without, the KL divergence of the outputs (one
    forward pass per layer and batch); with a `metric`, its drop when the
    layer alone is quantized (one forward pass per layer and batch). "Not
    quantized" always scores 0.

    Args:
        model: a built float `keras.Model`.
        data: inputs: a NumPy array (a list or dict of arrays for several
            inputs), or a `tf.data.Dataset` / iterable of batches, `(x, y)`
            tuples giving the labels.
        labels: array of labels for array `data`, or None.
        precisions: tuple of `"int8"` and/or `"float8"` (`"fp8"` is an
            old spelling of `"float8"`, with a `DeprecationWarning`).
        metric: callable `metric(y_true, y_pred) -> float`, higher is
            better (`keras_mp.precision.top1_accuracy`, or for a one-unit
            output `threshold_accuracy`). The score is `metric(float
            model) - metric(layer quantized)` over the scoring batches, on
            `labels`, or without labels on the float model's decisions as
            labels (its top-1; a one-unit output thresholded, 0.5 on
            probabilities, 0 on logits). None: the gradient or KL score.
        loss: callable `loss(y_true, y_pred) -> scalar` to differentiate.
            Defaults to (sparse) cross-entropy for integer labels and a
            classifier output (logits or probabilities, told apart on the
            data), binary cross-entropy for labels 0 and 1 and a one-unit
            output (logits or probabilities, told apart by its last
            layer's activation: `metrics.binary_threshold`), mean squared
            error otherwise.
        calibration: str. The `keras_mp.calibrate` method of the ranges.
            Defaults to `"auto"`.
        num_batches: int. Scoring batches. Defaults to 4.
        batch_size: int. For array data. Defaults to 64.
        calibration_batches: int. Calibration batches (of `batch_size`).
            Defaults to 16.
        verbose: int. 1 shows progress bars. Defaults to 1.

    Returns:
        `SensitivityReport` (`.rows`, `print(report)`, `.to_dict()`,
        `.plot()`).

    Raises:
        ValueError: an unknown precision, labels whose length is not the
            data's, labels with a dataset, labels that do not fit the
            classes of a one-output classifier (checked without a custom
            `loss`), a model with nothing to
            quantize, empty data, or a score that is not finite (the
            layer is named).

    Example:

    >>> report = keras_mp.layer_sensitivity(model, x[:512], y[:512])
    >>> print(report)
    """
    require_tensorflow("keras_mp.layer_sensitivity")
    report, _ = score_layers(
        model,
        data,
        labels,
        precisions,
        metric=metric,
        loss=loss,
        calibration=calibration,
        num_batches=num_batches,
        batch_size=batch_size,
        calibration_batches=calibration_batches,
        verbose=verbose,
    )
    return report


def precision_tuple(precisions, allowed, caller):
    """`precisions` as a tuple of names (`names.canonical_name`: old
    spellings warn), or a ValueError naming what is allowed."""
    if isinstance(precisions, str):
        precisions = (precisions,)
    precisions = tuple(precisions)
    if not precisions:
        raise ValueError(
            f"`{caller}`: `precisions` must be a non-empty tuple of "
            f"{list(allowed)}. Received: {precisions!r}"
        )
    return canonical_names(precisions, f"{caller}(precisions=)", allowed)


def score_layers(
    model,
    data,
    labels,
    precisions,
    metric=None,
    loss=None,
    calibration="auto",
    num_batches=4,
    batch_size=64,
    calibration_batches=16,
    verbose=1,
    caller="layer_sensitivity",
):
    """`layer_sensitivity`'s work; also returns the calibrated model of
    each precision (`{precision: qmodel}`), whose ranges
    `keras_mp.auto_quantize` reuses."""
    start = time.perf_counter()
    _models.check_model(model, caller)
    twins.check_float(model, caller)
    precisions = precision_tuple(precisions, PRECISIONS, caller)
    for name, value in (
        ("num_batches", num_batches),
        ("batch_size", batch_size),
        ("calibration_batches", calibration_batches),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(
                f"`{caller}`: `{name}` must be a positive integer. "
                f"Received: {value!r}"
            )
    specs = _inputs.input_specs(model, caller)
    batches = list(
        _inputs.batches(data, specs, caller, batch_size, num_batches, labels)
    )
    with_labels = [y is not None for _, y in batches]
    if loss is None and all(with_labels):
        _check_labels(model, [y for _, y in batches], caller)
    if metric is not None and loss is not None:
        raise ValueError(
            f"`{caller}`: pass a `metric` (scores are its drop) or a `loss` "
            "(scores are gradient scores), not both."
        )
    if metric is not None and not callable(metric):
        raise TypeError(
            f"`{caller}`: `metric` must be a callable `metric(y_true, "
            f"y_pred) -> float`. Received: {metric!r}"
        )
    if metric is not None:
        method = "metric"
    elif loss is not None or any(with_labels):
        method = "gradient"
    else:
        method = "kl"
    if any(with_labels) and not all(with_labels):
        raise ValueError(
            f"`{caller}`: some batches have labels and some do not. Give "
            "labels for every batch, or none."
        )
    qmodels, rows, units = {}, None, None
    passes = {"calibration": 0, "forward": 0, "backward": 0}
    float_out = None
    for p in precisions:
        copy, paths = float_copy(model, caller)
        qmodel = quantize_model(copy, precision=p, in_place=True)
        cal = calibrate(
            qmodel,
            data,
            method=calibration,
            num_batches=calibration_batches,
            batch_size=batch_size,
            verbose=0,
        )
        passes["calibration"] += cal.batches
        qmodels[p] = qmodel
        found = coupled_units(qmodel, paths)
        if units is None:
            units = found
            rows = {
                name: SensitivityRow(
                    name,
                    tuple(path for path, _ in members),
                    "+".join(
                        dict.fromkeys(
                            _models.class_name(layer).removeprefix("Quantized")
                            for _, layer in members
                        )
                    ),
                    {},
                    {},
                    reads_input=any(
                        _reads_model_input(layer) for _, layer in members
                    ),
                )
                for name, members in units.items()
            }
        twins.set_quantization_enabled(qmodel, False)
        if method == "gradient":
            scores, works = _gradient_scores(
                qmodel, found, batches, specs, loss, verbose, p
            )
            passes["forward"] += len(batches)
            passes["backward"] += len(batches)
        else:
            if float_out is None:
                float_out = [_outputs(qmodel, x, specs) for x, _ in batches]
                passes["forward"] += len(batches)
                score = (
                    _metric_drop(model, metric, batches, float_out, caller)
                    if method == "metric"
                    else functools.partial(_kl_total, float_out)
                )
            scores, works = _one_at_a_time(
                qmodel, found, batches, specs, score, verbose, p
            )
            # one pass for the layers' shapes, one per layer and batch
            passes["forward"] += 1 + len(batches) * len(found)
        twins.set_quantization_enabled(qmodel, True)
        for name, members in found.items():
            row = rows[name]
            row.scores[p] = scores[name]
            row.formats[p] = _format_of([layer for _, layer in members])
            if row.work is None:
                row.work = works.get(name)
            if not np.isfinite(scores[name]):
                raise ValueError(
                    f"`{caller}`: the {p} score of layer {name!r} is "
                    f"{scores[name]} (the loss or the outputs hold NaN or "
                    "Inf). Check the data and the loss."
                )
    ordered = sorted(
        rows.values(), key=lambda r: max(r.scores.values()), reverse=True
    )
    report = SensitivityReport(
        ordered,
        method,
        precisions,
        calibration,
        sum(len(x[0]) for x, _ in batches),
        passes,
        time.perf_counter() - start,
        metric=_metric_name(metric, all(with_labels)),
    )
    return report, qmodels


def _metric_name(metric, with_labels):
    if metric is None:
        return ""
    name = metrics.metric_name(metric)
    return name if with_labels else f"{name} on the float model's decisions"


def _check_labels(model, labels, caller):
    """A ValueError before any copy is quantized when class labels do not
    fit the classes of `model`'s one output (its last axis): a class index
    outside it, or one-hot rows of another width. Other outputs (one
    column, several outputs, unknown shapes) are not checked."""
    try:
        outputs = model.outputs or []
    except (AttributeError, ValueError):  # subclassed: no symbolic outputs
        return
    if len(outputs) != 1 or len(outputs[0].shape) < 2:
        return
    classes = outputs[0].shape[-1]
    if classes is None or classes < 2:
        return
    out = tuple(outputs[0].shape[1:])
    shape = np.asarray(labels[0]).shape[1:]
    y = np.concatenate([np.asarray(b).reshape(len(b), -1) for b in labels])
    # class indices: one per row of the output, or a trailing axis of 1
    sparse = len(shape) == len(out) - 1 or (
        len(shape) == len(out) and shape[-1] == 1
    )
    if sparse and y.dtype.kind in "iub":
        if y.min() < 0 or y.max() >= classes:
            raise ValueError(
                f"`{caller}`: the labels are class indices from {y.min()} to "
                f"{y.max()}, but model {model.name!r} has {classes} classes "
                f"(its output's last axis, shape {tuple(outputs[0].shape)}). "
                f"Pass labels in 0..{classes - 1}, for this model's output."
            )
        return
    if not sparse and len(shape) == len(out) and shape[-1] == classes:
        return  # one-hot or probability rows
    raise ValueError(
        f"`{caller}`: labels of shape {(None, *shape)} and dtype {y.dtype} "
        f"do not fit the {classes} classes of model {model.name!r} (output "
        f"shape {tuple(outputs[0].shape)}). Pass integer class indices in "
        f"0..{classes - 1}, or one-hot rows of {classes}; or a `loss` that "
        "takes these labels."
    )


def coupled_units(qmodel, paths):
    """`{unit name: [(layer path, twin), ...]}`: every quantized twin of
    `qmodel`, the query/key/value projections of one attention layer
    (siblings named so) as one unit, in walk order. Paths are those
    `paths` gives (`copies.paths_in`: the user's model's), whatever names
    the copy's layers got."""
    units, by_parent = {}, {}
    root = _record.contents(qmodel)
    for layer, parents in _models.walk_layers(root, with_parents=True):
        if not twins.is_quantized(layer):
            continue
        path = paths[id(layer)]
        name = path.rsplit("/", 1)[-1]
        if _COUPLED.fullmatch(name) and parents:
            parent = paths[id(parents[-1])]
            by_parent.setdefault(parent, []).append((path, layer))
        units[path] = [(path, layer)]
    for parent, members in by_parent.items():
        if len(members) < 2:
            continue
        names = ",".join(path.rsplit("/", 1)[-1] for path, _ in members)
        group = f"{parent}/{{{names}}}"
        first = members[0][0]
        rebuilt = {}
        for key, value in units.items():
            if key == first:
                rebuilt[group] = members
            elif key not in {path for path, _ in members}:
                rebuilt[key] = value
        units = rebuilt
    return units


def _reads_model_input(layer):
    """Whether a Functional graph feeds `layer` a model input directly."""
    for node in _keras.inbound_nodes(layer):
        for tensor in node.input_tensors:
            source = _keras.producer(tensor)
            if source is None or isinstance(source, keras.layers.InputLayer):
                return True
    return False


def _format_of(layers):
    names = sorted(
        {q.format.name for layer in layers for q in layer.owned_quantizers()}
    )
    return "+".join(names) if names else "float"


def _tensors(structure):
    return [t for t in tf.nest.flatten(structure) if hasattr(t, "shape")]


def _shapes(structure):
    return [tuple(int(d) for d in t.shape) for t in _tensors(structure)]


def _record_work(works, unit, layer, args, outputs):
    if works is None:
        return
    work = cost_model.layer_work(layer, _shapes(args), _shapes(outputs))
    works[unit] = work if unit not in works else works[unit] + work


class _GradientProbe:
    """Runs each twin with and without its quantizers, passes the float
    output on plus a zero tensor the tape watches (its gradient is
    `dL/dy`), and keeps `delta_y`."""

    def __init__(self, tape, unit_of, works):
        self.tape, self.unit_of, self.works = tape, unit_of, works
        self.found = []  # (unit, z, delta_y)
        self.nested = False

    def __call__(self, layer, run, args, kwargs):
        if self.nested:  # inside an outer layer's quantized run: float
            return run()
        layer.enabled = False
        out = run()
        layer.enabled = True
        self.nested = True
        try:
            quantized = run()
        finally:
            self.nested = False
            layer.enabled = False
        unit = self.unit_of[id(layer)]
        _record_work(self.works, unit, layer, (args, kwargs), out)
        passed = []
        for a, b in zip(tf.nest.flatten(out), tf.nest.flatten(quantized)):
            if hasattr(a, "dtype") and a.dtype.is_floating:
                z = tf.zeros_like(a)
                self.tape.watch(z)
                delta = tf.cast(b, tf.float32) - tf.cast(a, tf.float32)
                self.found.append((unit, z, tf.stop_gradient(delta)))
                new = a + z
                _keras.copy_mask(a, new)
                a = new
            passed.append(a)
        return tf.nest.pack_sequence_as(out, passed)


def _gradient_scores(qmodel, units, batches, specs, loss, verbose, p):
    unit_of = {id(layer): name for name, ms in units.items() for _, layer in ms}
    scores = dict.fromkeys(units, 0.0)
    works = {}
    progbar = keras.utils.Progbar(
        len(batches), verbose=verbose, unit_name=f"{p} batch"
    )
    for step, (x, y) in enumerate(batches):
        with tf.GradientTape() as tape:
            probe = _GradientProbe(tape, unit_of, works if step == 0 else None)
            with twins.probing(probe):
                outputs = qmodel(
                    _inputs.call_arg(qmodel, x, specs), training=False
                )
            value = _loss(loss, y, outputs, qmodel)
        grads = tape.gradient(value, [z for _, z, _ in probe.found])
        for (unit, _, delta), g in zip(probe.found, grads):
            if g is None:  # an output nothing downstream reads
                continue
            g = tf.cast(g, tf.float32)
            scores[unit] += float(tf.reduce_sum(tf.square(g * delta)))
        progbar.update(step + 1)
    return scores, works


def _one_at_a_time(qmodel, units, batches, specs, score, verbose, p):
    """Each unit's `score(outputs per batch)` with that unit alone
    quantized (the label-free KL and the metric drop)."""
    scores = dict.fromkeys(units, 0.0)
    works = {}

    unit_of = {id(layer): name for name, ms in units.items() for _, layer in ms}

    def shapes_probe(layer, run, args, kwargs):
        out = run()
        _record_work(works, unit_of[id(layer)], layer, (args, kwargs), out)
        return out

    with twins.probing(shapes_probe):
        qmodel(_inputs.call_arg(qmodel, batches[0][0], specs), training=False)
    progbar = keras.utils.Progbar(
        len(units), verbose=verbose, unit_name=f"{p} layer"
    )
    for k, (name, members) in enumerate(units.items()):
        for _, layer in members:
            layer.enabled = True
        outs = [_outputs(qmodel, x, specs) for x, _ in batches]
        for _, layer in members:
            layer.enabled = False
        scores[name] = score(outs)
        progbar.update(k + 1)
    return scores, works


def _metric_drop(model, metric, batches, float_out, caller):
    """`score(outputs per batch)`: `metric` on the float outputs minus on
    these, on the batches' labels (else the float model's decisions:
    `metrics.reference_labels`)."""
    if any(len(out) != 1 for out in float_out):
        raise ValueError(
            f"`{caller}`: a `metric` scores a model of one output; this one "
            f"has {len(float_out[0])}. Pass a `loss` that combines them, or "
            "no metric (the KL score)."
        )
    threshold, _ = metrics.binary_threshold(model, float_out[0][0])
    labels = np.concatenate(
        [
            metrics.reference_labels(out[0], threshold)
            if y is None
            else np.asarray(y)
            for (_, y), out in zip(batches, float_out)
        ]
    )

    def value(outs, what):
        predictions = np.concatenate([out[0] for out in outs])
        return metrics.metric_value(metric, labels, predictions, what, caller)

    base = value(float_out, "the float model")
    return lambda outs: base - value(outs, "a quantized layer's model")


def _outputs(model, x, specs):
    out = model(_inputs.call_arg(model, x, specs), training=False)
    return [np.asarray(_keras.to_numpy(t), np.float64) for t in _tensors(out)]


def _is_probabilities(y):
    """Non-negative rows summing to 1 over the last axis (a softmax
    output), as opposed to logits."""
    return bool(np.all(y >= 0) and np.allclose(y.sum(-1), 1.0, atol=1e-3))


def _probabilities(y):
    """`y` as probabilities over its last axis: itself when it already is
    one, else its softmax; None for a one-value output."""
    if y.ndim and y.shape[-1] > 1:
        if _is_probabilities(y):
            return np.clip(y, 1e-12, None)
        e = np.exp(y - y.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    return None


def _kl_total(float_out, outs):
    """The KL score over the batches: `_kl` summed."""
    return sum(map(_kl, float_out, outs))


def _kl(reference, quantized):
    """Mean KL(reference || quantized) over the samples, summed over the
    outputs; a one-value output (a regression) adds its mean squared
    change instead."""
    total = 0.0
    for a, b in zip(reference, quantized):
        pa, pb = _probabilities(a), _probabilities(b)
        if pa is None:
            total += float(np.mean((a - b) ** 2))
            continue
        pb = np.clip(pb, 1e-12, None)
        kl = np.sum(pa * (np.log(pa) - np.log(pb)), axis=-1)
        total += float(np.mean(kl))
    return total


def _loss(loss, y, outputs, model):
    if loss is not None:
        return tf.cast(loss(y, outputs), tf.float32)
    found = _tensors(outputs)
    if len(found) != 1:
        raise ValueError(
            f"The model has {len(found)} outputs: pass a `loss(y_true, "
            "y_pred)` that combines them."
        )
    out = tf.cast(found[0], tf.float32)
    y = np.asarray(y)
    if y.dtype.kind in "iub" and out.shape[-1] and out.shape[-1] > 1:
        logits = not _is_probabilities(out.numpy())
        return tf.reduce_mean(
            keras.losses.sparse_categorical_crossentropy(
                y, out, from_logits=logits
            )
        )
    target = tf.reshape(tf.cast(y, tf.float32), tf.shape(out))
    if (not out.shape[-1] or out.shape[-1] == 1) and np.isin(y, (0, 1)).all():
        threshold, _ = metrics.binary_threshold(model, out.numpy())
        return tf.reduce_mean(
            keras.losses.binary_crossentropy(
                target, out, from_logits=threshold == 0.0
            )
        )
    return tf.reduce_mean(tf.square(out - target))
