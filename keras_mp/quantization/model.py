"""`QuantizedModel`: a model quantized in place, saved as its float config
plus the quantization recipe.

Keras rebuilds a custom layer's sublayers from the custom layer's own code,
so quantized twins inside it would come back as float layers on load.
This container's config is the float model's config and the recipe; its
`from_config` rebuilds the float model, applies the recipe, and only then
do the weights load, quantizer ranges included. A model that cannot be
rebuilt from its config fails at save time, never silently on load.
"""

import keras

from keras_mp import _models
from keras_mp.quantization.recipe import Recipe, apply_recipe


@keras.saving.register_keras_serializable(package="keras_mp")
class QuantizedModel(_models.RecordedModel):
    """A model whose layers were quantized in place (`keras_mp.quantize_model`
    on a subclassed or nested model, a keras-hub backbone, attention).

    It calls the quantized model (`self.model`) on its inputs. Saved, its
    config is the float model's config plus the recipe; loading rebuilds
    the float model, quantizes it again by the recipe and loads the weights
    and ranges, so `keras.saving.load_model(path, safe_mode=True)` gives the
    same outputs.

    Args:
        model: the `keras.Model` quantized in place by `recipe`.
        recipe: `keras_mp.quantization.recipe.Recipe` (or its config).
        **kwargs: `name`, `trainable`.

    Raises:
        ValueError: at save time (`get_config`), when `model` cannot be
            rebuilt from its config as the same model.

    Example:

    >>> qmodel = keras_mp.quantize_model(keras_hub_backbone)
    >>> qmodel.save("q.keras")
    >>> keras.saving.load_model("q.keras")
    """

    RECORD_KEY = "recipe"
    SAVED_WHAT = "with its config"

    def __init__(self, model, recipe, **kwargs):
        if isinstance(recipe, dict):
            recipe = Recipe.from_config(recipe)
        super().__init__(model, **kwargs)
        self.recipe = recipe

    def float_config(self):
        """The serialized float model (no quantized twin in it)."""
        with _models.float_classes(self.model):
            return keras.saving.serialize_keras_object(self.model)

    inner_config = float_config

    def record(self):
        return self.recipe.get_config()

    @classmethod
    def apply_record(cls, model, record):
        apply_recipe(model, Recipe.from_config(record))

    def reload_hint(self):
        return (
            "into a model quantized again with `keras_mp.quantize_model(...)`"
        )

    @classmethod
    def _from_inner(cls, inner, record, **kwargs):
        return cls(inner, record, **kwargs)
