"""Quantization in place: any Keras 3 model, layers at any depth.

Used for the models a layer-graph copy cannot reach: subclassed models,
layers inside custom layers (keras-hub backbones, `MultiHeadAttention`), and
Functional subclasses. The model is copied through its config (or, with
`in_place=True`, taken as it is), the selected layers are turned into their
quantized twins (`twins.py`) by a recipe (`recipe.py`), and the result is
a `QuantizedModel` (`model.py`) that saves that recipe.
"""

import warnings

import keras

from keras_mp import layer_table
from keras_mp.quantization.config import QuantizeConfig
from keras_mp.quantization.layers import quantizable_row
from keras_mp.quantization.model import QuantizedModel
from keras_mp.quantization.recipe import (
    apply_recipe,
    check_same_structure,
    float_class_name,
    make_recipe,
    walk,
)
from keras_mp.selection import layer_matcher

# Attribute that `quantize_annotate_model` sets on the layers it marks in a
# model it cannot rewrite as a graph.
ANNOTATION = "_keras_mp_annotation"


def copy_state(source, target):
    """Copies every layer's own variables (Keras' per-layer save format)
    from `source` to `target`, two models of the same structure; quantizer
    state is left out, so either may be quantized."""
    pairs = [(source, target)] + [
        (a, b)
        for (a, _), (b, _) in zip(walk(source), walk(target), strict=True)
    ]
    for a, b in pairs:
        store = {}
        a.save_own_variables(store)
        b.load_own_variables(store)


def rebuild(model, config, caller, advice):
    """`model` rebuilt from its float `config`, checked to be the same
    model layer for layer, with `model`'s weights (quantizers left out).

    `caller` names the function for the errors; `advice` says what else
    to do when the model cannot be rebuilt."""
    try:
        fresh = keras.saving.deserialize_keras_object(config, safe_mode=False)
    except Exception as e:  # any layer's from_config can fail its own way
        raise ValueError(
            f"`{caller}` needs model {model.name!r} rebuilt from its config, "
            f"and that failed ({type(e).__name__}: {e}). Give "
            f"{type(model).__name__} a `get_config()` returning its "
            "constructor arguments (and register it with "
            f"`keras.saving.register_keras_serializable()`), or {advice}"
        ) from e
    layers = [float_class_name(layer) for layer, _ in walk(model)]
    check_same_structure(fresh, layers, caller)
    copy_state(model, fresh)
    return fresh


def copy_model(model, caller):
    """A float copy of `model`, rebuilt from its config, same weights."""
    return rebuild(
        model,
        keras.saving.serialize_keras_object(model),
        caller,
        "quantize the model object itself with "
        "`keras_mp.quantize_model(model, in_place=True)` (it cannot be "
        "saved as .keras then; `save_weights` works).",
    )


def config_for(chain, config):
    """The `QuantizeConfig` of the first entry of `config` matching a layer
    of `chain` (the layer, then the layers holding it, nearest first)."""
    if config is None or isinstance(config, QuantizeConfig):
        return config
    if not isinstance(config, dict):
        raise TypeError(
            "`config` must be a QuantizeConfig or a dict mapping layer "
            "names (or regexes) to QuantizeConfig. Received: "
            f"{type(config).__name__}"
        )
    for layer in chain:
        for key, value in config.items():
            if layer_matcher(key)(layer):
                return value
    return None


def _annotation(chain):
    from keras_mp.quantization.annotate import QuantizeAnnotate

    for layer in chain:
        if hasattr(layer, ANNOTATION):
            return getattr(layer, ANNOTATION)
        if isinstance(layer, QuantizeAnnotate):
            return layer.config or QuantizeConfig()
    return None


def choose(model, layers=None, config=None, annotated=False):
    """`{walk index: QuantizeConfig}` of the layers of `model` to quantize.

    A layer is selected when it or a layer holding it matches `layers`; its
    config is the first entry of `config` that matches it or, nearest
    first, a layer holding it (so a custom layer's name selects and
    configures everything inside it). With `annotated`, only the layers
    `quantize_annotate_*` marked (or held by a marked layer) count.
    """
    from keras_mp.quantization.annotate import QuantizeAnnotate

    match = layer_matcher(layers)
    chosen = {}
    for index, (layer, parents) in enumerate(walk(model)):
        if isinstance(
            layer, (keras.Model, keras.layers.InputLayer, QuantizeAnnotate)
        ):
            continue
        chain = (layer,) + tuple(reversed(parents))
        if not any(match(item) for item in chain):
            continue
        layer_config = config_for(chain, config)
        if annotated:
            layer_config = _annotation(chain)
            if layer_config is None:
                continue
        if layer_config is not None and layer_config.skip:
            continue
        if quantizable_row(layer) is None or not layer.built:
            continue
        chosen[index] = layer_config or QuantizeConfig()
    return chosen


def _nothing_to_quantize(model, layers):
    return ValueError(
        f"No quantizable layer in model {model.name!r} matches "
        f"layers={layers!r}. Supported types: "
        f"{', '.join(layer_table.quantizable_names())}."
    )


def annotate_in_place(model, layers, config):
    """`quantize_annotate_model` for a model that is not a layer graph: a
    copy whose selected layers carry their `QuantizeConfig` (read by
    `quantize_apply`)."""
    choices = choose(model, layers, config)
    if not choices:
        raise _nothing_to_quantize(model, layers)
    copy = copy_model(model, "quantize_annotate_model")
    walked = walk(copy)
    for index, layer_config in choices.items():
        setattr(walked[index][0], ANNOTATION, layer_config)
    return copy


def quantize_in_place(
    model, layers=None, config=None, annotated=False, in_place=False
):
    """Quantizes `model` (a copy of it, unless `in_place`) in place.

    Returns:
        A `QuantizedModel`.
    """
    from keras_mp.quantization.annotate import skip_indices

    caller = "quantize_apply" if annotated else "quantize_model"
    choices = choose(model, layers, config, annotated)
    if not choices:
        if annotated:
            raise ValueError(
                f"Model {model.name!r} has no annotated layer. Call "
                "keras_mp.quantize_annotate_model(model) first, or use "
                "keras_mp.quantize_model(model)."
            )
        raise _nothing_to_quantize(model, layers)
    target = model if in_place else copy_model(model, caller)
    recipe = make_recipe(target, choices, skip_indices)
    if not recipe.entries:
        raise _nothing_to_quantize(model, layers)
    apply_recipe(target, recipe)
    qmodel = QuantizedModel(target, recipe, name=model.name)
    if in_place:
        _warn_if_unsaveable(qmodel)
    return qmodel


def _warn_if_unsaveable(qmodel):
    """Says now, rather than at the end of training, that a model quantized
    in place cannot be saved as `.keras` (the copy path has already rebuilt
    it from its config)."""
    try:
        qmodel.get_config()
    except ValueError as e:
        warnings.warn(
            f"{e} Until then, `save_weights` is the way to keep its weights "
            "and quantizer ranges.",
            stacklevel=4,
        )
