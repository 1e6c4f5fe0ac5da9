"""The 16-bit pass of a strongly typed export (`export_onnx(dtype=...)`):
float32 tensors become float16 or bfloat16, except in the float32 islands
`islands.find_islands` chose, with a Cast only where an island meets the
16-bit graph; inputs and outputs stay float32 (`docs/export.md`,
"Strongly typed graphs")."""

import warnings

import numpy as np

from keras_mp._compat import optional_import
from keras_mp.onnx.graph import FLOAT, reads, subgraphs, walk
from keras_mp.onnx.subnormal import (
    block_scale_dqs,
    raise_subnormal_scales,
    raised_message,
)

# Float inputs that ONNX requires to stay float32 whatever the data type:
# (op_type, input index).
KEEP_FLOAT32_INPUTS = {
    ("Resize", 2),
    ("Upsample", 1),
    # NVFP4's global scale: a float32 constant in ModelOpt's export, read
    # by the DynamicQuantize and the block scales' DequantizeLinear
    ("TRT_FP4DynamicQuantize", 1),
}
_FP16_MAX = float(np.finfo(np.float16).max)
MIN_OPSET = 19
# ONNX element type and the name suffix of each 16-bit dtype.
_TYPES = {"float16": (10, "fp16"), "bfloat16": (16, "bf16")}
DTYPES = tuple(_TYPES)


def resolve_dtype(dtype, fp16, error):
    """The 16-bit type an export writes (None for float32), from its
    `dtype` and its `fp16` alias; `error` (an exception class) otherwise."""
    if dtype not in (None, "float32", *DTYPES):
        hint = (
            " FP8 is a quantization format: "
            "keras_mp.quantize_model(model, precision='float8')."
            if "8" in str(dtype)
            else ""
        )
        raise error(
            f"dtype must be 'float32', 'float16' or 'bfloat16'.{hint} "
            f"Received: dtype={dtype!r}. Nothing was written."
        )
    if fp16 and dtype not in (None, "float16"):
        raise error(
            f"fp16=True is an alias of dtype='float16', but dtype={dtype!r} "
            "was passed too. Pass only dtype. Nothing was written."
        )
    if fp16:
        import warnings

        warnings.warn(
            "`fp16=True` is deprecated (one name per job): pass "
            "dtype='float16'. It will be removed in the next release.",
            DeprecationWarning,
            stacklevel=3,
        )
        return "float16"
    return None if dtype == "float32" else dtype


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


def _cast_array(array, name, dtype):
    """A float32 constant as an ONNX tensor of `dtype`."""
    import ml_dtypes
    from onnx import numpy_helper

    if dtype == "float16":
        finite = array[np.isfinite(array)]
        if finite.size and np.max(np.abs(finite)) > _FP16_MAX:
            raise ValueError(
                f"Constant '{name}' holds {np.max(np.abs(finite)):.3g}, "
                f"beyond float16's largest value {_FP16_MAX:g}: this model "
                "cannot run in float16. Export with dtype='bfloat16' or in "
                "float32."
            )
        return numpy_helper.from_array(array.astype(np.float16), name)
    return numpy_helper.from_array(array.astype(ml_dtypes.bfloat16), name)


def _convert_body(body, dtype):
    """Every float32 tensor of a Loop/Scan/If body (and bodies inside it)
    -> `dtype`: initializers, Constants, Casts and declared value types."""
    half = _TYPES[dtype][0]
    from onnx import numpy_helper

    for init in body.initializer:
        if init.data_type == FLOAT:
            init.CopyFrom(
                _cast_array(numpy_helper.to_array(init), init.name, dtype)
            )
    # A body declares the types of its inputs and outputs (a loop-carried
    # state): float32 ones become 16-bit with the rest.
    for value in [*body.input, *body.output, *body.value_info]:
        if value.type.tensor_type.elem_type == FLOAT:
            value.type.tensor_type.elem_type = half
    for node in body.node:
        _convert_node(node, dtype, keep=set())


def _convert_node(node, dtype, keep):
    """`node`'s own float32 values -> `dtype`: a Constant's value (unless
    its output is in `keep`), a Cast's target, ConstantOfShape's fill, and
    its bodies."""
    from onnx import numpy_helper

    half = _TYPES[dtype][0]
    for attribute in node.attribute:
        if (
            node.op_type in ("Constant", "ConstantOfShape")
            and attribute.name == "value"
            and attribute.t.data_type == FLOAT
            and node.output[0] not in keep
        ):
            array = numpy_helper.to_array(attribute.t)
            attribute.t.CopyFrom(
                _cast_array(array, attribute.t.name or node.output[0], dtype)
            )
            attribute.t.name = ""
        if node.op_type == "Cast" and attribute.name == "to":
            if attribute.i == FLOAT:
                attribute.i = half
        if (  # from E8M0 scales (MXFP8), the type is this attribute
            node.op_type == "DequantizeLinear"
            and attribute.name == "output_dtype"
            and attribute.i == FLOAT
        ):
            attribute.i = half
    for sub in subgraphs(node):
        _convert_body(sub, dtype)


def to_half(model_proto, dtype="float16", islands=None, model=None):
    """Float32 -> `dtype` inside the graph, except in the float32 islands.

    Nodes named in `islands` keep computing in float32 (their constants,
    Q/DQ scales and bodies stay float32); every other float32 tensor
    becomes `dtype`. A Cast goes where a float tensor crosses from one side
    to the other: at the graph's float32 inputs and outputs and at each
    island boundary (the island chooser keeps a DequantizeLinear with its
    Conv/MatMul/Gemm, so no Cast lands between them). A float constant read
    on both sides is stored once in each type. For float16, Q/DQ scales
    below float16's smallest normal number (6.1e-5) are first raised to it
    (`raise_subnormal_scales`), with one `UserWarning` that lists the Keras
    quantizers they belong to and what each one's INT8 grid loses.

    Args:
        model_proto: an `onnx.ModelProto` at opset >= 19.
        dtype: str. `"float16"` or `"bfloat16"`. Defaults to `"float16"`.
        islands: set (or dict) of top-level node names to keep in float32.
            Defaults to None (none: everything 16-bit).
        model: the `keras.Model` the graph was exported from: the
            sub-normal warning names its quantizers. Defaults to None
            (ONNX tensor names).

    Returns:
        The converted `onnx.ModelProto` (a new object).

    Raises:
        ValueError: a constant read by a 16-bit node is beyond float16's
            largest value, or a Q/DQ scale is zero, negative or not finite.
    """
    onnx = optional_import("onnx")
    from onnx import helper, numpy_helper

    if dtype not in _TYPES:
        raise ValueError(f"dtype must be one of {DTYPES}. Received: {dtype!r}")
    half, suffix = _TYPES[dtype]
    island = set(islands or ())
    model_copy = onnx.ModelProto()
    model_copy.CopyFrom(model_proto)
    # NVFP4 weights: float32 global scale and DQs, a Cast to the GEMM
    global_scales, scale_dqs = block_scale_dqs(model_copy.graph)
    island |= scale_dqs
    if dtype == "float16":
        raised = raise_subnormal_scales(model_copy)
        if raised:
            warnings.warn(
                raised_message(raised, model), UserWarning, stacklevel=4
            )
    graph = model_copy.graph
    typed = onnx.shape_inference.infer_shapes(model_copy).graph
    is_float = {
        v.name
        for v in [*typed.value_info, *typed.input, *typed.output]
        if v.type.tensor_type.elem_type == FLOAT
    }
    is_float |= {i.name for i in graph.initializer if i.data_type == FLOAT}
    keep32 = set(global_scales)
    for node, _, _ in walk(graph):
        for op_type, slot in KEEP_FLOAT32_INPUTS:
            if node.op_type == op_type and len(node.input) > slot:
                keep32.add(node.input[slot])
    # Constants take the side of their readers: float32 when only islands
    # read them.
    readers = {}
    for node in graph.node:
        for name in reads(node):
            readers.setdefault(name, []).append(node.name in island)
    for node in graph.node:
        if node.op_type in ("Constant", "ConstantOfShape") and all(
            readers.get(node.output[0], [False])
        ):
            island.add(node.name)
    for node in graph.node:
        if node.name not in island:
            _convert_node(node, dtype, keep32)
    # Initializers: 16-bit when a 16-bit node reads them; a copy in each
    # type when both sides do.
    inits = {i.name: i for i in graph.initializer}
    half_names = {}
    for name, sides in readers.items():
        init = inits.get(name)
        if init is None or init.data_type != FLOAT or name in keep32:
            continue
        array = numpy_helper.to_array(init)
        if all(not s for s in sides):
            init.CopyFrom(_cast_array(array, name, dtype))
            half_names[name] = name
        elif not all(sides):
            half_names[name] = f"{name}_{suffix}"
            graph.initializer.append(
                _cast_array(array, half_names[name], dtype)
            )
    producers = {o: n for n in graph.node for o in n.output}

    def side(name):
        """True for float32, False for 16-bit, None for no float tensor."""
        if name not in is_float or name in keep32:
            return None
        if name in inits or name in half_names:
            return None  # constants are typed per reader above
        node = producers.get(name)
        return node is None or node.name in island

    casts, nodes = {}, []

    def cast(name, to_float32):
        key = (name, to_float32)
        if key not in casts:
            new = f"{name}_{'fp32' if to_float32 else suffix}"
            casts[key] = new
            nodes.append(
                helper.make_node(
                    "Cast",
                    [name],
                    [new],
                    name=f"{new}_Cast",
                    to=FLOAT if to_float32 else half,
                )
            )
        return casts[key]

    for node in list(graph.node):
        mine = node.name in island
        renames = {}
        for name in reads(node):
            if not mine and name in half_names:
                renames[name] = half_names[name]
            elif side(name) is not None and side(name) != mine:
                renames[name] = cast(name, mine)
        _renamereads(node, renames)
        nodes.append(node)
    # Outputs: a 16-bit producer writes `<name>_<suffix>`, cast back.
    for value in graph.output:
        if value.type.tensor_type.elem_type != FLOAT or side(value.name):
            continue
        inner = f"{value.name}_{suffix}"
        for node in nodes:
            for i, name in enumerate(node.output):
                if name == value.name:
                    node.output[i] = inner
            _renamereads(node, {value.name: inner})
        nodes.append(
            helper.make_node(
                "Cast",
                [inner],
                [value.name],
                name=f"{value.name}_Cast",
                to=FLOAT,
            )
        )
    del graph.node[:]
    graph.node.extend(nodes)
    # Intermediate types changed: let shape inference recompute them.
    del graph.value_info[:]
    return onnx.shape_inference.infer_shapes(model_copy, strict_mode=True)


def _renamereads(node, renames):
    """Points `node`'s inputs, and its bodies' reads, at new names."""
    if not renames:
        return
    for i, name in enumerate(node.input):
        if name in renames:
            node.input[i] = renames[name]
    for sub in subgraphs(node):
        for inner, _, _ in walk(sub):
            for i, name in enumerate(inner.input):
                if name in renames:
                    inner.input[i] = renames[name]
