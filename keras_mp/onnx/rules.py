"""The TensorRT explicit-quantization rules, one function each.

Each rule is `rule(graph) -> iterable of Finding` over a `LintGraph`,
listed in `RULES`: adding a rule is one function and one list entry
(`docs/tensorrt.md` lists what each checks and why).
"""

import dataclasses

import numpy as np

from keras_mp._compat import optional_import
from keras_mp.onnx.block_rules import is_blocked, rule_blocks
from keras_mp.onnx.graph import (
    BIAS_SLOT,
    INT32,
    LAYOUT_OPS,
    QDQ_OPS,
    TENSORRT_QDQ_TYPES,
    UINT8,
    WEIGHT_SLOTS,
    GraphIndex,
    attr,
    input_channel_axis,
    output_channel_axis,
)
from keras_mp.quantization import placement
from keras_mp.quantization.formats import format_of_onnx_type
from keras_mp.quantization.placement import (
    COMMUTING_OPS,
    DATA_MOVEMENT_OPS,
    FUSED_OPS,
    RESIDUAL_FOLDED_OPS,
    SCALE_COMMUTING_OPS,
)

QOPERATOR_OPS = frozenset(
    """QLinearConv QLinearMatMul ConvInteger MatMulInteger MatMulIntegerToFloat
    DynamicQuantizeLinear DynamicQuantizeMatMul QGemm QAttention QLinearAdd
    QLinearMul QLinearConcat QLinearAveragePool QLinearGlobalAveragePool
    QLinearLeakyRelu QLinearSigmoid QLinearSoftmax QLinearReduceMean
    QLinearConvTranspose QLinearWhere""".split()
)
SPARSE_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
# Ops that commute with quantization, through which TensorRT's Q/DQ
# propagation moves a Q backwards and a DQ forwards: layout ops (values
# only moved) and max pooling (max of codes is the code of the max). The
# facts and their sources are the placement's (`placement.COMMUTING_OPS`;
# a Concat is walked only when its inputs share one scale,
# `LintGraph.commutes`).
PASS_THROUGH_OPS = LAYOUT_OPS | COMMUTING_OPS


@dataclasses.dataclass(frozen=True)
class Finding:
    """One broken rule: which rule, on which node, and what to do.

    Example:

    >>> for finding in keras_mp.check_tensorrt("model.onnx").violations:
    ...     print(finding.rule, finding.node, finding.message)
    """

    rule: str
    node: str
    message: str
    severity: str = "error"

    def __str__(self):
        return f"`{self.node}` [{self.rule}] {self.message}"


class LintGraph(GraphIndex):
    """A `GraphIndex` with what the rules need beside it.

    Args:
        model: an `onnx.ModelProto`.
        check_sparsity: `"auto"`, True or False, as `check_tensorrt`'s.
    """

    def __init__(self, model, check_sparsity):
        super().__init__(model)
        self.check_sparsity = check_sparsity

    def commutes(self, node):
        """Whether TensorRT moves a DQ forwards across `node`: one of
        `PASS_THROUGH_OPS`, or a Concat whose inputs all come from
        DequantizeLinear nodes with one same scale, or all from
        QuantizeLinear nodes with one same scale (the DQ moved past the
        Concat already, as tf2onnx's optimizer does when the scales are
        equal; `placement.py` has the TensorRT source)."""
        if node.op_type in PASS_THROUGH_OPS:
            return True
        if node.op_type not in SCALE_COMMUTING_OPS:
            return False
        scales = [self._qdq_scale(tensor) for tensor in node.input]
        if any(s is None for s in scales):
            return False
        return all(np.array_equal(scales[0], s) for s in scales[1:])

    def _qdq_scale(self, tensor):
        """The scale of the DequantizeLinear, or else of the QuantizeLinear,
        that produces `tensor` (through layout ops); None if neither."""
        dq = self.trace(tensor).dq
        if dq is not None:
            scale = self.const(dq.input[1])
            return None if scale is None else np.asarray(scale)
        node = self.producers.get(tensor)
        while node is not None and node.op_type in LAYOUT_OPS:
            node = self.producers.get(node.input[0])
        if node is None or node.op_type != "QuantizeLinear":
            return None
        scale = self.const(node.input[1])
        return None if scale is None else np.asarray(scale)

    def consumers_through(self, tensor):
        """The nodes reading `tensor`, directly or past the ops TensorRT
        moves a DQ across (`commutes`: walked, not listed)."""
        found, pending, seen = [], [tensor], set()
        while pending:
            for node, _ in self.consumers.get(pending.pop(), []):
                if not self.commutes(node):
                    found.append(node)
                elif id(node) not in seen:
                    seen.add(id(node))
                    pending.append(node.output[0])
        return found

    def reached_moving(self, tensor):
        """The nodes reading `tensor`, directly or across the ops that only
        move values (`placement.DATA_MOVEMENT_OPS`, walked, not listed) or
        that TensorRT moves a DQ across (`commutes`)."""
        found, pending, seen = [], [tensor], set()
        while pending:
            for node, _ in self.consumers.get(pending.pop(), []):
                if not (
                    node.op_type in DATA_MOVEMENT_OPS or self.commutes(node)
                ):
                    found.append(node)
                elif id(node) not in seen:
                    seen.add(id(node))
                    pending.extend(node.output)
        return found

    def feeds_weighted_op(self, tensor):
        return any(
            node.op_type in WEIGHT_SLOTS
            for node in self.consumers_through(tensor)
        )


def _qdq_type(graph, node):
    """ONNX element type of the integer side of a Q/DQ node, or None."""
    if len(node.input) > 2 and node.input[2]:
        return graph.dtypes.get(node.input[2])
    if node.op_type == "QuantizeLinear":
        return attr(node, "output_dtype", 0) or UINT8
    return graph.dtypes.get(node.input[0])


def _qdq_format(graph, node):
    """The `FORMATS` row of a Q/DQ node's element type, or None."""
    dtype = _qdq_type(graph, node)
    return None if dtype is None else format_of_onnx_type(dtype)


def bad_groups(array, axis):
    """(groups of 4 with more than 2 non-zeros, all groups) along `axis`."""
    groups = np.moveaxis(np.asarray(array), axis, -1).reshape(-1, 4)
    return int((np.count_nonzero(groups, axis=1) > 2).sum()), len(groups)


def sparsity_candidates(graph):
    """(op, weight name, array, axis) for each weight 2:4 can apply to."""
    for op, slot, source in graph.weights:
        if op.op_type not in SPARSE_OPS or slot != 1:
            continue
        if any(n.op_type != "Identity" for n in source.layout):
            continue  # a moved weight: its input channels are not known here
        array = source.array
        axis = input_channel_axis(op.op_type, array.ndim, attr(op, "transB", 0))
        if array.ndim >= 2 and array.shape[axis] % 4 == 0:
            yield op, source.name, array, axis


def _rule_qoperator(graph):
    for node in graph.nodes:
        if node.op_type in QOPERATOR_OPS:
            yield Finding(
                "qoperator",
                graph.name(node),
                f"{node.op_type} is a QOperator-format op; TensorRT accepts "
                "only QuantizeLinear/DequantizeLinear pairs around float ops: "
                "re-export in QDQ format (ONNX Runtime: "
                "quant_format=QuantFormat.QDQ).",
            )
        elif node.op_type in QDQ_OPS and node.domain not in ("", "ai.onnx"):
            yield Finding(
                "qoperator",
                graph.name(node),
                f"{node.op_type} from domain '{node.domain}'; TensorRT parses "
                "only the standard ONNX QuantizeLinear/DequantizeLinear.",
            )


def _rule_zero_point(graph):
    for node in graph.qdq:
        if is_blocked(node):
            continue  # `_rule_blocks`
        has_zero_point = len(node.input) > 2 and node.input[2]
        dtype = _qdq_type(graph, node)
        message = None
        if dtype == INT32:
            message = (
                "dequantizes an INT32 tensor (a quantized bias); TensorRT "
                "quantizes biases itself and takes INT8 Q/DQ only: keep the "
                "bias float32 (ONNX Runtime: extra_options QuantizeBias=False)."
            )
        elif dtype is not None and dtype not in TENSORRT_QDQ_TYPES:
            kind = optional_import("onnx").TensorProto.DataType.Name(dtype)
            missing = "" if has_zero_point else "has no zero point, so it "
            message = (
                f"{missing}quantizes to {kind}; TensorRT needs INT8 (or FP8 "
                "E4M3, FLOAT8E4M3FN) with zero point 0: give it an INT8 zero "
                "point of 0 (ONNX Runtime: activation_type=QuantType.QInt8)."
            )
        elif has_zero_point:
            zero_point = graph.const(node.input[2])
            if zero_point is None:
                message = (
                    f"zero point '{node.input[2]}' is computed at run time; "
                    "TensorRT needs a constant INT8 zero point of 0."
                )
            elif np.any(zero_point != 0):
                values = np.unique(zero_point)[:4].tolist()
                message = (
                    f"zero point is {values}, not 0 (asymmetric); TensorRT "
                    "quantization is symmetric: use zero point 0 (ONNX "
                    "Runtime: extra_options ActivationSymmetric=True, "
                    "WeightSymmetric=True)."
                )
        if message:
            yield Finding("zero_point", graph.name(node), message)


def _rule_scale(graph):
    for node in graph.qdq:
        if is_blocked(node):
            continue  # `_rule_blocks` (E8M0 and NVFP4's computed scales)
        tensor = node.input[1]
        scale = graph.const(tensor)
        if scale is None:
            producer = graph.producers.get(tensor)
            origin = (
                f"computed at run time by {producer.op_type} "
                f"'{graph.name(producer)}'"
                if producer is not None
                else "a graph input"
            )
            message = (
                f"scale '{tensor}' is {origin}; TensorRT needs a constant: "
                "calibrate and store the scale as a float32 initializer."
            )
        elif scale.dtype != np.float32 and not (
            scale.dtype == np.float16 and graph.opset >= 19
        ):
            message = (
                f"scale '{tensor}' is {scale.dtype}; TensorRT needs float32 "
                "(or float16 at opset >= 19, for a float16 graph)."
            )
        elif not np.all(np.isfinite(scale) & (scale > 0)):
            bad = scale[~(np.isfinite(scale) & (scale > 0))].ravel()
            message = (
                f"scale '{tensor}' has {bad.size} value(s) that are not "
                f"positive and finite (e.g. {bad[0]}); an uncalibrated "
                "quantizer (amax 0) gives scale 0: calibrate it."
            )
        else:
            continue
        yield Finding("scale", graph.name(node), message)


def _rule_per_channel(graph):
    for node in graph.qdq:
        if is_blocked(node):
            continue  # `_rule_blocks`
        scale = graph.const(node.input[1])
        if scale is None or scale.size <= 1:
            continue
        name = graph.name(node)
        axis = attr(node, "axis", 1)
        if graph.opset < 13:
            yield Finding(
                "per_channel",
                name,
                f"per-channel scale needs opset >= 13; the graph has opset "
                f"{graph.opset}: export with opset 13 or later.",
            )
        use = graph.weight_use.get(id(node))
        if use is None:
            yield Finding(
                "per_channel",
                name,
                f"per-channel scale ({scale.size} values, axis {axis}) on "
                "a tensor that is not the weight of a Conv, ConvTranspose, "
                "MatMul or Gemm; TensorRT quantizes activations per-tensor: "
                "use a scalar scale.",
            )
            continue
        op, slot, source = use
        if slot == BIAS_SLOT or source.layout:
            continue  # reported by the zero_point / weight_dq_direct rules
        fmt = _qdq_format(graph, node)
        if (
            op.op_type not in ("MatMul", "Gemm")
            and node.op_type == "DequantizeLinear"
            and fmt is not None
            and fmt.conv_weights_per_tensor
        ):
            kind = fmt.label
            yield Finding(
                "per_channel",
                name,
                f"per-channel {kind} weight of {op.op_type} "
                f"'{graph.name(op)}': TensorRT documents per-channel {kind} "
                "weights for GEMMs (MatMul, Gemm; 10.6+) and keras_mp writes "
                f"{kind} convolution weights per tensor; ModelOpt's ONNX PTQ "
                "writes them per channel. Check that your TensorRT version "
                "builds it.",
                "warning",
            )
            continue
        shape = source.array.shape
        expected = output_channel_axis(op, slot, len(shape))
        if (axis + len(shape) if axis < 0 else axis) != expected:
            yield Finding(
                "per_channel",
                name,
                f"per-channel axis {axis} on the weight of {op.op_type} "
                f"'{graph.name(op)}' (shape {list(shape)}); its output-"
                f"channel axis is {expected} (Conv: 0, OIHW; ConvTranspose: "
                "1; MatMul: last; Gemm: 1, or 0 with transB=1).",
            )
        elif scale.size != shape[expected]:
            yield Finding(
                "per_channel",
                name,
                f"{scale.size} scales for {shape[expected]} output channels "
                f"of {op.op_type} '{graph.name(op)}'.",
            )


def _rule_weight_dq_direct(graph):
    for op, slot, source in graph.weights:
        if source.dq is None or not source.layout:
            continue
        chain = ", ".join(
            f"{n.op_type} '{graph.name(n)}'" for n in reversed(source.layout)
        )
        yield Finding(
            "weight_dq_direct",
            graph.name(op),
            f"weight DequantizeLinear '{graph.name(source.dq)}' reaches input "
            f"{slot} through {chain}; TensorRT needs the weight DQ to feed "
            f"the {op.op_type} directly: fold these ops into the weight "
            "initializer.",
        )


def _rule_partial_quantization(graph):
    for op in graph.weighted:
        quantized = graph.quantized_inputs(op)
        weight_only = any(
            is_blocked(graph.trace(t).dq or op) for t in op.input[:2]
        )
        if len(quantized) == 2 and quantized[0] != quantized[1]:
            if weight_only:
                continue  # INT4 weight-only: the input stays float
            missing = op.input[quantized.index(False)]
            yield Finding(
                "partial_quantization",
                graph.name(op),
                f"only one input is quantized ('{missing}' is not); TensorRT "
                f"runs the {op.op_type} in INT8 only when both input and "
                "weight are: add Q/DQ on the other input too.",
                "warning",
            )


def _small_gemm(graph, op):
    """Whether `op` is a MatMul/Gemm with a constant weight whose K or N is
    below the small-GEMM rule (`placement.gemm_too_small`): float by design
    (no faster quantized)."""
    if op.op_type not in ("MatMul", "Gemm") or len(op.input) < 2:
        return False
    array = graph.trace(op.input[1]).array
    return (
        array is not None
        and array.ndim >= 2
        and placement.gemm_too_small(*array.shape[-2:])
    )


def _rule_float_weighted_ops(graph):
    """In a graph with Q/DQ, the weighted ops with neither input quantized:
    legal, but TensorRT runs them in float (one finding for all of them).
    Recurrent ops (LSTM, GRU, RNN) and weighted ops inside Loop/Scan/If
    bodies count among them: TensorRT runs those in float whatever Q/DQ
    surrounds them (`GraphIndex.float_weighted`). A MatMul/Gemm whose
    weight has K or N below 16 does not: it is float by design
    (`placement.MIN_GEMM_DIM`)."""
    if not any(node.op_type in QDQ_OPS for node in graph.nodes):
        return
    left = [
        op
        for op in graph.weighted
        if not any(graph.quantized_inputs(op)) and not _small_gemm(graph, op)
    ]
    left += [op for op, _ in graph.float_weighted]
    if not left:
        return
    names = ", ".join(f"'{graph.name(op)}'" for op in left[:5])
    more = f" and {len(left) - 5} more" if len(left) > 5 else ""
    total = len(graph.weighted) + len(graph.float_weighted)
    why = "Quantize the layers they come from, or leave them float on purpose."
    if graph.float_weighted:
        why = (
            "Recurrent ops (LSTM, GRU, RNN) and ops inside Loop/Scan/If "
            "bodies stay float: TensorRT's ONNX importer builds a recurrent "
            "op's matmuls from float inputs only. Quantize the other layers, "
            "or leave them float on purpose."
        )
    yield Finding(
        "float_weighted_ops",
        graph.name(left[0]),
        f"{len(left)} of {total} weighted ops have no quantized input "
        f"({names}{more}): TensorRT runs them in float, which costs INT8 "
        f"speed. {why}",
        "warning",
    )


def _rule_output_qdq(graph):
    # Layout ops may stand between the op and its Q, between the Q and its
    # DQ, and after the DQ (tf2onnx puts attention's head split there).
    for op in graph.weighted:
        for q in graph.consumers_through(op.output[0]):
            if q.op_type != "QuantizeLinear":
                continue
            # INT8 values may move before their DQ (tf2onnx moves a Q back
            # across a Concat, a Gather, a Reshape: DLRM's interactions)
            dqs = [
                n
                for n in graph.reached_moving(q.output[0])
                if n.op_type == "DequantizeLinear"
            ]
            if not any(_qdq_is_used(graph, dq) for dq in dqs):
                yield Finding(
                    "output_qdq",
                    graph.name(q),
                    f"Q/DQ on the output of {op.op_type} '{graph.name(op)}' "
                    "feeds no weighted op; TensorRT fuses Q/DQ on the inputs "
                    "of weighted ops, so this pair may only add latency.",
                    "warning",
                )


def _qdq_is_used(graph, dq):
    """Whether TensorRT fuses `dq`: it feeds a weighted op; or an average
    pooling whose output is quantized (TensorRT fuses DQ -> pool -> Q into
    one INT8 kernel: `placement.FUSED_OPS`); or it is the quantized skip
    input of a residual Add whose other input comes from a quantized
    weighted op (the Conv+Add fusion `_rule_residual_add` asks for). The
    DQ is followed across the ops TensorRT moves it over (max pooling,
    layout ops, a Concat of inputs with one scale)."""
    if graph.feeds_weighted_op(dq.output[0]):
        return True
    if any(  # DQ -> Concat/Slice/Pad/... -> Q or weighted op: INT8 through
        n.op_type == "QuantizeLinear" or n.op_type in WEIGHT_SLOTS
        for n in graph.reached_moving(dq.output[0])
    ):
        return True
    consumers = graph.consumers_through(dq.output[0])
    for pool in consumers:
        if pool.op_type in FUSED_OPS and any(
            n.op_type == "QuantizeLinear"
            for n in graph.consumers_through(pool.output[0])
        ):
            return True
    for add in consumers:
        if add.op_type != "Add" or len(add.input) != 2:
            continue
        for tensor in add.input:
            if graph.trace(tensor).dq is not dq and (
                _from_quantized_weighted_op(graph, tensor) is not None
            ):
                return True
    return False


def _data_input(graph, node):
    """The run-time input of a two-input `node` whose other input is a
    constant (a bias add, a BatchNorm scale), else None."""
    if len(node.input) != 2:
        return None
    consts = [graph.trace(t).name is not None for t in node.input]
    return node.input[consts.index(False)] if consts.count(True) == 1 else None


def _from_quantized_weighted_op(graph, tensor):
    """The quantized weighted op behind `tensor`, through a BatchNormalization
    or the Mul/Add-by-constant pair tf2onnx decomposes an inference-mode
    Keras BatchNormalization into (TensorRT folds both into the conv:
    `placement.RESIDUAL_FOLDED_OPS`), and
    through ops that only move values (the NHWC/NCHW Transposes tf2onnx
    leaves when its transpose optimizer is skipped, a MatMul's output
    Reshape, a Slice, Pad or Resize: `placement.DATA_MOVEMENT_OPS` but
    Concat, which has several data inputs)."""
    node = graph.producers.get(tensor)
    for _ in range(8):
        if node is None:
            break
        if node.op_type in RESIDUAL_FOLDED_OPS or (
            node.op_type in DATA_MOVEMENT_OPS and node.op_type != "Concat"
        ):  # the data input; a Concat has more than one
            node = graph.producers.get(node.input[0])
        elif node.op_type in ("Mul", "Add"):
            data = _data_input(graph, node)
            if data is None:
                break
            node = graph.producers.get(data)
        else:
            break
    if node is None or node.op_type not in WEIGHT_SLOTS:
        return None
    return node if any(graph.quantized_inputs(node)) else None


# Ops TensorRT fuses after a Conv+Add, or that keep the values' scale up
# to the next QuantizeLinear (`_feeds_quantize` walks them): activations,
# BatchNormalization, and (tf2onnx's inference BatchNorm) arithmetic with a
# constant.
EPILOGUE_OPS = frozenset(
    "Relu LeakyRelu Clip Sigmoid Tanh HardSigmoid HardSwish "
    "BatchNormalization".split()
)
AFFINE_OPS = frozenset({"Mul", "Add", "Sub", "Div"})


def _feeds_quantize(graph, tensor):
    """Whether `tensor` reaches a QuantizeLinear, directly or through
    `PASS_THROUGH_OPS`, `EPILOGUE_OPS` and arithmetic with a constant:
    whether the op producing it can write INT8 for its consumer."""
    pending, seen = [tensor], set()
    while pending:
        for node, _ in graph.consumers.get(pending.pop(), []):
            if node.op_type == "QuantizeLinear":
                return True
            if id(node) in seen:
                continue
            if node.op_type in (
                PASS_THROUGH_OPS | EPILOGUE_OPS | DATA_MOVEMENT_OPS
            ) or (node.op_type in AFFINE_OPS and _data_input(graph, node)):
                seen.add(id(node))
                pending.extend(node.output)
    return False


def _rule_residual_add(graph):
    """A residual Add where TensorRT's INT8 Conv+Add fusion is possible and
    useful, but the graph blocks it.

    The pattern (TensorRT developer guide, "Q/DQ Layer-Placement
    Recommendations", figures 6 and 7): a quantized weighted op, through
    its BatchNorm, feeds one input of an Add; the other (skip) input is
    quantized; the Add's output, through activations, BatchNorm or layout
    ops, reaches a QuantizeLinear. TensorRT then runs op + Add as one INT8
    kernel whose INT8 output absorbs that Q. With a float skip input the
    fused output is float and the Q runs as a kernel of its own: the rule
    asks for Q/DQ on the skip input.

    An Add whose output reaches no QuantizeLinear is not flagged: its
    fused output is float whatever the skip input, so a skip Q/DQ adds a
    Q and a DQ and fuses into nothing. That is the residual Add of a
    transformer block, which feeds a LayerNormalization run in float;
    ModelOpt's ONNX PTQ does not use this pattern there either (its
    `get_fusible_backbone` in `modelopt/onnx/quantization/graph_utils.py`
    only knows Conv and ConvTranspose backbones; docs/quantization.md has
    what was measured).

    An Add with one input quantized and neither from a quantized weighted
    op is flagged too: quantize both or neither.
    """
    for node in graph.nodes:
        if node.op_type != "Add" or len(node.input) != 2:
            continue
        sources = [graph.trace(t) for t in node.input]
        if any(s.name is not None for s in sources):
            continue  # a bias add, not a residual one
        quantized = [s.dq is not None for s in sources]
        ops = [_from_quantized_weighted_op(graph, t) for t in node.input]
        for i, j in ((0, 1), (1, 0)):
            if quantized[j] or ops[j] is not None:
                continue
            if ops[i] is not None:
                if not _feeds_quantize(graph, node.output[0]):
                    continue  # a float output: no INT8 fusion to enable
                reason = (
                    f"put Q/DQ on the skip input '{node.input[j]}' so "
                    f"TensorRT fuses {ops[i].op_type} '{graph.name(ops[i])}' "
                    "and this Add into one INT8 kernel (the Add's output is "
                    "quantized next)."
                )
            elif quantized[i]:
                reason = (
                    f"input '{node.input[i]}' is quantized but "
                    f"'{node.input[j]}' is not: quantize both or neither."
                )
            else:
                continue
            yield Finding("residual_add", graph.name(node), reason, "warning")
            break


def _rule_sparsity(graph):
    if graph.check_sparsity is False:
        return
    for op, weight, array, axis in sparsity_candidates(graph):
        bad, total = bad_groups(array, axis)
        zeros = float(np.mean(array == 0))
        if bad == 0 or (graph.check_sparsity == "auto" and zeros < 0.4):
            continue
        looks = f"looks pruned ({zeros:.0%} zeros) but " if zeros >= 0.4 else ""
        yield Finding(
            "sparsity_2_4",
            graph.name(op),
            f"weight '{weight}' {looks}breaks 2:4: {bad} of {total} groups of "
            f"4 input channels (axis {axis}) have more than 2 non-zeros; "
            "prune with keras_mp.StructuredSparsity and keep its mask.",
        )


def _rule_blocks(graph):
    return rule_blocks(graph, Finding)


RULES = [
    _rule_qoperator,
    _rule_blocks,
    _rule_zero_point,
    _rule_scale,
    _rule_per_channel,
    _rule_weight_dq_direct,
    _rule_partial_quantization,
    _rule_float_weighted_ops,
    _rule_output_qdq,
    _rule_residual_add,
    _rule_sparsity,
]
