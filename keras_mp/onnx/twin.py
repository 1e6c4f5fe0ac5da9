"""A float32 twin of a model whose layers compute in float16 or bfloat16.

Export traces the twin, so the ONNX graph is float32 at its boundaries and
between its Q/DQ pairs whatever policy the model was trained under; see
`docs/export.md` ("Mixed-precision models").
"""

import keras

from keras_mp._models import walk_layers
from keras_mp.onnx.errors import ExportError

HALF_DTYPES = ("float16", "bfloat16")
# Dtype policy names that compute in 16 bits.
_HALF_POLICIES = ("mixed_float16", "mixed_bfloat16") + HALF_DTYPES


def half_compute_dtype(model):
    """The 16-bit compute dtype of `model`'s layers, or None.

    Args:
        model: a `keras.Model`.

    Returns:
        `"float16"` or `"bfloat16"` when some layer computes in it
        (`"float16"` when both occur), else None.
    """
    found = {
        layer.compute_dtype
        for layer in walk_layers(model)
        if layer.compute_dtype in HALF_DTYPES
    }
    if not found:
        return None
    return "float16" if "float16" in found else "bfloat16"


# Config keys that hold a policy by name: a layer's `dtype`, the
# `default_policy` of a `DTypePolicyMap` (keras-hub backbones carry one).
_POLICY_KEYS = ("dtype", "default_policy")


def _float32_config(value):
    """`value` (a serialized config) with every 16-bit policy -> float32:
    policies given by name, serialized `DTypePolicy` objects, and the
    default and per-layer policies of a `DTypePolicyMap`."""
    if isinstance(value, list):
        return [_float32_config(v) for v in value]
    if not isinstance(value, dict):
        return value
    config = value.get("config")
    if (
        str(value.get("class_name", "")).endswith("DTypePolicy")
        and isinstance(config, dict)
        and config.get("name") in _HALF_POLICIES
    ):
        return {**value, "config": {**config, "name": "float32"}}
    return {
        key: "float32"
        if key in _POLICY_KEYS and v in _HALF_POLICIES
        else _float32_config(v)
        for key, v in value.items()
    }


def _copy_state(model, twin):
    """Every variable (weights, quantizer ranges, masks) and every
    quantizer's on/off switch from `model` to `twin`."""
    pairs = list(zip(model.weights, twin.weights))
    if len(model.weights) != len(twin.weights) or any(
        tuple(a.shape) != tuple(b.shape) for a, b in pairs
    ):
        raise ExportError(
            f"Model {model.name!r} rebuilt from its config under float32 "
            "does not have the same variables as the original, so it cannot "
            "be exported in float32. Rebuild the model under the float32 "
            "policy, copy the weights (`set_weights`) and export that."
        )
    for source, target in pairs:
        target.assign(keras.ops.cast(source.value, target.dtype))
    for source, target in zip(walk_layers(model), walk_layers(twin)):
        if hasattr(source, "enabled") and hasattr(target, "enabled"):
            target.enabled = source.enabled


def float32_twin(model):
    """A copy of `model` that computes in float32, with the same state.

    Every mixed or 16-bit dtype policy in the model's config is rewritten
    to `"float32"`, the model is rebuilt from that config (keras_mp layers
    through their registered names), and every variable is copied,
    quantizer ranges included. Under a mixed policy the variables are
    float32 already, so the copy is exact.

    Args:
        model: a Sequential or Functional `keras.Model`.

    Returns:
        A new `keras.Model`.

    Raises:
        ExportError: the model cannot be rebuilt from its config (e.g. an
            unregistered custom layer) or rebuilds with other variables.

    Example:

    >>> twin = float32_twin(mixed_model)
    >>> twin.layers[1].compute_dtype
    'float32'
    """
    serialized = keras.saving.serialize_keras_object(model)
    try:
        twin = keras.saving.deserialize_keras_object(
            _float32_config(serialized), safe_mode=False
        )
    except Exception as e:  # any layer's from_config can fail its own way
        raise ExportError(
            f"Model {model.name!r} computes in 16 bits, and export traces a "
            "float32 copy rebuilt from its config, which failed "
            f"({type(e).__name__}: {e}). Register custom layers with "
            "`keras.saving.register_keras_serializable`, or rebuild the "
            "model under the float32 policy, copy its weights and export "
            "that."
        ) from e
    _copy_state(model, twin)
    return twin
