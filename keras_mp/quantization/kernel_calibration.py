"""Weight-only calibration for block-scaled formats: max, MSE, AWQ, GPTQ.

Each function works on one GEMM: a kernel in Keras' `(K, N)` layout (a
`Dense` kernel; an `EinsumDense` kernel reshaped so its contracted axes
come first, `kernel.reshape(K, -1)`) and calibration inputs `(..., K)`
(the layer's inputs, e.g. captured on a few batches). Blocks run along K,
as `blocks.py` defines them; numpy in, numpy out.

- `max_scales`: INT4 block scales `amax / 7` (what `blocks` computes).
- `mse_scales`: per block, the shrunk range minimising the weight's
  squared quantization error.
- `awq`: activation-aware scaling (ModelOpt's `awq_lite`, AWQ, Lin et al.
  2023): per input channel `s = mean|x| ** alpha / mean|w_hat| **
  (1 - alpha)`, alpha searched on a grid for the smallest layer output
  error. The kernel is scaled by `s` (rows) before quantization and the
  input by `1 / s`.
- `gptq`: second-order rounding with error compensation (GPTQ, Frantar et
  al. 2023): `H = 2 X^T X / n` damped by 1% of its mean diagonal, rows of
  the kernel quantized one at a time, the error spread over the rows not
  yet quantized through the Cholesky factor of `H^-1`, lazily per block.
"""

import dataclasses

import numpy as np

from keras_mp.quantization.blocks import (
    block_encode,
    block_format,
    block_quantize_dequantize,
)

ALPHAS = tuple(np.round(np.arange(0.0, 1.0001, 0.1), 1))
RATIOS = tuple(np.round(np.linspace(0.5, 1.0, 26), 2))


@dataclasses.dataclass(frozen=True)
class AWQResult:
    """The outcome of `awq`.

    Attributes:
        scales: float32 array `(K,)`. The per-input-channel scales `s`.
        alpha: float. The exponent chosen.
        errors: dict. Layer output mean squared error for each alpha.
        kernel: float32 array `(K, N)`. `s[:, None] * kernel`, the kernel
            to quantize (with the format's max block scales).
        input_scale: float32 array `(K,)`. `1 / s`: multiply the layer's
            input by it, folded into the op before the GEMM when that op
            is a norm's per-channel scale or feeds only this GEMM
            (otherwise a Mul before the GEMM, ModelOpt's
            `pre_quant_scale`).
    """

    scales: np.ndarray
    alpha: float
    errors: dict
    kernel: np.ndarray
    input_scale: np.ndarray


@dataclasses.dataclass(frozen=True)
class GPTQResult:
    """The outcome of `gptq`.

    Attributes:
        kernel: float32 array `(K, N)`. The quantized kernel, on the INT4
            grid of `scale`: `block_quantize_dequantize(kernel, "int4",
            block_size, scale=scale)` returns it unchanged.
        scale: float32 array `(K / block_size, N)`. The block scales.
    """

    kernel: np.ndarray
    scale: np.ndarray


def max_scales(kernel, block_size=128):
    """INT4 block scales `max|w| / 7` of a `(K, N)` kernel."""
    return block_encode(_kernel(kernel), "int4", block_size).scale


def mse_scales(kernel, block_size=128, ratios=RATIOS):
    """INT4 block scales minimising each block's squared weight error.

    Args:
        kernel: float array `(K, N)`.
        block_size: int. 128, 64 or 32. Defaults to 128.
        ratios: sequence of float. Fractions of the block's max tried as
            its range (1.0 included: never worse than `max_scales`).

    Returns:
        float32 array `(K / block_size, N)`.
    """
    kernel = _kernel(kernel)
    top = max_scales(kernel, block_size)
    best, best_err = top, None
    for ratio in ratios:
        scale = (np.float32(ratio) * top).astype(np.float32)
        err = _block_error(kernel, scale, block_size)
        if best_err is None:
            best, best_err = scale, err
            continue
        better = err < best_err
        best = np.where(better, scale, best)
        best_err = np.where(better, err, best_err)
    return best.astype(np.float32)


def awq(kernel, inputs, format="int4", block_size=None, alphas=ALPHAS):
    """Activation-aware scales for a kernel quantized in a block format.

    Follows ModelOpt's `awq_lite` (`model_calib.py`): activation statistic
    `mean|x|` per input channel, weight statistic the mean over output
    channels of `|w| / max|w|` of its block, `s = x ** alpha / w ** (1 -
    alpha)` clipped to [1e-4, 1e4] and divided by `sqrt(max(s) *
    min(s))`; the alpha with the smallest mean squared error of the layer
    output `(x / s) @ qdq(s * W)` against `x @ W` wins (the first on a
    tie).

    Args:
        kernel: float array `(K, N)`.
        inputs: float array `(..., K)`. Calibration inputs of the layer.
        format: str. A `blocks.FORMATS` name. Defaults to `"int4"`.
        block_size: int or None. The format's default when None.
        alphas: sequence of float. The grid searched. Defaults to 0, 0.1,
            ..., 1.

    Returns:
        `AWQResult`.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> w = rng.normal(size=(128, 16)).astype("float32")
    >>> x = rng.normal(size=(64, 128)).astype("float32")
    >>> awq(w, x).scales.shape
    (128,)
    """
    kernel, x = _kernel(kernel), _inputs(inputs, kernel)
    fmt = block_format(format)
    block_size = block_size or fmt.block_sizes[0]
    act = np.abs(x).mean(0)
    blocks = np.abs(kernel).reshape(-1, block_size, kernel.shape[1])
    peak = blocks.max(1, keepdims=True)
    normalized = blocks / (peak + np.finfo(np.float32).tiny)
    weight = normalized.reshape(kernel.shape).mean(1)
    reference = x @ kernel
    errors, best = {}, None
    for alpha in alphas:
        s = act**alpha / (weight ** (1 - alpha) + np.finfo(np.float32).tiny)
        s = np.clip(s, 1e-4, 1e4)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        scaled = s[:, None] * kernel
        quantized = _qdq(scaled, fmt.name, block_size)
        errors[float(alpha)] = float(
            np.mean(((x / s) @ quantized - reference) ** 2)
        )
        if best is None or errors[float(alpha)] < errors[best[0]]:
            best = (float(alpha), s, scaled)
    alpha, s, scaled = best
    return AWQResult(s, alpha, errors, scaled, (1.0 / s).astype(np.float32))


def gptq(kernel, inputs, block_size=128, damping=0.01):
    """GPTQ-quantizes a kernel to INT4 with per-block scales.

    `H = 2 X^T X / n` from the inputs (a channel that never fires gets
    `H_kk = 1` and a zero row), plus `damping * mean(diag(H))` on the
    diagonal. Rows (input channels) are quantized in order; each row's
    rounding error, divided by the diagonal of the upper Cholesky factor
    `U` of `H^-1`, is subtracted from the later rows of its block at once
    and from the rows after the block lazily. A block's scales are
    `max|w| / 7` of its rows when its turn comes (already compensated).

    Args:
        kernel: float array `(K, N)`.
        inputs: float array `(..., K)`. Calibration inputs of the layer.
        block_size: int. 128, 64 or 32; also the lazy batch. Defaults to
            128.
        damping: float. Fraction of the mean diagonal added to `H`.
            Defaults to 0.01.

    Returns:
        `GPTQResult`.

    Raises:
        ValueError: `damping` outside [0, 1), or shapes that do not match.
    """
    if not 0 <= damping < 1:
        raise ValueError(
            f"`damping` is a fraction of H's mean diagonal, in [0, 1). "
            f"Received: damping={damping}"
        )
    kernel, x = _kernel(kernel), _inputs(inputs, kernel)
    block_encode(kernel, "int4", block_size)  # validates the block size
    x = x.astype(np.float64)
    h = 2.0 * x.T @ x / len(x)
    w = kernel.astype(np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[dead] = 0.0
    h[np.diag_indices_from(h)] += damping * np.mean(np.diag(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    k = kernel.shape[0]
    codes = np.zeros(kernel.shape, np.float64)
    scales = []
    for start in range(0, k, block_size):
        stop = start + block_size
        rows = w[start:stop]  # a view: updates land in `w`
        scale = max_scales(rows.astype(np.float32), block_size)[0]
        scales.append(scale)
        errors = np.zeros_like(rows)
        for i in range(block_size):
            code = np.clip(np.rint(rows[i] / scale), -8, 7)
            codes[start + i] = code
            err = (rows[i] - code * scale) / u[start + i, start + i]
            rows[i:] -= np.outer(u[start + i, start + i : stop], err)
            errors[i] = err
        w[stop:] -= u[start:stop, stop:].T @ errors
    scale = np.stack(scales).astype(np.float32)
    quantized = codes.astype(np.float32) * np.repeat(scale, block_size, 0)
    return GPTQResult(quantized, scale)


def output_error(kernel, inputs, quantized, input_scale=None):
    """Relative squared error of a layer's output, `||x W - (x * c) Q||^2
    / ||x W||^2`, with `c` the input scale (AWQ's `1 / s`) or 1."""
    kernel, x = _kernel(kernel), _inputs(inputs, kernel)
    reference = x @ kernel
    if input_scale is not None:
        x = x * np.asarray(input_scale, np.float32)
    diff = x @ np.asarray(quantized, np.float32) - reference
    return float(np.sum(diff**2) / np.sum(reference**2))


def _qdq(kernel, format, block_size, scale=None):
    return np.asarray(
        block_quantize_dequantize(kernel, format, block_size, scale=scale)
    )


def _block_error(kernel, scale, block_size):
    diff = (kernel - _qdq(kernel, "int4", block_size, scale)) ** 2
    return diff.reshape(-1, block_size, kernel.shape[1]).sum(1)


def _kernel(kernel):
    kernel = np.asarray(kernel, np.float32)
    if kernel.ndim != 2:
        raise ValueError(
            "Expected a kernel of shape (K, N): reshape an EinsumDense "
            "kernel so its contracted axes come first, "
            f"`kernel.reshape(K, -1)`. Received: shape={kernel.shape}"
        )
    return kernel


def _inputs(inputs, kernel):
    x = np.asarray(inputs, np.float32)
    k = np.shape(kernel)[0]
    if x.shape[-1] != k:
        raise ValueError(
            f"The inputs' last axis must be the kernel's K={k}. Received: "
            f"inputs.shape={x.shape}"
        )
    return x.reshape(-1, k)
