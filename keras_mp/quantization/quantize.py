"""Annotate -> apply: which layers get quantized, for any Keras 3 model.

tfmot's flow (annotate, apply, fine-tune, strip) with one mechanism for
every model: Sequential, Functional, subclassed, keras-hub backbones,
layers inside custom layers or `MultiHeadAttention`. The selected layers
of a copy of the model (or of the model itself, `in_place=True`) become
their quantized twins where they are (`attach.py`), keeping their names;
where the Q/DQ go is `placement.py`'s decision.
"""

import keras

from keras_mp import _models
from keras_mp._compat import require_tensorflow
from keras_mp.quantization import attach
from keras_mp.quantization.activation import quantizable_row
from keras_mp.quantization.config import QuantizeConfig
from keras_mp.quantization.legacy import check_current
from keras_mp.quantization.twins import check_float


def quantize_annotate_layer(layer, config=None):
    """Marks one layer for quantization (use it while building a model).

    The layer itself is returned, marked: it computes as before, and
    `quantize_apply` quantizes the marked layers of the model built with
    it. The mark is not saved with the model: quantize before saving.

    Args:
        layer: `keras.layers.Layer` of a supported type.
        config: `QuantizeConfig`. Defaults to the type's defaults.

    Returns:
        `layer`, marked.

    Raises:
        TypeError: `layer` is not a Keras 3 layer.
        ValueError: the layer type is not supported.

    Example:

    >>> model = keras.Sequential([
    ...     keras.Input((28, 28, 1)),
    ...     keras_mp.quantize_annotate_layer(keras.layers.Conv2D(8, 3)),
    ...     keras.layers.Flatten(),
    ...     keras.layers.Dense(10),
    ... ])
    >>> qmodel = keras_mp.quantize_apply(model)
    """
    if not isinstance(layer, keras.layers.Layer):
        raise TypeError(
            f"Expected a Keras 3 layer. Received: {type(layer).__name__}"
        )
    if quantizable_row(layer) is None:
        raise attach.unsupported(layer)
    if config is not None and not isinstance(config, QuantizeConfig):
        raise TypeError(
            "`config` must be a QuantizeConfig. Received: "
            f"{type(config).__name__}"
        )
    attach.annotate(layer, config or QuantizeConfig())
    return layer


def _check_float_model(model, caller):
    _models.check_model(model, caller)
    check_current(model, caller)
    check_float(model, caller)
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} has never been called, so its layers "
            f"have no weights yet for `{caller}`. Build it with "
            "`keras.Input(...)` or call it once on a batch first."
        )


def quantize_annotate_model(model, layers=None, config=None):
    """Marks layers of a model for quantization.

    Args:
        model: a built `keras.Model` of any kind (nested models, custom
            layers and subclassed models included).
        layers: which layers: a name, regex, layer class, callable, or a list
            of them; a custom layer's or a nested model's name selects the
            layers inside it. Defaults to every supported layer.
        config: a `QuantizeConfig` for all, or a dict mapping names/regexes
            to `QuantizeConfig` (a key matching a custom layer or a nested
            model configures everything inside it). `QuantizeConfig(skip=
            True)` leaves a layer in float.

    Returns:
        A copy of `model` (same weights) whose selected layers are marked
        for `quantize_apply`.

    Raises:
        TypeError: a tf_keras or non-Keras model.
        ValueError: the selection names an unsupported layer, or matches
            no quantizable layer; a model that cannot be copied.

    Example:

    >>> annotated = keras_mp.quantize_annotate_model(model, layers="conv.*")
    >>> qmodel = keras_mp.quantize_apply(annotated)
    """
    _check_float_model(model, "quantize_annotate_model")
    return attach.annotate_in_place(model, layers, config)


def quantize_apply(model):
    """Quantizes every annotated layer.

    Returns a `keras_mp.RecordedModel` holding a copy of `model` whose
    annotated layers are quantized in place (same names, weights and layer
    state); weight ranges are set from the weights. Activation ranges
    start at 0 (not calibrated): run `keras_mp.calibrate` (PTQ) before
    `fit` (QAT) or export.

    Args:
        model: a model from `quantize_annotate_model`, or one built with
            `quantize_annotate_layer`.

    Returns:
        The quantized `keras_mp.RecordedModel`.

    Raises:
        ValueError: nothing is annotated, the model is already quantized or
            cannot be copied.
        TypeError: a tf_keras or non-Keras model.

    Example:

    >>> qmodel = keras_mp.quantize_apply(
    ...     keras_mp.quantize_annotate_model(model)
    ... )
    >>> keras_mp.calibrate(qmodel, x[:512])
    """
    require_tensorflow("keras_mp.quantize_apply")
    _check_float_model(model, "quantize_apply")
    return attach.quantize_in_place(model, annotated=True)


def quantize_model(
    model, config=None, layers=None, in_place=False, precision=None
):
    """Annotates and applies in one call: the quantized copy of `model`.

    Any Keras 3 model: Sequential, Functional, subclassed, and models built
    from keras-hub backbones, with layers at any depth (inside custom
    layers, inside `MultiHeadAttention`). The selected layers of a copy of
    `model` are quantized where they are and keep their names, so outputs,
    `loss` dict keys, `get_layer(name)` and the ONNX input and output names
    are the float model's. The result is a `keras_mp.RecordedModel`, which
    saves as `.keras` and loads with `safe_mode=True`.

    Args:
        model: a built `keras.Model`.
        config: `QuantizeConfig` or dict of them (see
            `quantize_annotate_model`).
        layers: selection (see `quantize_annotate_model`). Defaults to every
            supported layer.
        in_place: bool. Quantize the layers of `model` itself instead of a
            copy rebuilt from its config; for a model that has no working
            `get_config()` (it then saves with `save_weights` only).
            Defaults to False.
        precision: str or None. `"int8"`, `"float8"` or `"int4"`
            (weight-only, blocks of 128; `"fp8"` is an old spelling of
            `"float8"`, with a `DeprecationWarning`): the precision of the
            selected layers that `config` does not configure (a layer
            `config` names keeps its `QuantizeConfig(precision=...)`, so
            one model mixes INT4, INT8, FP8 and float layers). Defaults to
            None (`"int8"`).

    Returns:
        A `keras_mp.RecordedModel` ready for `keras_mp.calibrate`.

    Raises:
        ValueError: the model is already quantized, was never built, has
            no quantizable layer in the selection, or cannot be rebuilt
            from its config (the message says what to do).
        TypeError: a tf_keras or non-Keras model.

    Example:

    >>> qmodel = keras_mp.quantize_model(model)
    >>> keras_mp.calibrate(qmodel, x_train[:2048], method="entropy")
    >>> qmodel.compile(...); qmodel.fit(...)  # optional QAT
    """
    require_tensorflow("keras_mp.quantize_model")
    _check_float_model(model, "quantize_model")
    default = QuantizeConfig(precision=precision or "int8")
    return attach.quantize_in_place(
        model, layers, config, in_place=in_place, default=default
    )
