"""The TensorRT rules of blocked DequantizeLinear (weight-only INT4,
NVFP4, MXFP8).

What TensorRT builds (onnx-tensorrt `onnxOpImporters.cpp`,
DequantizeLinear; the `FORMATS` rows hold the same facts, which this
module reads): INT4 only as the weight of a MatMul or Gemm, in blocks of
64 or 128 along K (axis 0 of a MatMul weight `(K, N)`, axis 1 of a Gemm
weight with transB=1), K a multiple of the block (TensorRT infers the block
size from the weight and scale shapes), scales of the weight's shape with
`K / block_size` on the blocked axis, zero point absent or 0 (symmetric),
opset >= 21; NVFP4 (FLOAT4E2M1 codes, blocks of 16, its scales a
DequantizeLinear of FP8 E4M3 block scales, opset 23) and MXFP8
(FLOAT8E4M3FN codes, FLOAT8E8M0 scales, blocks of 32, opset 24) alike.
The INT8 rules on zero-point type, scale type, per-channel axes and
partial quantization do not apply to these nodes (`is_blocked`). NVFP4 and
MXFP8 activations are TensorRT's trt-domain DynamicQuantize
(`dynamic_blocks`, ModelOpt's export), blocked DQs of its outputs: their
input must be float16 or bfloat16 and their blocks of 16 / 32.
"""

import numpy as np

from keras_mp.onnx.graph import attr
from keras_mp.quantization.formats import FORMATS

# The `FORMATS` row of a blocked DQ's code type (onnx.TensorProto values,
# fixed by the spec: INT4, FLOAT4E2M1, FLOAT8E4M3FN).
_ROWS = {22: "int4", 23: "nvfp4", 17: "mxfp8"}


def is_blocked(node):
    """Whether Q/DQ `node` has a `block_size` (a blocked Q/DQ)."""
    return attr(node, "block_size", 0) > 0


def rule_blocks(graph, finding):
    """Findings (made by `finding(rule, node, message)`) for each blocked
    DequantizeLinear of `graph` (a `rules.LintGraph`) TensorRT would not
    build."""
    yield from _dynamic_findings(graph, finding)
    for node in graph.qdq:
        if not is_blocked(node) or _from_dynamic(graph, node):
            continue
        name, block = graph.name(node), attr(node, "block_size", 0)
        dtype = graph.dtypes.get(node.input[0])
        row = FORMATS.get(_ROWS.get(dtype, ""))
        if node.op_type != "DequantizeLinear" or row is None:
            yield finding(
                "blocks",
                name,
                f"a blocked {node.op_type} of element type {dtype}: "
                "TensorRT takes blocked DequantizeLinear of INT4, FLOAT4E2M1 "
                "or FLOAT8E4M3FN weights.",
            )
            continue
        label = row.label
        problems = []
        use = graph.weight_use.get(id(node))
        if use is None or use[0].op_type not in row.tensorrt_ops:
            what = "an activation" if use is None else use[0].op_type
            problems.append(
                f"{label} on {what}: TensorRT runs {label} weight-only on "
                f"{' and '.join(row.tensorrt_ops)} weights only; quantize "
                "convolutions in INT8 or FP8"
            )
        if block not in row.tensorrt_block_sizes:
            problems.append(
                f"block_size={block}: TensorRT builds {label} blocks of "
                f"{' or '.join(map(str, row.tensorrt_block_sizes))}"
            )
        opset = row.block_format.min_opset
        if graph.opset < opset:
            problems.append(
                f"opset {graph.opset}: {label} blocked DequantizeLinear "
                f"needs {opset}"
            )
        if len(node.input) > 2 and node.input[2]:
            zero = graph.const(node.input[2])
            if zero is None or np.any(zero.astype(np.float32)):
                problems.append(f"zero point not 0: {label} is symmetric")
        if use is not None:
            problems += _shape_problems(graph, node, use, block)
        for problem in problems:
            yield finding("blocks", name, problem + ".")


_DYNAMIC_ROWS = {
    "TRT_FP4DynamicQuantize": "nvfp4",
    "TRT_MXFP8DynamicQuantize": "mxfp8",
}


def _from_dynamic(graph, node):
    """Whether DequantizeLinear `node` reads a DynamicQuantize's codes."""
    producer = graph.producers.get(node.input[0])
    return producer is not None and producer.op_type in _DYNAMIC_ROWS


def _dynamic_findings(graph, finding):
    """TensorRT's DynamicQuantize takes float16/bfloat16 input (ModelOpt
    casts to FP16 first) in the format's one block size, along the last
    axis."""
    for node in graph.nodes:
        name = _DYNAMIC_ROWS.get(node.op_type)
        if name is None:
            continue
        row = FORMATS[name]
        label = row.label
        dtype = graph.dtypes.get(node.input[0])
        block = attr(node, "block_size", 0)
        problems = []
        if dtype not in (10, 16):
            problems.append(
                f"{node.op_type} input of element type {dtype}: TensorRT "
                "quantizes float16 or bfloat16 activations dynamically; "
                "export with dtype='float16' or 'bfloat16'"
            )
        if block not in row.tensorrt_block_sizes:
            problems.append(
                f"block_size={block}: TensorRT builds {label} blocks of "
                f"{' or '.join(map(str, row.tensorrt_block_sizes))}"
            )
        if attr(node, "axis", -1) != -1:
            problems.append(
                f"axis={attr(node, 'axis', -1)}: keras_mp and ModelOpt "
                "block the GEMM input along its last axis (-1)"
            )
        opset = row.block_format.min_opset
        if graph.opset < opset:
            problems.append(f"opset {graph.opset}: {label} needs {opset}")
        for problem in problems:
            yield finding("blocks", graph.name(node), problem + ".")


def _scale_shape(graph, tensor):
    """The shape of a blocked DQ's scales: a constant, or (NVFP4) a
    DequantizeLinear of constant FP8 block scales; None otherwise."""
    scale = graph.const(tensor)
    if scale is None:
        producer = graph.producers.get(tensor)
        if producer is None or producer.op_type != "DequantizeLinear":
            return None
        scale = graph.const(producer.input[0])
    return None if scale is None else scale.shape


def _shape_problems(graph, node, use, block):
    """The blocked axis, K and scale shape of a weight's blocked DQ."""
    op, slot, source = use
    weight = graph.const(node.input[0])
    scale = _scale_shape(graph, node.input[1])
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
    if list(scale) != want:
        return [f"scale shape {list(scale)}, expected {want}"]
    return []
