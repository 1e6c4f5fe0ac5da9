"""`upgrade`: the current form of a model saved by an earlier keras_mp.

Every kind of legacy file goes through this one function: a quantized
graph copy of `QuantizeWrapper` layers, an annotated one of
`QuantizeAnnotate` layers (their load-only classes: `legacy.py`), and a
MuPPET model of `FixedPointWrapper` layers (`keras_mp.muppet.legacy`).
Files of the `RecordedModel` era need no upgrade: their record is applied
on load (op sites of hand-written twins included, `recipe.py`); nor do
files of the `QuantizedModel` / `SparseModel` containers (they load as a
`RecordedModel`) or configs with old format names (`"fp8"`, `num_bits`:
read silently, `names.py`).
"""

from keras_mp import _models, _record
from keras_mp.quantization import attach, twins
from keras_mp.quantization.config import QuantizeConfig
from keras_mp.quantization.legacy import (
    LEGACY_CLASSES,
    QuantizeAnnotate,
    legacy_layers,
)
from keras_mp.quantization.recipe import Recipe, apply_recipe


def upgrade(model):
    """The current form of a model loaded from a file of an earlier keras_mp.

    A Sequential or Functional model quantized before every model was
    quantized in place holds `QuantizeWrapper` layers named
    `quant_<name>`; one annotated by the old `quantize_annotate_layer`
    holds `QuantizeAnnotate` layers. `upgrade` gives the model keras_mp
    makes today: a `keras_mp.RecordedModel` whose layers have their own
    names, with the same placement, weights and ranges (same outputs); for
    an annotated model, a float model whose layers carry the annotation,
    ready for `keras_mp.quantize_apply`. A MuPPET model of `FixedPointWrapper`
    layers comes back as `keras_mp.fixed_point_model` makes it today
    (fixed-point layers in place, same word length, weights and switching
    state). Files of the `QuantizedModel` and `SparseModel` containers, and
    configs naming formats the old way (`"fp8"`, `num_bits`), load in the
    current form: they need no upgrade, only saving again.

    Args:
        model: a `keras.Model` loaded from an old `.keras` file.

    Returns:
        A new `keras.Model`; `model` is left as it is.

    Raises:
        ValueError: `model` holds no layer of an earlier keras_mp, or holds
            them beside layers quantized the current way.
        TypeError: `model` is not a Keras 3 model.

    Example:

    >>> old = keras.saving.load_model("quantized_v0.keras")  # doctest: +SKIP
    >>> qmodel = keras_mp.upgrade(old)  # doctest: +SKIP
    >>> qmodel.save("quantized.keras")  # doctest: +SKIP
    """
    # muppet sits beside quantization: imported on use, not at load
    from keras_mp.muppet import legacy as muppet_legacy

    _models.check_model(model, "upgrade")
    found = legacy_layers(model)
    if not found and muppet_legacy.legacy_fixed_point_layers(model):
        return muppet_legacy.upgrade_fixed_point(model)
    if not found:
        raise ValueError(
            f"`upgrade`: model {model.name!r} holds no QuantizeWrapper, "
            "QuantizeAnnotate or FixedPointWrapper layer of an earlier "
            "keras_mp: there is nothing to upgrade. A float model is "
            "quantized with `keras_mp.quantize_model(model)`; a file of the "
            "QuantizedModel or SparseModel container, or one naming formats "
            "the old way ('fp8', num_bits), already loads in the current "
            "form (save it again to write it so)."
        )
    if twins.quantized_layers(model):
        raise ValueError(
            f"`upgrade`: model {model.name!r} holds both layers of an earlier "
            "keras_mp (QuantizeWrapper/QuantizeAnnotate) and layers quantized "
            "the current way; keras_mp never builds such a model, and "
            "nothing was changed. Upgrade the old model on its own first "
            "(`keras_mp.upgrade(old)` on the model loaded from its file), "
            "then quantize more layers of it, or of the float model "
            "`keras_mp.strip_quantization(upgraded)` gives back."
        )
    floats, sources = _models.unwrapped_copy(model, LEGACY_CLASSES)
    walked = _models.walk(floats)
    entries = []
    for index, (layer, _) in enumerate(walked):
        source = sources.get(id(layer))
        if source is None:
            continue
        config = source.config or QuantizeConfig()
        if isinstance(source, QuantizeAnnotate):
            setattr(layer, attach.ANNOTATION, config)
            continue
        entries.append(
            {
                "index": index,
                "class_name": _models.class_name(layer),
                "config": config.get_config(),
                "inputs": list(source.input_indices),
            }
        )
    if not entries:
        return floats
    recipe = Recipe(
        tuple(entries), tuple(_models.class_name(x) for x, _ in walked)
    )
    apply_recipe(floats, recipe)
    for entry in entries:
        twin, source = (
            walked[entry["index"]][0],
            sources[id(walked[entry["index"]][0])],
        )
        for new, old in zip(twin.input_quantizers, source.input_quantizers):
            new.amax.assign(old.amax)
        for new, old in zip(twin.inner_quantizers, source.inner_quantizers):
            new.amax.assign(old.amax)
        if twin.inner_quantizers and not source.inner_quantizers:
            # Saved before separable convolutions had a pointwise Q/DQ.
            twin.inner_quantizers[0].enabled = False
        for new, (_, _, amax) in zip(
            twin.weight_quantizers, source.weight_ranges
        ):
            new.amax.assign(amax)
    return _record.RecordedModel(floats, name=model.name)
