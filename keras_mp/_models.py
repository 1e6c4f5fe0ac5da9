"""One model check, one layer walker, one model copier and one way to reset
compiled functions. The container that saves a model with one record of its
keras_mp state is in `_record.py`."""

import contextlib
import copy
import functools

import keras

from keras_mp import _keras

# Where tf_keras (Keras 2) keeps its model and layer classes.
_KERAS_2_MODULES = ("tf_keras", "keras.src.engine", "keras.engine")


def check_model(model, caller):
    """Raises a TypeError naming `caller` unless `model` is a Keras 3 model.

    Args:
        model: the object a user passed.
        caller: str. The public function's name, for the message.
    """
    if isinstance(model, keras.Model):
        return
    hint = ""
    if type(model).__module__.startswith(_KERAS_2_MODULES):
        hint = (
            " tf_keras (Keras 2) models are not supported: rebuild it with "
            "Keras 3 (`import keras`)."
        )
    raise TypeError(
        f"`{caller}` expects a Keras 3 `keras.Model`. Received: "
        f"{type(model).__module__}.{type(model).__name__}.{hint}"
    )


def check_graph_model(model, caller, alternative):
    """Raises a TypeError unless `model` is a Sequential or Functional model.

    Args:
        model: a `keras.Model` (see `check_model`).
        caller: str. The public function's name.
        alternative: str. What a user with a subclassed model can do.
    """
    check_model(model, caller)
    if not _keras.is_graph_model(model):
        raise TypeError(
            f"`{caller}` needs the layer graph of a Sequential or Functional "
            f"model; model {model.name!r} is a subclassed "
            f"{type(model).__name__}, whose graph is Python code. "
            f"{alternative}"
        )


def walk_layers(
    root, include_models=False, stop_at=(), with_parents=False, owned=False
):
    """Every layer inside `root`, at any depth, each once, in tracking order.

    Walks Keras' layer tracker: the layers of nested models, the inner layer
    of a `keras.layers.Wrapper`, and the sublayers that custom layers keep
    as attributes. The quantizers that keras_mp attached to a layer
    (`own`) are part of that layer, not layers of the model: skipped.
    The order is the same for two models built by the same code
    (quantization records layers by their position in it).

    Args:
        root: a `keras.Model` or layer (not itself yielded).
        include_models: bool. Also yield nested `keras.Model`s (before their
            layers). Defaults to False.
        stop_at: tuple of layer classes yielded but not entered (e.g. a
            quantize wrapper, whose inner layer is not a layer of its own).
        with_parents: bool. Yield `(layer, parents)` pairs, `parents` the
            tuple of layers between `root` and `layer` (outermost first).
            Defaults to False.
        owned: bool. Also yield the quantizers attached to layers (for a
            per-layer trace of every Q/DQ). Defaults to False.

    Yields:
        `keras.layers.Layer`s, parents before children.
    """
    seen = {id(root)}

    def visit(layer, parents):
        for child in _keras.sublayers(layer):
            if id(child) in seen or (is_owned(child) and not owned):
                continue
            seen.add(id(child))
            if not isinstance(child, keras.Model) or include_models:
                yield (child, parents) if with_parents else child
            if not isinstance(child, stop_at):
                yield from visit(child, parents + (child,))

    yield from visit(root, ())


def first_difference(found, expected):
    """Where two walks (lists of class names) first differ: `(index, found
    entry, expected entry)`, "nothing" past the end of either; None when
    they are equal."""
    found, expected = list(found), list(expected)
    if found == expected:
        return None
    where = next(
        (i for i, (a, b) in enumerate(zip(found, expected)) if a != b),
        min(len(found), len(expected)),
    )
    return (
        where,
        found[where] if where < len(found) else "nothing",
        expected[where] if where < len(expected) else "nothing",
    )


def layer_paths(root, stop_at=()):
    """`{id(layer): path}` for every layer inside `root` (as `walk_layers`
    walks it): the names from `root`'s top-level layer down to the layer,
    joined by "/". A top-level layer's path is its name; a nested one's
    tells it apart from its namesakes (every keras-hub encoder block has a
    `query`)."""
    return {
        id(layer): layer_path(layer, parents)
        for layer, parents in walk_layers(
            root, stop_at=stop_at, with_parents=True
        )
    }


def layer_path(layer, parents):
    """The path of `layer` below `parents` (from `walk_layers`)."""
    return "/".join(p.name for p in parents + (layer,))


def reset_compiled_functions(model):
    """Makes `fit`, `evaluate` and `predict` trace their functions again,
    with the current layer state (new constraints, quantizers turned off).

    The test and predict functions are dropped; a train function is built
    anew (not traced yet), so this also works from a callback inside `fit`,
    which calls `model.train_function` at every step.
    """
    for name in ("test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)
    if getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)


# Attribute set on the quantizers keras_mp attaches to a layer (`own`).
OWNED = "_keras_mp_owned"


def own(owner, quantizer):
    """Marks `quantizer` (a layer) as part of `owner`: `walk_layers` skips
    it, and reports and records name `owner` instead."""
    object.__setattr__(quantizer, OWNED, True)
    return quantizer


def is_owned(layer):
    return getattr(layer, OWNED, False)


@functools.cache
def twin_type(prefix, base, cls):
    """The twin class of layer class `cls` with behaviour `base`: a subclass
    of both named `prefix + cls.__name__`, with `float_class = cls`. The
    one factory of quantized twins (`quantization.recipe.twin_class`) and
    fixed-point twins (`muppet.twins.fixed_point_twin_class`)."""
    return type(
        f"{prefix}{cls.__name__}",
        (base, cls),
        {"float_class": cls, "__module__": base.__module__},
    )


def switch(layer, twin, owned=()):
    """Turns `layer` into an instance of its twin class `twin`, in place,
    owning the layers of `owned` (its quantizers or state, `own`): every
    reference to the layer sees the twin. The one way both quantization
    and MuPPET attach."""
    for sub in owned:
        own(layer, sub)
    object.__setattr__(layer, "__class__", twin)


def class_name(layer):
    """The name of `layer`'s class; of its float class for a layer that
    keras_mp switched to a twin class in place (`float_class`)."""
    cls = type(layer)
    return (getattr(cls, "float_class", None) or cls).__name__


@contextlib.contextmanager
def float_classes(model):
    """Within the block, every layer inside `model` that keras_mp switched
    to a twin class has its float class back, so Keras serializes the
    float model (its config holds no twin)."""
    switched = [
        (layer, type(layer))
        for layer, _ in walk(model)
        if getattr(type(layer), "float_class", None) is not None
    ]
    for layer, twin in switched:
        object.__setattr__(layer, "__class__", twin.float_class)
    try:
        yield
    finally:
        for layer, twin in switched:
            object.__setattr__(layer, "__class__", twin)


def walk(model):
    """`[(layer, parents)]` of every layer of `model`, nested models
    included: the one walk that records (quantization recipe, 2:4 masks)
    index layers by."""
    return list(walk_layers(model, include_models=True, with_parents=True))


def structure(model):
    """The class names of `walk(model)`, float classes for twins: what two
    models built by the same code share."""
    return [class_name(layer) for layer, _ in walk(model)]


def check_structure(model, expected, what, record, paths=None):
    """Raises a ValueError unless `structure(model)` is `expected`, naming
    the first difference; `what` says who asks, `record` what was made for
    the other model ("the quantization recipe"), `paths` (optional) the
    recorded layer paths, to say which layer was expected there."""
    found = structure(model)
    difference = first_difference(found, expected)
    if difference is None:
        return
    where, got, want = difference
    if paths is not None and where < len(paths):
        want = f"{want} {paths[where]!r}"
    raise ValueError(
        f"{what}: model {model.name!r} does not have the layers {record} "
        f"was made for (layer {where} of its walk is {got}, expected "
        f"{want}; {len(found)} layers, {len(expected)} expected). Build it "
        "with the same code and arguments as the model it was made for."
    )


def copy_state(source, target, constraints=True):
    """Copies what `source` saves to `target`, two models of the same
    structure: every layer's own variables and the stateful constraints
    on them (2:4 masks), attached to `target` where missing. The
    quantizers keras_mp attached are left out, so either may be
    quantized. `constraints=False` leaves the constraints out.
    """
    pairs = [(source, target)] + [
        (a, b)
        for (a, _), (b, _) in zip(walk(source), walk(target), strict=True)
    ]
    for a, b in pairs:
        store = {}
        a.save_own_variables(store)
        b.load_own_variables(store)
        if constraints:
            _copy_constraints(a, b)


def _copy_constraints(a, b):
    """The stateful constraints (`_keras.SaveableState`) of `a`'s variables,
    with their state, on the same variables of `b`."""
    for va, vb in zip(_keras.own_variables(a), _keras.own_variables(b)):
        constraint = getattr(va, "constraint", None)
        if not isinstance(constraint, _keras.SaveableState):
            continue
        mine = getattr(vb, "constraint", None)
        config = constraint.get_config()
        if type(mine) is not type(constraint) or mine.get_config() != config:
            mine = type(constraint).from_config(config)
            vb.constraint = mine
            with _keras.unlocked(b):
                for attr, value in list(vars(a).items()):
                    if value is constraint:
                        setattr(b, attr, mine)
        store = {}
        constraint.save_own_variables(store)
        mine.load_own_variables(store)


COPY_ADVICE = (
    "or work on the model object itself where the function offers it "
    "(`in_place=True`)."
)


def rebuild(model, config, caller, advice=COPY_ADVICE, constraints=True):
    """`model` rebuilt from `config` (its float config), checked to be the
    same model layer for layer, with `model`'s state (`copy_state`).

    The one model copier: a subclassed model or a keras-hub backbone
    rebuilds its sublayers from its own code, so this works where copying
    each sublayer's config would not.

    Args:
        model: a built `keras.Model` (or layer).
        config: its serialized float form.
        caller: str. The public function's name, for the message.
        advice: str. What else to do when it cannot be rebuilt.
        constraints: bool. Carry the stateful constraints (2:4 masks).
            Defaults to True.

    Raises:
        ValueError: the config does not rebuild `model` (what to do).
    """
    try:
        fresh = keras.saving.deserialize_keras_object(
            copy.deepcopy(config), safe_mode=False
        )
        if not fresh.built:
            fresh.build_from_config(model.get_build_config())
    except Exception as e:  # any layer's from_config can fail its own way
        cls = type(model).__name__
        raise ValueError(
            f"`{caller}` works on a copy of {cls} {model.name!r} rebuilt "
            f"from its config, and that failed ({type(e).__name__}: {e}). "
            f"Give {cls} a `get_config()` returning its constructor "
            "arguments (and register it with "
            f"`keras.saving.register_keras_serializable()`), {advice}"
        ) from e
    check_structure(fresh, structure(model), f"`{caller}`", "its copy")
    copy_state(model, fresh, constraints)
    return fresh


def copy_model(model, caller, advice=COPY_ADVICE, constraints=True):
    """A copy of `model` rebuilt from its config, with its state
    (`rebuild`); quantized layers come back float."""
    with float_classes(model):
        config = keras.saving.serialize_keras_object(model)
    return rebuild(model, config, caller, advice, constraints)


def symbolic_inputs(model):
    """Fresh `keras.Input`s like `model`'s inputs, in their structure (a
    dict for keras-hub backbones); for a subclassed model, shaped by the
    shape it was built with (batch size left free), float32.

    Raises:
        ValueError: `model` was never called or built, so its inputs are
            unknown.
    """
    try:
        structure = model.input
    except (AttributeError, ValueError):
        structure = None
    if structure is not None:
        return keras.tree.map_structure(
            lambda t: keras.Input(
                batch_shape=t.shape, dtype=t.dtype, name=t.name
            ),
            structure,
        )
    shape = (model.get_build_config() or {}).get("input_shape")
    if shape is None:
        raise ValueError(
            f"Model {model.name!r} has never been called, so its inputs are "
            "unknown. Call it once on a batch (or `model.build(shape)`) "
            "first."
        )
    return keras.tree.map_shape_structure(
        lambda s: keras.Input(batch_shape=(None, *tuple(s)[1:])), shape
    )


def _graph_layers(model):
    """The layers of graph model `model` and of the models inside it, in
    a fixed order (two clones list matching layers at the same place)."""
    models = [model] + [
        layer
        for layer in walk_layers(model, include_models=True)
        if isinstance(layer, keras.Model)
    ]
    return [layer for m in models for layer in m.layers]


def unwrapped_copy(model, wrappers):
    """A copy of graph model `model` with every layer of a class in tuple
    `wrappers` (a legacy wrapper with a `.layer`) replaced by the layer it
    wraps, same weights, and `{id(copy layer): wrapper}`."""
    sources = {}

    def clone(layer):
        inner = layer.layer if isinstance(layer, wrappers) else layer
        fresh = inner.__class__.from_config(inner.get_config())
        if isinstance(layer, wrappers):
            sources[id(fresh)] = layer
        return fresh

    new = keras.models.clone_model(model, clone_function=clone, recursive=True)
    for old, fresh in zip(_graph_layers(model), _graph_layers(new)):
        if isinstance(old, keras.Model):
            continue
        inner = old.layer if isinstance(old, wrappers) else old
        fresh.set_weights(inner.get_weights())
    return new, sources
