"""The "muppet" section of a saved model's record: which layers are fixed
point, with which seed and which model inputs they quantize, and which one
holds the `PrecisionState`.

Keras rebuilds the sublayers of custom layers, subclassed models and
keras-hub backbones from their parents' code, as float layers: the
container saves the float model's config and this record, and re-applies
it on load before the weights (word lengths, random streams, gradient
records, switching state) load. A layer is named by its position in
`keras_mp._models.walk`, which is the same for two models built by the
same code.
"""

from keras_mp import _models
from keras_mp.muppet import twins


def fixed_point_record(model, walked):
    """The record of `model`'s fixed-point layers, or None when it has none.

    Args:
        model: the inner model of a container.
        walked: `keras_mp._models.walk(model)`.

    Returns:
        `{"layers": [{"index", "seed", "weights", "inputs", "sites"},
        ...], "state": index}` (JSON-able; `sites` only for a layer with
        op sites), or None.
    """
    del model  # the walk names every layer
    entries, state = [], None
    for index, (layer, _) in enumerate(walked):
        if not twins.is_fixed_point(layer):
            continue
        fixed = layer.fixed_point
        entry = {
            "index": index,
            "seed": int(fixed.seed),
            "weights": bool(fixed.weight_shapes),
            "inputs": list(fixed.inputs),
        }
        if layer.op_sites:
            entry["sites"] = layer.op_sites
        entries.append(entry)
        if fixed.precision_state is not None:
            state = index
    if not entries:
        return None
    return {"layers": entries, "state": state}


def apply_fixed_point_record(model, record, walked):
    """Switches the layers `record` names to fixed point, in place, and
    creates the `PrecisionState` where it was.

    Args:
        model: the float model rebuilt from its config.
        record: from `fixed_point_record`.
        walked: `keras_mp._models.walk(model)`.

    Raises:
        ValueError: the record names a layer the model does not have.
    """
    for entry in record["layers"]:
        index = entry["index"]
        if index >= len(walked):
            raise ValueError(
                f"The fixed-point record names layer {index} of the walk of "
                f"model {model.name!r}, which has {len(walked)} layers. Load "
                "it into a model built by the same code."
            )
        layer, parents = walked[index]
        twins.attach(
            layer,
            entry["seed"],
            entry.get("inputs", ()),
            entry.get("weights", True),
            entry.get("sites", ()),
            _models.layer_path(layer, parents),
        )
    if record.get("state") is not None:
        walked[record["state"]][0].fixed_point.hold_precision_state()
