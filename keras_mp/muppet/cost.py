"""GPU cost model of MuPPET training: the speed-up fixed point would buy.

On this CPU fixed point is only emulated (and slower than float32); this
module estimates, from peak tensor-core rates, what a GPU with integer
tensor cores would gain.
"""

from keras_mp.muppet.quantizer import check_word_length
from keras_mp.quantization.names import canonical_name

# Peak dense tensor throughput (TFLOPS / TOPS, no sparsity) from NVIDIA's
# Turing architecture whitepaper (RTX 2080 Ti at reference clocks) and the
# T4 datasheet. Turing has no TF32: float32 runs on CUDA cores. Keyed by
# Keras' dtype names and keras_mp's format names (`names.py`); a row
# added with the old keys "fp32" / "fp16" is read with a warning.
GPU_THROUGHPUT = {
    "rtx2080ti": {
        "name": "NVIDIA GeForce RTX 2080 Ti (Turing TU102)",
        "float32": 13.4,
        "float16": 53.8,  # FP16 tensor cores with FP32 accumulation
        "int8": 215.2,
        "int4": 430.3,
    },
    "t4": {
        "name": "NVIDIA T4 (Turing TU104)",
        "float32": 8.1,
        "float16": 65.0,
        "int8": 130.0,
        "int4": 260.0,
    },
}
# What `precision_unit` returns, the keys of a `GPU_THROUGHPUT` row.
UNITS = ("float32", "float16", "int8", "int4")


def precision_unit(word_length):
    """GPU arithmetic assumed for a MuPPET word length (None = float32).

    Up to 4 bits: INT4 tensor cores (`"int4"`); 5-8 bits: INT8 (`"int8"`);
    9-16 bits: the 16-bit tensor-core path at the FP16 rate (`"float16"`:
    Turing has no INT16 tensor cores, so this assumes a 16-bit integer
    GEMM as fast as FP16); wider: FP32 (`"float32"`). Before this release
    the float units were named `"fp16"` and `"fp32"`.
    """
    bits = check_word_length(word_length)
    if bits == 0 or bits > 16:
        return "float32"
    if bits <= 4:
        return "int4"
    return "int8" if bits <= 8 else "float16"


def estimate_speedup(precisions, gpu="rtx2080ti", compute_fraction=0.6):
    """Estimates the GPU training speed-up of a MuPPET run over float32.

    Amdahl's law per epoch: a share `compute_fraction` of a float32
    training step (convolutions and matrix products) runs on the unit that
    `precision_unit()` assigns to the epoch's word length, at the peak
    throughput of `GPU_THROUGHPUT[gpu]`; the rest (memory-bound element-wise
    ops, quantization, optimizer, input pipeline) does not speed up.
    Speed-up = epochs / sum over epochs of relative epoch time. This is an
    estimate from peak rates: it ignores the cost of quantizing and assumes
    kernels reach the same share of peak at every precision. It says
    nothing about the CPU here, where fixed point is only emulated and runs
    slower than float32.

    Args:
        precisions: sequence of per-epoch word lengths (None or 32 for
            float32), e.g. `history.history["precision"]`.
        gpu: str. Key of `GPU_THROUGHPUT`. Defaults to `"rtx2080ti"`.
        compute_fraction: float in [0, 1]. Defaults to 0.6.

    Returns:
        dict with `speedup`, `gpu`, `epochs_per_precision`,
        `relative_epoch_time` and `assumptions`.

    Raises:
        ValueError: unknown `gpu`, `compute_fraction` outside [0, 1], no
            epochs, or a word length outside 2..32.

    Example:

    >>> round(estimate_speedup([8, 8, 16, None])["speedup"], 2)
    1.65
    """
    if gpu not in GPU_THROUGHPUT:
        raise ValueError(
            f"Unknown `gpu`: {gpu!r}. Choose one of {sorted(GPU_THROUGHPUT)} "
            "or add its peak rates to keras_mp.muppet.GPU_THROUGHPUT."
        )
    if not 0.0 <= compute_fraction <= 1.0:
        raise ValueError(
            "`compute_fraction` must be in [0, 1]. Received: "
            f"compute_fraction={compute_fraction}"
        )
    if len(precisions) == 0:
        raise ValueError("estimate_speedup() needs at least one epoch.")
    rates = _rates(gpu)
    counts, relative = {}, {}
    for bits in precisions:
        bits = None if bits is None or int(bits) in (0, 32) else int(bits)
        key = bits or 32
        counts[key] = counts.get(key, 0) + 1
        unit = precision_unit(bits)
        relative[key] = (1.0 - compute_fraction) + compute_fraction * (
            rates["float32"] / rates[unit]
        )
    total = sum(counts[k] * relative[k] for k in counts)
    return {
        "speedup": len(precisions) / total,
        "gpu": rates["name"],
        "epochs_per_precision": counts,
        "relative_epoch_time": relative,
        "assumptions": (
            f"{compute_fraction:.0%} of a float32 step in conv/GEMM at peak "
            f"rates of {rates['name']} (FP32 {rates['float32']}, FP16 "
            f"{rates['float16']}, INT8 {rates['int8']} T(FL)OPS); 9-16 bits at "
            "the FP16 rate; quantization overhead ignored"
        ),
    }


def _rates(gpu):
    """The `GPU_THROUGHPUT` row of `gpu`, keyed by `UNITS` (a row added
    with the old keys "fp32" / "fp16" warns, `names.canonical_name`)."""
    return {
        key
        if key == "name"
        else canonical_name(key, f"GPU_THROUGHPUT[{gpu!r}]", UNITS): value
        for key, value in GPU_THROUGHPUT[gpu].items()
    }
