"""Quantization in place: the one attach mechanism, for any Keras 3 model.

The model is copied once through its config (or, with `in_place=True`,
taken as it is), the selected layers become their quantized twins where
they are (`twins.py`), keeping their names, by a recipe (`recipe.py`, with
the placement of `placement.py`), and the result is a `keras_mp.RecordedModel`
(`_record.py`), whose record holds the quantized layers (`record.py`).
"""

import warnings

import keras

from keras_mp import _keras, _models, _record, layer_table
from keras_mp.quantization import placement
from keras_mp.quantization.activation import quantizable_row
from keras_mp.quantization.config import QuantizeConfig
from keras_mp.quantization.recipe import apply_recipe, make_recipe
from keras_mp.selection import layer_matcher

# Attribute set on the layers `quantize_annotate_*` marks (not saved).
ANNOTATION = "_keras_mp_annotation"

_COPY_ADVICE = (
    "or quantize the model object itself with "
    "`keras_mp.quantize_model(model, in_place=True)` (it cannot be saved as "
    ".keras then; `save_weights` works)."
)


def unsupported(layer):
    """The ValueError for a layer of a type that cannot be quantized."""
    supported = ", ".join(layer_table.quantizable_names())
    return ValueError(
        f"Layer {layer.name!r} of type {type(layer).__name__} cannot be "
        f"quantized. Supported types: {supported}. Leave it out of the "
        "selection or give it `QuantizeConfig(skip=True)`."
    )


def op_candidate(layer, parents):
    """Whether the ops of `layer`'s own code may be quantized at the op
    call (`op_sites`): a layer of no table row that is not Keras' own (those
    are in the table, or known float), not a model, and not inside a
    recurrent layer (whose loop TensorRT builds from float inputs)."""
    if isinstance(layer, keras.Model):
        return False
    if type(layer).__module__.split(".")[0] == "keras":
        return False
    return not any(isinstance(p, keras.layers.RNN) for p in parents)


def annotate(layer, config):
    """Marks `layer` for `quantize_apply` with `config`."""
    with _keras.unlocked(layer):
        object.__setattr__(layer, ANNOTATION, config)


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
    for layer in chain:
        if hasattr(layer, ANNOTATION):
            return getattr(layer, ANNOTATION)
    return None


def _check_names(model, walked, layers, config):
    """A ValueError when a layer name (or regex) of `layers` or of the keys
    of a `config` dict matches no layer of `model` at all."""
    names = [s for s in (layers if isinstance(layers, list) else [layers])]
    names = [s for s in names if isinstance(s, str)]
    if isinstance(config, dict):
        names += [k for k in config if isinstance(k, str)]
    for name in names:
        match = layer_matcher(name)
        if not any(match(layer) for layer, _ in walked):
            known = sorted({layer.name for layer, _ in walked})
            shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
            raise ValueError(
                f"No layer of model {model.name!r} is named (or matches) "
                f"{name!r}. Its layers: {shown}. Nothing was quantized."
            )


def choose(model, layers=None, config=None, annotated=False, default=None):
    """`{walk index: QuantizeConfig}` of the layers of `model` to quantize.

    A layer is selected when it or a layer holding it matches `layers`; its
    config is the first entry of `config` that matches it or, nearest
    first, a layer holding it (so a custom layer's or a nested model's
    name selects and configures everything inside it). With `annotated`,
    only the layers `quantize_annotate_*` marked (or held by a marked
    layer) count.

    Raises:
        ValueError: a name in `layers` or `config` matches no layer; a
            layer selected by its name is of an unsupported type.
    """
    walked = _models.walk(model)
    _check_names(model, walked, layers, config)
    match = layer_matcher(layers)
    chosen = {}
    for index, (layer, parents) in enumerate(walked):
        if isinstance(layer, (keras.Model, keras.layers.InputLayer)):
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
        if quantizable_row(layer) is None:
            if not op_candidate(layer, parents):
                named = isinstance(layers, str) and layer.name == layers
                if named and not _keras.sublayers(layer):
                    raise unsupported(layer)
                continue
        if layer.built:
            chosen[index] = layer_config or default or QuantizeConfig()
            placement.check_blocks(
                layer, _models.layer_path(layer, parents), chosen[index]
            )
    return chosen


def _nothing_to_quantize(model, layers):
    """The ValueError when no layer was selected, naming the layers that
    `layers` did match (e.g. an LSTM, whose cell holds no quantizable
    layer)."""
    matched = ""
    if layers is not None:
        match = layer_matcher(layers)
        found = [
            f"{layer.name} ({type(layer).__name__})"
            for layer, _ in _models.walk(model)
            if match(layer) and not isinstance(layer, keras.layers.InputLayer)
        ]
        if found:
            shown = ", ".join(found[:8]) + (", ..." if len(found) > 8 else "")
            matched = (
                f" It matches {shown}: neither these types nor any layer "
                "inside them can be quantized."
            )
    small = [
        layer.name
        for layer, _ in _models.walk(model)
        if placement.small_gemm(layer)
    ]
    if small:
        shown = ", ".join(small[:8]) + (", ..." if len(small) > 8 else "")
        matched += (
            f" Dense/EinsumDense layers with K or N below "
            f"{placement.MIN_GEMM_DIM} stay float ({shown}): TensorRT runs "
            "them no faster quantized; QuantizeConfig(small_gemms=True) "
            "quantizes them anyway."
        )
    recurrent = [
        f"{layer.name} ({type(layer).__name__})"
        for layer, _ in _models.walk(model)
        if isinstance(layer, (keras.layers.RNN, keras.layers.Bidirectional))
    ]
    if recurrent:
        shown = ", ".join(recurrent[:8])
        shown += ", ..." if len(recurrent) > 8 else ""
        matched += (
            f" Recurrent layers stay float ({shown}): TensorRT builds the "
            "matmuls of an ONNX LSTM/GRU/RNN op from float inputs only."
        )
    return ValueError(
        f"No quantizable layer in model {model.name!r} matches "
        f"layers={layers!r}.{matched} Supported types: "
        f"{', '.join(layer_table.quantizable_names())}. Nothing was "
        "quantized."
    )


def annotate_in_place(model, layers, config):
    """`quantize_annotate_model`: a copy whose selected layers carry their
    `QuantizeConfig` (read by `quantize_apply`)."""
    choices = choose(model, layers, config)
    if not choices:
        raise _nothing_to_quantize(model, layers)
    copy = _models.copy_model(model, "quantize_annotate_model", _COPY_ADVICE)
    walked = _models.walk(copy)
    for index, layer_config in choices.items():
        annotate(walked[index][0], layer_config)
    return copy


def quantize_in_place(
    model,
    layers=None,
    config=None,
    annotated=False,
    in_place=False,
    default=None,
):
    """Quantizes `model` (a copy of it, unless `in_place`) in place;
    `default` is the config of selected layers `config` does not name.

    Returns:
        A `keras_mp.RecordedModel`.
    """
    caller = "quantize_apply" if annotated else "quantize_model"
    choices = choose(model, layers, config, annotated, default)
    if not choices:
        if annotated:
            raise ValueError(
                f"Model {model.name!r} has no annotated layer. Call "
                "keras_mp.quantize_annotate_model(model) first, or use "
                "keras_mp.quantize_model(model)."
            )
        raise _nothing_to_quantize(model, layers)
    target = (
        model if in_place else _models.copy_model(model, caller, _COPY_ADVICE)
    )
    recipe = make_recipe(target, choices)
    if not recipe.entries:
        raise _nothing_to_quantize(model, layers)
    apply_recipe(target, recipe)
    qmodel = _record.RecordedModel(target, name=model.name)
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
