"""`upgrade_fixed_point`: a MuPPET model loaded from a file of an earlier
keras_mp, in the current form.

Until keras_mp 0.1 `fixed_point_model` copied a Sequential or Functional
graph with each weighted layer in a `FixedPointWrapper` (named
`fixed_point_<name>`), put a `FixedPointInput` on every model input and a
`PrecisionState` layer in front, and wrapped any other model whole. Those
classes stay registered so that such files load with `safe_mode=True` and
compute what they did (Keras names weight-file groups after class and
attribute names, so they keep theirs). `upgrade_fixed_point` gives the
model `fixed_point_model` makes today, with the same weights, word length,
random streams, gradient records and switching state. Migration notes:
`docs/migration.md`.
"""

import keras

from keras_mp import _keras, _models, _record
from keras_mp.muppet import twins
from keras_mp.muppet.layers import (
    FixedPointInput,
    FixedPointWrapper,
    PrecisionState,
)
from keras_mp.muppet.model import (
    make_record,
    precision_state,
    probe_model,
)
from keras_mp.muppet.record import apply_fixed_point_record


def legacy_fixed_point_layers(model):
    """The `FixedPointWrapper`s inside `model`."""
    return [
        layer
        for layer, _ in _models.walk(model)
        if isinstance(layer, FixedPointWrapper)
    ]


def _body(model):
    """The wrapped model of an old `fixed_point_model` result: the one
    layer besides its inputs, `PrecisionState` and `FixedPointInput`s."""
    if not _keras.is_graph_model(model):
        return None
    rest = [
        layer
        for layer in model.layers
        if not isinstance(
            layer, (keras.layers.InputLayer, PrecisionState, FixedPointInput)
        )
    ]
    return rest[0] if len(rest) == 1 else None


def _unwrapped(body):
    """A float copy of `body` (a `FixedPointWrapper` around a whole model,
    or a graph of wrappers) with the same weights, and `{id(float layer):
    wrapper}` for the layers that were wrapped."""
    if isinstance(body, FixedPointWrapper):
        fresh = _models.copy_model(body.layer, "upgrade_fixed_point")
        return fresh, {id(fresh): body}
    return _models.unwrapped_copy(body, (FixedPointWrapper,))


def _owners(layer):
    """`{id(variable): (twin, k)}`: the twin inside `layer` (or `layer`)
    that runs each trainable variable in fixed point, as its k-th."""
    found = {}
    candidates = [layer] + list(_models.walk_layers(layer))
    for twin in candidates:
        if twins.is_fixed_point(twin):
            for k, v in enumerate(twin.fixed_point_weights()):
                found[id(v)] = (twin, k)
    return found


def _copy_wrapper_state(wrapper, fresh):
    """Word length, random stream and gradient records of old `wrapper`
    onto the twins inside `fresh`, the float copy of its layer."""
    owners = _owners(fresh)
    word_length = wrapper.word_length.numpy()
    squares = wrapper.gradient_square_sums.numpy()
    touched = {}
    for i, v in enumerate(fresh.trainable_variables):
        if id(v) not in owners:
            continue
        twin, k = owners[id(v)]
        twin.last_gradients[k].assign(wrapper.last_gradients[i].value)
        twin.gradient_sums[k].assign(wrapper.gradient_sums[i].value)
        touched.setdefault(id(twin), (twin, {}))[1][k] = squares[i]
    for twin, by_index in touched.values():
        values = twin.gradient_square_sums.numpy()
        for k, value in by_index.items():
            values[k] = value
        twin.gradient_square_sums.assign(values)
        twin.seed_state.assign(wrapper.seed_state.value)
    for twin in [fresh] + list(_models.walk_layers(fresh)):
        if twins.is_fixed_point(twin):
            twin.word_length.assign(word_length)


def upgrade_fixed_point(model):
    """The current form of a MuPPET model loaded from an earlier keras_mp.

    The model (built by the old `fixed_point_model`: `FixedPointWrapper`
    layers named `fixed_point_<name>`, `FixedPointInput`s, a
    `PrecisionState` layer) becomes what `fixed_point_model` makes today:
    the float model's layers under their own names, switched to fixed
    point in place, in a `keras_mp.RecordedModel`. Weights, word length,
    random streams, gradient records and switching state are copied, so it
    computes the same outputs and `PrecisionSwitching` resumes where it
    was. A layer the old model wrapped whole now has every weighted layer
    inside it in fixed point (the activations between them quantized too),
    each continuing the whole layer's random stream.

    Args:
        model: a `keras.Model` loaded from an old `.keras` file.

    Returns:
        A new `keras_mp.RecordedModel`; `model` is left as it is.

    Raises:
        TypeError: `model` is not a Keras 3 model.
        ValueError: `model` holds no `FixedPointWrapper`, or is not shaped
            as the old `fixed_point_model` made it.

    Example:

    >>> old = keras.saving.load_model("muppet_v0.keras")  # doctest: +SKIP
    >>> model = upgrade_fixed_point(old)  # doctest: +SKIP
    """
    _models.check_model(model, "upgrade")
    if not legacy_fixed_point_layers(model):
        raise ValueError(
            f"`upgrade`: model {model.name!r} holds no FixedPointWrapper of "
            "an earlier keras_mp: there is nothing to upgrade. A float model "
            "goes to fixed point with `keras_mp.fixed_point_model(model)`."
        )
    body = _body(model)
    if body is None:
        raise ValueError(
            f"`upgrade`: model {model.name!r} holds FixedPointWrapper layers "
            "but is not shaped as the old `fixed_point_model` made it (its "
            "inputs, a PrecisionState, FixedPointInputs and the wrapped "
            "model). Rebuild the float model, call "
            "`keras_mp.fixed_point_model` on it and copy the weights."
        )
    floats, sources = _unwrapped(body)
    walked = _models.walk(floats)
    # the wrappers ran no op sites: the upgraded model computes as they did
    consumers, _ = probe_model(floats, walked)
    record = make_record(floats, walked, consumers=consumers, sites={})
    apply_fixed_point_record(floats, record, walked)
    by_id = {id(layer): layer for layer, _ in walked}
    by_id[id(floats)] = floats
    for fresh_id, wrapper in sources.items():
        _copy_wrapper_state(wrapper, by_id[fresh_id])
    old_inputs = [
        layer for layer in model.layers if isinstance(layer, FixedPointInput)
    ]
    # Named fixed_point_input_<i> after the model input they quantized.
    old_inputs.sort(key=lambda layer: int(layer.name.rsplit("_", 1)[-1]))
    for index, positions in consumers.items():
        state = walked[index][0].fixed_point
        source = old_inputs[min(positions.values())]
        state.input_seed_state.assign(source.seed_state.value)
        if not state.weight_shapes:
            state.word_length.assign(source.word_length.value)
    old_state = precision_state(model)
    new_state = precision_state(floats)
    for new, old in zip(new_state.weights, old_state.weights, strict=True):
        new.assign(old.value)
    return _record.RecordedModel(floats, name=model.name)
