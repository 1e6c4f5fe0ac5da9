"""Which ONNX tensors may hold each layer call's output, for
`compare_onnx`: the tensor of the same TensorFlow name, else the float
tensors of its scope, a recurrent op's outputs read as Keras returns
them, or, for a Q/DQ tf2onnx renamed, its parent's activation
DequantizeLinears."""

import numpy as np

from keras_mp.onnx.compare_graph import FLOAT_TYPES, fits
from keras_mp.quantization.activation import QuantizeActivation

# Candidates kept per layer call when its tensor was renamed: enough for
# the calls of a layer repeated over time steps (`TimeDistributed`), whose
# tensors share one scope.
_MAX_CANDIDATES = 64


def _match(graph, call, shape):
    """(the ONNX tensors that may hold `call`'s output, as `(name, view)`
    pairs (`Graph.views`), None), or (None, why not).

    The tensor of the same TensorFlow name when tf2onnx kept it; else the
    float tensors of a fitting shape among the nodes of the scope that
    produced the output (a layer returning its input points to its
    producer), then among the nodes of the layer's own scope, last first:
    the values decide among them (a layer called once per time step has
    one such tensor per step in the same scope; a recurrent op's outputs
    are read per direction and merged as `Bidirectional` merges them).
    """
    elem, dims = graph.types.get(call.tensor, (None, None))
    if elem in FLOAT_TYPES and fits(dims, shape):
        return [(call.tensor, "")], None

    def views(tensors):
        return [
            view
            for name, dims in tensors
            for view, view_dims in graph.views(name, dims)
            if fits(view_dims, shape)
        ]

    # tf2onnx merges the nodes of a Bidirectional's two layers into one
    # op under either's name: its parent's recurrent ops are candidates.
    recurrent = []
    if _is_recurrent(call.layer):
        parent = call.scope.rsplit("/", 1)[0]
        for scope in (call.scope, parent):
            recurrent += views(graph.recurrent_outputs(scope))
    producer = call.tensor.rsplit("/", 1)[0]
    for scope in dict.fromkeys((producer, call.scope)):
        found = views(graph.float_outputs(scope))
        if found or recurrent:
            found = list(dict.fromkeys(recurrent + found))
            return found[:_MAX_CANDIDATES], None
    if call.scope not in graph.groups:
        return None, (
            "no ONNX node carries its name (folded into a constant, or "
            "renamed by tf2onnx)"
        )
    return None, "no ONNX tensor of its output's shape"


def plan(graph, calls, values):
    """Per call, the ONNX tensors to compare its output with, and the calls
    with none (and why).

    A Q/DQ tf2onnx renamed (a Transpose moved between its QuantizeLinear
    and DequantizeLinear, a layer quantizing its own input) has no node
    of its scope: it is matched with the activation DequantizeLinears of
    its parent layer that no other Q/DQ took, and those outside it that
    its nodes read (a Q/DQ tf2onnx merged with the equal Q/DQ of another
    consumer of the same tensor, named after that one), the best fit
    chosen; only those of the Q/DQ's own scale: another Q/DQ of the
    layer is not a stand-in.
    """
    plan, unmatched, orphans = [], [], []
    for depth, call in enumerate(calls):
        tensors, why = _match(graph, call, values[call.output].shape)
        if tensors is not None:
            plan.append((depth, call, tensors))
        elif is_qdq(call.layer):
            orphans.append((depth, call, why))
        else:
            unmatched.append((call.name, why))
    taken = {tensors[0] for _, _, tensors in plan if len(tensors) == 1}
    for depth, call, why in orphans:
        parent = call.scope.rsplit("/", 1)[0]
        own = [dq for dq in graph.activation_dqs(parent) if dq not in taken]
        found = [
            (dq, "")
            for dq in dict.fromkeys(own + graph.feeding_dqs(parent))
            if _same_scale(graph.dq_scale(dq), step(call.layer))
        ]
        if found:
            plan.append((depth, call, found))
        else:
            unmatched.append((call.name, f"{why}; {_NO_DQ}"))
    return sorted(plan, key=lambda p: p[0]), unmatched


_NO_DQ = (
    "no activation DequantizeLinear of its scale in its layer or feeding it"
)

# A scale stored in the graph's float type differs from the quantizer's
# `amax / qmax` by its rounding (a few units in the last place).
_SCALE_ULPS = 8


def _same_scale(found, want):
    """Whether a DequantizeLinear's `(scale, eps)` (None: not a constant,
    so unknown) can be the scale `want`."""
    if found is None:
        return True
    scale, eps = found
    return abs(scale - want) <= _SCALE_ULPS * eps * want


def _is_recurrent(layer):
    """A recurrent layer (`LSTM`, `GRU`, `SimpleRNN`, a `Bidirectional`):
    its output may be an output of an ONNX recurrent op."""
    import keras

    return isinstance(layer, (keras.layers.RNN, keras.layers.Bidirectional))


def is_qdq(layer):
    """A calibrated, enabled `QuantizeActivation`: its output is a Q/DQ."""
    return (
        isinstance(layer, QuantizeActivation)
        and layer.enabled
        and step(layer) > 0
    )


def qdq_steps(got, want, quantizer, eps):
    """The largest difference between ONNX Runtime's (`got`) and Keras'
    (`want`) outputs of an activation Q/DQ, in codes of its format where
    the two lie: `|got - want| / (scale * local step)`, the local step at
    the smaller of the two magnitudes (`NumberFormat.local_step`: 1 on
    an int grid, so a flip is one step; 32 scales near 448 on FP8 E4M3,
    where a flip is one code there too). `eps` is the relative
    resolution of the graph's float type: ONNX Runtime's codes are read
    up to it (a float16 graph rounds the scale and the output, so its 64
    may read 63.99), and a step is never taken finer than `qmax * eps`,
    the rounding a float16 graph's Q reads its input with, which spans
    many of FP8's codes near 0."""
    if not want.size:
        return 0.0
    scale = step(quantizer)
    fmt = quantizer.format
    got, want = got.astype(np.float64), want.astype(np.float64)
    smaller = np.minimum(np.abs(got), np.abs(want)) * (1 + eps) / scale
    local = scale * np.maximum(fmt.local_step(smaller), fmt.qmax * eps)
    return float(np.max(np.abs(got - want) / local))


def step(quantizer):
    """One quantization step of a `QuantizeActivation` (0 uncalibrated)."""
    return float(quantizer.amax.numpy()) / quantizer.format.qmax
