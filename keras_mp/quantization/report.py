"""`quantization_report`: what is quantized in a model, with which ranges."""

import keras
import numpy as np

from keras_mp import _models
from keras_mp.layer_table import NO_INPUTS
from keras_mp.quantization.layers import (
    QuantizeActivation,
    QuantizeWrapper,
    quantizable_row,
)


def _wrapper_row(layer):
    amaxes = [float(q.amax.numpy()) for q in layer.input_quantizers]
    uncalibrated = any(a == 0 for a in amaxes)
    return {
        "type": type(layer.layer).__name__,
        "quantized": True,
        "inputs": dict(zip(layer.input_indices, amaxes)),
        "weights": {
            attr: (float(np.min(v.numpy())), float(np.max(v.numpy())))
            for attr, _, v in layer.weight_ranges
        },
        "note": "uncalibrated input range (0): run keras_mp.calibrate"
        if uncalibrated
        else "",
    }


def _float_note(layer):
    row = quantizable_row(layer)
    if row is None:
        return "not a quantizable type: runs in float"
    if not row.weights and row.inputs == NO_INPUTS:
        return "no Q/DQ needed (TensorRT propagates scales)"
    return "not selected, or skipped by QuantizeConfig"


def quantization_report(model, verbose=True):
    """Per layer: what is quantized, with which ranges, what is skipped, why.

    Args:
        model: a `keras.Model`, quantized or not; nested models are listed
            layer by layer.
        verbose: bool. Print the table. Defaults to True.

    Returns:
        A list of dicts: `layer`, `type`, `quantized` (bool), `inputs`
        (activation ranges by input index), `weights` (per-channel range
        min/max by weight), `note`.

    Raises:
        TypeError: `model` is not a Keras 3 model.

    Example:

    >>> rows = keras_mp.quantization_report(qmodel, verbose=False)
    >>> [r["layer"] for r in rows if r["quantized"]]
    """
    _models.check_model(model, "quantization_report")
    rows = []
    stop = (QuantizeWrapper, QuantizeActivation)
    for layer in _models.walk_layers(model, stop_at=stop):
        if isinstance(layer, keras.layers.InputLayer):
            continue
        row = {"layer": layer.name, "type": type(layer).__name__}
        if isinstance(layer, QuantizeWrapper):
            row.update(_wrapper_row(layer))
        elif isinstance(layer, QuantizeActivation):
            row.update(quantized=True, inputs={0: float(layer.amax.numpy())})
            row.update(weights={}, note="stand-alone Q/DQ")
        else:
            row.update(quantized=False, inputs={}, weights={})
            row["note"] = _float_note(layer)
        rows.append(row)
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
