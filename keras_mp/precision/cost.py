"""What a layer costs at INT8, FP8 or unquantized on a TensorRT GPU.

Two costs for choosing a precision per layer: `latency`, a roofline of the
layer's GEMM work and memory traffic at a GPU's dense Tensor Core peak and
bandwidth (`GPUS`), with TensorRT's rules for quantized layers; and
`bits_cost` / `effective_bits`, the weight bits (ModelOpt AutoQuantize's
"effective bits"). `layer_work` counts a layer's work from the shapes of
one call (`work.py`); the GPUs are in `gpus.py`; this module is the one
import for both. An unquantized layer (`"float"`) is priced in float16,
the type TensorRT builds it in. Guide, with the GPU table and its
sources: `docs/latency_model.md`.

This is a model, not a measurement. It ignores kernel launch overheads,
the fusion of elementwise layers into GEMM epilogues (an Add, a ReLU or a
BatchNormalization after a convolution costs TensorRT almost nothing; here
it pays its bytes), the L2 cache (every tensor comes from DRAM), the
fraction of peak kernels really reach (every precision is assumed to reach
the same fraction), and sparse Tensor Cores. Use it to rank choices;
`trtexec` on the GPU is the ground truth.
"""

from keras_mp.precision.gpus import (
    GPU,
    GPUS,
    PRECISIONS,
    check_precisions,
    gpu_spec,
)
from keras_mp.precision.work import KINDS, LayerWork, layer_work
from keras_mp.quantization import formats, placement
from keras_mp.quantization.names import NOT_QUANTIZED

__all__ = [
    "BITS",
    "GPU",
    "GPUS",
    "KINDS",
    "PRECISIONS",
    "LayerWork",
    "bits_cost",
    "check_precisions",
    "effective_bits",
    "gpu_spec",
    "latency",
    "layer_work",
]

# Bits per value of each precision: float16's when not quantized, and the
# `FORMATS` rows'.
BITS = {
    p: 16 if p == NOT_QUANTIZED else formats.FORMATS[p].bits for p in PRECISIONS
}
# Tensor Core multiples a GEMM's K and N are padded to: 16 bytes, 8 float16
# or 16 8-bit elements (NVIDIA's Matrix Multiplication Background User's
# Guide, "Tensor Core Requirements").
TILE = {p: 16 * 8 // bits for p, bits in BITS.items()}
# Kinds that are MatMuls in ONNX, the ops ModelOpt's small-GEMM rule reads.
_MATMULS = ("gemm", "dot", "attention")
# A stand-alone QuantizeLinear reads float16 and writes 8 bits.
_QUANTIZE_BYTES = 3


def _padded(work, tile):
    """The ratio of padded to exact FLOPs with K and N padded to `tile`."""
    k, n = work.gemm_k, work.gemm_n
    if not k or not n:
        return 1.0
    padded_k, padded_n = (-(-size // tile) * tile for size in (k, n))
    if work.kind == "attention":
        # Q.K^T pads the key size, probs.V the value size
        return (padded_k + padded_n) / (k + n)
    return padded_k / k * padded_n / n


def _small_gemm(work):
    return (
        work.kind in _MATMULS
        and work.gemm_k is not None
        and placement.gemm_too_small(work.gemm_k, work.gemm_n)
    )


def _roofline(work, precision, gpu, batch_scale):
    width = BITS[precision] // 8
    peak = gpu.peak[precision]
    if precision != NOT_QUANTIZED and _small_gemm(work):
        peak = gpu.peak[NOT_QUANTIZED]
    flops = work.flops * batch_scale * _padded(work, TILE[precision])
    # outputs in float16: a quantized layer's output is dequantized unless
    # the next layer fuses a Q (conservative)
    activations = work.input_elements * width + work.output_elements * 2
    data = work.weight_elements * width * work.calls + activations * batch_scale
    return max(flops / (peak * 1e12), data / (gpu.bandwidth * 1e9))


def latency(work, precision, gpu, batch_scale=1.0, fused_input=False):
    """Seconds `work` takes at `precision` on `gpu`, by a roofline.

    `max(padded FLOPs / peak, bytes / bandwidth)`, with these TensorRT
    rules (sources in `docs/latency_model.md`):

    - bytes: weights and inputs at the precision's width (float, i.e.
      float16, 2 bytes, int8 and float8 1), outputs at 2 bytes (a
      quantized layer's output is dequantized unless the next layer
      fuses a Q); a quantized layer adds a stand-alone Quantize kernel of
      its input (read 2 bytes, write 1 per element) unless `fused_input`.
    - K and N are padded to Tensor Core multiples: 8 for float16, 16 for
      int8 and float8 (NVIDIA's Matrix Multiplication Background User's
      Guide, "Tensor Core Requirements"); FLOPs count the padding.
    - a MatMul with K or N below 16 is no faster in int8/float8 than in
      float16 (ModelOpt's `_MIN_MATMUL_DIM`, keras_mp's
      `placement.gemm_too_small`): its compute term takes the float16 peak
      and its kernel is never faster than the float16 one, so the Q/DQ
      make it slower.
    - a convolution TensorRT has no FP8 kernel for (16 channels or fewer
      in or out, more than 32 taps: the `float8` row's `conv_min_channels`
      and `conv_max_taps`, `LayerWork.no_fp8`) is priced in INT8 when float8
      is asked, as keras_mp places it.
    - a layer without GEMM (`flops == 0`) costs its bytes only.

    Args:
        work: `LayerWork`, from `layer_work`.
        precision: str. One of `PRECISIONS` (`"float"`: not quantized;
            `"float16"` and `"fp8"` are old spellings, with a
            `DeprecationWarning`).
        gpu: str or `GPU`. See `gpu_spec`.
        batch_scale: float. Multiplies FLOPs and activation bytes (not
            weight bytes): price batch 64 from shapes recorded at batch 8
            with 8.0. Defaults to 1.0.
        fused_input: bool. The producer of the input writes it quantized
            (no stand-alone Quantize kernel). Defaults to False.

    Returns:
        float, seconds.

    Raises:
        ValueError: an unknown GPU or precision, a precision the GPU
            cannot run, or `batch_scale` not positive.

    Example:

    >>> big = LayerWork(2 * 8192**3, 8192**2, 8192**2, 8192**2,
    ...                 8192, 8192, "gemm")
    >>> fp16 = latency(big, "float", "H100")
    >>> round(fp16 / latency(big, "int8", "H100", fused_input=True), 2)
    2.0
    >>> round(fp16 / latency(big, "int8", "H100"), 2)  # + a Quantize kernel
    1.81
    """
    gpu = gpu_spec(gpu)
    (precision,) = check_precisions(gpu, (precision,))
    if not batch_scale > 0:
        raise ValueError(
            f"`batch_scale` must be positive. Received: batch_scale="
            f"{batch_scale!r}"
        )
    # `no_fp8`: a convolution beyond the float8 row's limits (`conv_limit`)
    row = formats.FORMATS.get(precision)  # None: not quantized
    if work.no_fp8 and row is not None and row.conv_limited:
        precision = "int8"
        check_precisions(gpu, (precision,))
    seconds = _roofline(work, precision, gpu, batch_scale)
    if precision == NOT_QUANTIZED:
        return seconds
    if _small_gemm(work):
        seconds = max(seconds, _roofline(work, NOT_QUANTIZED, gpu, batch_scale))
    if not fused_input:
        quantize = work.input_elements * batch_scale * _QUANTIZE_BYTES
        seconds += quantize / (gpu.bandwidth * 1e9)
    return seconds


def bits_cost(work, precision):
    """The bits of `work`'s weights at `precision` (float: 16, int8 and
    float8: 8).

    Raises:
        ValueError: an unknown precision.

    Example:

    >>> bits_cost(LayerWork(0, 1000, 0, 0, None, None, "gemm"), "int8")
    8000.0
    """
    (precision,) = check_precisions(None, (precision,))
    return float(work.weight_elements * BITS[precision])


def effective_bits(works_and_precisions):
    """Mean weight bits over weight elements, ModelOpt AutoQuantize's
    "effective bits" (16.0: nothing quantized, 8.0: everything).

    Args:
        works_and_precisions: iterable of `(LayerWork, precision)` pairs.

    Returns:
        float.

    Raises:
        ValueError: no weights at all, or an unknown precision.

    Example:

    >>> a = LayerWork(0, 3000, 0, 0, None, None, "gemm")
    >>> b = LayerWork(0, 1000, 0, 0, None, None, "gemm")
    >>> effective_bits([(a, "int8"), (b, "float")])
    10.0
    """
    elements = bits = 0
    for work, precision in works_and_precisions:
        elements += work.weight_elements
        bits += bits_cost(work, precision)
    if not elements:
        raise ValueError(
            "effective_bits() needs at least one layer with weights; every "
            "work received has weight_elements=0."
        )
    return bits / elements
