"""Where the Q/DQ go: every placement decision of keras_mp, in one place.

TensorRT's explicit-quantization rules (`docs/quantization.md`): Q/DQ on
the inputs of weighted layers (per the layer table's row, or a
`QuantizeConfig` override); on a residual Add, the inputs TensorRT cannot
fuse into the convolution before it; none on Concatenate and pooling (the
consumer's Q moves across them); attention layers own one Q/DQ per
distinct input tensor, and the projections inside them take theirs from
the attention layer; a `Dot` (a matmul of two activations) gets one on
each input unless `QuantizeConfig(dot=False)`; a layer called more than
once shares one input range.
The ONNX lint (`keras_mp/onnx/rules.py`) checks the exported graph with the
same fusibility facts (`fusable_producer` and `RESIDUAL_FOLDED_OPS`, and
which ops TensorRT moves Q/DQ across or fuses them into: `COMMUTING_OPS`,
`SCALE_COMMUTING_OPS`, `FUSED_OPS`, `qdq_role`, and the ops that only move
values: `LAYOUT_OPS`, `DATA_MOVEMENT_OPS`); the lint and the cost model
(`keras_mp.precision.cost`) read the small-GEMM rule (`gemm_too_small`)
here too. Per-format facts (FP8's convolution limits, per-tensor FP8
convolution weights, the fixed FP8 softmax range) are fields of the
`formats.FORMATS` rows.
"""

import warnings

import keras

from keras_mp import _keras, layer_table
from keras_mp.layer_table import ALL_INPUTS, NO_INPUTS, SKIP_INPUTS
from keras_mp.quantization import op_probe
from keras_mp.quantization.activation import quantizable_row
from keras_mp.quantization.formats import FORMATS, number_format

# How TensorRT treats the non-weighted ops around a Q/DQ (TensorRT Developer
# Guide, "Explicit Quantization" > "TensorRT Processing of Q/DQ Networks"
# and "Q/DQ Limitations",
# https://docs.nvidia.com/deeplearning/tensorrt/latest/inference-library/quantized-types-explicit-quantization.html):
# - it propagates each Q backwards and each DQ forwards across ops that
#   commute with (de)quantization, Q(op(x)) == op(Q(x)): max pooling (the
#   guide's example) and the layout ops (`keras_mp.onnx.graph.LAYOUT_OPS`);
# - Concat commutes with a Q always, but the DQs of its inputs move past it
#   only when they share one scale (rewrites that compare the scales of two
#   or more Q/DQ happen only when they are equal; ModelOpt's ONNX PTQ groups
#   a Concat's input Q/DQ under one scale for this, its "concat_elimination"
#   pass, `get_concat_eliminated_tensors`);
# - "quantizable" non-weighted ops that do not commute (average pooling, the
#   guide's example; ModelOpt's INT8 PTQ also quantizes GlobalAveragePool)
#   fuse DQ -> op -> Q into one INT8 kernel, and only then: "non-weighted
#   layers that have INT8 inputs also require INT8 outputs".
# ONNX op types, read by the lint; `qdq_role` gives the same for a layer.
COMMUTING_OPS = frozenset({"MaxPool", "GlobalMaxPool"})
SCALE_COMMUTING_OPS = frozenset({"Concat"})
FUSED_OPS = frozenset({"AveragePool", "GlobalAveragePool"})
# Ops that only move or relabel values (ONNX op types): they may stand
# between a weight and its op in a float graph, but not between a weight's
# DQ and its op (`keras_mp.onnx.graph` re-exports them for export's weight
# folding and the lint).
LAYOUT_OPS = frozenset(
    {"Transpose", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten"}
)
# Ops that only move, pick or repeat values (ONNX op types; the layout ops
# and these; Gather: a DLRM's upper triangle of its interactions). A DQ
# that reaches a Q or a weighted op across them is not wasted even where it
# does not commute (a Concat of inputs with different scales): DQ -> op -> Q
# runs as one INT8 op ("non-weighted layers that have INT8 inputs also
# require INT8 outputs"), so the producer before the DQ writes INT8. The
# lint follows them for `output_qdq` and `residual_add`.
DATA_MOVEMENT_OPS = LAYOUT_OPS | frozenset(
    "Concat Split Slice Pad Resize Tile Gather".split()
)
# Residual Add: what TensorRT folds into the weighted op before the Add it
# fuses (TensorRT Developer Guide, "Q/DQ Layer-Placement Recommendations"):
# BatchNormalization, as a Keras layer (`fusable_producer`) and as ONNX op
# types (the lint's `_from_quantized_weighted_op`). An activation between
# them blocks the fusion (the Add comes before any activation in the
# fused kernel).
RESIDUAL_FOLDED_LAYERS = (keras.layers.BatchNormalization,)
RESIDUAL_FOLDED_OPS = frozenset({"BatchNormalization"})


def qdq_role(layer):
    """How TensorRT treats a Q/DQ on the input of non-weighted `layer`:
    its layer-table row's `qdq_role`.

    Returns:
        `"commuting"` (max pooling: TensorRT moves the Q/DQ across it),
        `"same_scale"` (Concatenate: the DQs of its inputs move across it
        only when they share one scale), `"fused"` (average pooling: an
        INT8 kernel only when its output is quantized too), or None.
    """
    row = layer_table.row_for(layer)
    return None if row is None else row.qdq_role


# What `quantization_report` says of a quantized layer with a `qdq_role`
# (its input Q/DQ come from `QuantizeConfig(quantize_inputs=True)`).
ROLE_NOTES = {
    "commuting": (
        "input Q/DQ asked for: TensorRT moves it across this max pooling "
        "to the next quantized op"
    ),
    "same_scale": (
        "input Q/DQ asked for: one range for all inputs (TensorRT moves "
        "their DQs across a Concat only when the scales are equal)"
    ),
    "fused": (
        "input Q/DQ asked for: INT8 average pooling only when its output "
        "is quantized too (quantize the next layer's input)"
    ),
}


def fusable_producer(layer):
    """True when TensorRT can fuse `layer`'s output into a following Add:
    a weighted layer with no activation of its own (the Add comes before
    any activation in the fused kernel), optionally through
    BatchNormalization (`RESIDUAL_FOLDED_LAYERS`). The lint's
    `_from_quantized_weighted_op` walks the same path in the ONNX graph
    (`RESIDUAL_FOLDED_OPS`, no activation op)."""
    if isinstance(layer, RESIDUAL_FOLDED_LAYERS):
        nodes = _keras.inbound_nodes(layer)
        tensors = nodes[0].input_tensors if nodes else []
        parents = [_keras.producer(t) for t in tensors]
        return any(p is not None and fusable_producer(p) for p in parents)
    row = layer_table.row_for(layer)
    if row is None or not row.weighted:
        return False
    activation = getattr(layer, "activation", None)
    return activation is None or activation is keras.activations.linear


def skip_indices(layer):
    """Residual Add: Q/DQ on the inputs TensorRT cannot fuse, when at least
    one input comes from a weighted layer; none otherwise (and none for an
    Add that is not a node of a layer graph: its producers are unknown)."""
    nodes = _keras.inbound_nodes(layer)
    if not nodes:
        return []
    producers = [_keras.producer(t) for t in nodes[0].input_tensors]
    fusable = [p is not None and fusable_producer(p) for p in producers]
    if not any(fusable):
        return []
    # TensorRT fuses the Add into a GEMM whose output feeds the Add only;
    # one that also feeds other layers (a transformer's residual stream)
    # keeps its output, so its tensor is the skip input.
    alone = [
        i
        for i, p in enumerate(producers)
        if fusable[i] and len(_keras.outbound_nodes(p)) == 1
    ]
    fused = alone[0] if alone else fusable.index(True)
    return [i for i in range(len(producers)) if i != fused]


def _input_count(layer):
    """How many tensors the layer's first input holds (merge layers)."""
    nodes = _keras.inbound_nodes(layer)
    if nodes:
        return len(nodes[0].input_tensors)
    shape = (layer.get_build_config() or {}).get("input_shape")
    if isinstance(shape, (list, tuple)) and any(
        isinstance(s, (list, tuple)) for s in shape
    ):
        return len(shape)
    return 1


def inputs_refused(layer, row, config):
    """Why `QuantizeConfig(quantize_inputs=True)` puts no Q/DQ on the
    inputs of `layer`, or "" (`input_placement` gives them)."""
    if not config.quantize_inputs:
        return ""
    if config.blocked and (_gemm_layer(layer) or not row.weights):
        return (
            f"{_label(config)} is weight-only: the inputs stay "
            "in the layer's float dtype"
        )
    if row.matmul and not config.dot:
        return "QuantizeConfig(dot=False) keeps this matmul float"
    return ""


def input_placement(layer, row, config):
    """The input indices of a leaf layer that get a Q/DQ (none for a
    matmul of two activations kept float by `QuantizeConfig(dot=False)`,
    none of a weight-only precision: `inputs_refused` says why)."""
    placement = row.inputs
    if config.blocked and not row.weights:
        return []  # TensorRT quantizes block formats into GEMMs only
    if config.blocked and _gemm_layer(layer):
        if not config.block_inputs or block_inputs_refused(layer, config):
            # weight-only: inputs stay in the layer's float dtype (a
            # convolution takes INT8, its input Q/DQ included:
            # `layer_format`)
            return []
    if config.quantize_inputs is not None:
        placement = ALL_INPUTS if config.quantize_inputs else NO_INPUTS
    if row.matmul and not config.dot:
        return []
    if placement == ALL_INPUTS:
        return list(range(_input_count(layer)))
    if placement == SKIP_INPUTS:
        return skip_indices(layer)
    return []


# TensorRT's FP8 convolution limits, read from the `fp8` row of `FORMATS`
# (`conv_min_channels`, `conv_max_taps`; sources there).
FP8_MIN_CHANNELS = FORMATS["float8"].conv_min_channels
FP8_MAX_TAPS = FORMATS["float8"].conv_max_taps


def _is_conv(layer):
    return hasattr(layer, "kernel_size")


def conv_limit(layer, fmt):
    """Why TensorRT has no kernel in format `fmt` (a `FORMATS` name or
    row) for convolution `layer`, or "": the row's `conv_min_channels`
    and `conv_max_taps`. ONNX counts a depthwise filter's input channels
    per group: 1."""
    row = number_format(fmt)
    if not row.conv_limited:
        return ""
    name = row.label
    for weight in quantizable_row(layer).weights:
        shape = tuple(getattr(layer, weight.attr).shape)
        taps = 1
        for size in shape[:-2]:
            taps *= int(size)
        depthwise = "depthwise" in weight.attr
        channels = (1 if depthwise else int(shape[-2]), int(shape[-1]))
        if min(channels) <= row.conv_min_channels:
            return (
                f"{name} asked, INT8 here: a convolution with "
                f"{min(channels)} channels {'per group ' if depthwise else ''}"
                f"(TensorRT has {name} convolutions above "
                f"{row.conv_min_channels} channels in and out)"
            )
        if row.conv_max_taps is not None and taps > row.conv_max_taps:
            return (
                f"{name} asked, INT8 here: a {taps}-tap filter (TensorRT has "
                f"{name} convolutions up to {row.conv_max_taps} taps)"
            )
    return ""


# The block-scaled formats are weight-only on MatMul/Gemm here (TensorRT:
# INT4 weight-only on GEMMs; `FORMATS` rows' `tensorrt_ops`): a Dense or
# EinsumDense kernel takes them; a convolution, or a weight in a layer's
# own code (op sites), takes INT8 (ModelOpt's INT4 configs leave
# convolutions to INT8/FP8 too); matmuls of two activations stay float.
def _more(names, shown):
    """`" and N more"` for a list cut at `shown` names, or ""."""
    return f" and {len(names) - shown} more" if len(names) > shown else ""


def _label(config):
    """The name of `config`'s format in messages (`"NVFP4"`, `"FP8"`)."""
    return number_format(config.precision).label


def _blocked_note(config):
    return (
        f"{_label(config)} asked, INT8 here: TensorRT runs "
        f"{_label(config)} on MatMul/Gemm weights only "
        "(weight-only); keras_mp blocks Dense and EinsumDense kernels"
    )


def _gemm_layer(layer):
    return isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))


def layer_format(layer, config):
    """`(format name, note)`: the `FORMATS` row `layer`'s quantizers use
    under `config`, and why it is not the one `config` asks for ("" when
    it is). A convolution TensorRT cannot run in FP8 takes INT8, and so
    does a layer other than Dense/EinsumDense asked for INT4; an NVFP4 or
    MXFP8 GEMM whose input TensorRT cannot block quantizes its weights
    only (`block_inputs_refused`)."""
    if config.blocked and not _gemm_layer(layer):
        return "int8", _blocked_note(config)
    if config.blocked:
        return config.format, block_inputs_refused(layer, config)
    if _is_conv(layer):
        reason = conv_limit(layer, config.format)
        if reason:
            return "int8", reason
    return config.format, ""


def weight_axes(layer, weight, config):
    """The output-channel axes of `weight`'s range: its row's with
    `per_channel`, except for convolutions in a format whose convolution
    weights are per tensor (FP8: `conv_weights_per_tensor`), else `()`."""
    if not config.per_channel:
        return ()
    fmt = number_format(layer_format(layer, config)[0])
    if fmt.conv_weights_per_tensor and _is_conv(layer):
        return ()
    return weight.out_axes


def weight_blocks(layer, weight, config):
    """`(block_size, K axes)` of `weight` for a blocked INT4 quantizer, or
    None for a per-channel/per-tensor one: the kernel axes of a Dense or
    EinsumDense that are not output channels."""
    if not config.blocked or not _gemm_layer(layer):
        return None
    rank = len(getattr(layer, weight.attr).shape)
    if isinstance(layer, keras.layers.EinsumDense):
        x_spec, kernel_spec, output = layer_table._einsum_parts(layer.equation)
        k_axes = tuple(
            i
            for i, c in enumerate(kernel_spec)
            if c in x_spec and c not in output
        )
    else:
        out = {a % rank for a in weight.out_axes}
        k_axes = tuple(a for a in range(rank) if a not in out)
    return config.block_size, k_axes


def check_blocks(layer, path, config):
    """A ValueError, before anything is quantized, when a Dense or
    EinsumDense selected for a block format has a K that
    `config.block_size` does not divide, naming the layer, K and the block
    sizes that fit; with block-scaled inputs (NVFP4/MXFP8), also when the
    input's last axis is not a summed axis the block size divides."""
    row = quantizable_row(layer)
    if row is None or row.op_sites:
        return
    for weight in row.weights:
        blocks = weight_blocks(layer, weight, config)
        if blocks is None:
            continue
        shape = getattr(layer, weight.attr).shape
        k = 1
        for a in blocks[1]:
            k *= int(shape[a])
        if k % blocks[0]:
            sizes = FORMATS[config.format].block_sizes
            fits = [b for b in sizes if k % b == 0]
            raise ValueError(
                f"Layer {path!r}: its {weight.attr} has K={k}, not a "
                f"multiple of block_size={blocks[0]} (TensorRT reads a "
                "blocked weight without a shorter last block). Block sizes "
                f"that divide K: {fits or 'none'} of {list(sizes)}; give "
                f"this layer QuantizeConfig(precision={config.precision!r}, "
                "block_size=...) "
                "with one of them, or another precision. Nothing was "
                "quantized."
            )


def block_inputs_refused(layer, config):
    """Why the input of `layer` takes no NVFP4/MXFP8 Q/DQ under `config`
    (the layer quantizes its weights only), or "". TensorRT's
    DynamicQuantize blocks a GEMM input along its last axis (ModelOpt
    exports `axis=-1`): that axis must be the one K the GEMM sums over and
    a multiple of the block size. An EinsumDense summing over more axes
    (an attention output projection, `abcd,cde->abe`) is exported as a
    Transpose and Reshape into K, where that pattern cannot sit."""
    if not (config.block_inputs and _gemm_layer(layer)):
        return ""
    shape = (layer.get_build_config() or {}).get("input_shape")
    k = shape[-1] if isinstance(shape, (list, tuple)) and shape else None
    why = ""
    if isinstance(layer, keras.layers.EinsumDense):
        x_spec, kernel_spec, output = layer_table._einsum_parts(layer.equation)
        summed = [c for c in x_spec if c in kernel_spec and c not in output]
        if x_spec[-1] not in summed:
            why = (
                f"its input's last axis is not summed over ({layer.equation!r})"
            )
        elif len(summed) > 1:
            why = (
                f"it sums over {len(summed)} input axes ({layer.equation!r}), "
                "which the ONNX graph transposes and reshapes into K"
            )
    if not why and isinstance(k, int) and k % config.block_size:
        why = (
            f"its input's last axis has {k} values, not a multiple of "
            f"block_size={config.block_size}"
        )
    if not why:
        return ""
    return (
        f"{_label(config)} weights only here: {why} (TensorRT's "
        "DynamicQuantize blocks a GEMM input along its last axis)"
    )


# TensorRT's INT8 and FP8 GEMM kernels are no faster than float when K or N
# is below 16 (ModelOpt's ONNX PTQ, `graph_utils.py`
# `find_nodes_from_matmul_to_exclude`, `_MIN_MATMUL_DIM = 16`): such a
# Dense or EinsumDense gets no Q/DQ (a 10-class head stays float).
MIN_GEMM_DIM = 16


def gemm_too_small(k, n):
    """Whether a GEMM with reduction size `k` and `n` output channels is
    below the small-GEMM rule (`MIN_GEMM_DIM`; a size None, unknown, is
    not small): the one test placement, the lint (`float_weighted_ops`)
    and the cost model apply."""
    return any(d is not None and d < MIN_GEMM_DIM for d in (k, n))


def small_gemm(layer):
    """Why the Dense or EinsumDense `layer` is too small for a quantized
    GEMM (K or N below `MIN_GEMM_DIM`), or ""."""
    if not isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
        return ""
    kernel = getattr(layer, "kernel", None)
    if kernel is None or not layer.built:
        return ""
    size = 1
    for dim in kernel.shape:
        size *= int(dim)
    if isinstance(layer, keras.layers.EinsumDense):
        n = layer_table.output_channels(layer, kernel)
    else:
        n = int(kernel.shape[-1])
    k = size // max(n, 1)
    if not gemm_too_small(k, n):
        return ""
    # `QuantizeConfig(small_gemms=True)` quantizes it anyway
    return (
        f"GEMM with K={k}, N={n}: no Q/DQ below {MIN_GEMM_DIM} (TensorRT's "
        "INT8/FP8 kernels are no faster than float there; ModelOpt skips "
        "them too)"
    )


def site_float(site, config, row=None):
    """Why an op site (`op_sites`) of a layer's own code stays float, or
    "": the small-GEMM rule for a GEMM with a weight, `config.attention`
    for a matmul of two activations or an attention op (`config.dot` in a
    layer of a `matmul` row: `Dot`), and nothing float to quantize."""
    roles = [spec["role"] for spec in site["operands"]]
    if not any(roles):
        return "no float operand"
    if config.blocked and "weight" not in roles:
        return (
            f"{_label(config)} is weight-only here: a matmul of "
            "two activations stays float"
        )
    if not site.get("gemm", True):
        return "sums over nothing (an outer or elementwise product): no GEMM"
    for spec in site["operands"]:
        if spec["role"] != "weight":
            continue
        k, n = op_probe.gemm_size(spec["shape"], spec["axes"])
        if gemm_too_small(k, n) and not config.small_gemms:
            return (
                f"GEMM with K={k}, N={n}: no Q/DQ below {MIN_GEMM_DIM} "
                "(TensorRT's INT8/FP8 kernels are no faster there)"
            )
        return ""
    if row is not None and row.matmul:
        if not config.dot:
            return "matmul of two activations: QuantizeConfig(dot=False)"
        return ""
    if not config.attention:
        return "matmul of two activations: QuantizeConfig(attention=False)"
    return ""


def fixed_range(fmt, matmul_input):
    """The range of an attention matmul input no calibration changes, or
    None: a softmax output (`"probs"`, in [0, 1]) in a format with a
    `fixed_softmax_amax` takes it (FP8: 1.0, the fixed scale 1/448 of
    ModelOpt's FP8 transformer recipe)."""
    if matmul_input == "probs":
        return number_format(fmt).fixed_softmax_amax
    return None


def decide(walked, choices, calls):
    """The Q/DQ placement of the selected layers of a float model.

    Args:
        walked: `_models.walk(model)`.
        choices: `{walk index: QuantizeConfig}` of the selected layers.
        calls: `{id(layer): number of calls}` a probe run saw (empty when
            the model could not run). A selected layer the probe saw no
            call of gets no quantizer.

    Returns:
        `[(walk index, inputs, number of calls)]` of the layers that get a
        quantizer: `inputs` the input indices with a Q/DQ. Warns once, naming
        the shared layers (one input range for all their calls).
    """
    decided, shared, unused, small, refused = [], [], [], [], []
    weights_only = []
    for index, config in sorted(choices.items()):
        layer, _ = walked[index]
        row = quantizable_row(layer)
        if calls and not calls.get(id(layer)):
            # built but never called (DepthAnything's first fusion stage
            # has no residual): no tensor to calibrate, nothing in a graph
            unused.append(layer.name)
            continue
        count = max(1, calls.get(id(layer), 1))
        if not config.small_gemms and small_gemm(layer):
            small.append(layer.name)
            continue  # stays float; `quantization_report` says why
        inputs = input_placement(layer, row, config)
        if block_inputs_refused(layer, config):
            weights_only.append(layer.name)
        why = inputs_refused(layer, row, config)
        if why:
            refused.append(f"{layer.name} ({why})")
        if not row.weights and not inputs:
            continue
        if count > 1 and inputs:
            shared.append(layer.name)
        decided.append((index, inputs, count))
    if shared:
        warnings.warn(
            f"Layers called more than once (shared weights): "
            f"{', '.join(shared)}. Each gets one input Q/DQ whose range "
            "covers all its calls (one scale for every call); "
            "`quantization_report` marks them shared.",
            stacklevel=5,
        )
    if refused:
        warnings.warn(
            "QuantizeConfig(quantize_inputs=True) puts no input Q/DQ on: "
            f"{', '.join(refused)}.",
            stacklevel=5,
        )
    if weights_only:
        warnings.warn(
            "NVFP4/MXFP8 quantize the weights only of "
            f"{', '.join(weights_only[:8])}{_more(weights_only, 8)}: "
            "TensorRT's DynamicQuantize cannot block their inputs "
            "(`quantization_report` says why for each).",
            stacklevel=5,
        )
    if unused:
        warnings.warn(
            f"Layers the model did not call when run on zeros stay float "
            f"(no data would calibrate them): {', '.join(unused[:8])}"
            f"{f' and {len(unused) - 8} more' if len(unused) > 8 else ''}. "
            "A layer the model calls only on other inputs stays float too.",
            stacklevel=5,
        )
    return decided
