"""`RecordedModel`: the one container that saves a model with keras_mp state
at any depth, as its float config plus one versioned record.

The record names layers by their position in one walk (`_models.walk`),
with the walk's class names and layer paths as a cross-check, and holds one
section per kind of state, registered by the package that owns it
(`register_section`: `sparsity`, `quantization`, `muppet`). Guide:
`docs/architecture.md` ("Persistence").
"""

import copy
import dataclasses
import json
import os

import keras

from keras_mp import _models, io
from keras_mp._compat import require_tensorflow
from keras_mp._load_only import LoadOnly


def contents(model):
    """The model a keras_mp container (`RecordedModel`) holds, else
    `model`: what reports and records name layers below, so that paths
    are the float model's layer names."""
    return model.model if isinstance(model, RecordedModel) else model


# The record: one per saved model, one section per kind of state.
RECORD_VERSION = 2


@dataclasses.dataclass(frozen=True)
class Section:
    """One kind of keras_mp state in the record (`register_section`)."""

    name: str
    order: int
    record: object  # (model, walked) -> JSON-able dict, or None
    apply: object  # (model, record, walked) -> None


_SECTIONS = {}


def register_section(name, record, apply, order):
    """Adds a kind of state to the one record `RecordedModel` saves.

    Args:
        name: str. The record's key (`"sparsity"`, `"quantization"`,
            `"muppet"`).
        record: `(model, walked) -> dict or None`: the state of `model`,
            its layers named by their index in `walked` (`_models.walk(model)`);
            None when `model` holds none of it.
        apply: `(model, record, walked) -> None`: sets that state again
            on the float model rebuilt from its config, before its weights
            load.
        order: int. Sections apply in increasing order (2:4 masks, which
            constrain float weights, before quantization, which switches
            classes).
    """
    _SECTIONS[name] = Section(name, order, record, apply)


def _sections():
    return sorted(_SECTIONS.values(), key=lambda s: s.order)


_RECORD_KEYS = ("version", "layers", "paths")


def make_record(model):
    """The record of every keras_mp state inside `model`, one walk for all:
    `{"version", "layers": class names, "paths": layer paths, <section>:
    ...}` (sections with no state left out)."""
    walked = _models.walk(model)
    record = {
        "version": RECORD_VERSION,
        "layers": [_models.class_name(layer) for layer, _ in walked],
        "paths": [
            _models.layer_path(layer, parents) for layer, parents in walked
        ],
    }
    for section in _sections():
        state = section.record(model, walked)
        if state:
            record[section.name] = state
    return record


def apply_record(model, record):
    """Sets on the float `model` every state `record` (`make_record`) holds.

    The record names layers by their index in the walk; the class names
    must match, and the recorded paths say, in an error, which layer the
    index meant. (Paths are not required to match: layers that custom
    layers create without a name get a new automatic name per process.)

    Raises:
        ValueError: the record is of a newer keras_mp, has a section this
            one does not know, or was made for another model.
    """
    version = record.get("version")
    if version != RECORD_VERSION:
        raise ValueError(
            f"Model {model.name!r}: its keras_mp record has version "
            f"{version!r}; this keras_mp reads version {RECORD_VERSION}. "
            "Load it with the keras_mp that saved it (or a newer one)."
        )
    unknown = sorted(set(record) - set(_RECORD_KEYS) - set(_SECTIONS))
    if unknown:
        raise ValueError(
            f"Model {model.name!r}: its keras_mp record holds state this "
            f"keras_mp does not know ({', '.join(unknown)}). Load it with "
            "the keras_mp that saved it (or a newer one)."
        )
    _models.check_structure(
        model, record["layers"], "Loading", "its record", record.get("paths")
    )
    walked = _models.walk(model)
    for section in _sections():
        if section.name in record:
            section.apply(model, record[section.name], walked)


@keras.saving.register_keras_serializable(package="keras_mp")
class RecordedModel(keras.Model):
    """A model with keras_mp state at any depth, saved with one record.

    `keras_mp.quantize_model` returns one, and so does
    `keras_mp.fixed_point_model`; wrap a pruned model in one yourself to
    save its 2:4 masks (`RecordedModel(model).save(path)`). It calls the
    model it holds (`self.model`) on fresh inputs, with the same output
    names, and `get_layer` finds that model's layers by name.

    Keras rebuilds a custom layer's sublayers (and a subclassed model's or
    a keras-hub backbone's) from their parent's code, so what keras_mp set
    on them in place (quantized layers and their ranges, 2:4 masks,
    fixed-point layers) is not in any config. Saved, the container's
    config is the float model's config plus one versioned record of all
    of that state, the layers named by their position in one walk
    (`walk`), with their class names and paths as a cross-check
    (`make_record`); loading rebuilds the float model, applies the record,
    and only then loads the weights, ranges and masks, so
    `keras.saving.load_model(path, safe_mode=True)` gives the same model.
    `get_config` (and `save`, before any file is opened) rebuilds the
    model from that config and applies the record, as loading will, so a
    model that cannot be rebuilt fails at save time with what to do, never
    at load time with its state missing. It saves to `.keras` only: a
    `.h5` name is refused.

    Attributes the wrapped model has beyond `keras.Model`'s are forwarded
    to it: a quantized keras-hub `CausalLM` `generate()`s with its
    quantized layers (`qmodel.generate(...)` is `qmodel.model.generate(
    ...)`), and `qmodel.preprocessor` and `qmodel.backbone` are the task's.
    The methods `keras.Model` itself has (`compile`, `fit`, `predict`,
    `call`, `save`) are the container's: a task's own `compile()` defaults
    are reached through `qmodel.model`.

    Args:
        model: a built `keras.Model` (a subclassed one needs a
            `get_config()` returning its constructor arguments and a
            registered class to be saved).
        **kwargs: `name`, `trainable`.

    Raises:
        ValueError: at save time (`get_config`), when `model` cannot be
            rebuilt from its config as the same model; `save` to a `.h5`
            or `.hdf5` name.

    Example:

    >>> qmodel = keras_mp.quantize_model(model)  # a RecordedModel
    >>> qmodel.save("q.keras")  # doctest: +SKIP
    >>> keras.saving.load_model("q.keras")  # doctest: +SKIP
    """

    def __init__(self, model, **kwargs):
        require_tensorflow(f"keras_mp.{type(self).__name__}")
        model = contents(model)
        inputs = _models.symbolic_inputs(model)
        super().__init__(inputs=inputs, outputs=model(inputs), **kwargs)
        self._rebuilt_config = None
        # The inner model's output names (its output layers'), so `loss`
        # and `metrics` dicts and exported outputs are keyed as for it (a
        # Sequential model keeps them on the Functional model it builds).
        names = getattr(model, "output_names", None) or getattr(
            getattr(model, "_functional", None), "output_names", None
        )
        if names and len(names) == len(self.output_names):
            self.output_names = list(names)

    def get_layer(self, name=None, index=None):
        """A layer of the inner model by name (as the float model's
        `get_layer`), else Keras' lookup among the container's own."""
        if name is not None and name != self.model.name:
            try:
                return self.model.get_layer(name=name)
            except ValueError:
                pass
        return super().get_layer(name=name, index=index)

    @property
    def model(self):
        """The wrapped model."""
        return next(
            layer for layer in self.layers if isinstance(layer, keras.Model)
        )

    def __getattr__(self, name):
        """What the wrapped model offers beyond `keras.Model` (a keras-hub
        task's `generate`, `preprocessor`, `backbone`): called only when
        the container has no attribute `name`. Private names are never
        forwarded (Keras' own lookups of them must fail as before)."""
        if name.startswith("_") or name in ("model", "layers"):
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}"
            )
        try:
            inner = RecordedModel.model.fget(self)
        except Exception:  # during __init__: no wrapped model yet
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}"
            ) from None
        try:
            return getattr(inner, name)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}, "
                f"nor has the model it holds ({inner.name!r}, "
                f"{type(inner).__name__})"
            ) from None

    def float_config(self):
        """The serialized inner model, its keras_mp layers in their float
        classes (as `from_config` rebuilds it before applying the
        record)."""
        with _models.float_classes(self.model):
            return keras.saving.serialize_keras_object(self.model)

    def record(self):
        """The record of the inner model's keras_mp state (`make_record`)."""
        return make_record(self.model)

    def get_config(self):
        config = {
            "name": self.name,
            "trainable": self.trainable,
            "model": self.float_config(),
            "record": self.record(),
        }
        self._check_rebuild(config)
        return config

    def quantize(self, mode=None, *args, **kwargs):
        """Refuses Keras' own `quantize`: Keras would switch its layers to
        `quantized_call`, which keras_mp's quantizers never see, and its
        int8/int4/float8 weights export no Q/DQ for TensorRT."""
        raise ValueError(
            f"Model {self.name!r} holds keras_mp state; Keras' own "
            f"`quantize({mode!r})` would bypass its quantizers (Keras runs "
            "`quantized_call` instead of the layers' `call`) and export no "
            "Q/DQ. Quantize with keras_mp alone "
            '(`keras_mp.quantize_model(model, precision="int8" | "float8")` on '
            "the float model), or call `quantize` on the float model and "
            "leave keras_mp out. Nothing was changed."
        )

    def save(self, filepath, overwrite=True, **kwargs):
        """`keras.Model.save`, with the config checked before any file is
        opened, and a local `.keras` file written to a temporary file that
        is renamed over `filepath` once complete.

        (`keras.saving.save_model(model, path)` checks the config too, but
        Keras opens `path` before asking for it: on that error `path` is
        left empty. `model.save(path)` leaves any previous file intact.)
        """
        path = (
            os.fspath(filepath)
            if isinstance(filepath, os.PathLike)
            else filepath
        )
        if isinstance(path, str) and path.lower().endswith((".h5", ".hdf5")):
            raise ValueError(
                f"Model {self.name!r} holds keras_mp state, which only the "
                "`.keras` format saves (a legacy HDF5 file would not load "
                "without `custom_objects`, nor with its state). Received: "
                f"filepath={path!r}. Save it as "
                f"{os.path.splitext(path)[0] + '.keras'!r}, or its weights "
                "only with `model.save_weights('<name>.weights.h5')`. Nothing "
                "was written."
            )
        self.get_config()
        local = isinstance(path, str) and "://" not in path
        if not (local and path.endswith(".keras")) or (
            not overwrite and os.path.exists(path)
        ):
            return super().save(filepath, overwrite=overwrite, **kwargs)
        with io.atomic_path(path) as tmp:
            super().save(tmp, **kwargs)

    def _check_rebuild(self, config):
        """Rebuilds the inner model from `config` and applies the record, as
        loading will: a ValueError now rather than a model that loads
        without its state."""
        key = json.dumps(config, sort_keys=True, default=str)
        if key == self._rebuilt_config:
            return
        inner = self.model
        cls = type(inner).__name__
        try:
            # A copy: Keras' from_config may consume the dict it is given.
            rebuilt = keras.saving.deserialize_keras_object(
                copy.deepcopy(config["model"]), safe_mode=False
            )
            if not rebuilt.built:
                rebuilt.build_from_config(inner.get_build_config())
            apply_record(rebuilt, config["record"])
        except Exception as e:  # any layer's from_config can fail its own way
            raise ValueError(
                f"Model {self.name!r} cannot be saved with its keras_mp "
                f"state: {inner.name!r} ({cls}) cannot be rebuilt from its "
                f"config as loading would ({type(e).__name__}: {e}). Give "
                f"{cls} a `get_config()` returning its constructor arguments "
                "and register it with "
                "`keras.saving.register_keras_serializable()`; or save the "
                "weights only (`model.save_weights(path)`) and load them "
                "into a model prepared again by the same calls "
                "(`quantize_model`, `StructuredSparsity(...).set_model`, "
                "`fixed_point_model`)."
            ) from e
        want = [tuple(v.shape) for v in inner.weights]
        got = [tuple(v.shape) for v in rebuilt.weights]
        if want != got:
            raise ValueError(
                f"Model {self.name!r} cannot be saved with its keras_mp "
                f"state: {inner.name!r} rebuilt from its config has "
                f"{len(got)} variables, not the {len(want)} it has now (its "
                "config does not describe all of its layers). Make its "
                "`get_config()` return every constructor argument, or save "
                "the weights only (`model.save_weights(path)`)."
            )
        self._rebuilt_config = key

    @classmethod
    def from_config(cls, config, custom_objects=None):
        require_tensorflow("Loading a keras_mp model")
        inner = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        cls.apply_saved_record(inner, config)
        return RecordedModel(
            inner,
            name=config["name"],
            trainable=config.get("trainable", True),
        )

    @classmethod
    def apply_saved_record(cls, model, config):
        """Applies the record of a saved `config` to the rebuilt `model`
        (the load-only classes of earlier keras_mp read theirs)."""
        apply_record(model, config["record"])


class LoadOnlyContainer(LoadOnly, RecordedModel):
    """Base of the containers of earlier keras_mp releases, kept so that
    their files load (into a `RecordedModel`). Constructing one outside
    `keras_mp.legacy.loading()` raises a `TypeError` (`REPLACEMENT` says
    what to use); inside, it saves as a `RecordedModel`. A subclass reads
    its own record in `apply_old_record(model, config)`."""

    def __init__(self, model, *args, **kwargs):
        super().__init__(model, **kwargs)

    @classmethod
    def apply_saved_record(cls, model, config):
        if "record" in config:  # saved by this keras_mp
            apply_record(model, config["record"])
        else:
            cls.apply_old_record(model, config)

    @classmethod
    def apply_old_record(cls, model, config):
        raise NotImplementedError
