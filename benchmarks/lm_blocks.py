"""keras_mp's block formats on the LM benchmark's model, weights only.

Every transformer block's Dense / EinsumDense kernel is replaced by its
fake quantization in a block format (`keras_mp/quantization/blocks.py`),
with max, MSE, AWQ or GPTQ scales (`kernel_calibration.py`), layer by
layer: each block calibrated on its inputs through the blocks before it,
already quantized. The export of these formats is not wired yet, so
`block_quantized` also counts the bytes it would write.
"""

import os

import keras
import numpy as np

from keras_mp._models import walk_layers
from keras_mp.quantization import blocks
from keras_mp.quantization import kernel_calibration as wc

# keras_mp's block formats, weights only: (label, format, calibration).
BLOCK_ROWS = [
    ("keras_mp INT4, max (blocks of 128)", "int4", "max"),
    ("keras_mp INT4, MSE", "int4", "mse"),
    ("keras_mp INT4, AWQ", "int4", "awq"),
    ("keras_mp INT4, GPTQ", "int4", "gptq"),
    ("keras_mp NVFP4 (E2M1, FP8 scales per 16)", "nvfp4", "max"),
    ("keras_mp MXFP8 (E4M3, E8M0 scales per 32)", "mxfp8", "max"),
]
_BITS = {"int4": 4, "nvfp4": 4, "mxfp8": 8}


def _contracted(layer):
    """How many leading kernel axes a Dense / EinsumDense contracts."""
    if isinstance(layer, keras.layers.EinsumDense):
        inputs, rest = layer.equation.split(",")
        kernel, outputs = rest.split("->")
        axes = [c for c in kernel if c in inputs and c not in outputs]
        if not (
            kernel.startswith("".join(axes)) and inputs.endswith("".join(axes))
        ):
            raise ValueError(
                f"{layer.name}: not a (K, N) GEMM: {layer.equation}"
            )
        return len(axes)
    return 1


def gemms(block):
    return [
        layer
        for layer in walk_layers(block)
        if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))
    ]


def _captured_inputs(model, layers, windows, inputs):
    """Each layer's inputs `(tokens, K)` over a forward pass on `windows`
    (`inputs(windows)` the model's inputs), taken by wrapping the layers'
    `call` for the pass."""
    seen = {id(layer): [] for layer in layers}
    for layer in layers:

        def call(x, *args, _layer=layer, _call=layer.call, **kwargs):
            k = int(np.prod(_layer.kernel.shape[: _contracted(_layer)]))
            seen[id(_layer)].append(np.asarray(x).reshape(-1, k))
            return _call(x, *args, **kwargs)

        object.__setattr__(layer, "call", call)
    try:
        for i in range(0, len(windows), 16):
            model(inputs(windows[i : i + 16]), training=False)
    finally:
        for layer in layers:
            object.__delattr__(layer, "call")
    return {key: np.concatenate(value) for key, value in seen.items()}


def _block_kernel(kernel, x, fmt, method):
    """The fake-quantized `(K, N)` kernel, and its initializer bytes."""
    if method == "gptq":
        result = wc.gptq(kernel, x)
        return result.kernel, blocks.block_encode(
            result.kernel, fmt, scale=result.scale
        )
    if method == "awq":
        result = wc.awq(kernel, x, format=fmt)
        quantized = blocks.block_quantize_dequantize(result.kernel, fmt)
        # (x / s) @ qdq(s W): the 1 / s folded into the kernel rows here.
        folded = np.asarray(quantized) * result.input_scale[:, None]
        return folded, blocks.block_encode(result.kernel, fmt)
    scale = wc.mse_scales(kernel) if method == "mse" else None
    quantized = blocks.block_quantize_dequantize(kernel, fmt, scale=scale)
    return np.asarray(quantized), blocks.block_encode(kernel, fmt, scale=scale)


def block_quantized(path, fmt, method, calibration, inputs):
    """The cached model with every transformer-block GEMM's kernel
    replaced by its block-format fake quantization (layer by layer, each
    calibrated on inputs through the already quantized layers before it),
    and the bytes the export would write for those kernels."""
    model = keras.saving.load_model(path)
    written = 0
    for block in model.backbone.transformer_layers:
        layers = gemms(block)
        seen = {}
        if method in ("awq", "gptq"):
            seen = _captured_inputs(model, layers, calibration, inputs)
        for layer in layers:
            shape = tuple(layer.kernel.shape)
            k = int(np.prod(shape[: _contracted(layer)]))
            kernel = keras.ops.convert_to_numpy(layer.kernel).reshape(k, -1)
            quantized, codes = _block_kernel(
                kernel, seen.get(id(layer)), fmt, method
            )
            layer.kernel.assign(np.reshape(quantized, shape))
            written += codes.codes.size * _BITS[fmt] // 8 + codes.scale.nbytes
    return model, written


# keras_mp's formats through `quantize_model`, `calibrate` and
# `export_onnx`: (label, precision, calibration method). INT8 and FP8
# quantize the blocks' GEMM inputs and attention matmuls too (calibrated
# by max); the block formats are weight-only.
PIPELINE_ROWS = [
    (
        "keras_mp INT8 quantize_model + calibrate max + export_onnx",
        "int8",
        "max",
    ),
    (
        "keras_mp FP8 quantize_model + calibrate max + export_onnx",
        "float8",
        "max",
    ),
    (
        "keras_mp INT4 quantize_model + export_onnx (blocks of 128)",
        "int4",
        "max",
    ),
    (
        "keras_mp INT4 quantize_model + calibrate GPTQ + export_onnx",
        "int4",
        "gptq",
    ),
    (
        "keras_mp INT4 quantize_model + calibrate AWQ + export_onnx",
        "int4",
        "awq",
    ),
    (
        "keras_mp NVFP4 W4A4 quantize_model + calibrate + export_onnx float16",
        "nvfp4",
        "max",
    ),
    (
        "keras_mp MXFP8 W8A8 quantize_model + export_onnx float16",
        "mxfp8",
        "max",
    ),
]


def pipeline_row(
    path, label, precision, method, calibration, inputs, perplexity
):
    """A row of the LM benchmark: the cached model at `path` quantized by
    keras_mp's own pipeline, the transformer blocks in `precision` (INT8
    and FP8 with their inputs and attention matmuls; INT4 weight-only,
    NVFP4 and MXFP8 with their inputs, exported as a float16 graph),
    calibrated on `inputs(calibration)` by `method` when the model has
    activation ranges or `method` is `"gptq"` or `"awq"`, exported to
    ONNX (parity against Keras on four windows: ONNX Runtime for INT8,
    FP8 and INT4, `onnx.reference` for NVFP4 and MXFP8) beside the
    float32 model; `perplexity(model)` of the quantized Keras model, both
    file sizes, the `trtexec` command of the file and, for INT4, the size
    of the `.keras` file after `keras_mp.pack_weights`."""
    import tempfile
    import time

    import keras_mp

    model = keras.saving.load_model(path)
    start = time.perf_counter()
    qmodel = keras_mp.quantize_model(
        model, layers="transformer_layer_.*", precision=precision
    )
    from keras_mp.quantization import activation_quantizers

    if method != "max" or activation_quantizers(qmodel):
        keras_mp.calibrate(
            qmodel, inputs(calibration), method=method, verbose=0
        )
    seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as directory:
        onnx_path = os.path.join(directory, f"{precision}-{method}.onnx")
        float_path = os.path.join(directory, "float32.onnx")
        # NVFP4/MXFP8 inputs: TensorRT's DynamicQuantize, 16-bit graphs
        dtype = "float16" if precision in ("nvfp4", "mxfp8") else None
        parity = keras_mp.export_onnx(
            qmodel, onnx_path, verify_data=inputs(calibration[:4]), dtype=dtype
        )
        keras_mp.export_onnx(model, float_path)
        command = keras_mp.trtexec_command(onnx_path)
        sizes = os.path.getsize(onnx_path), os.path.getsize(float_path)
        ppl = perplexity(qmodel)
        packed = {}
        if precision == "int4":  # the .keras file with 4-bit codes
            keras_mp.pack_weights(qmodel)
            saved = os.path.join(directory, "packed.keras")
            qmodel.save(saved)
            packed["keras_file_bytes"] = os.path.getsize(saved)
    return {
        "variant": label,
        "mode": f"{precision}-{method}-onnx",
        "perplexity": ppl,
        **packed,
        "onnx_file_bytes": sizes[0],
        "float32_onnx_file_bytes": sizes[1],
        "onnx_parity_rel_l2": float(parity.rel_l2),
        "onnx_parity_runtime": parity.runtime,
        "trtexec": command.replace(directory + os.sep, ""),
        "quantize_seconds": round(seconds, 1),
    }
