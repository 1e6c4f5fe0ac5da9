"""Writes docs/support_matrix.md from `keras_mp.layer_table`.

Every row of the table the features read (quantization, sparsity, channel
permutation, mixed precision) becomes a row of the page;
`tests/integration/test_examples.py` fails when the committed page is stale.

    python docs/gen_support_matrix.py          # rewrite the page
    python docs/gen_support_matrix.py --check  # exit 1 when it is stale
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

from keras_mp import layer_table  # noqa: E402
from keras_mp.quantization.report import RECURRENT_NOTE  # noqa: E402
from keras_mp.sparsity.model import (  # noqa: E402
    ALIGNED_INPUT_CHANNELS,
    ALIGNED_OUTPUT_CHANNELS,
)

PAGE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "support_matrix.md"
)
EINSUM_EQUATION = "abc,cde->abde"  # MultiHeadAttention's query

# A row that depends on the layer's settings is shown for one instance. A
# new row of that kind needs a sample here: the generator stops until it has.
SAMPLES = {
    keras.layers.EinsumDense: lambda: keras.layers.EinsumDense(
        EINSUM_EQUATION, (None, 4, 8)
    ),
}
# Common layers outside the table, listed so the page says what happens to
# them too.
OTHERS = (keras.layers.Embedding, keras.layers.Flatten, keras.layers.Reshape)
INPUTS = {
    layer_table.ALL_INPUTS: "every input",
    layer_table.SKIP_INPUTS: "the skip input of a residual Add (the input "
    "not fused with a preceding conv)",
    layer_table.NO_INPUTS: "none by default; `QuantizeConfig("
    "quantize_inputs=True)` adds one on each input",
}
PERMUTE = {
    layer_table.GEMM: "input and output channels",
    layer_table.CONSUMER: "input channels",
    layer_table.CHANNELWISE: "passes the order through",
    "": "-",
}


def _axes(out_axes):
    if not out_axes:
        return "per-tensor"
    if len(out_axes) == 1:
        return f"per-channel, axis {out_axes[0]}"
    axes = " x ".join(str(a) for a in out_axes)
    return f"per-channel over axes {axes} (flattened)"


def _weights(row):
    if not row.quantizable:
        return "float"
    if not row.weights:
        return "-"
    return "; ".join(f"`{w.attr}`: {_axes(w.out_axes)}" for w in row.weights)


def _sparsity(row):
    if row.prune is not None:
        return f"`{row.prune.attr}`, input-channel axis {row.prune.in_axis}"
    return row.not_prunable or "-"


ATTENTION_WEIGHTS = (
    "its `query`, `key`, `value` and `output` EinsumDense sublayers, as "
    "EinsumDense"
)
ATTENTION_INPUTS = (
    "each projection's own input Q/DQ (tf2onnx merges those of one tensor: "
    "self-attention shows one), and at the op site of Keras' "
    "`dot_product_attention` (or its einsums, with dropout) the scaled "
    "query, the key, the softmax output and the value before the two "
    "attention matmuls (`QuantizeConfig(attention=False)` leaves those two "
    "matmuls float)"
)
ATTENTION_RUN = (
    "INT8 MatMul: the four projections and both attention matmuls "
    "(TensorRT's fused attention pattern)"
)
# Keras' other attention layers: (weights, input Q/DQ, what TensorRT runs).
ATTENTION_SWITCH = "(`QuantizeConfig(attention=False)` leaves {} float)"
OTHER_ATTENTION = {
    keras.layers.GroupQueryAttention: (
        "its `query`, `key`, `value` and `attention_output` EinsumDense "
        "sublayers, as EinsumDense",
        "each projection's own input Q/DQ; the scaled query, the key and "
        "the value (repeated to the query heads) and the softmax output "
        "before the two attention matmuls "
        + ATTENTION_SWITCH.format("those two matmuls"),
        ATTENTION_RUN,
    ),
    keras.layers.Attention: (
        "- (its optional scalar `scale` stays float)",
        "the query and the transposed key of the score matmul "
        '(`score_mode="dot"`; `"concat"` scores have no matmul), the softmax '
        "output and the value " + ATTENTION_SWITCH.format("both matmuls"),
        "INT8 MatMul: both attention matmuls (scores, probs @ value)",
    ),
    keras.layers.AdditiveAttention: (
        "- (its `scale` vector stays float)",
        "the softmax output and the value of `probs @ value` (its scores, "
        "`sum(tanh(query + key))`, have no matmul) "
        + ATTENTION_SWITCH.format("that matmul"),
        "INT8 MatMul: probs @ value",
    ),
}
SEPARABLE_INPUTS = "every input, and the pointwise convolution's input"
DOT_INPUTS = (
    "both operands of the `ops.matmul` of Keras' code (its op site), after "
    "the l2-normalization of `normalize=True` "
    "(`QuantizeConfig(dot=False)` leaves the matmul float)"
)
DOT_RUN = "INT8 MatMul of two activations (both inputs from a DQ)"
# What tf2onnx 1.17 makes of each recurrent layer (measured by
# tests/onnx/test_recurrent.py); the TensorRT column is
# `quantization_report`'s note.
RECURRENT = {
    keras.layers.LSTM: "an ONNX `LSTM` op",
    keras.layers.GRU: "an ONNX `Loop` whose body holds the cell's MatMuls",
    keras.layers.SimpleRNN: "an ONNX `Loop` whose body holds the cell's "
    "MatMuls",
    keras.layers.Bidirectional: "one bidirectional `LSTM` op for an LSTM, "
    "one `Loop` per direction otherwise",
}


def _inputs(name, spec):
    if not spec.quantizable:
        return "-"
    if spec.attention:
        return ATTENTION_INPUTS
    if spec.matmul:
        return DOT_INPUTS
    if name.startswith("SeparableConv"):
        return SEPARABLE_INPUTS
    return INPUTS[spec.inputs]


def _row(cls):
    spec = layer_table.TABLE[cls]
    name = cls.__name__
    weights_note = ""
    if callable(spec):  # the row depends on the layer's settings
        rule = " ".join(spec.__doc__.split()).removeprefix(f"{name}: ")
        spec = spec(SAMPLES[cls]())
        weights_note = f" for `{EINSUM_EQUATION}`; in general: {rule}"
    weights = ATTENTION_WEIGHTS if spec.attention else _weights(spec)
    inputs = _inputs(name, spec)
    run = "INT8 Conv / MatMul" if spec.weighted else "-"
    if spec.attention:
        run = ATTENTION_RUN
    elif spec.matmul:
        run = DOT_RUN
    if cls in OTHER_ATTENTION:
        weights, inputs, run = OTHER_ATTENTION[cls]
    if not hasattr(keras.layers, name):  # exported under another name
        public = [
            n for n in dir(keras.layers) if getattr(keras.layers, n) is cls
        ]
        name = f"{public[0]} (class `{name}`)"
    return (
        f"| {name} | {weights}{weights_note} | {inputs} | "
        f"{run} | "
        f"{_sparsity(spec)} | {PERMUTE[spec.permute]} | "
        f"{'float32' if spec.float32 else 'policy'} |"
    )


def render():
    """The page text."""
    missing = [
        cls.__name__
        for cls, spec in layer_table.TABLE.items()
        if callable(spec) and cls not in SAMPLES
    ]
    if missing:
        raise SystemExit(
            f"docs/gen_support_matrix.py has no sample for {missing}: add a "
            "line to SAMPLES."
        )
    listed = [
        cls.__name__
        for cls in OTHERS
        if any(base in layer_table.TABLE for base in cls.__mro__)
    ]
    if listed:
        raise SystemExit(
            f"{listed} now have a row in keras_mp.layer_table: remove them "
            "from OTHERS in docs/gen_support_matrix.py."
        )
    lines = [
        "# Layer support matrix",
        "",
        "<!-- Generated by docs/gen_support_matrix.py from "
        "keras_mp.layer_table; do not edit. -->",
        "",
        "What `keras_mp.quantize_model`, `keras_mp.StructuredSparsity`, "
        "`keras_mp.permute_for_sparsity` and mixed precision do with each "
        "Keras layer type, read from `keras_mp.layer_table`, the table the "
        "code uses. Weight axes are in the Keras kernel layout (ConvND "
        "`(..., in, out)`, ConvNDTranspose `(..., out, in)`, "
        "DepthwiseConvND `(..., in, multiplier)`, Dense `(in, out)`); "
        "weights are symmetric INT8 per output channel, activations "
        "per-tensor, as TensorRT wants. A subclass of a listed type is "
        "handled like its parent.",
        "",
        "A layer of a type with a 2:4 axis below is pruned when its input "
        "channels are a multiple of 4 (or with `pad=True`); with "
        "`skip_unaligned=True` (NVIDIA ASP's rule) only when its output "
        f"channels are a multiple of {ALIGNED_OUTPUT_CHANNELS} and its input "
        f"channels a multiple of {ALIGNED_INPUT_CHANNELS} as well. The "
        "permutation column says which channels `permute_for_sparsity` can "
        "reorder in a layer of that type, when channels are last "
        "(BatchNormalization: on the last axis); see "
        "[2:4 structured sparsity](sparsity.md). The mixed precision "
        "column says which types keep float32 under a mixed policy; the "
        "others compute in the policy's dtype.",
        "",
        "keras-hub's own attention layers (Gemma, Llama, T5, DeBERTaV3, "
        "...) and each keras-hub backbone class, with its coverage and "
        "what stays float and why, are in [keras-hub](keras_hub.md); "
        "recurrent layers (LSTM, GRU, SimpleRNN) stay float, everything "
        "around them INT8 ([export](export.md)).",
        "",
        "| Keras layer | INT8 weights | input Q/DQ | TensorRT runs it as | "
        "2:4 sparsity | channel permutation | mixed precision |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [_row(cls) for cls in layer_table.TABLE]
    lines += [
        "",
        "## Other layers",
        "",
        "A layer type not in the table above is not quantized: it runs in "
        "the precision of its neighbours, is not pruned, and stops a "
        "channel permutation (BatchNormalization, in the table, stays "
        "unfolded and TensorRT folds it into the preceding conv). "
        "`keras_mp.fixed_point_model` (MuPPET) switches every layer with "
        "trainable weights to fixed point in place, whatever its type and "
        "depth. For example: "
        + ", ".join(cls.__name__ for cls in OTHERS)
        + ".",
        "",
        "## Recurrent layers",
        "",
        "Stateless recurrent layers export, `return_sequences` either "
        "way, masked (`Embedding(mask_zero=True)`) or unrolled, in float, "
        "INT8 (the layers around them quantized), mixed precision and "
        "`fp16=True`; a stateful one raises an `ExportError` (ONNX has no "
        "variables to keep its state in). The lint counts their matmuls "
        "as float weighted ops, by name. See "
        "[Export: recurrent layers](export.md#recurrent-layers).",
        "",
        "| Keras layer | INT8 weights | ONNX graph | TensorRT runs it as |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {cls.__name__} | float | {graph} | {RECURRENT_NOTE} |"
        for cls, graph in RECURRENT.items()
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when the page is stale"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        with open(PAGE) as f:
            stale = f.read() != text
        if stale:
            print(f"{PAGE} is stale: run python docs/gen_support_matrix.py")
        return int(stale)
    with open(PAGE, "w") as f:
        f.write(text)
    print(f"Wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
