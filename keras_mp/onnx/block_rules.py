"""The TensorRT rules of blocked DequantizeLinear (INT4 weight-only).

What TensorRT builds (onnx-tensorrt `onnxOpImporters.cpp`,
DequantizeLinear; the row `FORMATS["int4"]` holds the same facts, which
this module reads): INT4 only as the weight of a MatMul or Gemm, in blocks
of 64 or 128 along K (axis 0 of a MatMul weight `(K, N)`, axis 1 of a Gemm
weight with transB=1), K a multiple of the block (TensorRT infers the block
size from the weight and scale shapes), float32 scales of the weight's
shape with `K / block_size` on the blocked axis, zero point absent or 0
(symmetric), opset >= 21. The activation stays float (weight-only), so the
INT8 rules on zero-point type, per-channel axes and partial quantization do
not apply to these nodes (`is_blocked`).
"""

from keras_mp.onnx.graph import attr
from keras_mp.quantization.formats import FORMATS

# ONNX element type INT4 (onnx.TensorProto.INT4, fixed by the spec).
INT4 = 22


def is_blocked(node):
    """Whether Q/DQ `node` has a `block_size` (a blocked Q/DQ)."""
    return attr(node, "block_size", 0) > 0


def rule_blocks(graph, finding):
    """Findings (made by `finding(rule, node, message)`) for each blocked
    DequantizeLinear of `graph` (a `rules.LintGraph`) TensorRT would not
    build."""
    int4 = FORMATS["int4"]
    for node in graph.qdq:
        if not is_blocked(node):
            continue
        name, block = graph.name(node), attr(node, "block_size", 0)
        dtype = graph.dtypes.get(node.input[0])
        problems = []
        if node.op_type != "DequantizeLinear" or dtype != INT4:
            problems.append(
                f"a blocked {node.op_type} of element type {dtype}: "
                "keras_mp checks blocked INT4 DequantizeLinear of weights"
            )
        use = graph.weight_use.get(id(node))
        if use is None or use[0].op_type not in int4.tensorrt_ops:
            what = "an activation" if use is None else use[0].op_type
            problems.append(
                f"INT4 on {what}: TensorRT runs INT4 weight-only on "
                f"{' and '.join(int4.tensorrt_ops)} weights only; quantize "
                "convolutions in INT8 or FP8"
            )
        if block not in int4.tensorrt_block_sizes:
            problems.append(
                f"block_size={block}: TensorRT builds INT4 blocks of "
                f"{' or '.join(map(str, int4.tensorrt_block_sizes))}"
            )
        if graph.opset < int4.block_format.min_opset:
            problems.append(
                f"opset {graph.opset}: blocked DequantizeLinear needs "
                f"{int4.block_format.min_opset}"
            )
        if len(node.input) > 2 and node.input[2]:
            zero = graph.const(node.input[2])
            if zero is None or zero.any():
                problems.append(
                    "zero point not 0: TensorRT's INT4 is symmetric"
                )
        if use is not None:
            problems += _shape_problems(graph, node, use, block)
        for problem in problems:
            yield finding("blocks", name, problem + ".")


def _shape_problems(graph, node, use, block):
    """The blocked axis, K and scale shape of a weight's blocked DQ."""
    op, slot, source = use
    weight = graph.const(node.input[0])
    scale = graph.const(node.input[1])
    if weight is None or scale is None or weight.ndim != 2 or slot != 1:
        return ["not a constant 2-D weight (input B) with constant scales"]
    trans_b = op.op_type == "Gemm" and attr(op, "transB", 0)
    k_axis = 1 if trans_b else 0
    axis = attr(node, "axis", 1) % 2
    if source.layout:
        return ["layout ops between the DQ and its op: fold them"]
    if axis != k_axis:
        return [
            f"blocked along axis {axis}; the weight's K axis of {op.op_type} "
            f"'{graph.name(op)}' is {k_axis}"
        ]
    k = weight.shape[k_axis]
    if k % block:
        return [f"K={k} is not a multiple of block_size={block}"]
    want = list(weight.shape)
    want[k_axis] = k // block
    if list(scale.shape) != want:
        return [f"scale shape {list(scale.shape)}, expected {want}"]
    return []
