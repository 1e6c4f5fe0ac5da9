"""Float16 ONNX for strongly typed TensorRT builds (`export_onnx(fp16=True)`):
every float32 tensor inside the graph, Q/DQ scales included, becomes
float16; inputs and outputs stay float32. A Q/DQ scale below float16's
smallest normal number is raised to it first, with one warning naming the
Keras quantizers and what their grids lose (`docs/export.md`, "Float16
graphs for strongly typed TensorRT")."""

import warnings

import numpy as np

from keras_mp._compat import optional_import
from keras_mp.onnx.graph import subgraphs, walk
from keras_mp.onnx.subnormal import raise_subnormal_scales, raised_message

# Float inputs that ONNX requires to stay float32 whatever the data type:
# (op_type, input index).
_KEEP_FLOAT32_INPUTS = {("Resize", 2), ("Upsample", 1)}
_FP16_MAX = float(np.finfo(np.float16).max)
MIN_OPSET = 19


def convert_version(model_proto, opset):
    """`model_proto` moved to the default-domain `opset` (no-op if equal)."""
    optional_import("onnx")
    current = next(
        o.version
        for o in model_proto.opset_import
        if o.domain in ("", "ai.onnx")
    )
    if current == opset:
        return model_proto
    from onnx import version_converter

    return version_converter.convert_version(model_proto, opset)


def to_float16(model_proto, model=None):
    """Float32 -> float16 inside the graph; inputs and outputs stay float32.

    Q/DQ scales below float16's smallest normal number (6.1e-5) are first
    raised to it (`raise_subnormal_scales`), with one `UserWarning` that
    lists the Keras quantizers they belong to and what each one's INT8
    grid loses.

    Args:
        model_proto: an `onnx.ModelProto` at opset >= 19.
        model: the `keras.Model` the graph was exported from (the float32
            twin of a mixed-precision model): the warning names its
            quantizers. Defaults to None (ONNX tensor names).

    Returns:
        The converted `onnx.ModelProto` (a new object).

    Raises:
        ValueError: a constant is beyond float16's largest value (this
            model cannot run in float16), or a Q/DQ scale is zero,
            negative or not finite.
    """
    onnx = optional_import("onnx")
    from onnx import helper, numpy_helper

    FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    model_copy = onnx.ModelProto()
    model_copy.CopyFrom(model_proto)
    raised = raise_subnormal_scales(model_copy)
    if raised:
        warnings.warn(raised_message(raised, model), UserWarning, stacklevel=3)
    graph = model_copy.graph
    keep32 = set()
    for node, _, _ in walk(graph):
        for op_type, slot in _KEEP_FLOAT32_INPUTS:
            if node.op_type == op_type and len(node.input) > slot:
                keep32.add(node.input[slot])

    def half(array, name):
        finite = array[np.isfinite(array)]
        if finite.size and np.max(np.abs(finite)) > _FP16_MAX:
            raise ValueError(
                f"Constant '{name}' holds {np.max(np.abs(finite)):.3g}, "
                f"beyond float16's largest value {_FP16_MAX:g}: this model "
                "cannot run in float16. Export with fp16=False."
            )
        return array.astype(np.float16)

    bodies = [sub for node, _, _ in walk(graph) for sub in subgraphs(node)]
    for init in [i for g in (graph, *bodies) for i in g.initializer]:
        if init.data_type == FLOAT and init.name not in keep32:
            init.CopyFrom(
                numpy_helper.from_array(
                    half(numpy_helper.to_array(init), init.name), init.name
                )
            )
    # A Loop/Scan/If body declares the types of its inputs and outputs (a
    # loop-carried state): float32 ones become float16 with the rest.
    for body in bodies:
        for value in [*body.input, *body.output, *body.value_info]:
            if value.type.tensor_type.elem_type == FLOAT:
                value.type.tensor_type.elem_type = FLOAT16
    for node, _, _ in walk(graph):
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if (
                    attribute.name == "value"
                    and attribute.t.data_type == FLOAT
                    and node.output[0] not in keep32
                ):
                    attribute.t.CopyFrom(
                        numpy_helper.from_array(
                            half(
                                numpy_helper.to_array(attribute.t),
                                node.output[0],
                            ),
                            attribute.t.name,
                        )
                    )
        for attribute in node.attribute:
            if (
                node.op_type == "Cast"
                and attribute.name == "to"
                and attribute.i == FLOAT
            ):
                attribute.i = FLOAT16
            if node.op_type == "ConstantOfShape" and attribute.name == "value":
                if attribute.t.data_type == FLOAT:
                    attribute.t.CopyFrom(
                        numpy_helper.from_array(
                            numpy_helper.to_array(attribute.t).astype(
                                np.float16
                            )
                        )
                    )

    # Boundaries: float32 in, Cast to float16; float16 out, Cast to float32.
    casts = []
    for value in graph.input:
        if value.type.tensor_type.elem_type != FLOAT:
            continue
        inner = f"{value.name}_fp16"
        for node in graph.node:
            for i, name in enumerate(node.input):
                if name == value.name:
                    node.input[i] = inner
        casts.append(
            helper.make_node(
                "Cast", [value.name], [inner], name=f"{inner}_Cast", to=FLOAT16
            )
        )
    for node in reversed(casts):
        graph.node.insert(0, node)
    for value in graph.output:
        if value.type.tensor_type.elem_type != FLOAT:
            continue
        inner = f"{value.name}_fp16"
        for node in graph.node:
            for i, name in enumerate(node.output):
                if name == value.name:
                    node.output[i] = inner
            for i, name in enumerate(node.input):
                if name == value.name:
                    node.input[i] = inner
        graph.node.append(
            helper.make_node(
                "Cast",
                [inner],
                [value.name],
                name=f"{value.name}_Cast",
                to=FLOAT,
            )
        )
    # Intermediate types changed: let shape inference recompute them.
    del graph.value_info[:]
    return onnx.shape_inference.infer_shapes(model_copy, strict_mode=True)
