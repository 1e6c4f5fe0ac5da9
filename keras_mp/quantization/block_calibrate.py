"""GPTQ for a model's block-scaled (INT4) weights: `calibrate(...,
method="gptq")`.

The inputs of each INT4 GEMM are observed where keras_mp observes a
quantized layer's calls (`twins.probing`: the twin's own `__call__`, no
`call` swapped), in one pass over the data with every quantizer as it is
(the earlier GEMMs quantized with max scales, as they run before GPTQ
changes them). `weight_calibration.gptq` then rounds each kernel, as its
`(K, N)` matrix; the layer keeps the rounded kernel and its quantizer the
block ranges `7 * scale` (`amax`), which the export writes as they are.
A later `calibrate(method="max")`, or a training step (the weight ranges
follow the weights), sets max ranges again.
"""

import numpy as np

from keras_mp.quantization import twins
from keras_mp.quantization.quantizers import matrix_view
from keras_mp.quantization.weight_calibration import gptq

# The weight methods of `calibrate`, and what each runs on one kernel.
WEIGHT_METHODS = ("gptq",)


def block_quantizers(model):
    """The `twins.Quantizer` rows of `model`'s enabled block-scaled
    weights of a layer's own attribute (Dense/EinsumDense kernels).

    Raises:
        ValueError: there are none.
    """
    rows = [
        q
        for q in twins.quantizers(model, "calibrate")
        if q.quantizer.block_size
        and q.weight is not None
        and not q.site
        and q.quantizer.enabled
    ]
    if not rows:
        raise ValueError(
            f"Model {model.name!r} has no block-scaled weight for GPTQ: "
            "quantize it with precision='int4' (QuantizeConfig(precision="
            "'int4')) first. Nothing was calibrated."
        )
    return rows


def calibrate_blocks(model, run_batches):
    """GPTQ-rounds every block-scaled weight of `model`.

    Args:
        model: a quantized model.
        run_batches: callable running `model` over the calibration data
            once (`calibrate`'s batches), under the probe set here.

    Returns:
        dict: for each weight quantizer's name, the relative output error
        `||X W_q - X W|| / ||X W||` on the observed inputs before (max
        scales) and after GPTQ, as `(before, after)`.

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
                f"{q.layer.name!r}: GPTQ needs its inputs."
            )
        variable = getattr(q.layer, q.weight)
        view, back = matrix_view(np.asarray(variable), q.quantizer.block_axes)
        kernel = view.numpy()
        x = np.concatenate([i.reshape(-1, kernel.shape[0]) for i in inputs])
        before = _error(x, kernel, q)
        result = gptq(kernel, x, q.quantizer.block_size)
        variable.assign(back(result.kernel).numpy().astype(variable.dtype))
        q.quantizer.amax.assign(
            np.float32(q.quantizer.format.qmax) * result.scale
        )
        after = _error(x, kernel, q)
        errors[q.name] = (before, after)
    return errors


def _error(x, kernel, q):
    """Relative output error on inputs `x` of the weight of `q` as its
    quantizer rounds it, against the float `(K, N)` `kernel`."""
    weight = getattr(q.layer, q.weight)
    quantized = q.quantizer(np.asarray(weight))
    view, _ = matrix_view(quantized, q.quantizer.block_axes)
    reference = x @ kernel
    diff = x @ view.numpy() - reference
    return float(np.linalg.norm(diff) / np.linalg.norm(reference))
