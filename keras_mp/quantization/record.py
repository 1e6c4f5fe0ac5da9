"""The quantization section of the one record (`_record.RecordedModel`),
and `QuantizedModel`, the container of earlier keras_mp (load only).

The record names every quantized layer by its index in the walk, with its
`QuantizeConfig`, its Q/DQ placement and the quantizers turned off; loading
rebuilds the float model, turns those layers into their quantized twins
again (`recipe.attach`), and only then do the weights and ranges load.
"""

import keras

from keras_mp import _models, _record
from keras_mp.quantization import legacy_twins, packed, pre_scale, twins
from keras_mp.quantization.recipe import Recipe, apply_entries, apply_recipe


def quantization_record(model, walked):
    """`{"entries": [...]}`: one entry per quantized layer of `walked` (its
    `index`, `class_name`, `config`, `inputs`, and `calls` for a shared
    layer, `off` for quantizers turned off, `pre_quant_scale` (its shape)
    for AWQ's input scale, `packed` for weights stored packed); None when
    there is none."""
    entries = []
    for index, (layer, _) in enumerate(walked):
        if not twins.is_quantized(layer):
            continue
        # an old file's MultiHeadAttention names its inputs
        attention = isinstance(layer, legacy_twins.QuantizedAttention)
        entry = {
            "index": index,
            "class_name": _models.class_name(layer),
            "config": layer.quantize_config.get_config(),
            "inputs": list(
                layer.input_names if attention else layer.input_indices
            ),
        }
        if layer.quantize_calls > 1:
            entry["calls"] = layer.quantize_calls
        if getattr(layer, "op_sites", None):
            entry["sites"] = layer.op_sites
            if getattr(layer, "site_attr", None):
                entry["quantizer_attr"] = layer.site_attr
        if not layer.enabled:
            entry["enabled"] = False
        off = [k for k, q in layer.named_quantizers().items() if not q.enabled]
        if off and layer.enabled:
            entry["off"] = off
        scale = pre_scale.get(layer)
        if scale is not None:  # AWQ: `calibrate(method="awq")`
            entry["pre_quant_scale"] = list(scale.scale_shape)
        if getattr(layer, packed.ATTR, None):  # `pack_weights`
            entry["packed"] = list(getattr(layer, packed.ATTR))
        entries.append(entry)
    return {"entries": entries} if entries else None


def apply_quantization_record(model, record, walked):
    """Quantizes the float `model` in place as `record` says."""
    apply_entries(model, walked, record["entries"])


_record.register_section(
    "quantization", quantization_record, apply_quantization_record, order=20
)


@keras.saving.register_keras_serializable(package="keras_mp")
class QuantizedModel(_record.LoadOnlyContainer):
    """The quantized model container of keras_mp before one record held
    every kind of state: kept so that its files load.

    Loading such a file (`keras.saving.load_model(path, safe_mode=True)`)
    gives a `keras_mp.RecordedModel` with the same layers, ranges and
    outputs. `keras_mp.quantize_model` returns a `RecordedModel`, and
    `keras_mp.RecordedModel(model)` wraps a model quantized in place.

    Args:
        model: the `keras.Model` quantized in place.
        *args: ignored (the recipe it took: the record is read from the
            model's layers).
        **kwargs: `name`, `trainable`.
    """

    REPLACEMENT = (
        "`keras_mp.quantize_model` returns a `keras_mp.RecordedModel`, and "
        "`keras_mp.RecordedModel(model)` wraps a model quantized in place."
    )

    @classmethod
    def apply_old_record(cls, model, config):
        apply_recipe(model, Recipe.from_config(config["recipe"]))
