"""Carrier Q/DQ -> the format they stand for (FP8 E4M3 today).

tf2onnx writes Q/DQ only from TensorFlow's `QuantizeAndDequantizeV3`, with
INT8 (or UINT8) zero points, and at opsets up to 18. A `NumberFormat` it
cannot write has a `carrier` (`keras_mp.quantization.formats`): while
`export_onnx` traces the model, such a quantizer computes an unsigned
8-bit Q/DQ of its own scale, which tf2onnx writes with a UINT8 zero point
that no keras_mp quantizer uses otherwise. This pass gives each carrier
its quantizer's exact scale and a zero point of the format's ONNX type
(FLOAT8E4M3FN: TensorRT's parser reads FP8 from it); the weight fold then
stores those weights in that type. `docs/export.md` ("FP8").
"""

import numpy as np

from keras_mp._compat import optional_import
from keras_mp.onnx.errors import ExportError
from keras_mp.onnx.graph import (
    FLOAT,
    LAYOUT_OPS,
    QDQ_OPS,
    UINT8,
    attr,
    subgraphs,
    walk,
)

# How far tf2onnx's float32 carrier scale, `float32(amax * 255 / qmax) /
# 255`, may lie from the quantizer's `amax / qmax` (a few float32 ulps).
_MATCH_RTOL = 1e-5


def carrier_quantizers(model):
    """`(description, format, exported scale)` of each enabled quantizer
    of `model` whose format the export writes through a carrier."""
    from keras_mp.quantization.quantizers import MIN_AMAX
    from keras_mp.quantization.twins import quantizers

    rows = []
    for q in quantizers(model, "export_onnx"):
        fmt = q.quantizer.format
        if fmt.carrier is None or not (q.quantizer.enabled and q.layer.enabled):
            continue
        amax = np.asarray(q.quantizer.amax.numpy(), np.float32)
        scale = fmt.scale(np.maximum(amax, np.float32(MIN_AMAX)))
        rows.append((q.name, fmt, np.atleast_1d(scale)))
    return rows


def min_opset(model):
    """The lowest opset that holds every format `model`'s quantizers use."""
    return max(
        (fmt.min_opset for _, fmt, _ in carrier_quantizers(model)), default=0
    )


def _match(scale, candidates):
    """The candidate `(description, format, scale)` nearest `scale`, or
    None when none is within `_MATCH_RTOL`."""
    scale = np.atleast_1d(np.asarray(scale, np.float32))
    best, best_err = None, _MATCH_RTOL
    for candidate in candidates:
        if candidate[2].shape != scale.shape:
            continue
        err = float(np.max(np.abs(candidate[2] - scale) / candidate[2]))
        if err <= best_err:
            best, best_err = candidate, err
    return best


def retype_carriers(model_proto, model):
    """Gives every carrier Q/DQ of `model_proto` its format, in place.

    Args:
        model_proto: the `onnx.ModelProto` tf2onnx wrote for `model`, at an
            opset that holds the formats (`min_opset`).
        model: the Keras model traced (its quantizers give the formats and
            exact scales).

    Returns:
        The names of the quantizers whose Q/DQ were retyped.

    Raises:
        ExportError: a carrier Q/DQ matches no quantizer of `model`.
    """
    onnx = optional_import("onnx")
    numpy_helper = onnx.numpy_helper
    candidates = carrier_quantizers(model)
    inits = {}
    for _node, owner, _ in walk(model_proto.graph):
        for init in owner.initializer:
            inits.setdefault(init.name, init)
    done, retyped, codes = set(), [], {}
    for node, _, _ in walk(model_proto.graph):
        if node.op_type not in QDQ_OPS or len(node.input) < 3:
            continue
        zero = inits.get(node.input[2])
        if zero is None or (
            zero.data_type != UINT8 and node.input[2] not in done
        ):
            continue  # not a carrier (a zero point shared by carriers is
            # retyped at the first)
        scale_init = inits.get(node.input[1])
        match = None
        if scale_init is not None:
            match = _match(numpy_helper.to_array(scale_init), candidates)
        if match is None:
            raise ExportError(
                f"The unsigned 8-bit Q/DQ {node.name!r} of the traced graph "
                "matches no quantizer of an FP8 (carrier) format: keras_mp "
                "writes such Q/DQ only for those. Was the model changed "
                "after calibration, or does it use a TensorFlow "
                "QuantizeAndDequantize op of its own? Nothing was written."
            )
        description, fmt, scale = match
        if node.input[1] not in done:
            shape = tuple(scale_init.dims)
            scale_init.CopyFrom(
                numpy_helper.from_array(scale.reshape(shape), scale_init.name)
            )
            done.add(node.input[1])
        if node.input[2] not in done:
            zeros = np.zeros(tuple(zero.dims), fmt.storage)
            zero.CopyFrom(numpy_helper.from_array(zeros, zero.name))
            done.add(node.input[2])
        if node.op_type == "QuantizeLinear":
            codes[node.output[0]] = onnx.TensorProto.DataType.Value(
                fmt.onnx_type
            )
        if description not in retyped:
            retyped.append(description)
    _dq_after_layout(model_proto.graph, set(codes))
    graphs = [model_proto.graph] + [
        sub for n, _, _ in walk(model_proto.graph) for sub in subgraphs(n)
    ]
    for graph in graphs:  # the codes' declared type (tf2onnx: UINT8)
        for info in [*graph.value_info, *graph.output]:
            if info.name in codes:
                info.type.tensor_type.elem_type = codes[info.name]
    return retyped


def _dq_after_layout(graph, codes):
    """Moves each QuantizeLinear writing one of `codes` past the layout ops
    tf2onnx put between it and its DequantizeLinear (`Q -> Transpose ->
    DQ` becomes `Transpose -> Q -> DQ`, one Q per DQ reached): ONNX types
    Transpose, Reshape, ... for FP8 only from opset 21, and TensorRT wants
    each Q next to its DQ. Activation Q/DQ are per tensor, so the move
    changes no value."""
    consumers = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    floats = set()  # layout outputs that now carry float values
    for q in [n for n in graph.node if n.op_type == "QuantizeLinear"]:
        if q.output[0] not in codes or attr(q, "axis", None) is not None:
            continue
        found = _layout_tree(q.output[0], consumers)
        if found is None:
            continue
        layouts, dqs = found
        for node in layouts:
            if node.input[0] == q.output[0]:
                node.input[0] = q.input[0]
            floats.add(node.output[0])
        for i, dq in enumerate(d for d in dqs if d.input[0] != q.output[0]):
            moved = graph.node.add()
            moved.CopyFrom(q)
            moved.name = f"{q.name}_moved_{i}"
            moved.input[0] = dq.input[0]
            moved.output[0] = f"{q.output[0]}_moved_{i}"
            dq.input[0] = moved.output[0]
        if not any(q.output[0] in n.input for n in graph.node if n is not q):
            graph.node.remove(q)
    for info in graph.value_info:
        if info.name in floats:
            info.type.tensor_type.elem_type = FLOAT
    _sort(graph)
    _check_fp8_consumers(graph, codes)


def _check_fp8_consumers(graph, codes):
    """An ExportError when FP8 codes still reach an op other than a
    DequantizeLinear (at opset 19 only Q/DQ take FP8 tensors)."""
    for node in graph.node:
        if node.op_type == "DequantizeLinear":
            continue
        for sub in subgraphs(node):
            for inner, _, _ in walk(sub):
                read = [i for i in inner.input if i in codes]
                if read:
                    _fp8_error(node, read[0])
        read = [i for i in node.input if i in codes]
        if read:
            _fp8_error(node, read[0])


def _fp8_error(node, tensor):
    raise ExportError(
        f"The FP8 codes {tensor!r} reach {node.op_type} {node.name!r}, "
        "which ONNX (opset 19) and TensorRT take in float only: tf2onnx "
        "put that op between an FP8 Q and its DQ, and keras_mp moves a Q "
        "only past ops that move values of one input. Keep the layer "
        "around it INT8 (QuantizeConfig(precision='int8') for it) and "
        "report the model. Nothing was written."
    )


# Ops that move or pick the values of their first input only: a per-tensor
# Q commutes with them (Concat, whose other inputs may be float, does not).
_MOVABLE_OPS = LAYOUT_OPS | {"Slice", "Gather", "Split", "Tile", "Expand"}


def _layout_tree(tensor, consumers):
    """`(layout ops, DequantizeLinears)` reached from `tensor` through
    layout ops only, or None when something else reads a value on the way
    (then nothing moves)."""
    layouts, dqs, pending = [], [], [tensor]
    while pending:
        for node in consumers.get(pending.pop(), []):
            if node.op_type in _MOVABLE_OPS and node.input[0] in (
                tensor,
                *(n.output[0] for n in layouts),
            ):
                layouts.append(node)
                pending.append(node.output[0])
            elif node.op_type == "DequantizeLinear":
                dqs.append(node)
            else:
                return None
    return (layouts, dqs) if layouts else None


def _sort(graph):
    """Orders `graph.node` topologically (stable for nodes already in
    order); outer-scope and initializer names count as available."""
    produced = {o for n in graph.node for o in n.output}
    ready = set()
    pending, ordered = list(graph.node), []
    while pending:
        rest = []
        for node in pending:
            if all(
                i == "" or i not in produced or i in ready for i in node.input
            ):
                ordered.append(node)
                ready.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):  # a cycle: leave the order as it was
            return
        pending = rest
    copies = [type(n)() for n in ordered]
    for copy, node in zip(copies, ordered):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)
