"""One row per Keras layer type: what every feature needs to know of it.

Quantization reads which weights get fake-quantized (and their
output-channel axes) and which inputs get a Q/DQ; sparsity reads the
input-channel axis that 2:4 groups run along and the constraint that holds
the mask; channel permutation reads whether a layer passes channels through;
mixed precision reads which types stay in float32. The support matrix page
(`docs/support_matrix.md`, with the kernel layouts the axes refer to) is
generated from this table. A new layer type is one row here plus one entry
in `SAMPLES` of `tests/test_layer_table.py`.
"""

import dataclasses
import math

import keras

from keras_mp import _keras

L = keras.layers

# Which inputs of a layer get a Q/DQ (TensorRT's placement rules).
ALL_INPUTS = "all"  # weighted layers (Q/DQ on inputs, never on outputs)
SKIP_INPUTS = "skip"  # residual Add: the inputs not fused with a conv
NO_INPUTS = "none"

# Roles in a channel permutation (sparsity/permutation.py).
GEMM = "gemm"  # its kernel's input and output channels can be reordered
CONSUMER = "consumer"  # only its input channels can be reordered
CHANNELWISE = "channelwise"  # output channel c depends on input channel c


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight of a layer type.

    Attributes:
        attr: str. The layer attribute holding the variable.
        out_axes: tuple of int. Kernel axes whose product is the output
            channel (per-channel ranges run over them, flattened row-major
            in this order: the order of the layer's output); `()` for one
            range per tensor.
        in_axis: int or None. The input-channel (GEMM reduction) axis that
            2:4 groups run along; None when the weight cannot be pruned.
        constraint: str. The layer attribute holding its constraint.
    """

    attr: str
    out_axes: tuple = ()
    in_axis: int = None
    constraint: str = None


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """What keras_mp knows of one layer type.

    Attributes:
        weights: tuple of `Weight`, the ones quantization fake-quantizes.
        inputs: str. Default Q/DQ placement: `"all"`, `"skip"`, `"none"`.
        quantizable: bool. `quantize_model` may wrap it.
        weighted: bool. TensorRT runs it as a Conv/MatMul (a Q/DQ-fusable
            producer for a following residual Add).
        prune: `Weight` or None. The weight 2:4 sparsity prunes.
        not_prunable: str. Why a type with weights cannot be pruned.
        permute: str. Its channel-permutation role, or "" for none.
        float32: bool. Mixed precision keeps it in float32.
        separable: bool. Depthwise then pointwise convolution: the
            pointwise input (the depthwise output) gets a Q/DQ of its own.
        attention: bool. An attention layer: its attention matmuls get
            Q/DQ on their inputs (`QuantizeConfig(attention=False)` keeps
            them float); its projections, if any, are layers that quantize
            their own inputs.
        matmul: bool. A matmul of two activations (`Dot`): both operands
            get a Q/DQ, unless `QuantizeConfig(dot=False)` keeps it float.
        op_sites: bool. Quantized at the op calls of its own code
            (`quantization/op_sites.py`), not by the row's weights and
            inputs.
        qdq_role: str or None. How TensorRT treats a Q/DQ on the input of
            this non-weighted layer (`placement.qdq_role` reads it, the
            lint has the same facts as ONNX op types): `"commuting"` (max
            pooling: the Q/DQ moves across it), `"same_scale"`
            (Concatenate: its inputs' DQs move across it only when they
            share one scale, so its input Q/DQ share one range), `"fused"`
            (average pooling: an INT8 kernel only when its output is
            quantized too), or None.
    """

    weights: tuple = ()
    inputs: str = NO_INPUTS
    quantizable: bool = False
    weighted: bool = False
    prune: Weight = None
    not_prunable: str = ""
    permute: str = ""
    float32: bool = False
    separable: bool = False
    attention: bool = False
    matmul: bool = False
    op_sites: bool = False
    qdq_role: str = None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A feature's decision for one layer: `value` when it applies, else
    the `reason` it does not (`ok` is False)."""

    value: object = None
    reason: str = ""

    @property
    def ok(self):
        return not self.reason


def _conv(kernel="kernel", out=(-1,), prune_axis=-2, constraint=None):
    weight = Weight(
        kernel, out, prune_axis, constraint or f"{kernel}_constraint"
    )
    return LayerRow(
        weights=(weight,),
        inputs=ALL_INPUTS,
        quantizable=True,
        weighted=True,
        prune=weight,
        permute=GEMM,
    )


_DEPTHWISE = dataclasses.replace(
    _conv(out=(-2, -1), prune_axis=None),
    prune=None,
    not_prunable="depthwise conv: one input channel per output, no channel "
    "group",
    permute="",
)
_SEPARABLE = LayerRow(
    weights=(
        Weight("depthwise_kernel", (-2, -1)),
        Weight("pointwise_kernel", (-1,), -2, "pointwise_constraint"),
    ),
    inputs=ALL_INPUTS,
    quantizable=True,
    weighted=True,
    prune=Weight("pointwise_kernel", (-1,), -2, "pointwise_constraint"),
    separable=True,
)
_TRANSPOSE = dataclasses.replace(
    _conv(out=(-2,), prune_axis=-1), permute=CONSUMER
)
# Pooling runs in INT8 when its input is quantized, but TensorRT moves the
# next layer's Q/DQ across max pooling by itself: off by default (extra Q/DQ
# only add latency), on with `QuantizeConfig(quantize_inputs=True)`. Max
# pooling commutes with quantization; average pooling runs in INT8 only
# with its output quantized too (`placement.py` has TensorRT's source).
_MAX_POOL = LayerRow(
    quantizable=True, permute=CHANNELWISE, qdq_role="commuting"
)
_AVERAGE_POOL = dataclasses.replace(_MAX_POOL, qdq_role="fused")
# Keras' attention layers (MultiHeadAttention and its subclasses,
# GroupQueryAttention, Attention, AdditiveAttention): their attention
# matmuls are quantized at their op sites (`op_sites`: the matmuls,
# einsums and `dot_product_attention` of Keras' code), their projections
# as EinsumDense rows of their own, each with its input Q/DQ (tf2onnx
# merges the identical Q/DQ of one tensor: self-attention shows one).
# `weighted`: the output comes from a GEMM (probs @ value), as the lint
# sees it.
_OP_SITES_ATTENTION_ROW = LayerRow(
    inputs=NO_INPUTS,
    quantizable=True,
    weighted=True,
    attention=True,
    op_sites=True,
)
# TensorRT moves the next weighted layer's input Q backwards across a
# Concatenate into its producers; Q/DQ on its own inputs only add
# requantizations: off by default, as for pooling. Its input DQs move
# across it only when their scales are equal: its input Q/DQ, when asked
# for, share one range.
_CONCAT = LayerRow(quantizable=True, qdq_role="same_scale")
# A matmul of two activations (DLRM's feature interactions): TensorRT runs
# it in INT8 when both inputs come from a DQ, as an attention matmul; the
# matmul of Keras' code is quantized at its op site, after a `normalize`.
# `weighted`: its output comes from a GEMM, as the lint sees it.
_DOT = LayerRow(
    inputs=NO_INPUTS,
    quantizable=True,
    weighted=True,
    matmul=True,
    op_sites=True,
)
_CHANNEL_WISE = LayerRow(permute=CHANNELWISE)
_FLOAT32 = LayerRow(float32=True)


def _einsum_parts(equation):
    """`(input, kernel, output)` subscripts of an EinsumDense equation,
    broadcast dimensions (`...`) dropped."""
    inputs, output = equation.replace("...", "").split("->")
    x_spec, kernel_spec = inputs.split(",")
    return x_spec, kernel_spec, output


def _einsum_channel_axes(x_spec, kernel_spec, output):
    """The kernel axes an EinsumDense's output channels run over, in the
    order of the output: the kernel axes that reach the output, when none
    is also an input axis and they sit side by side in the output (the
    axis tf2onnx's MatMul weight flattens them into: `(hidden, heads,
    head_dim)` of "abc,cde->abde" becomes `(hidden, heads * head_dim)`,
    and so does `(heads, hidden, head_dim)` of "btd,ndh->btnh"); `()`
    (per-tensor) otherwise."""
    letters = "".join(c for c in output if c in kernel_spec)
    if len(letters) > 1 and (
        letters not in output or any(c in x_spec for c in letters)
    ):
        return ()
    return tuple(kernel_spec.index(c) for c in letters)


def _einsum_row(layer):
    """EinsumDense: per-channel over the kernel axes that reach the output,
    flattened in the output's order (a Q/K/V projection `(hidden, heads,
    head_dim)` gets `heads * head_dim` ranges, like the ONNX MatMul weight
    `(hidden, heads * head_dim)` TensorRT sees); per-tensor when those axes
    are not side by side in the output or one is also an input axis. 2:4
    groups run along the last kernel axis contracted with the input."""
    x_spec, kernel_spec, output = _einsum_parts(layer.equation)
    contracted = [c for c in kernel_spec if c in x_spec and c not in output]
    weight = Weight(
        "kernel",
        _einsum_channel_axes(x_spec, kernel_spec, output),
        kernel_spec.index(contracted[-1]) if contracted else None,
        "kernel_constraint",
    )
    return LayerRow(
        weights=(weight,),
        inputs=ALL_INPUTS,
        quantizable=True,
        weighted=True,
        prune=weight if contracted else None,
        not_prunable=""
        if contracted
        else f"EinsumDense equation '{layer.equation}' contracts no kernel "
        "axis with the input",
    )


TABLE = {
    L.Conv1D: _conv(),
    L.Conv2D: _conv(),
    L.Conv3D: _conv(),
    L.Conv1DTranspose: _TRANSPOSE,
    L.Conv2DTranspose: _TRANSPOSE,
    L.Conv3DTranspose: _TRANSPOSE,
    L.DepthwiseConv1D: _DEPTHWISE,
    L.DepthwiseConv2D: _DEPTHWISE,
    L.SeparableConv1D: _SEPARABLE,
    L.SeparableConv2D: _SEPARABLE,
    L.Dense: _conv(prune_axis=0),
    L.EinsumDense: _einsum_row,
    L.MultiHeadAttention: _OP_SITES_ATTENTION_ROW,
    L.GroupQueryAttention: _OP_SITES_ATTENTION_ROW,
    L.Attention: _OP_SITES_ATTENTION_ROW,
    L.AdditiveAttention: _OP_SITES_ATTENTION_ROW,
    L.Add: LayerRow(inputs=SKIP_INPUTS, quantizable=True),
    L.Concatenate: _CONCAT,
    L.Dot: _DOT,
    # every pooling of every rank, global or not: one row per kind, so
    # `quantize_inputs=True` means the same on each
    **{
        getattr(L, f"{kind}Pooling{rank}D"): row
        for prefix, row in (("Max", _MAX_POOL), ("Average", _AVERAGE_POOL))
        for kind in (prefix, f"Global{prefix}")
        for rank in (1, 2, 3)
    },
    **dict.fromkeys(
        (
            L.Activation,
            L.ReLU,
            L.LeakyReLU,
            L.ELU,
            L.Dropout,
        ),
        _CHANNEL_WISE,
    ),
    L.BatchNormalization: dataclasses.replace(_FLOAT32, permute=CHANNELWISE),
    **dict.fromkeys(
        (
            L.LayerNormalization,
            L.GroupNormalization,
            L.UnitNormalization,
            L.Normalization,
            L.Softmax,
        ),
        _FLOAT32,
    ),
}

# Activation functions mixed precision keeps in float32, as layer types.
FLOAT32_ACTIVATIONS = ("softmax", "log_softmax")


def row_for(layer):
    """The `LayerRow` of `layer`'s type (its closest listed base class), or
    None when the table does not know the type (a custom layer, keras-hub's
    attention layers: the GEMMs of their own code are quantized at their
    op sites, `quantization/op_sites.py`)."""
    for cls in type(layer).__mro__:
        row = TABLE.get(cls)
        if row is not None:
            return row(layer) if callable(row) else row
    return None


def float_attention_note(layer):
    """Why the attention matmuls of float (not quantized) `layer` run in
    float, or "" when it is not an attention layer: a keras-hub attention
    row or Keras' GroupQueryAttention, Attention, AdditiveAttention left
    out, or a layer named `...Attention...` with sublayers or
    weights whose type the table does not know, and no `...Attention...`
    sublayer (a block such as DeBERTaV3's `DisentangledAttentionEncoder`:
    its attention is the sublayer's row)."""
    row = row_for(layer)
    if row is not None:
        if row.attention and row.inputs == NO_INPUTS:
            note = (
                "attention matmuls run in float: not selected, or "
                "QuantizeConfig(attention=False)"
            )
            if _keras.sublayers(layer):
                note += "; its projections are listed on their own rows"
            return note
        return ""
    name = type(layer).__name__
    inner = _keras.sublayers(layer)
    holds = inner or _keras.own_variables(layer)
    if any("Attention" in type(sub).__name__ for sub in inner):
        return ""
    if "Attention" in name and holds:
        return f"attention matmuls run in float: {name} not supported"
    return ""


def quantizable_names():
    """Names of the layer types `quantize_model` can wrap, sorted."""
    return sorted(
        cls.__name__
        for cls, row in TABLE.items()
        if callable(row) or row.quantizable
    )


def prunable_weight(layer):
    """`Verdict` whose value is the `Weight` 2:4 sparsity prunes."""
    row = row_for(layer)
    if row is None or (row.prune is None and not row.not_prunable):
        return Verdict(
            reason=f"{type(layer).__name__} is not a supported layer type"
        )
    if row.prune is None:
        return Verdict(reason=row.not_prunable)
    return Verdict(row.prune)


def output_channels(layer, kernel):
    """Output channels (GEMM N) of a prunable kernel: for EinsumDense, the
    kernel axes that reach the output and are not in the input."""
    if isinstance(layer, L.EinsumDense):
        x_spec, kernel_spec, output = _einsum_parts(layer.equation)
        return math.prod(
            size
            for c, size in zip(kernel_spec, kernel.shape)
            if c in output and c not in x_spec
        )
    weight = row_for(layer).prune
    return math.prod(kernel.shape[a] for a in weight.out_axes)


def keeps_float32(layer):
    """Whether the AMP rules keep `layer` in float32 by its type or its
    activation (normalizations, softmax)."""
    row = row_for(layer)
    if row is not None and row.float32:
        return True
    activation = getattr(layer, "activation", None)
    name = getattr(activation, "__name__", activation)
    return name in FLOAT32_ACTIVATIONS
