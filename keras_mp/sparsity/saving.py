"""`SparseModel`: a pruned model saved as its config plus a record of its
2:4 masks.

Keras rebuilds a custom layer's sublayers (and a subclassed model's or a
keras-hub backbone's) from their parent's code, so a `SparsityMask` set on
one of them is not in the config and would be gone on load. This
container's config is the inner model's config plus, per masked kernel,
its position in the layer walk and the mask's settings; `from_config`
rebuilds the inner model, attaches the masks, and only then do the weights
and the mask variables load.
"""

import keras

from keras_mp import _models, layer_table
from keras_mp.sparsity.masks import SparsityMask


def _walk(model):
    return list(_models.walk_layers(model))


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


def mask_record(model):
    """The masks of `model` by walk position, and the walk's class names."""
    walked = _walk(model)
    masks = []
    for index, layer in enumerate(walked):
        mask = _mask_of(layer)
        if mask is not None:
            masks.append({"index": index, "mask": mask.get_config()})
    return {"layers": [type(x).__name__ for x in walked], "masks": masks}


def apply_mask_record(model, record):
    """Attaches to `model` the masks `record` (from `mask_record`) lists.

    Raises:
        ValueError: the walk of `model` is not the recorded one.
    """
    walked = _walk(model)
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
        layer = walked[entry["index"]]
        have = _mask_of(layer)
        if have is not None and have.get_config() == entry["mask"]:
            continue  # its own config (a layer of a graph) made it already
        attach_mask(layer, SparsityMask(**entry["mask"]))


@keras.saving.register_keras_serializable(package="keras_mp")
class SparseModel(_models.RecordedModel):
    """A model whose 2:4 masks survive `.keras` save/load at any depth.

    Wrap a model whose pruned layers sit inside custom layers, a subclassed
    model or a keras-hub backbone (before or after `fit` with
    `StructuredSparsity`) and save the wrapper:
    `keras.saving.load_model(path, safe_mode=True)` gives back every
    `SparsityMask` with its mask, schedule progress (`kept`) and
    `kept_magnitude`. It calls the wrapped model (`self.model`) on its
    inputs; its config is that model's config plus a record of which layer
    of the walk has which mask, taken when it is saved.

    Args:
        model: a built `keras.Model` that its config rebuilds (a subclassed
            model needs `get_config()` and registration).
        **kwargs: `name`, `trainable`.

    Raises:
        ValueError: at save time (`get_config`), when `model` cannot be
            rebuilt from its config as the same model.

    Example:

    >>> sparse = SparseModel(model)  # doctest: +SKIP
    >>> sparse.compile("adam", "mse")  # doctest: +SKIP
    >>> sparse.fit(x, y, callbacks=[StructuredSparsity()])  # doctest: +SKIP
    >>> sparse.save("sparse.keras")  # doctest: +SKIP
    """

    RECORD_KEY = "sparsity"
    SAVED_WHAT = "with its 2:4 masks"

    def record(self):
        return mask_record(self.model)

    @classmethod
    def apply_record(cls, model, record):
        apply_mask_record(model, record)

    def reload_hint(self):
        return (
            "into a model rebuilt by the same code, after "
            "`StructuredSparsity(...).set_model(model)`"
        )
