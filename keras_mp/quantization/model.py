"""`QuantizedModel`: a model quantized in place, saved as its float config
plus the quantization recipe.

Keras rebuilds a custom layer's sublayers from the custom layer's own code,
so quantized twins inside it would come back as float layers on load.
This container's config is the float model's config and the recipe; its
`from_config` rebuilds the float model, applies the recipe, and only then
do the weights load, quantizer ranges included. A model that cannot be
rebuilt from its config fails at save time, never silently on load.
"""

import copy
import json
import os

import keras

from keras_mp import _models, io
from keras_mp.quantization import twins
from keras_mp.quantization.recipe import Recipe, apply_recipe


@keras.saving.register_keras_serializable(package="keras_mp")
class QuantizedModel(keras.Model):
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

    def __init__(self, model, recipe, **kwargs):
        if isinstance(recipe, dict):
            recipe = Recipe.from_config(recipe)
        inputs = _models.symbolic_inputs(model)
        super().__init__(inputs=inputs, outputs=model(inputs), **kwargs)
        self.recipe = recipe
        self._rebuilt_config = None

    @property
    def model(self):
        """The model quantized in place."""
        return next(
            layer for layer in self.layers if isinstance(layer, keras.Model)
        )

    def float_config(self):
        """The serialized float model (no quantized twin in it)."""
        with twins.float_classes(self.model):
            return keras.saving.serialize_keras_object(self.model)

    def get_config(self):
        config = {
            "name": self.name,
            "trainable": self.trainable,
            "model": self.float_config(),
            "recipe": self.recipe.get_config(),
        }
        self._check_rebuild(config)
        return config

    def save(self, filepath, overwrite=True, **kwargs):
        """`keras.Model.save`, with the config checked before any file is
        opened, and a local `.keras` file written to a temporary file that
        is renamed over `filepath` once complete.

        (`keras.saving.save_model(qmodel, path)` checks the config too, but
        Keras opens `path` before asking for it: on that error `path` is
        left empty. `qmodel.save(path)` leaves any previous file intact.)
        """
        self.get_config()
        path = (
            os.fspath(filepath)
            if isinstance(filepath, os.PathLike)
            else filepath
        )
        local = isinstance(path, str) and "://" not in path
        if not (local and path.endswith(".keras")) or (
            not overwrite and os.path.exists(path)
        ):
            return super().save(filepath, overwrite=overwrite, **kwargs)
        with io.atomic_path(path) as tmp:
            super().save(tmp, **kwargs)

    def _check_rebuild(self, config):
        """Rebuilds the float model from `config` and applies the recipe,
        as loading will: a ValueError now rather than a model that loads
        without its quantizers."""
        key = json.dumps(config, sort_keys=True, default=str)
        if key == self._rebuilt_config:
            return
        inner = self.model
        try:
            # A copy: Keras' from_config may consume the dict it is given.
            rebuilt = keras.saving.deserialize_keras_object(
                copy.deepcopy(config["model"]), safe_mode=False
            )
            apply_recipe(rebuilt, self.recipe)
        except Exception as e:  # any layer's from_config can fail its own way
            raise ValueError(
                f"Model {self.name!r} cannot be saved with its config: the "
                f"quantized model {inner.name!r} ({type(inner).__name__}) "
                "cannot be rebuilt from its config and quantized again, as "
                f"loading would ({type(e).__name__}: {e}). Give "
                f"{type(inner).__name__} a `get_config()` returning its "
                "constructor arguments and register it with "
                "`keras.saving.register_keras_serializable()`; or save the "
                "weights only (`model.save_weights(path)`) and load them "
                "into a model quantized again with "
                "`keras_mp.quantize_model(...)`."
            ) from e
        want = [tuple(v.shape) for v in inner.weights]
        got = [tuple(v.shape) for v in rebuilt.weights]
        if want != got:
            raise ValueError(
                f"Model {self.name!r} cannot be saved with its config: "
                f"{inner.name!r} rebuilt from its config has "
                f"{len(got)} variables, not the {len(want)} it has now "
                "(its config does not describe all of its layers). Make its "
                "`get_config()` return every constructor argument, or save "
                "the weights only (`model.save_weights(path)`)."
            )
        self._rebuilt_config = key

    @classmethod
    def from_config(cls, config, custom_objects=None):
        inner = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        recipe = Recipe.from_config(config["recipe"])
        apply_recipe(inner, recipe)
        return cls(
            inner,
            recipe,
            name=config["name"],
            trainable=config.get("trainable", True),
        )
