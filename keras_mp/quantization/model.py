"""The quantization section of the one record (`_models.RecordedModel`),
and `QuantizedModel`, the container of earlier keras_mp (load only).

The record names every quantized layer by its index in the walk, with its
`QuantizeConfig`, its Q/DQ placement and the quantizers turned off; loading
rebuilds the float model, turns those layers into their quantized twins
again (`recipe.attach`), and only then do the weights and ranges load.
"""

import warnings

import keras

from keras_mp import _models
from keras_mp.quantization import twins
from keras_mp.quantization.config import QuantizeConfig
from keras_mp.quantization.layers import quantizable_row
from keras_mp.quantization.recipe import Recipe, apply_recipe, attach


def quantization_record(model, walked):
    """`{"entries": [...]}`: one entry per quantized layer of `walked` (its
    `index`, `class_name`, `config`, `inputs`, and `calls` for a shared
    layer, `off` for quantizers turned off); None when there is none."""
    entries = []
    for index, (layer, _) in enumerate(walked):
        if not twins.is_quantized(layer):
            continue
        attention = quantizable_row(layer).attention
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
        if not layer.enabled:
            entry["enabled"] = False
        off = [k for k, q in layer.named_quantizers().items() if not q.enabled]
        if off and layer.enabled:
            entry["off"] = off
        entries.append(entry)
    return {"entries": entries} if entries else None


def apply_quantization_record(model, record, walked):
    """Quantizes the float `model` in place as `record` says."""
    for entry in record["entries"]:
        layer, parents = walked[entry["index"]]
        attach(
            layer,
            quantizable_row(layer),
            QuantizeConfig.from_config(entry["config"]),
            entry["inputs"],
            _models.layer_path(layer, parents),
            entry.get("calls", 1),
        )
        if entry.get("enabled", True) is False:
            layer.enabled = False
        named = layer.named_quantizers()
        for key in entry.get("off", ()):
            named[key].enabled = False


_models.register_section(
    "quantization", quantization_record, apply_quantization_record, order=20
)


@keras.saving.register_keras_serializable(package="keras_mp")
class QuantizedModel(_models.RecordedModel):
    """The quantized model container of keras_mp before one record held
    every kind of state: kept so that its files load.

    Loading such a file (`keras.saving.load_model(path, safe_mode=True)`)
    gives a `keras_mp.RecordedModel` with the same layers, ranges and
    outputs. `keras_mp.quantize_model` returns a `RecordedModel`; so does
    this constructor's replacement, `keras_mp.RecordedModel(model)`.

    Args:
        model: the `keras.Model` quantized in place.
        recipe: ignored (the record is read from the model's layers).
        **kwargs: `name`, `trainable`.
    """

    def __init__(self, model, recipe=None, **kwargs):
        warnings.warn(
            "`keras_mp.QuantizedModel` is load-only: "
            "`keras_mp.quantize_model` returns a `keras_mp.RecordedModel`, "
            "and `keras_mp.RecordedModel(model)` wraps a model quantized in "
            "place. This one saves as a RecordedModel.",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(model, **kwargs)

    @classmethod
    def apply_saved_record(cls, model, config):
        if "record" in config:  # saved by this keras_mp
            _models.apply_record(model, config["record"])
            return
        apply_recipe(model, Recipe.from_config(config["recipe"]))
