"""The 2:4 masks' section of the one record (`_record.RecordedModel`), and
`SparseModel`, the container of earlier keras_mp (load only).

Keras rebuilds a custom layer's sublayers (and a subclassed model's or a
keras-hub backbone's) from their parent's code, so a `SparsityMask` set on
one of them is not in the config and would be gone on load. The record
lists, per masked kernel, its layer's position in the walk and the mask's
settings; loading rebuilds the model, attaches the masks, and only then do
the weights and the mask variables load.
"""

import keras

from keras_mp import _models, _record, layer_table
from keras_mp.sparsity.masks import SparsityMask


def _mask_of(layer):
    verdict = layer_table.prunable_weight(layer)
    if not verdict.ok:
        return None
    kernel = getattr(layer, verdict.value.attr, None)
    constraint = getattr(kernel, "constraint", None)
    return constraint if isinstance(constraint, SparsityMask) else None


def attach_mask(layer, mask):
    """Sets `mask` (a `SparsityMask`) as the constraint of the kernel that
    2:4 sparsity prunes in `layer` (a built layer of a supported type)."""
    weight = layer_table.prunable_weight(layer).value
    getattr(layer, weight.attr).constraint = mask
    setattr(layer, weight.constraint, mask)


def mask_record(model, walked):
    """The sparsity section of the record (`_record.make_record`):
    `{"masks": [{"index", "mask"}]}`, each masked kernel's layer by its
    index in `walked`; None when no kernel has a mask."""
    masks = []
    for index, (layer, _) in enumerate(walked):
        mask = _mask_of(layer)
        if mask is not None:
            masks.append({"index": index, "mask": mask.get_config()})
    return {"masks": masks} if masks else None


def apply_masks(model, record, walked):
    """Attaches to `model` the masks `record` (from `mask_record`) lists."""
    for entry in record["masks"]:
        _attach_saved(walked[entry["index"]][0], entry["mask"])


def _attach_saved(layer, config):
    have = _mask_of(layer)
    if have is not None and have.get_config() == config:
        return  # its own config (a layer of a graph) made it already
    attach_mask(layer, SparsityMask(**config))


_record.register_section("sparsity", mask_record, apply_masks, order=10)


def apply_legacy_mask_record(model, record):
    """Attaches the masks of a `SparseModel` file's record (by position in
    the walk without nested models, and its class names).

    Raises:
        ValueError: the walk of `model` is not the recorded one.
    """
    walked = list(_models.walk_layers(model))
    found = [type(x).__name__ for x in walked]
    difference = _models.first_difference(found, record["layers"])
    if difference is not None:
        where, got, want = difference
        raise ValueError(
            f"Model {model.name!r} is not the model its 2:4 masks were "
            f"recorded for: layer {where} of its walk is {got}, the record "
            f"says {want} ({len(found)} layers found, "
            f"{len(record['layers'])} recorded). Load the file with the code "
            "that saved it."
        )
    for entry in record["masks"]:
        _attach_saved(walked[entry["index"]], entry["mask"])


@keras.saving.register_keras_serializable(package="keras_mp")
class SparseModel(_record.LoadOnlyContainer):
    """The 2:4 mask container of keras_mp before one record held every
    kind of state: kept so that its files load.

    Loading such a file (`keras.saving.load_model(path, safe_mode=True)`)
    gives a `keras_mp.RecordedModel` with every `SparsityMask` (mask,
    schedule progress, `kept_magnitude`). Wrap a pruned model in
    `keras_mp.RecordedModel(model)` to save its masks at any depth.

    Args:
        model: a built `keras.Model`.
        **kwargs: `name`, `trainable`.
    """

    REPLACEMENT = (
        "Wrap the model in `keras_mp.RecordedModel(model)`, which saves its "
        "2:4 masks (and any other keras_mp state)."
    )

    @classmethod
    def apply_old_record(cls, model, config):
        apply_legacy_mask_record(model, config["sparsity"])
