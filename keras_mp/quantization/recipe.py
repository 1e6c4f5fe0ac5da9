"""The quantization recipe: which layers of a model become quantized twins,
with which settings and Q/DQ placement, recorded so that it can be applied
again to the same model rebuilt from its config.

A layer is named by its position in `keras_mp._models.walk_layers` (with
nested models), which is the same for two models built by the same code;
layer names are not, for layers that custom layers create without one.
"""

import collections
import dataclasses
import functools
import warnings

import keras
import numpy as np

from keras_mp import _inputs, _keras, _models, layer_table
from keras_mp.layer_table import ALL_INPUTS, NO_INPUTS, SKIP_INPUTS
from keras_mp.quantization import attention, hub_attention, twins
from keras_mp.quantization.attention import (
    ATTENTION_MATMUL_INPUTS,
    QuantizedAttention,
)
from keras_mp.quantization.config import QuantizeConfig
from keras_mp.quantization.layers import QuantizeActivation, quantizable_row
from keras_mp.quantization.twins import QuantizedLayer, WeightQuantizer


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What `quantize_model` did to a model, in a form that is saved.

    Attributes:
        entries: tuple of dicts, one per quantized layer: `index` (its
            position in the walk), `class_name`, `config` (a
            `QuantizeConfig` config) and `inputs` (the input indices that
            get a Q/DQ, or for an attention layer the input names that own
            one).
        layers: tuple of str. The class name of every layer of the walk,
            to check that a rebuilt model is the same model.
    """

    entries: tuple
    layers: tuple

    def get_config(self):
        return {"entries": list(self.entries), "layers": list(self.layers)}

    @classmethod
    def from_config(cls, config):
        return cls(tuple(config["entries"]), tuple(config["layers"]))


def float_class_name(layer):
    """The name of `layer`'s class, of its float class for a twin."""
    cls = type(layer)
    return (
        cls.float_class.__name__ if twins.is_quantized(layer) else cls.__name__
    )


def walk(model):
    """`(layer, parents)` of every layer of `model`, nested models included,
    skipping the quantizers that quantized twins own."""
    owned = twins.owned_quantizers(model)
    return [
        (layer, parents)
        for layer, parents in _models.walk_layers(
            model, include_models=True, with_parents=True
        )
        if id(layer) not in owned
    ]


def path_of(layer, parents):
    return "/".join(p.name for p in parents + (layer,))


def check_same_structure(model, layers, what):
    """Raises a ValueError unless the walk of `model` has the classes
    `layers` (a recipe's), naming the first difference."""
    found = [float_class_name(layer) for layer, _ in walk(model)]
    difference = _models.first_difference(found, layers)
    if difference is None:
        return
    where, got, want = difference
    raise ValueError(
        f"{what}: model {model.name!r} does not have the layers the "
        f"quantization recipe was made for (layer {where} of its walk is "
        f"{got}, the recipe expects {want}; {len(found)} layers, "
        f"{len(layers)} expected). Build it with the same code and "
        "arguments as the model that was quantized."
    )


@functools.cache
def twin_class(cls):
    """The quantized twin of layer class `cls`: a subclass of it and of
    `QuantizedLayer` (`QuantizedAttention` for attention layers,
    `hub_attention`'s twins for keras-hub's own attention layers)."""
    base = (
        QuantizedAttention
        if issubclass(cls, keras.layers.MultiHeadAttention)
        else hub_attention.twin_base(cls) or QuantizedLayer
    )
    return type(
        f"Quantized{cls.__name__}",
        (base, cls),
        {"float_class": cls, "__module__": __name__},
    )


def _activation(config, name):
    q = QuantizeActivation(
        num_bits=config.num_bits,
        learned_range=config.learned_range,
        name=name,
        dtype="float32",
    )
    q.build(())
    return q


def attach(layer, row, config, inputs, path):
    """Turns `layer` into its quantized twin, in place.

    Args:
        layer: a built layer of a quantizable table row.
        row: its `layer_table.LayerRow`.
        config: `QuantizeConfig`.
        inputs: the inputs that get a Q/DQ: indices, or for an attention
            layer the names (`ATTENTION_INPUTS`) that own one.
        path: str. The layer's path of names below the model.
    """
    with _keras.unlocked(layer):
        layer.quantize_config = config
        layer.quantize_path = path
        layer._quantize_enabled = True
        layer.weight_attrs = [w.attr for w in row.weights]
        layer.weight_quantizers = []
        for weight in row.weights:
            axes = weight.out_axes if config.per_channel else ()
            q = WeightQuantizer(
                axes, config.num_bits, name=f"{layer.name}_{weight.attr}_q"
            )
            q.build(getattr(layer, weight.attr).shape)
            layer.weight_quantizers.append(q)
        if row.attention:
            layer.input_names = list(inputs)
            layer.input_indices = []
            layer.input_quantizers = [
                _activation(config, f"{layer.name}_{name}_input")
                for name in inputs
            ]
            layer.attention_quantizers = (
                [
                    _activation(config, f"{layer.name}_attention_{name}")
                    for name in ATTENTION_MATMUL_INPUTS
                ]
                if config.attention
                else []
            )
        else:
            layer.input_indices = [int(i) for i in inputs]
            layer.input_quantizers = [
                _activation(config, f"{layer.name}_input_{i}") for i in inputs
            ]
        layer.inner_quantizers = (
            [_activation(config, f"{layer.name}_pointwise_input")]
            if row.separable
            else []
        )
    object.__setattr__(layer, "__class__", twin_class(type(layer)))
    layer.update_weight_ranges()


def apply_recipe(model, recipe):
    """Quantizes the float `model` in place as `recipe` says.

    Raises:
        ValueError: `model` is not the model the recipe was made for.
    """
    check_same_structure(model, recipe.layers, "Applying a quantization recipe")
    walked = walk(model)
    for entry in recipe.entries:
        layer, parents = walked[entry["index"]]
        attach(
            layer,
            quantizable_row(layer),
            QuantizeConfig.from_config(entry["config"]),
            entry["inputs"],
            path_of(layer, parents),
        )


def _input_count(layer):
    """How many tensors the layer's first input holds (merge layers)."""
    nodes = _keras.inbound_nodes(layer)
    if nodes:
        return len(nodes[0].input_tensors)
    shape = (layer.get_build_config() or {}).get("input_shape")
    if isinstance(shape, (list, tuple)) and any(
        isinstance(s, (list, tuple)) for s in shape
    ):
        return len(shape)
    return 1


def input_placement(layer, row, config, skip_indices):
    """The input indices of a leaf layer that get a Q/DQ."""
    placement = row.inputs
    if config.quantize_inputs is not None:
        placement = ALL_INPUTS if config.quantize_inputs else NO_INPUTS
    if placement == ALL_INPUTS:
        return list(range(_input_count(layer)))
    if placement == SKIP_INPUTS:
        return skip_indices(layer)
    return []


def _probe_calls(model, layers):
    """Runs `model` once on zeros with each of `layers` recording its calls:
    `{id(layer): [sources, ...]}` (`attention.attention_sources` for attention
    layers, None for others). None when the model cannot be run so."""
    calls = collections.defaultdict(list)
    probes = {}

    def probe_class(cls):
        if cls not in probes:
            is_attention = issubclass(cls, keras.layers.MultiHeadAttention)

            def __call__(self, *args, **kwargs):
                sources = None
                if is_attention:
                    arguments = twins.bind_call(cls, self, args, kwargs)
                    sources = attention.attention_sources(arguments)
                calls[id(self)].append(sources)
                return cls.__call__(self, *args, **kwargs)

            probes[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
        return probes[cls]

    originals = [(layer, type(layer)) for layer in layers]
    try:
        sample = _zeros_like_inputs(model)
        for layer, cls in originals:
            object.__setattr__(layer, "__class__", probe_class(cls))
        model(sample, training=False)
    except Exception as e:  # a model that needs real data: no probe
        if any(isinstance(x, keras.layers.MultiHeadAttention) for x in layers):
            warnings.warn(
                f"Could not run model {model.name!r} on zeros to see which "
                "attention inputs are one tensor "
                f"({type(e).__name__}: {e}); query, key and value of every "
                "attention layer get a Q/DQ each (identical ones for one "
                "tensor).",
                stacklevel=5,
            )
        return None
    finally:
        for layer, cls in originals:
            object.__setattr__(layer, "__class__", cls)
    return calls


def _zeros_like_inputs(model):
    specs = _inputs.input_specs(model, "quantize_model")
    if specs is None:  # subclassed: the shape it was built with
        shape = (model.get_build_config() or {})["input_shape"]
        return keras.tree.map_shape_structure(
            lambda s: np.zeros([d or 1 for d in s], "float32"), shape
        )
    arrays = [np.zeros([d or 1 for d in s.shape], s.dtype) for s in specs]
    return _inputs.call_arg(model, arrays, specs)


def _attention_inputs(calls):
    """The input names that own a Q/DQ: one per distinct tensor of every
    call the probe saw; all three when it saw none."""
    if not calls or any(c is None for c in calls):
        return list(attention.ATTENTION_INPUTS)
    needed = {source for c in calls for source in c.values()}
    return [n for n in attention.ATTENTION_INPUTS if n in needed]


def make_recipe(structure, choices, skip_indices):
    """The recipe for float model `structure`.

    Args:
        structure: the float model to be quantized (walked, probed).
        choices: `{walk index: QuantizeConfig}` of the selected layers.
        skip_indices: callable giving the residual-Add input indices.

    Returns:
        `Recipe`.
    """
    walked = walk(structure)
    projections = set()
    for layer, _ in walked:
        row = layer_table.row_for(layer)
        if row is not None and row.attention and layer.built:
            projections.update(
                id(p) for p in _keras.attention_projections(layer) if p
            )
    candidates = [walked[i][0] for i in choices]
    calls = _probe_calls(structure, candidates) or {}
    entries, shared = [], []
    for index, config in sorted(choices.items()):
        layer, _ = walked[index]
        row = quantizable_row(layer)
        if row.attention:
            inputs = (
                []
                if config.quantize_inputs is False or row.inputs == NO_INPUTS
                else _attention_inputs(calls.get(id(layer)))
            )
            if not inputs and not config.attention:
                continue
        else:
            inputs = []
            if id(layer) not in projections:
                inputs = input_placement(layer, row, config, skip_indices)
            if not row.weights and not inputs:
                continue
            if len(calls.get(id(layer), ())) > 1 and inputs:
                shared.append(layer.name)
        entries.append(
            {
                "index": index,
                "class_name": float_class_name(layer),
                "config": config.get_config(),
                "inputs": inputs,
            }
        )
    if shared:
        warnings.warn(
            f"Layers called more than once (shared weights): "
            f"{', '.join(shared)}. Each gets one input Q/DQ whose range "
            "covers all its calls (one scale for every call).",
            stacklevel=4,
        )
    layers = tuple(float_class_name(layer) for layer, _ in walked)
    return Recipe(tuple(entries), layers)
