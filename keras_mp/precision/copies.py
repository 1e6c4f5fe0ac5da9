"""The copies `layer_sensitivity` and `auto_quantize` quantize, named after
the user's model.

A copy is rebuilt from the model's config, so a layer that creates its
sublayers in `build` without names (keras-rs `FeatureCross` makes a
`Dense`) gets new counter names in each copy: `cross1/dense` in the
user's model is `cross1/dense_6` in one copy and `cross1/dense_9` in the
next. Rows, choices and the ranges shared between copies are keyed by the
user's model's paths instead, each copy layer matched to the model's layer
at the same position of the walk (`keras_mp._models.walk`, the walk whose
class structure `rebuild` checks to be the model's).
"""

from keras_mp import _models, _record
from keras_mp.quantization import twins

_COPY_ADVICE = (
    "so that `layer_sensitivity` and `auto_quantize`, which quantize "
    "copies of the model (one per precision, one per configuration "
    "measured), can make them."
)


def float_copy(model, caller):
    """A float copy of `model` to quantize in place, and `paths_in(model,
    copy)`; one that cannot be made gets this feature's advice."""
    copy = _models.copy_model(model, caller, _COPY_ADVICE)
    return copy, paths_in(model, copy)


def paths_in(model, copy):
    """`{id(copy layer): path of the same layer in model}` for `copy`, a
    float or quantized copy of `model` (a `keras_mp.RecordedModel` is read
    through to the model it holds, as reports name layers)."""
    pairs = zip(
        _models.walk(_record.contents(copy)),
        _models.walk(_record.contents(model)),
        strict=True,
    )
    return {
        id(layer): _models.layer_path(*theirs) for (layer, _), theirs in pairs
    }


def quantizers_by_path(qmodel, paths):
    """`{name: Quantizer}` of every quantizer of `qmodel` (`twins.
    quantizers`), each name's layer path replaced by the path `paths`
    gives that layer (`paths_in`)."""
    own = _models.layer_paths(_record.contents(qmodel))
    found = {}
    for q in twins.quantizers(qmodel):
        path = own.get(id(q.layer))
        name = q.name
        if path is not None and id(q.layer) in paths:
            name = paths[id(q.layer)] + q.name[len(path) :]
        found[name] = q
    return found
