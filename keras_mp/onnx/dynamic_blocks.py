"""NVFP4 and MXFP8 activations in the ONNX graph: TensorRT's DynamicQuantize.

TensorRT quantizes a block-scaled GEMM input at run time: ModelOpt's ONNX
export (`modelopt/torch/quantization/export_onnx.py`, `export_fp4` and
`export_mxfp8` with `onnx_quantizer_type="dynamic"`) writes

- NVFP4: `trt::TRT_FP4DynamicQuantize(x, global_scale; axis=-1,
  block_size=16, scale_type=FLOAT8E4M3FN)` -> (FLOAT4E2M1 codes, FP8 E4M3
  block scales); `DequantizeLinear(block scales, global_scale)` -> float32
  scales; `DequantizeLinear(codes, scales; axis=-1, block_size=16)`; the
  global scale a float32 constant, the calibrated `amax / (6 * 448)`; then
  a Cast to the graph's 16-bit type before the MatMul (ModelOpt's "FP4
  pattern": `TRT_FP4DynamicQuantize -> DQ -> DQ -> Cast(f16) -> MatMul`).
- MXFP8: `trt::TRT_MXFP8DynamicQuantize(x; axis=-1, block_size=32,
  output_dtype=FLOAT8E4M3FN)` -> (FLOAT8E4M3FN codes, FLOAT8E8M0 scales);
  `DequantizeLinear(codes, scales; axis=-1, block_size=32,
  output_dtype=<16-bit>)`.

TensorRT's dynamic quantize takes float16 or bfloat16 input ("TRT
StronglyType only supports FP16 QDQ ops", ModelOpt casts to FP16 first),
so such a graph is exported with `dtype="float16"` or `"bfloat16"`.

While `export_onnx` traces the model, each such quantizer computes an
unsigned 8-bit Q/DQ whose scale is a marker (`formats.dynamic_carrier`,
below 2**-90: no quantizer's scale comes near); `write_dynamic_quantizers`
replaces each by the nodes above. `REFERENCE_OPS` run the two trt-domain
ops in `onnx.reference` (ONNX Runtime has no kernel for them), computing
what `blocks.block_activation_quantize_dequantize` does in numpy.
`docs/export.md` ("NVFP4 and MXFP8 activations").
"""

import contextlib

import ml_dtypes
import numpy as np

from keras_mp.onnx.errors import ExportError

DOMAIN = "trt"
FP4_OP = "TRT_FP4DynamicQuantize"
MXFP8_OP = "TRT_MXFP8DynamicQuantize"
OPS = (FP4_OP, MXFP8_OP)
# marker k: 2**-100 * (1 + k / 1024), k < 1024 (tf2onnx's scale is within
# a few float32 ulps of it: matched with a relative 1e-5)
_MARKER_BASE = 2.0**-100
_MATCH_RTOL = 1e-5
_FLOAT = 1


def dynamic_quantizers(model):
    """`(description, quantizer)` of each enabled block-scaled activation
    quantizer of `model` (`TensorQuantizer(dynamic_blocks=True)`)."""
    from keras_mp.quantization.twins import quantizers

    return [
        (q.name, q.quantizer)
        for q in quantizers(model, "export_onnx")
        if getattr(q.quantizer, "dynamic_blocks", False)
        and q.quantizer.enabled
        and q.layer.enabled
    ]


# Default parity tolerances of a graph with NVFP4 inputs (`export_onnx`):
# those inputs read 16-bit values, and one float16 rounding at a boundary
# of E2M1's coarse levels moves a value a whole step. Measured: Keras
# against itself with float16-sized noise (2**-11) on those inputs, rel. L2
# 0.045 (a Dense stack) and 0.11 with 84% top-1 (a random-weight GPT2);
# Keras against the ONNX graph, 0.042 and 0.098-0.11 with 88-94%.
NVFP4_INPUT_MAX_REL_L2 = 0.25
NVFP4_INPUT_MIN_TOP1 = 0.8


def has_nvfp4_inputs(model):
    """Whether `model` quantizes a GEMM input in NVFP4 (a block format with
    a second-level global scale)."""
    return any(
        q.format.block_format.global_scale for _, q in dynamic_quantizers(model)
    )


def min_opset(model):
    """The lowest opset of `model`'s block-scaled activations (0: none)."""
    return max(
        (q.format.block_format.min_opset for _, q in dynamic_quantizers(model)),
        default=0,
    )


def check_dtype(model, dtype):
    """ExportError, before anything is written, when `model` has NVFP4 or
    MXFP8 activations and the graph would be float32."""
    found = dynamic_quantizers(model)
    if not found or dtype in ("float16", "bfloat16"):
        return
    names = sorted({q.format.label for _, q in found})
    raise ExportError(
        f"Model {model.name!r} quantizes GEMM inputs in "
        f"{'/'.join(names)} ({len(found)} quantizer(s), e.g. "
        f"{found[0][0]!r}). TensorRT quantizes them with DynamicQuantize, "
        "which takes float16 or bfloat16 input only (ModelOpt's ONNX "
        "export casts to FP16 first), so the graph must be strongly typed "
        "16-bit. Pass dtype='float16' (or 'bfloat16'), or quantize the "
        "weights only: QuantizeConfig(precision=..., weights_only=True). "
        "Nothing was written."
    )


@contextlib.contextmanager
def markers(model):
    """While active, `model`'s block-scaled activation quantizers trace
    as carriers of distinct marker scales (`formats.dynamic_carrier`)."""
    from keras_mp.quantization.formats import dynamic_markers

    found = dynamic_quantizers(model)
    if len(found) > 1024:
        raise ExportError(
            f"Model {model.name!r} has {len(found)} NVFP4/MXFP8 activation "
            "quantizers; the export tells at most 1024 apart. Quantize "
            "some layers' weights only. Nothing was written."
        )
    with dynamic_markers({id(q): _marker(k) for k, (_, q) in enumerate(found)}):
        yield


def _marker(k):
    return float(np.float32(_MARKER_BASE * (1 + k / 1024)))


def write_dynamic_quantizers(model_proto, model, dtype):
    """Replaces each carrier Q/DQ of a block-scaled activation quantizer of
    `model` in `model_proto` (traced under `markers`) by TensorRT's
    DynamicQuantize and DequantizeLinear(s), in place.

    tf2onnx's optimizer moves a Q back across the ops that only move values
    (a Dense's Tensordot Reshape to `(-1, K)`, TimeDistributed's Transpose
    and per-step Slice, a Bidirectional LSTM's Slice / Squeeze / Concat of
    its last steps) and gives each reader a DQ: the ops between run on the
    float values again, each DQ that feeds anything but a Shape becomes the
    DynamicQuantize and its DQs, a DQ read only by Shape ops goes. Blocks
    along the last axis commute exactly with each op crossed that keeps
    every block whole and in place (`_keeps_blocks`): a Transpose whose
    perm leaves the last axis last, a Slice / Gather / Squeeze / Unsqueeze
    off the last axis, a Reshape / Flatten whose last axis is a multiple of
    the block (blocks are the same runs of values in memory order), a
    Concat of this quantizer's codes whose parts along the last axis are
    multiples of the block; the global scale (NVFP4) is one per tensor.

    Returns:
        The descriptions of the quantizers written.

    Raises:
        ExportError: a quantizer has no carrier in the graph, or its codes
            cross an op that moves or splits the blocks (or one whose
            effect on them the graph does not tell).
    """
    from onnx import helper

    graph = model_proto.graph
    found = dynamic_quantizers(model)
    wanted = np.asarray([_marker(k) for k in range(len(found))], np.float64)
    inits = {i.name: i for i in graph.initializer}
    shapes = _shapes(model_proto)
    written = []
    groups = {}  # tf2onnx may split a carrier Q (one per Concat input)
    for quant in graph.node:
        match = _carrier(quant, inits, wanted)
        if match is not None:
            groups.setdefault(match, []).append(quant)
    for match, quants in groups.items():
        description, q = found[match]
        codes, dqs = _codes_and_dqs(
            graph, quants, description, shapes, q.block_size
        )
        floats = {quant.output[0]: quant.input[0] for quant in quants}
        for node in graph.node:  # the moved ops read the float values
            for i, name in enumerate(node.input):
                if name in floats and node.op_type != "DequantizeLinear":
                    node.input[i] = floats[name]
        for k, dq in enumerate(dqs):
            readers = [n for n in graph.node if dq.output[0] in n.input]
            x = floats.get(dq.input[0], dq.input[0])
            at = list(graph.node).index(dq)
            graph.node.remove(dq)
            if readers and all(n.op_type == "Shape" for n in readers):
                for n in readers:
                    n.input[0] = x
                continue
            base = f"{description}_dynamic_{k}".replace("/", "_")
            nodes = _dynamic_nodes(q, x, dq.output[0], base, graph)
            for i, node in enumerate(nodes):
                graph.node.insert(at + i, node)
        for quant in quants:
            graph.node.remove(quant)
        for info in list(graph.value_info):
            if info.name in codes:
                graph.value_info.remove(info)
        written.append(description)
    missing = [d for d, _ in found if d not in written]
    if missing:
        raise ExportError(
            f"The NVFP4/MXFP8 activation quantizer {missing[0]!r} left no "
            "stand-in in the traced graph (was the layer skipped by the "
            "trace?). Quantize this layer's weights only "
            "(QuantizeConfig(weights_only=True)) and report the model. "
            "Nothing was written."
        )
    if not any(o.domain == DOMAIN for o in model_proto.opset_import):
        model_proto.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    _declare_outputs(graph)
    return written


def _carrier(quant, inits, wanted):
    """The index of the marker `quant`'s scale is, or None."""
    from onnx import numpy_helper

    if quant.op_type != "QuantizeLinear" or not len(wanted):
        return None
    init = inits.get(quant.input[1])
    if init is None:
        return None
    scale = float(numpy_helper.to_array(init).reshape(-1)[0])
    err = np.abs(wanted - scale) / wanted
    return int(err.argmin()) if err.min() <= _MATCH_RTOL else None


def _codes_and_dqs(graph, quants, description, shapes, block_size):
    """The code tensors of the carrier Qs `quants` of one quantizer (their
    outputs and the outputs of the ops that move them) and the
    DequantizeLinears reading them."""
    frontier = [quant.output[0] for quant in quants]
    codes, dqs, moved = set(frontier), [], {}
    while frontier:
        name = frontier.pop()
        for node in graph.node:
            if name not in node.input:
                continue
            if node.op_type == "DequantizeLinear":
                if node.input[0] == name:
                    dqs.append(node)
                    continue
            elif node.op_type == "Shape":
                continue  # the same shape on the float values
            elif id(node) in moved:
                continue
            elif _keeps_blocks(node, name, graph, shapes, block_size):
                moved[id(node)] = node
                codes.add(node.output[0])
                frontier.append(node.output[0])
                continue
            raise _crossing_error(description, node)
    for node in moved.values():  # a Concat of these codes only
        if node.op_type == "Concat" and not set(node.input) <= codes:
            raise _crossing_error(description, node)
    return codes, dqs


def _crossing_error(description, node):
    return ExportError(
        f"The NVFP4/MXFP8 activation of quantizer {description!r} crosses "
        f"ONNX op {node.op_type} {node.name!r} on its way to its MatMul, "
        "which could move K off the last axis the blocks run along. "
        "Quantize this layer's weights only "
        "(QuantizeConfig(weights_only=True)) and report the model. "
        "Nothing was written."
    )


def _shapes(model_proto):
    """Inferred shapes by tensor name (int or None per dim)."""
    import onnx

    try:
        typed = onnx.shape_inference.infer_shapes(model_proto).graph
    except Exception:  # an untyped graph: the ops that need ranks refuse
        return {}
    shapes = {}
    for info in [*typed.value_info, *typed.input, *typed.output]:
        tensor = info.type.tensor_type
        if tensor.HasField("shape"):
            shapes[info.name] = [
                d.dim_value if d.HasField("dim_value") else None
                for d in tensor.shape.dim
            ]
    return shapes


def _const(graph, name):
    """The int64 values of constant `name`, or None."""
    from onnx import numpy_helper

    from keras_mp.onnx.graph import constant_value

    for init in graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init).astype(np.int64).ravel()
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            value = constant_value(node)
            return None if value is None else value[0].astype(np.int64).ravel()
    return None


def _last_target_dim(graph, name):
    """The last entry of a Reshape's computed target shape when it is a
    constant (a Concat whose last part is one, through Casts), or None."""
    producers = {o: n for n in graph.node for o in n.output}
    for _ in range(8):
        node = producers.get(name)
        if node is None or node.op_type not in ("Cast", "Identity", "Concat"):
            break
        name = node.input[-1]
        value = _const(graph, name)
        if value is not None:
            return int(value[-1]) if value.size and value[-1] > 0 else None
    return None


def _axes(graph, node, slot, rank):
    """`node`'s axes (an input at `slot`, or the `axes` attribute of
    opsets before 13), normalized to `rank`; None when not constant."""
    from keras_mp.onnx.graph import attr

    if len(node.input) > slot and node.input[slot]:
        axes = _const(graph, node.input[slot])
    else:
        axes = attr(node, "axes", None)
    if axes is None:
        return None
    return [int(a) % rank for a in axes]


def _keeps_blocks(node, name, graph, shapes, block_size):
    """Whether `node`, reading codes `name`, leaves every block of
    `block_size` along the last axis whole and in place."""
    from keras_mp.onnx.graph import attr

    shape = shapes.get(name)
    out = shapes.get(node.output[0])
    rank = None if shape is None else len(shape)
    op = node.op_type
    if op == "Identity":
        return True
    if op in ("Reshape", "Flatten"):
        if node.input[0] != name:
            return False
        last = out[-1] if out else None
        if last is None and op == "Reshape":
            target = _const(graph, node.input[1])
            if target is not None and target.size and target[-1] > 0:
                last = int(target[-1])
            elif target is None:  # Concat(dims read at run time, K)
                last = _last_target_dim(graph, node.input[1])
            elif (  # 0 copies the input's last dim to the same place
                target is not None
                and target.size == rank
                and target[-1] == 0
                and shape[-1] is not None
            ):
                last = shape[-1]
        if last is None and op == "Flatten" and rank:
            axis = int(attr(node, "axis", 1)) % rank
            last = shape[-1] if axis == rank - 1 else None
        if last is None and rank is None:
            return op == "Reshape"  # as before: (-1, K) of a Tensordot
        return last is not None and last % block_size == 0
    if rank is None or node.input[0] != name and op != "Concat":
        return False
    if op == "Transpose":
        perm = attr(node, "perm", None)
        return perm is not None and int(perm[-1]) % rank == rank - 1
    if op == "Slice":
        axes = _axes(graph, node, 3, rank)
        if axes is None and len(node.input) <= 3:
            starts = _const(graph, node.input[1])
            axes = None if starts is None else list(range(len(starts)))
        return axes is not None and rank - 1 not in axes
    if op == "Gather":
        return int(attr(node, "axis", 0)) % rank != rank - 1
    if op == "Squeeze":
        if len(node.input) < 2 and attr(node, "axes", None) is None:
            return shape[-1] is not None and shape[-1] > 1
        axes = _axes(graph, node, 1, rank)
        return axes is not None and rank - 1 not in axes
    if op == "Unsqueeze":
        raw = _const(graph, node.input[1]) if len(node.input) > 1 else None
        if raw is None:
            raw = attr(node, "axes", None)
        if raw is None:
            return False
        rank_out = rank + len(raw)
        return rank_out - 1 not in [int(a) % rank_out for a in raw]
    if op == "Concat":
        axis = int(attr(node, "axis", 0)) % rank
        if axis != rank - 1:
            return True
        return all(
            shapes.get(i)
            and shapes[i][-1] is not None
            and shapes[i][-1] % block_size == 0
            for i in node.input
        )
    return False


def _dynamic_nodes(q, x, out, base, graph):
    """The DynamicQuantize and DequantizeLinear(s) of quantizer `q` from
    float `x` to `out` (ModelOpt's `export_fp4` / `export_mxfp8`), in a
    float32 graph: `fp16.to_half` turns the DQ's `output_dtype` (MXFP8)
    and the Cast after the DQs (NVFP4) into the 16-bit type."""
    from onnx import helper, numpy_helper

    from keras_mp.quantization.blocks import activation_global_scale

    if not q.format.block_format.global_scale:
        return [
            helper.make_node(
                MXFP8_OP,
                [x],
                [f"{base}_fp8", f"{base}_e8m0_scale"],
                name=f"{base}_{MXFP8_OP}",
                domain=DOMAIN,
                axis=-1,
                block_size=q.block_size,
                output_dtype=17,  # FLOAT8E4M3FN
            ),
            helper.make_node(
                "DequantizeLinear",
                [f"{base}_fp8", f"{base}_e8m0_scale"],
                [out],
                name=f"{base}_DequantizeLinear",
                axis=-1,
                block_size=q.block_size,
                output_dtype=_FLOAT,
            ),
        ]
    gs = np.float32(activation_global_scale(q.amax.numpy()).numpy())
    graph.initializer.append(
        numpy_helper.from_array(gs, f"{base}_global_scale")
    )
    return [
        helper.make_node(
            FP4_OP,
            [x, f"{base}_global_scale"],
            [f"{base}_fp4", f"{base}_fp8_scale"],
            name=f"{base}_{FP4_OP}",
            domain=DOMAIN,
            axis=-1,
            block_size=q.block_size,
            scale_type=17,  # FLOAT8E4M3FN
        ),
        helper.make_node(
            "DequantizeLinear",
            [f"{base}_fp8_scale", f"{base}_global_scale"],
            [f"{base}_scale"],
            name=f"{base}_scale_DequantizeLinear",
        ),
        helper.make_node(
            "DequantizeLinear",
            [f"{base}_fp4", f"{base}_scale"],
            [f"{base}_dq"],
            name=f"{base}_DequantizeLinear",
            axis=-1,
            block_size=q.block_size,
        ),
        # float32 out of the DQs (the global scale's type), as ModelOpt's
        # "DQ -> DQ -> Cast(f16) -> MatMul"
        helper.make_node(
            "Cast", [f"{base}_dq"], [out], name=f"{base}_Cast", to=_FLOAT
        ),
    ]


def _declare_outputs(graph):
    """The element types of the trt ops' outputs and of the 16-bit values
    they give (shape inference has no schema for the trt domain)."""
    from onnx import helper

    ops = {n.output[0]: n for n in graph.node if n.op_type in OPS}
    for node in ops.values():
        codes, scales = (23, 17) if node.op_type == FP4_OP else (17, 24)
        graph.value_info.extend(
            [
                helper.make_tensor_value_info(node.output[0], codes, None),
                helper.make_tensor_value_info(node.output[1], scales, None),
            ]
        )


def has_dynamic_ops(proto):
    """Whether `proto` holds trt-domain DynamicQuantize nodes."""
    return any(n.op_type in OPS for n in proto.graph.node)


def _reference_ops():
    """`onnx.reference` implementations of the two trt-domain ops."""
    from onnx.reference.op_run import OpRun

    class TRT_FP4DynamicQuantize(OpRun):  # noqa: N801 - the ONNX op name
        op_domain = DOMAIN

        def _run(self, x, global_scale, axis=-1, block_size=16, scale_type=17):
            codes, scales = fp4_dynamic_quantize(
                x, global_scale, axis, block_size
            )
            return codes, scales

    class TRT_MXFP8DynamicQuantize(OpRun):  # noqa: N801
        op_domain = DOMAIN

        def _run(self, x, axis=-1, block_size=32, output_dtype=17):
            return mxfp8_dynamic_quantize(x, axis, block_size)

    return [TRT_FP4DynamicQuantize, TRT_MXFP8DynamicQuantize]


def _blocks(x, axis, block_size):
    x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    if x.shape[-1] % block_size:
        raise ValueError(
            f"DynamicQuantize: axis of {x.shape[-1]} values, not a multiple "
            f"of block_size={block_size}"
        )
    xb = x.reshape(x.shape[:-1] + (-1, block_size))
    return xb, np.max(np.abs(xb), axis=-1, keepdims=True)


def _unblock(values, shape, axis):
    return np.moveaxis(values.reshape(shape), -1, axis)


def fp4_dynamic_quantize(x, global_scale, axis=-1, block_size=16):
    """TensorRT's FP4 DynamicQuantize in numpy, as ModelOpt documents it
    (`_nvfp4_act_qdq_eager`): per block of `block_size` along `axis`, the
    scale `block_amax / 6 / global_scale` saturated at 448 and rounded to
    FP8 E4M3 (1 for an all-zero block); values divided by `fp8 scale *
    global_scale`, rounded to E2M1 (half to even, saturated at 6; 0 where
    that scale is 0). Computed in float32.

    Returns:
        `(codes, scales)`: `ml_dtypes.float4_e2m1fn` codes shaped like `x`,
        `ml_dtypes.float8_e4m3fn` scales with `axis` divided by
        `block_size`.
    """
    xb, amax = _blocks(x, axis, block_size)
    gs = np.float32(np.asarray(global_scale, np.float32).reshape(()))
    per_block = amax / np.float32(6.0)
    block = np.minimum(per_block / gs, np.float32(448.0))
    block = block.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    block = np.where(per_block > 0, block, np.float32(1.0))
    scale = block * gs
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.clip(xb / np.where(scale > 0, scale, 1), -6, 6)
    v = np.where(scale > 0, v, 0).astype(np.float32)
    codes = v.astype(ml_dtypes.float4_e2m1fn)
    shape = np.moveaxis(np.asarray(x), axis, -1).shape
    scales = block.astype(ml_dtypes.float8_e4m3fn)
    return (
        _unblock(codes, shape, axis),
        _unblock(scales, shape[:-1] + (shape[-1] // block_size,), axis),
    )


def mxfp8_dynamic_quantize(x, axis=-1, block_size=32):
    """TensorRT's MXFP8 DynamicQuantize in numpy: per block of
    `block_size` along `axis`, the E8M0 scale `2 ** ceil(log2(block_amax /
    448))` (clamped to [-127, 127]; ModelOpt's MXFP8 `compute_e8m0`), values
    times its inverse saturated at 448 and rounded to FP8 E4M3.

    Returns:
        `(codes, scales)`: `ml_dtypes.float8_e4m3fn` codes shaped like `x`,
        `ml_dtypes.float8_e8m0fnu` scales with `axis` divided by
        `block_size`.
    """
    xb, amax = _blocks(x, axis, block_size)
    ratio = (amax / np.float32(448.0)).astype(np.float32)
    mantissa, exponent = np.frexp(ratio)  # ratio = mantissa * 2**exponent
    exponent = np.where(mantissa > 0.5, exponent, exponent - 1)
    exponent = np.where(ratio > 0, exponent, -127)
    exponent = np.clip(exponent, -127, 127).astype(np.int32)
    inverse = np.ldexp(np.float64(1.0), -exponent)
    v = np.clip(xb * inverse, -448.0, 448.0).astype(np.float32)
    codes = v.astype(ml_dtypes.float8_e4m3fn)
    scales = np.ldexp(np.float64(1.0), exponent).astype(
        ml_dtypes.float8_e8m0fnu
    )
    shape = np.moveaxis(np.asarray(x), axis, -1).shape
    return (
        _unblock(codes, shape, axis),
        _unblock(scales, shape[:-1] + (shape[-1] // block_size,), axis),
    )


def reference_evaluator(proto):
    """An `onnx.reference.ReferenceEvaluator` of `proto` that also runs
    the trt-domain DynamicQuantize ops."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(proto, new_ops=_reference_ops())
