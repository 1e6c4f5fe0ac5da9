"""`fixed_point_model`: a model whose weighted layers train in MuPPET fixed
point in place, at any depth, and the helpers that find and set them.
Guide: `docs/muppet.md`.
"""

import warnings

import keras

from keras_mp import _keras, _models, _record
from keras_mp._compat import require_tensorflow
from keras_mp.muppet import twins
from keras_mp.muppet.layers import (
    FixedPointInput,
    FixedPointWrapper,
    PrecisionState,
)
from keras_mp.muppet.quantizer import check_word_length
from keras_mp.muppet.record import apply_fixed_point_record
from keras_mp.quantization import op_probe
from keras_mp.quantization.activation import quantizable_row
from keras_mp.quantization.recipe import PROBE_LENGTHS


def _check(model, in_place):
    _models.check_model(model, "fixed_point_model")
    if not model.built or (_keras.is_graph_model(model) and not model.inputs):
        raise ValueError(
            f"fixed_point_model() needs a built model with known inputs; "
            f"'{model.name}' is not built. Start it with keras.Input(shape) "
            "or call it on data first."
        )
    if not model.trainable_weights:
        raise ValueError(
            f"Model '{model.name}' has no trainable weights: there is "
            "nothing to train in fixed point. Pass a model with trainable "
            "layers (check `layer.trainable`)."
        )
    if list(fixed_point_layers(model)):
        raise ValueError(
            f"Model '{model.name}' is in fixed point already. Pass the float "
            "model to fixed_point_model(), or keep training this one."
        )
    # A quantized layer (a twin of its float class) cannot also run in
    # fixed point, and a copy of the model would not be float either.
    twinned = [
        layer.name
        for layer, _ in _models.walk(model)
        if getattr(type(layer), "float_class", None) is not None
    ]
    if twinned:
        raise ValueError(
            "fixed_point_model() trains a float model in fixed point; "
            f"model '{model.name}' is quantized (layer {twinned[0]!r}, "
            f"in_place={in_place}). Pass the float model, or get it back "
            "with `keras_mp.strip_quantization(model)` first."
        )


def _sample_inputs(model, length=1):
    """Zero tensors shaped and typed like `model`'s inputs, in their
    structure (batch 1, another free dimension `length`)."""

    def shape(dims):
        return [d or (1 if i == 0 else length) for i, d in enumerate(dims)]

    return keras.tree.map_structure(
        lambda t: keras.ops.zeros(shape(t.shape), t.dtype),
        _models.symbolic_inputs(model),
    )


def probe_model(model, walked):
    """One call of `model` on zeros (`quantization.op_probe.probe`, the
    probe quantization runs too), for two things.

    Returns:
        `(consumers, sites)`. `consumers`: `{walk index: {position: input
        index}}`, for each float input of `model` the outermost layers
        that receive it unchanged, and where in their flattened positional
        call arguments. `sites`: `{walk index: [site, ...]}`, the op sites
        with an activation operand (`matmul` and `einsum` calls) of the
        layers that do GEMMs in their own code (no layer-table row, or an
        op-sites row: custom layers, `Dot`, attention): their activations
        run in fixed point too.
    """
    layers = [
        (index, layer)
        for index, (layer, parents) in enumerate(walked)
        if not isinstance(layer, keras.Model)
        and not any(isinstance(p, keras.layers.RNN) for p in parents)
    ]
    candidates = [
        layer
        for _, layer in layers
        if (row := quantizable_row(layer)) is None or row.op_sites
    ]

    def run(length):
        sample = _sample_inputs(model, length)
        targets = {
            id(t): i
            for i, t in enumerate(keras.tree.flatten(sample))
            if keras.backend.is_float_dtype(t.dtype)
        }
        return targets, op_probe.probe(
            lambda: model(sample, training=False),
            [layer for _, layer in layers],
            candidates,
            targets,
        )

    try:
        for length in PROBE_LENGTHS:  # quantization's lengths
            try:
                targets, (found, changed, _, received) = run(length)
                break
            except Exception:
                if length == PROBE_LENGTHS[-1]:
                    raise
    except Exception as e:  # a model that needs real data: no probe
        warnings.warn(
            f"fixed_point_model: could not run model {model.name!r} on zeros "
            f"to find the layers its inputs go to and the matmuls of its "
            f"layers' own code ({type(e).__name__}: {e}); its inputs and "
            "those matmuls' activations are not quantized (every weight and "
            "layer output still is).",
            stacklevel=3,
        )
        return {}, {}
    sites = {}
    for index, layer in layers:
        kept = [
            site
            for site in found.get(id(layer), ())
            if site["op"] != "dot_product_attention"
            and any(s["role"] in ("input", "probs") for s in site["operands"])
        ]
        if kept and id(layer) not in changed:
            sites[index] = found[id(layer)]
    return _consumers(model, walked, targets, received), sites


def _consumers(model, walked, targets, received):
    """`probe_model`'s consumers, from the model inputs each layer
    received (`{id(layer): {(position, input index)}}`)."""
    if not targets:  # token ids, masks: nothing to quantize
        return {}
    consumers, reached = {}, set()
    for index, (layer, parents) in enumerate(walked):
        # An input a parent received is quantized by that parent.
        outer = {i for p in parents for _, i in received.get(id(p), ())}
        mine = {p: i for p, i in received.get(id(layer), ()) if i not in outer}
        if mine:
            consumers[index] = dict(sorted(mine.items()))
            reached |= set(mine.values())
    missed = sorted(set(targets.values()) - reached)
    if missed:
        warnings.warn(
            f"fixed_point_model: input(s) {missed} of model {model.name!r} "
            "reach no layer unchanged (the model's own code transforms them "
            "first), so they are not quantized per sample; the layers' "
            "weights and outputs still are.",
            stacklevel=4,
        )
    return consumers


def make_record(model, walked, seed=None, consumers=None, sites=None):
    """The fixed-point record for float `model`: every layer with trainable
    weights of its own, at any depth, the layers that receive a model
    input (`consumers`) and those whose own code does GEMMs on
    activations (`sites`; both from `probe_model` when None). Every layer
    starts its random streams at `seed` (a random seed each for None), as
    the wrappers of earlier keras_mp did: same seed, same draws."""
    weighted = {
        index
        for index, (layer, parents) in enumerate(walked)
        if twins.runs_in_fixed_point(layer, parents)
    }
    if consumers is None or sites is None:
        probed, probed_sites = probe_model(model, walked)
        consumers = probed if consumers is None else consumers
        sites = probed_sites if sites is None else sites
    entries = []
    own = [v.name for v in _keras.own_variables(model) if v.trainable]
    if own:
        warnings.warn(
            f"fixed_point_model: model {model.name!r} holds trainable "
            f"weights of its own ({', '.join(own)}), outside any layer; they "
            "train in float32. Move them into a layer to train them in "
            "fixed point.",
            stacklevel=3,
        )
    if not weighted:
        raise ValueError(
            f"Model '{model.name}' has no layer with trainable weights of its "
            "own below it (a model's own weights cannot be run in fixed "
            "point in place). Move them into a layer."
        )
    for index in sorted(weighted | set(consumers) | set(sites)):
        entry = {
            "index": index,
            "seed": None if seed is None else int(seed),
            "weights": index in weighted,
            "inputs": list(consumers.get(index, ())),
        }
        if index in sites:
            entry["sites"] = sites[index]
        entries.append(entry)
    return {"layers": entries, "state": entries[0]["index"]}


def fixed_point_model(model, seed=None, in_place=False):
    """Returns a MuPPET-trainable copy of a Keras 3 model.

    Every layer with trainable weights of its own, at any depth (inside
    nested models, custom layers, subclassed models, keras-hub backbones,
    the projections of `MultiHeadAttention`), becomes its fixed-point twin
    in place: each call reads fixed-point copies of its weights (stochastic
    rounding, straight-through gradients, quantized weight gradients) and
    quantizes its outputs and the gradients flowing back, so the
    activations between the sublayers of a custom layer are quantized too.
    The layers that receive a model input quantize it per sample first.
    Layer names and the model's structure are the float model's. The copy
    starts in float32 (word length 0) and computes exactly what `model`
    computes until `keras_mp.PrecisionSwitching` lowers the precision. It
    saves to `.keras` and loads with `safe_mode=True`.

    Args:
        model: built `keras.Model`. A subclassed one needs a `get_config()`
            returning its constructor arguments and a registered class
            (unless `in_place=True`).
        seed: int or None. Seed of the stochastic rounding. Defaults to None.
        in_place: bool. Switch `model`'s own layers instead of a copy's.
            Defaults to False.

    Returns:
        A new, uncompiled `keras_mp.RecordedModel` calling the fixed-point
        model (its `model` attribute) on `model`'s inputs.

    Raises:
        TypeError: `model` is not a Keras 3 model (e.g. a tf_keras one).
        ValueError: `model` is not built, has no trainable weights, is in
            fixed point already, is quantized (`quantize_model`), or
            cannot be rebuilt from its config.

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> fp = fixed_point_model(model)
    >>> fp.compile("sgd", "mse")
    """
    require_tensorflow("keras_mp.fixed_point_model")
    _check(model, in_place)
    inner = (
        model if in_place else _models.copy_model(model, "fixed_point_model")
    )
    walked = _models.walk(inner)
    apply_fixed_point_record(inner, make_record(inner, walked, seed), walked)
    return _record.RecordedModel(inner, name=f"{model.name}_fixed_point")


_FIXED_POINT = (twins.FixedPointLayer, FixedPointWrapper, FixedPointInput)


def fixed_point_layers(model):
    """Yields the layers of `model`, at any depth, that hold a `word_length`
    variable: fixed-point twins (and, in a model loaded from a file of an
    earlier keras_mp, `FixedPointWrapper`s and `FixedPointInput`s)."""
    for layer, _ in _models.walk(model):
        if isinstance(layer, _FIXED_POINT):
            yield layer


def precision_state(model):
    """Returns the `PrecisionState` layer of `model`, or None."""
    for layer, _ in _models.walk(model):
        if twins.is_fixed_point(layer):
            if layer.fixed_point.precision_state is not None:
                return layer.fixed_point.precision_state
        elif isinstance(layer, PrecisionState):
            return layer
    return None


def set_word_length(model, word_length):
    """Sets every fixed-point layer of `model` to `word_length` bits.

    Args:
        model: a model from `fixed_point_model()`.
        word_length: int in 2..32, or None for float32.

    Raises:
        ValueError: bad `word_length`.

    Example:

    >>> set_word_length(fixed_point_model(model), 8)
    """
    value = float(check_word_length(word_length))
    for layer in fixed_point_layers(model):
        layer.word_length.assign(value)
