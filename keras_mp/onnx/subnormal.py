"""Q/DQ scales below float16's smallest normal number, raised to it before
a float16 export (`fp16.to_half`), and the warning that says which
Keras quantizers they belong to and what their INT8 grids lose
(`docs/export.md`, "Strongly typed graphs")."""

import dataclasses

import numpy as np

from keras_mp.onnx.fold import _dequantize, _quantize
from keras_mp.onnx.graph import QDQ_OPS, GraphIndex, attr, reads, walk
from keras_mp.quantization.formats import number_format

# Smallest float16 normal number (2**-14). A smaller scale is subnormal in
# float16: it keeps fewer significant bits, and flush-to-zero kernels read 0.
FP16_TINY = float(np.finfo(np.float16).tiny)
# The INT8 grid the exported scales belong to: 127 steps between 0 and
# amax for activations (full range) and weights (narrow range) alike.
_STEPS = number_format("int8").qmax


@dataclasses.dataclass
class RaisedScale:
    """A Q/DQ scale that `raise_subnormal_scales` raised.

    Attributes:
        tensor: str. The ONNX scale tensor, before.
        nodes: list of str. The QuantizeLinear/DequantizeLinear nodes that
            read it (they all read the raised copy now).
        scale: float32 NumPy array. Its values before.
        empty: bool NumPy array like `scale` for a weight's scale (True
            where that channel's INT8 codes are all zero), None for an
            activation's.
    """

    tensor: str
    nodes: list
    scale: np.ndarray
    empty: np.ndarray = None


def block_scale_dqs(graph):
    """NVFP4's scales of scales: `(global scales, weight DQs)`.

    NVFP4 dequantizes in two steps, `DQ(FP8 E4M3 block scales, float32
    global scale)` then `DQ(FP4 codes, that)`: the global scale is a
    float32 constant in ModelOpt's export (`amax / (6 * 448)`, below
    float16's smallest normal for any weight whose range is under 0.16),
    and so are the scales and values the two DQs compute, cast to 16-bit
    before the GEMM ("DQ -> DQ -> Cast(f16) -> MatMul"). Returns the
    names of those global scales (read by such a DQ, the FP8 block scales
    a constant or a `TRT_FP4DynamicQuantize` output) and the names of the
    two DQs of each weight (FP8 block scales a constant): the 16-bit pass
    keeps them in float32, with a Cast after. A scale of scales is told by
    its place (a DQ whose output is another DQ's scale), not by types: an
    FP8 weight's DQ reads FP8 codes and a float32 scale too."""
    inits = {i.name for i in graph.initializer}
    dqs = [
        n
        for n in graph.node
        if n.op_type == "DequantizeLinear" and len(n.input) > 1
    ]
    second = {n.input[1]: n for n in dqs}  # a DQ whose scale a DQ computes
    scales, names = set(), set()
    for node in dqs:
        if node.output[0] not in second:
            continue
        scales.add(node.input[1])
        if node.input[0] in inits:  # a weight's: both DQs
            names |= {node.name, second[node.output[0]].name}
    return scales, names


def raise_subnormal_scales(model_proto):
    """Raises every Q/DQ scale below float16's smallest normal to it.

    Run on the float32 graph, in place. Every Q/DQ node that reads such a
    scale reads the raised copy, so the QuantizeLinear and DequantizeLinear
    of a pair keep one scale; a weight's INT8 codes are requantized to it
    (`round(codes * old / new)`), so its DequantizeLinear still outputs the
    weight. Channels at or above the smallest normal are left as they are.

    Args:
        model_proto: an `onnx.ModelProto`, edited in place.

    Returns:
        A list of `RaisedScale`, one per scale tensor raised.

    Raises:
        ValueError: a constant Q/DQ scale is zero, negative or not finite.
    """
    from onnx import numpy_helper

    graph = model_proto.graph
    index = GraphIndex(model_proto)
    readers = {}
    for node, _, _ in walk(graph):  # Q/DQ in Loop/Scan/If bodies too
        if node.op_type in QDQ_OPS and len(node.input) > 1:
            readers.setdefault(node.input[1], []).append(node)
    taken = {init.name for init in graph.initializer} | {
        name for node, _, _ in walk(graph) for name in node.output
    }

    def add(base, array):
        name, n = base, 0
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        taken.add(name)
        graph.initializer.append(numpy_helper.from_array(array, name))
        return name

    raised, replaced = [], set()
    float32_scales, _ = block_scale_dqs(graph)
    for tensor, nodes in readers.items():
        if tensor in float32_scales:
            continue  # NVFP4's global scale: float32 in the 16-bit graph
        scale = index.const(tensor)
        if scale is None:
            continue  # computed at run time: the lint's `scale` rule says so
        if np.asarray(scale).dtype.kind != "f" or np.asarray(
            scale
        ).dtype.itemsize not in (2, 4, 8):
            continue  # E8M0 / FP8 scales: powers of two, not float16
        scale = np.asarray(scale, np.float32)
        if not np.all(np.isfinite(scale) & (scale > 0)):
            bad = scale[~(np.isfinite(scale) & (scale > 0))].ravel()
            raise ValueError(
                f"Quantization scale '{tensor}' (read by "
                f"{', '.join(index.name(n) for n in nodes[:3])}) holds "
                f"{bad[0]}: a Q/DQ scale must be positive and finite, and "
                "TensorRT rejects this graph. An uncalibrated quantizer "
                "(amax 0) gives scale 0: run keras_mp.calibrate(model, "
                "data) on finite data, or skip that layer with "
                "QuantizeConfig(skip=True)."
            )
        if not np.any(scale < FP16_TINY):
            continue
        new_scale = np.maximum(scale, np.float32(FP16_TINY))
        new_name = add(f"{tensor}_fp16_normal", new_scale)
        replaced.add(tensor)
        empty = None
        for node in nodes:
            node.input[1] = new_name
            codes = index.const(node.input[0])
            if node.op_type != "DequantizeLinear" or codes is None:
                continue  # activation pairs: the Q computes with the new scale
            axis = attr(node, "axis", 1)
            values = _dequantize(codes, scale, axis)
            replaced.add(node.input[0])
            node.input[0] = add(
                f"{node.input[0]}_fp16_normal",
                _quantize(values, new_scale, axis),
            )
            empty = _empty_channels(codes, scale, axis)
        raised.append(
            RaisedScale(tensor, [index.name(n) for n in nodes], scale, empty)
        )
    _drop_unused(graph, replaced)
    return raised


def _empty_channels(codes, scale, axis):
    """Per channel of `scale`: whether all of its INT8 codes are zero."""
    if scale.size == 1:
        return np.asarray(not np.any(codes)).reshape(scale.shape)
    per_channel = np.moveaxis(codes, axis % codes.ndim, 0)
    return ~np.any(per_channel.reshape(len(per_channel), -1), axis=1)


def _drop_unused(graph, names):
    """Removes the initializers (or Constant nodes) among `names` that no
    node reads any more."""
    used = {name for node in graph.node for name in reads(node)}
    used |= {o.name for o in graph.output}
    for init in list(graph.initializer):
        if init.name in names and init.name not in used:
            graph.initializer.remove(init)
    for node in list(graph.node):
        if node.op_type == "Constant" and node.output[0] in names - used:
            graph.node.remove(node)


def _quantizer_scales(model):
    """`(description, range amax, exported scale)` of each enabled quantizer
    of `model`; the scale is the one tf2onnx writes for it:
    `max(amax, MIN_AMAX) / qmax` of its format, in float32."""
    from keras_mp.quantization.fake_quant import MIN_AMAX
    from keras_mp.quantization.twins import quantizers

    rows = []
    for q in quantizers(model, "export_onnx"):
        if not (q.quantizer.enabled and q.layer.enabled):
            continue
        amax = np.asarray(q.quantizer.amax.numpy(), np.float32)
        scale = q.quantizer.format.scale(np.maximum(amax, np.float32(MIN_AMAX)))
        description = f"{q.name} ({'weight' if q.weight else 'input'})"
        rows.append((description, amax, scale))
    return rows


def _cost(raised):
    """What raising `raised` costs its grid, in words."""
    amax = raised.scale.astype(np.float64) * _STEPS
    steps = amax / FP16_TINY
    low = raised.scale < FP16_TINY
    if raised.empty is None:
        n = float(np.max(steps))
        got = f"{n:.0f}" if n >= 0.5 else "0 (every value rounds to 0)"
        return (
            f"its INT8 grid gets {got} instead of {_STEPS} steps over its "
            f"calibrated range [-{amax.max():.3g}, {amax.max():.3g}], and "
            f"it clips at {_STEPS * FP16_TINY:.3g} instead of "
            f"{amax.max():.3g}"
        )
    lossy = low & ~raised.empty
    text = f"{int(low.sum())} of {low.size} channel(s) raised"
    if lossy.any():
        text += (
            f"; {int(lossy.sum())} of them get as few as "
            f"{float(steps[lossy].min()):.0f} instead of {_STEPS} INT8 steps "
            f"over their range (amax down to {amax[lossy].min():.3g})"
        )
    if (low & raised.empty).any():
        text += (
            f"; {int((low & raised.empty).sum())} hold only zeros and lose "
            "nothing"
        )
    return text


def _describe(raised, model):
    """`(owner, cost)` lines for the warning: each raised scale matched to
    the Keras quantizers whose range exports as it (tf2onnx renames Q/DQ
    nodes and shares one scale tensor between equal ranges, so the value
    says whose it is, not the name); an unmatched scale is named by its
    ONNX tensor and nodes."""
    quantizers = _quantizer_scales(model) if model is not None else []
    lines = {}
    for r in raised:
        owners = [
            description
            for description, _, scale in quantizers
            if scale.size == r.scale.size
            and np.allclose(scale.ravel(), r.scale.ravel(), rtol=1e-6, atol=0)
        ]
        if not owners:
            owners = [
                f"ONNX scale '{r.tensor}' (read by {', '.join(r.nodes[:3])})"
            ]
        for owner in owners:
            lines.setdefault(owner, _cost(r))
    order = {d: i for i, (d, _, _) in enumerate(quantizers)}
    return sorted(lines.items(), key=lambda kv: order.get(kv[0], len(order)))


def raised_message(raised, model):
    lines = _describe(raised, model)
    name = f" of model {model.name!r}" if model is not None else ""
    listing = "\n".join(f"  - {owner}: {cost}" for owner, cost in lines)
    return (
        f"dtype='float16': {len(lines)} quantizer(s){name} have a Q/DQ "
        f"scale below float16's smallest normal number {FP16_TINY:.3g}, "
        "which float16 would store with fewer significant bits and "
        "flush-to-zero kernels read as 0. Each was raised to the smallest "
        "normal (the Q and DQ of a pair together; weight codes "
        f"requantized), which coarsens its grid:\n{listing}\nThe parity "
        "check (verify_data) measures the effect on the outputs. To keep "
        "the full grid, export with dtype='float32' (float32 scales), skip "
        "these layers (QuantizeConfig(skip=True)), or scale the model so "
        f"that these ranges are at least {_STEPS * FP16_TINY:.3g}."
    )
