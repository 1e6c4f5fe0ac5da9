"""GPTQ and AWQ for a model's block-scaled weights: `calibrate(...,
method="gptq" | "awq")`.

The inputs of each block-scaled GEMM are observed where keras_mp observes
a quantized layer's calls (`twins.probing`: the twin's own `__call__`, no
`call` swapped), in one pass over the data with every quantizer as it is
(the earlier GEMMs quantized as they run before this changes them).

- `"gptq"` (INT4): `kernel_calibration.gptq` rounds each kernel, as its
  `(K, N)` matrix; the layer keeps the rounded kernel and its quantizer
  the block ranges `7 * scale` (`amax`), which the export writes as they
  are. A later `calibrate(method="max")`, or a training step (the weight
  ranges follow the weights), sets max ranges again.
- `"mse"` (INT4; `mse_block_ranges`): per block, the range with the
  least squared weight error, searched on the weights alone.
- `"awq"` (INT4, NVFP4, MXFP8): `kernel_calibration.awq` searches the
  per-input-channel scales `s` (ModelOpt's `awq_lite`); the kernel becomes
  `s * W` (max block ranges of it) and the layer gets the input
  pre-scale `1 / s` (`pre_scale.InputScale`, saved, exported as a Mul
  before the MatMul), so its float function is unchanged. A layer whose
  output error AWQ does not lower, or whose input does not end with the
  kernel's contracted axes, is left as it was.
"""

import numpy as np

from keras_mp.quantization import pre_scale, twins
from keras_mp.quantization.fake_quant import matrix_view
from keras_mp.quantization.kernel_calibration import awq, gptq, mse_scales

# The weight methods of `calibrate`, and what each runs on one kernel.
WEIGHT_METHODS = ("gptq", "awq")


def block_quantizers(model):
    """The `twins.Quantizer` rows of `model`'s enabled block-scaled
    weights of a layer's own attribute (Dense/EinsumDense kernels).

    Raises:
        ValueError: there are none.
    """
    rows = twins.block_weight_quantizers(model, "calibrate")
    if not rows:
        quantized = any(True for _ in twins.quantizers(model, "calibrate"))
        how = (
            "its quantized layers all took INT8 or FP8: TensorRT has 4-bit "
            "kernels for Dense/EinsumDense weights only, and a convolution "
            "or a weight in a layer's own code takes INT8 "
            "(`keras_mp.quantization_report` says so per layer). Calibrate "
            "it with method='max' (or 'entropy', 'percentile', 'mse')"
            if quantized
            else "quantize it with precision='int4' "
            "(QuantizeConfig(precision='int4')) first"
        )
        raise ValueError(
            f"Model {model.name!r} has no block-scaled weight for GPTQ or "
            f"AWQ: {how}. Nothing was calibrated."
        )
    return rows


def calibrate_blocks(model, run_batches, method="gptq"):
    """GPTQ-rounds, or AWQ-scales, every block-scaled weight of `model`.

    Args:
        model: a quantized model.
        run_batches: callable running `model` over the calibration data
            once (`calibrate`'s batches), under the probe set here.
        method: str. `"gptq"` or `"awq"`. Defaults to `"gptq"`.

    Returns:
        dict: for each weight quantizer's name, the relative output error
        `||X W_q - X W|| / ||X W||` on the observed inputs before (as the
        weight was quantized) and after, as `(before, after)`.

    Raises:
        ValueError: the model has no block-scaled weight, or the data
            reached none of them.
    """
    rows = block_quantizers(model)
    seen = {id(q.layer): [] for q in rows}

    def probe(layer, run, args, kwargs):
        if id(layer) in seen:
            x = args[0] if args else next(iter(kwargs.values()))
            seen[id(layer)].append(np.asarray(x, np.float32))
        return run()

    with twins.probing(probe):
        run_batches()
    errors = {}
    for q in rows:
        inputs = seen[id(q.layer)]
        if not inputs:
            raise ValueError(
                f"The calibration data never reached layer "
                f"{q.layer.name!r}: {method.upper()} needs its inputs."
            )
        variable = getattr(q.layer, q.weight)
        view, back = matrix_view(np.asarray(variable), q.quantizer.block_axes)
        kernel = view.numpy()
        x = np.concatenate([i.reshape(-1, kernel.shape[0]) for i in inputs])
        if method == "awq":
            errors[q.name] = _awq(q, kernel, x, back)
            continue
        before = _error(x, x @ kernel, q)
        result = gptq(kernel, x, q.quantizer.block_size)
        variable.assign(back(result.kernel).numpy().astype(variable.dtype))
        q.quantizer.amax.assign(
            np.float32(q.quantizer.format.qmax) * result.scale
        )
        errors[q.name] = (before, _error(x, x @ kernel, q))
    return errors


def _awq(q, kernel, x, back):
    """AWQ on the weight of `q` (its `(K, N)` `kernel`, inputs `x` before
    the layer's pre-scale): `(before, after)` relative output errors."""
    layer, variable = q.layer, getattr(q.layer, q.weight)
    shape = pre_scale.input_shape_of(layer, q.quantizer)
    found = pre_scale.get(layer)
    current = (
        np.ones(kernel.shape[0], np.float32)
        if found is None
        else np.asarray(found.scale).reshape(-1)
    )
    x = x * current  # what the GEMM sees
    reference = x @ kernel
    before = _error(x, reference, q)
    if shape is None:
        return before, before
    fmt = q.quantizer.format.name
    result = awq(kernel, x, fmt, q.quantizer.block_size)
    after = np.sqrt(result.errors[result.alpha] * reference.size) / (
        np.linalg.norm(reference)
    )
    if not after < before:
        return before, before
    variable.assign(back(result.kernel).numpy().astype(variable.dtype))
    q.quantizer.update(variable)
    scale = pre_scale.add(layer, shape)
    scale.scale.assign((current * result.input_scale).reshape(shape))
    return before, _error(x * result.input_scale, reference, q)


def mse_block_ranges(model):
    """Sets the block ranges of every enabled INT4 weight of `model` to
    the per-block ranges with the least squared weight error
    (`kernel_calibration.mse_scales`: 0.5 to 1 times the block's max),
    for `calibrate(method="mse")`. NVFP4/MXFP8 scales follow from the
    values: left as they are.

    Returns:
        dict: for each weight quantizer's name, the relative weight error
        `||W_q - W|| / ||W||` with max ranges and with these, as
        `(before, after)`; empty when there is no INT4 weight.
    """
    errors = {}
    for q in twins.quantizers(model, "calibrate"):
        tq = q.quantizer
        if not (
            tq.block_size
            and q.weight is not None
            and not q.site
            and tq.enabled
            and tq.format.name == "int4"
        ):
            continue
        weight = getattr(q.layer, q.weight)
        tq.update(weight)
        before = _weight_error(q)
        view, _ = matrix_view(np.asarray(weight), tq.block_axes)
        scale = mse_scales(view.numpy(), tq.block_size)
        tq.amax.assign(np.float32(tq.format.qmax) * scale)
        errors[q.name] = (before, _weight_error(q))
    return errors


def _weight_error(q):
    weight = np.asarray(getattr(q.layer, q.weight))
    diff = np.asarray(q.quantizer(weight)) - weight
    return float(np.linalg.norm(diff) / np.linalg.norm(weight))


def _error(x, reference, q):
    """Relative output error on GEMM inputs `x` of the weight of `q` as
    its quantizer rounds it, against the float output `reference`."""
    weight = getattr(q.layer, q.weight)
    quantized = q.quantizer(np.asarray(weight))
    view, _ = matrix_view(quantized, q.quantizer.block_axes)
    diff = x @ view.numpy() - reference
    return float(np.linalg.norm(diff) / np.linalg.norm(reference))
