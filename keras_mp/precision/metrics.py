"""The metrics `auto_quantize` measures and `layer_sensitivity` scores by.

A classifier of several classes is measured by top-1 accuracy. A one-unit
output (a binary classifier, a click-through-rate model) is measured by
the accuracy of its output thresholded, 0.5 on probabilities and 0 on
logits: its top-1 is always class 0, so a top-1 accuracy would be the
share of label 0 whatever the model does, and a budget on its drop would
never bind. Without labels, both compare with the float model's decisions
(its top-1, or its thresholded output).
"""

import functools
import math

import keras
import numpy as np

from keras_mp import _keras


def top1_accuracy(y_true, y_pred):
    """The fraction of samples whose largest output is the label.

    Args:
        y_true: array of class indices, one per sample.
        y_pred: array of scores, classes on the last axis.

    Returns:
        float.

    Raises:
        ValueError: `y_pred` has one column (a binary output), whose
            largest output is always the first.

    Example:

    >>> top1_accuracy(np.array([1, 0]), np.array([[0.2, 0.8], [0.3, 0.7]]))
    0.5
    """
    y_pred = np.asarray(y_pred)
    if y_pred.ndim < 2 or y_pred.shape[-1] == 1:
        raise ValueError(
            "top1_accuracy: the predictions have one column (shape "
            f"{y_pred.shape}): their top-1 is always class 0, so the "
            "accuracy would be the share of label 0 whatever the model "
            "does. For a one-unit (binary) output use "
            "`keras_mp.precision.threshold_accuracy` (threshold 0.5 on "
            "probabilities, 0 on logits)."
        )
    y_true = np.asarray(y_true).reshape(-1)
    return float(np.mean(np.argmax(y_pred, axis=-1).reshape(-1) == y_true))


def threshold_accuracy(y_true, y_pred, threshold=0.5):
    """The fraction of outputs above `threshold` exactly where the label
    is 1: the accuracy of a one-unit (binary) classifier.

    Args:
        y_true: array of labels 0 and 1 (or booleans), one per output.
        y_pred: array of outputs, as many (e.g. shape `(n, 1)`).
        threshold: float. 0.5 for probabilities (a sigmoid output), 0.0
            for logits. Defaults to 0.5.

    Returns:
        float.

    Raises:
        ValueError: labels other than 0 and 1 (a regression's targets),
            or not one label per output.

    Example:

    >>> threshold_accuracy(np.array([1, 0]), np.array([[0.9], [0.6]]))
    0.5
    """
    y_true = np.asarray(y_true).reshape(-1)
    y_pred = np.asarray(y_pred).reshape(-1)
    if not np.isin(y_true, (0, 1)).all():
        found = np.unique(y_true)[:5].tolist()
        raise ValueError(
            "threshold_accuracy measures a binary classifier: labels must "
            f"be 0 or 1. Received labels such as {found}. For a "
            "regression, pass a `metric` of your own (higher is better, "
            "e.g. minus the mean squared error)."
        )
    if len(y_true) != len(y_pred):
        raise ValueError(
            f"threshold_accuracy takes one label per output: {len(y_true)} "
            f"labels for {len(y_pred)} outputs. Pass labels of the output's "
            "shape."
        )
    return float(np.mean((y_pred > threshold) == y_true.astype(bool)))


def binary_threshold(model, predictions):
    """The threshold of a one-unit output, and how it was told: 0.5 when
    the output layer's activation is a sigmoid, 0.0 when it is linear
    (logits); for any other last layer, 0.5 when every output of the
    float model (`predictions`) lies in [0, 1], else 0.0. `(None, "")`
    for an output of several classes."""
    if predictions.ndim > 1 and predictions.shape[-1] != 1:
        return None, ""
    try:
        outputs = model.outputs or []
    except (AttributeError, ValueError):  # subclassed: no symbolic outputs
        outputs = []
    last = _keras.producer(outputs[0]) if len(outputs) == 1 else None
    activation = getattr(last, "activation", None)
    if activation is keras.activations.sigmoid:
        return 0.5, f"probabilities: {last.name!r} ends in a sigmoid"
    if activation is keras.activations.linear:
        return 0.0, f"logits: {last.name!r} has no activation"
    if np.all((predictions >= 0) & (predictions <= 1)):
        return 0.5, "probabilities: every float output is in [0, 1]"
    return 0.0, "logits: float outputs outside [0, 1]"


def reference_labels(predictions, threshold):
    """The float model's decisions, the labels of a metric without
    labels: its top-1 class, or for a one-unit output (`threshold` not
    None) its output thresholded (0 or 1)."""
    if threshold is None:
        return np.argmax(predictions, axis=-1)
    return (predictions > threshold).astype("int32")


def default_metric(threshold, why, with_labels):
    """`(metric, name)`: top-1 accuracy, or for a one-unit output
    `threshold_accuracy` at `threshold`; the name says which, and
    whether it is measured on labels or on agreement with the float
    model."""
    if threshold is None:
        name = "top-1 accuracy" if with_labels else "top-1 agreement"
        return top1_accuracy, name
    name = "accuracy" if with_labels else "agreement"
    return (
        functools.partial(threshold_accuracy, threshold=threshold),
        f"{name} at threshold {threshold:g} ({why})",
    )


def metric_name(metric):
    """The name a report gives a metric function (a `functools.partial`
    is named after the function it wraps)."""
    while isinstance(metric, functools.partial):
        metric = metric.func
    return getattr(metric, "__name__", None) or type(metric).__name__


def metric_value(metric, y_true, y_pred, what, caller):
    """`metric(y_true, y_pred)` as a float, or a ValueError naming `what`
    was measured when it is not a finite number."""
    found = metric(y_true, y_pred)
    try:
        found = float(found)
    except (TypeError, ValueError):
        found = math.nan
    if not math.isfinite(found):
        raise ValueError(
            f"`{caller}`: the metric of {what} is {found} (not a finite "
            "number). Check the metric function and the data."
        )
    return found
