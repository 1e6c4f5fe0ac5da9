"""Weight folding: the post-tf2onnx pass that makes each weight an INT8
initializer whose DequantizeLinear feeds its weighted op directly
(`docs/export.md`, "What export fixes up")."""

import numpy as np

from keras_mp._compat import optional_import
from keras_mp.onnx.graph import (
    LAYOUT_OPS,
    GraphIndex,
    apply_layout,
    attr,
    output_channel_axis,
)


def _shapes(model_proto, index, op, inferred):
    """`index.constants`, plus, for a Reshape whose target shape is computed
    (a Concat of Shape slices that tf2onnx did not fold), the static shape
    ONNX shape inference gives its output."""
    if op.op_type != "Reshape" or op.input[1] in index.constants:
        return index.constants
    if not inferred:  # once per graph, only when needed
        onnx = optional_import("onnx")
        graph = onnx.shape_inference.infer_shapes(model_proto).graph
        inferred.update(
            (
                info.name,
                [
                    d.dim_value if d.HasField("dim_value") else None
                    for d in info.type.tensor_type.shape.dim
                ],
            )
            for info in list(graph.value_info) + list(graph.output)
        )
    shape = inferred.get(op.output[0])
    if not shape or None in shape:
        return index.constants
    return {**index.constants, op.input[1]: np.asarray(shape, np.int64)}


def fold_weight_qdq(model_proto):
    """Folds each weight's Q/DQ and layout ops into INT8 initializers.

    A weight QuantizeLinear on a constant becomes an INT8 initializer, and
    layout ops (Transpose, Reshape, ...) between a weight's
    DequantizeLinear and its Conv, ConvTranspose, MatMul or Gemm are
    applied to the initializer, so the DQ feeds the op directly.

    Args:
        model_proto: an `onnx.ModelProto`, edited in place.

    Returns:
        `model_proto`.
    """
    onnx = optional_import("onnx")
    from onnx import numpy_helper

    graph = model_proto.graph
    index = GraphIndex(model_proto)
    inferred = {}
    for node in index.weighted:
        if len(node.input) < 2:
            continue
        source = index.trace(node.input[1])
        dq = source.dq
        if dq is None:
            continue
        codes, scale, dq_axis = _dq_constants(dq, index)
        if codes is None or (
            not source.layout and dq.input[0] in index.constants
        ):
            continue
        values = _dequantize(codes, scale, dq_axis)
        try:
            for op in reversed(source.layout):
                values = apply_layout(
                    op, values, _shapes(model_proto, index, op, inferred)
                )
        except ValueError:  # a shape that is neither constant nor static
            continue
        weight_axis = output_channel_axis(node, 1, values.ndim) % values.ndim
        if scale.size > 1:
            if values.shape[weight_axis] != scale.size:
                continue  # not per-channel on the output axis: leave it
            shape = [1] * values.ndim
            shape[weight_axis] = -1
            new_codes = np.rint(values / scale.reshape(shape))
        else:
            new_codes = np.rint(values / scale)
        base = f"{node.name}_weight"
        graph.initializer.extend(
            [
                numpy_helper.from_array(
                    new_codes.astype(np.int8), f"{base}_int8"
                ),
                numpy_helper.from_array(
                    scale.astype(np.float32), f"{base}_scale"
                ),
                numpy_helper.from_array(
                    np.zeros(scale.shape, np.int8), f"{base}_zero_point"
                ),
            ]
        )
        attrs = {"axis": weight_axis} if scale.size > 1 else {}
        new_dq = onnx.helper.make_node(
            "DequantizeLinear",
            [f"{base}_int8", f"{base}_scale", f"{base}_zero_point"],
            [f"{base}_dq"],
            name=f"{base}_DequantizeLinear",
            **attrs,
        )
        graph.node.insert(list(graph.node).index(node), new_dq)
        node.input[1] = f"{base}_dq"
    _prune_dead(graph)
    return model_proto


def _dq_constants(dq, index):
    """(INT8 codes, float32 scale, axis) of a weight DequantizeLinear whose
    codes are a constant or a QuantizeLinear of one, possibly moved by
    layout ops (tf2onnx puts an EinsumDense kernel's Reshape between the Q
    and the DQ); Nones otherwise."""
    scale = index.const(dq.input[1])
    codes = index.const(dq.input[0])
    layout, q = [], index.producers.get(dq.input[0])
    while q is not None and q.op_type in LAYOUT_OPS:
        layout.append(q)
        q = index.producers.get(q.input[0])
    if codes is None and q is not None and q.op_type == "QuantizeLinear":
        values = index.const(q.input[0])
        if values is not None:
            codes = _quantize(
                values, index.const(q.input[1]), attr(q, "axis", 1)
            )
            try:
                for op in reversed(layout):
                    codes = apply_layout(op, codes, index.constants)
            except ValueError:  # a computed shape: leave this weight
                codes = None
    if codes is None or scale is None:
        return None, None, None
    return codes, np.asarray(scale, np.float32), attr(dq, "axis", 1)


def _broadcast_scale(scale, ndim, axis):
    if scale.size == 1:
        return scale.reshape(())
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return scale.reshape(shape)


def _quantize(values, scale, axis):
    """The INT8 codes Keras' weight quantizer gave `values`, bit for bit.

    TF's `QuantizeAndDequantizeV3` (narrow range, range `amax` given)
    rounds `clip(w, -amax, amax) * float32(127 / amax)` half to even, in
    float32; ONNX's QuantizeLinear rounds `w / scale` with `scale =
    float32(amax / 127)` (all tf2onnx keeps), which picks the other code at
    some ties. So `amax` is recovered from the scale and TF's product is
    rounded.
    """
    values = np.asarray(values, np.float32)
    scale = _broadcast_scale(np.asarray(scale, np.float32), values.ndim, axis)
    amax = _amax(values, scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.rint(np.clip(values, -amax, amax) * (np.float32(127) / amax))
    return np.clip(codes, -128, 127).astype(np.int8)


def _amax(values, scale):
    """The float32 range `amax` with `float32(amax / 127) == scale`, per
    channel (`scale` broadcast against `values`).

    keras_mp's weight range is the weight's own `max|w|` (per channel), so
    that is taken when it gives back the scale; otherwise (a range set by
    hand, or stale) the float32 nearest `127 * scale` that does. At most two
    float32 values give one scale, so a stale range is the only case where
    the pick can be wrong.
    """
    channel_axes = tuple(
        a for a in range(values.ndim) if scale.ndim == 0 or scale.shape[a] == 1
    )
    peak = np.max(np.abs(values), axis=channel_axes, keepdims=True)
    near = (scale * np.float32(127)).astype(np.float32)
    amax = near
    for candidate in (
        np.nextafter(near, np.float32(0)),
        np.nextafter(near, np.float32(np.inf)),
        near,
        peak,
    ):  # later candidates win
        amax = np.where(candidate / np.float32(127) == scale, candidate, amax)
    return amax


def _dequantize(codes, scale, axis):
    return codes.astype(np.float32) * _broadcast_scale(scale, codes.ndim, axis)


def _prune_dead(graph):
    """Removes nodes and initializers nothing consumes any more."""
    outputs = {o.name for o in graph.output}
    while True:
        used = {name for node in graph.node for name in node.input} | outputs
        dead = [n for n in graph.node if not any(o in used for o in n.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    used = {name for node in graph.node for name in node.input}
    for init in list(graph.initializer):
        if init.name not in used:
            graph.initializer.remove(init)
