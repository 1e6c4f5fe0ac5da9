"""Packed 4-bit storage of INT4 weights: `keras_mp.pack_weights`.

A quantized model keeps float master weights, which QAT trains and its
`.keras` file stores (float32). `pack_weights` turns each INT4 weight into
its codes on the quantizer's grid: the kernel variable then holds the
dequantized codes (`codes * scale`, the values the fake quantization gave,
so outputs do not change), and the layer's `save_own_variables` writes the
codes two to a byte (`blocks.pack_nibbles`) with their float32 block
scales in place of the float kernel; loading decodes them. The record
marks the layer packed (`model.quantization_record`), so a loaded model is
packed again. A packed layer refuses training: its float weights are gone.
"""

import warnings

import ml_dtypes
import numpy as np

from keras_mp import _models
from keras_mp.quantization.blocks import block_encode, pack_nibbles

ATTR = "packed_weights"


def pack_weights(model):
    """Stores a quantized model's INT4 weights as packed 4-bit codes.

    Each enabled INT4 (block-scaled) weight of a Dense or EinsumDense
    layer is replaced by its codes and block scales: the layer computes
    exactly what it computed before (the kernel holds `codes * scale`,
    decoded in memory), and `model.save("m.keras")` writes the codes two
    to a byte plus float32 scales, about an eighth of the float32 kernel;
    `keras.saving.load_model(path, safe_mode=True)` gives the packed model
    back. `export_onnx` writes the same ONNX as before packing.

    Packing is the last step before deployment: calibrate (`"max"`,
    `"gptq"`, `"awq"`) and train first. A packed model refuses training
    (`fit`, or a call with `training=True`) and calibration: quantize the
    float model again (`keras_mp.quantize_model`) for QAT. NVFP4 and MXFP8
    weights stay float (their scales follow from the values, so decoded
    codes would quantize to other scales); they are named in a warning.

    Args:
        model: a quantized model (`keras_mp.quantize_model(...,
            precision="int4")`), changed in place.

    Returns:
        list of str: the names of the weights packed
        (`<layer path>/kernel`).

    Raises:
        ValueError: `model` has no enabled INT4 weight.

    Example:

    >>> qmodel = keras_mp.quantize_model(model, precision="int4")
    >>> keras_mp.calibrate(qmodel, x_calibration, method="awq")
    >>> keras_mp.pack_weights(qmodel)
    >>> qmodel.save("int4.keras")  # a Dense stack: 0.16x the float32 file
    """
    from keras_mp.quantization import twins

    _models.check_model(model, "pack_weights")
    rows = [
        q
        for q in twins.block_weight_quantizers(model, "pack_weights")
        if q.layer.enabled
    ]
    int4 = [q for q in rows if q.quantizer.format.name == "int4"]
    others = [q.name for q in rows if q.quantizer.format.name != "int4"]
    if not int4:
        raise ValueError(
            f"Model {model.name!r} has no enabled INT4 weight to pack: "
            "quantize it with precision='int4' first"
            + (
                f" (its {others[0]!r} is NVFP4/MXFP8, kept float)"
                if others
                else ""
            )
            + ". Nothing was changed."
        )
    if others:
        warnings.warn(
            f"pack_weights packs INT4 weights only: {len(others)} "
            f"NVFP4/MXFP8 weight(s) stay float32 ({others[0]!r}, ...).",
            stacklevel=2,
        )
    for q in int4:
        variable = getattr(q.layer, q.weight)
        codes, scale = encode(q.quantizer, np.asarray(variable))
        variable.assign(decode(q.quantizer, codes, scale, variable.shape))
        mark(q.layer, [*getattr(q.layer, ATTR, ()), q.weight])
    _models.reset_compiled_functions(model)
    return [q.name for q in int4]


def mark(layer, attrs):
    """Records that `layer`'s weights `attrs` are packed (a plain
    attribute: no tracking, not saved but by the record)."""
    object.__setattr__(layer, ATTR, list(dict.fromkeys(attrs)))


def is_packed(model):
    """Whether any layer of `model` has packed weights."""
    return any(
        getattr(layer, ATTR, None) for layer in _models.walk_layers(model)
    )


def check_unpacked(model, caller):
    """A ValueError naming `caller` when `model` has packed weights."""
    if is_packed(model):
        raise ValueError(
            f"`{caller}`: model {model.name!r} has packed INT4 weights "
            "(`keras_mp.pack_weights`), whose float values are gone. "
            f"Call `{caller}` before packing, on the quantized float model."
        )


def refuse_training(layer):
    raise ValueError(
        f"Layer {layer.name!r} has packed INT4 weights "
        "(`keras_mp.pack_weights`): it cannot train, its float master "
        "weights are gone. For quantization-aware training, quantize the "
        "float model (`keras_mp.quantize_model(model, precision='int4')`), "
        "train it, and pack after training."
    )


def encode(quantizer, weight):
    """`(codes, scale)` of `weight` on `quantizer`'s INT4 grid: int8 codes
    of its `(K, N)` matrix view and float32 scales `(K / block_size, N)`
    (the quantizer's `amax / 7`)."""
    from keras_mp.quantization.fake_quant import block_scale, matrix_view

    view, _ = matrix_view(weight, quantizer.block_axes)
    scale = block_scale(quantizer.amax, quantizer.format).numpy()
    found = block_encode(
        view.numpy(), "int4", quantizer.block_size, scale=scale
    )
    return found.codes.astype(np.int8), scale


def decode(quantizer, codes, scale, shape):
    """The weight of `shape` the int8 `(K, N)` `codes` and their `scale`
    give: `codes * scale`, in float32, laid out as the layer's weight."""
    from keras_mp.quantization.fake_quant import matrix_view

    values = codes.astype(np.float32) * np.repeat(
        scale, quantizer.block_size, axis=0
    )
    _, back = matrix_view(np.zeros(shape, np.float32), quantizer.block_axes)
    return back(values).numpy()


def unpack_nibbles(packed, size):
    """The int8 codes `blocks.pack_nibbles` packed: `size` of them."""
    packed = np.asarray(packed, np.uint8)
    nibbles = np.stack([packed & 0x0F, packed >> 4], axis=1).reshape(-1)
    codes = nibbles[:size].astype(np.int8)
    return np.where(codes >= 8, codes - 16, codes).astype(np.int8)


def save_own_variables(layer, store, save):
    """Writes `layer`'s own variables with `save` (the float layer's
    method), each packed weight as its codes (uint8, two a byte) and its
    scales (`<key>_scale`) in place of its float values."""
    values = {}
    save(values)
    for attr in getattr(layer, ATTR):
        key = _key(layer, attr, values)
        q = layer.weight_quantizers[layer.weight_attrs.index(attr)]
        codes, scale = encode(q, np.asarray(values[key]))
        values[key] = pack_nibbles(codes.astype(ml_dtypes.int4))
        values[f"{key}_scale"] = scale
    for key, value in values.items():
        store[key] = value


def load_own_variables(layer, store, load):
    """Reads what `save_own_variables` wrote: each packed weight decoded
    to its float values, then the float layer's `load`."""
    values = {key: store[key] for key in store.keys()}
    keys = [k[: -len("_scale")] for k in values if k.endswith("_scale")]
    for attr, key in zip(getattr(layer, ATTR), sorted(keys, key=int)):
        variable = getattr(layer, attr)
        q = layer.weight_quantizers[layer.weight_attrs.index(attr)]
        scale = np.asarray(values.pop(f"{key}_scale"), np.float32)
        codes = unpack_nibbles(values[key], int(np.prod(variable.shape)))
        k = scale.shape[0] * q.block_size
        values[key] = decode(q, codes.reshape(k, -1), scale, variable.shape)
    load(values)


def _key(layer, attr, values):
    """The key under which the float layer's `save_own_variables` wrote
    weight `attr` (found by its values)."""
    weight = np.asarray(getattr(layer, attr))
    for key, value in values.items():
        value = np.asarray(value)
        if value.shape == weight.shape and np.array_equal(value, weight):
            return key
    raise ValueError(
        f"Layer {layer.name!r}: its saved variables hold no {attr!r}."
    )
