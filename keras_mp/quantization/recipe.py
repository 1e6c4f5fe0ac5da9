"""The quantization recipe: which layers of a model become quantized twins,
with which settings and Q/DQ placement, recorded so that it can be applied
again to the same model rebuilt from its config.

A layer is named by its position in `keras_mp._models.walk_layers` (with
nested models), which is the same for two models built by the same code;
layer names are not, for layers that custom layers create without one.
"""

import dataclasses
import functools
import warnings

import keras
import numpy as np

from keras_mp import _inputs, _keras, _models
from keras_mp.quantization import (
    legacy_twins,
    op_probe,
    op_sites,
    packed,
    placement,
    pre_scale,
)
from keras_mp.quantization.activation import QuantizeActivation, quantizable_row
from keras_mp.quantization.config import QuantizeConfig
from keras_mp.quantization.formats import FORMATS
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


# (layer class, twin base), newest first: `register_twin`.
_USER_TWINS = []


def register_twin(layer_class, twin_class):
    """Makes `twin_class` the quantized twin base of `layer_class` (and its
    subclasses), as ModelOpt's `QuantModuleRegistry.register` does.

    Most layers need no twin: their Dense/Conv/EinsumDense sublayers are
    quantized by the layer table, and the matmuls, einsums and attention
    calls of their own code at their op sites. A twin is for a layer whose
    quantized computation is not its float one with Q/DQ on GEMM operands.
    The twin class derives from `keras_mp.quantization.QuantizedLayer` and
    overrides what it needs (usually `call`, calling `super().call`); the
    quantized layer's class becomes `(twin_class, layer_class)`, so the
    layer keeps its identity, weights and name, and saved models re-apply
    the twin on load (the twin is registered again by the code that
    defines it, before loading).

    Args:
        layer_class: a `keras.layers.Layer` subclass.
        twin_class: a subclass of `keras_mp.quantization.QuantizedLayer`.

    Raises:
        TypeError: either class is not of that kind.

    Example:

    >>> class QuantizedMyLayer(keras_mp.quantization.QuantizedLayer):
    ...     def call(self, x):
    ...         return super().call(x)  # op sites, plus anything of yours
    >>> keras_mp.register_twin(MyLayer, QuantizedMyLayer)
    """
    if not (
        isinstance(layer_class, type)
        and issubclass(layer_class, keras.layers.Layer)
    ):
        raise TypeError(
            "`layer_class` must be a keras.layers.Layer subclass. "
            f"Received: layer_class={layer_class!r}"
        )
    if not (
        isinstance(twin_class, type) and issubclass(twin_class, QuantizedLayer)
    ):
        raise TypeError(
            "`twin_class` must subclass keras_mp.quantization.QuantizedLayer. "
            f"Received: twin_class={twin_class!r}"
        )
    _USER_TWINS.insert(0, (layer_class, twin_class))
    twin_class_cache_clear()


def _registered(cls, registry):
    return next((base for c, base in registry if issubclass(cls, c)), None)


@functools.cache
def twin_class(cls, legacy=False):
    """The quantized twin of layer class `cls`: a subclass of it and of
    its registered twin base (`register_twin`), or of `QuantizedLayer`.
    `legacy`: for a record entry of an earlier release, the load-only
    twin it was saved with (`legacy_twins`), when `cls` had one."""
    base = _registered(cls, _USER_TWINS)
    if base is None and legacy:
        base = _registered(cls, legacy_twins.LEGACY_TWINS)
    return _models.twin_type("Quantized", base or QuantizedLayer, cls)


twin_class_cache_clear = twin_class.cache_clear


def _activation(fmt, config, name, matmul_input=None):
    fixed = placement.fixed_range(fmt, matmul_input)
    # NVFP4 / MXFP8 inputs: per-block scales at run time, as TensorRT's
    # DynamicQuantize (one per-tensor range: NVFP4's global scale)
    dynamic = dict(dynamic_blocks=True, block_size=config.block_size)
    q = QuantizeActivation(
        format=fmt,
        fixed_range=fixed,
        learned_range=config.learned_range
        and fixed is None
        and FORMATS[fmt].kind != "block",
        name=name,
        dtype="float32",
        **(dynamic if FORMATS[fmt].kind == "block" else {}),
    )
    q.build(())
    return q


def attach(layer, row, config, inputs, path, calls=1, sites=(), site_attr=None):
    """Turns `layer` into its quantized twin, in place.

    Args:
        layer: a built layer of a quantizable table row, or of none with
            `sites`.
        row: its `layer_table.LayerRow`, or None (op-level only).
        config: `QuantizeConfig`.
        inputs: the inputs that get a Q/DQ: indices, or for an old
            file's MultiHeadAttention (`legacy_twins`) the names that own
            one.
        path: str. The layer's path of names below the model.
        calls: int. How many calls of the layer one input range covers
            (a shared layer: more than one).
        sites: list of dicts. The op sites of the layer's own code
            (`op_probe.probe`), each with a Q/DQ per operand role.
        site_attr: str or None. The attribute that tracks the sites'
            quantizers (the saved files' name for them): `op_quantizers`
            by default.
    """
    fmt, _ = placement.layer_format(layer, config)
    with _keras.unlocked(layer):
        layer.quantize_config = config
        layer.quantize_path = path
        layer._quantize_enabled = True
        weights = () if _at_op_sites(row) else row.weights
        layer.weight_attrs = [w.attr for w in weights]
        layer.weight_quantizers = []
        _attach_sites(layer, list(sites), fmt, config, site_attr)
        for weight in weights:
            blocks = placement.weight_blocks(layer, weight, config)
            if blocks is None:
                axes, kwargs = placement.weight_axes(layer, weight, config), {}
            else:
                axes, kwargs = (
                    (),
                    dict(zip(("block_size", "block_axes"), blocks)),
                )
            q = WeightQuantizer(
                axes, format=fmt, name=f"{layer.name}_{weight.attr}_q", **kwargs
            )
            q.build(getattr(layer, weight.attr).shape)
            layer.weight_quantizers.append(q)
        if not _at_op_sites(row) and row.attention:
            layer.input_names = list(inputs)
            layer.input_indices = []
            layer.input_quantizers = [
                _activation(fmt, config, f"{layer.name}_{name}_input")
                for name in inputs
            ]
            layer.attention_quantizers = (
                [
                    _activation(
                        fmt, config, f"{layer.name}_attention_{name}", name
                    )
                    for name in legacy_twins.ATTENTION_MATMUL_INPUTS
                ]
                if config.attention
                else []
            )
        else:
            layer.input_indices = [int(i) for i in inputs]
            layer.input_quantizers = [
                _activation(fmt, config, f"{layer.name}_input_{i}")
                for i in inputs
            ]
        layer.inner_quantizers = (
            [_activation(fmt, config, f"{layer.name}_pointwise_input")]
            if not _at_op_sites(row) and row.separable
            else []
        )
        layer.quantize_calls = int(calls)
        # TensorRT moves a Concat's input DQs only when their scales are
        # equal: its inputs share one range (`placement.qdq_role`).
        layer.shared_input_range = (
            placement.qdq_role(layer) == "same_scale"
            and not config.learned_range
        )
    twin = twin_class(type(layer), legacy=not _at_op_sites(row))
    _models.switch(layer, twin)
    for q in layer.owned_quantizers():  # the twin's, known once switched
        _models.own(layer, q)
    layer.update_weight_ranges()


def _attach_sites(layer, sites, fmt, config, site_attr=None):
    """The quantizers of `layer`'s op sites: `op_quantizers` (each once,
    tracked, so saved with the layer) and `op_quantizers_by_site` (`{site
    ordinal: {operand index or "probs": quantizer}}`, an operand that is
    the same tensor as an earlier site's sharing its quantizer)."""
    layer.op_sites = sites
    site_attr = site_attr or "op_quantizers"
    setattr(layer, site_attr, [])  # tracked: saved with the layer
    if site_attr != "op_quantizers":
        object.__setattr__(layer, "op_quantizers", getattr(layer, site_attr))
        object.__setattr__(layer, "site_attr", site_attr)
    by_site = {}
    shared = {}  # (site, operand) of a float site -> its readers' Q/DQ
    for k, site in enumerate(sites):
        if site.get("float"):
            continue
        found = by_site.setdefault(k, {})
        for i, spec in enumerate(site["operands"]):
            role = spec["role"]
            name = f"{layer.name}_{op_sites.site_key(site, k, i)}"
            name = name.replace("/", "_")
            if role == "weight":
                axes = spec["axes"] if config.per_channel else ()
                q = WeightQuantizer(axes, format=fmt, name=name)
                q.build(tuple(spec["shape"]))
            elif role == "input" and spec.get("same"):
                s, j = spec["same"]
                q = by_site.get(s, {}).get(j) or shared.get((s, j))
                if q is None:
                    # the first reader of this tensor stays float (a small
                    # router GEMM): this operand gets the tensor's Q/DQ,
                    # which later readers share (`same` names the first)
                    q = _activation(fmt, config, name)
                    shared[(s, j)] = q
            elif role in ("input", "probs"):
                matmul_input = "probs" if role == "probs" else None
                q = _activation(fmt, config, name, matmul_input)
            else:
                continue
            found[i] = q
            if q not in layer.op_quantizers:
                layer.op_quantizers.append(q)
        if site["op"] == "dot_product_attention":
            name = f"{layer.name}_{op_sites.site_key(site, k, 3)}"
            found["probs"] = _activation(
                fmt, config, name.replace("/", "_"), "probs"
            )
            layer.op_quantizers.append(found["probs"])
    object.__setattr__(layer, "op_quantizers_by_site", by_site)
    object.__setattr__(layer, "op_site_index", op_sites.site_index(sites))


def _at_op_sites(row):
    """Whether a layer of table row `row` (None: no row) is quantized at
    its op sites rather than by its row."""
    return row is None or row.op_sites


def apply_recipe(model, recipe):
    """Quantizes the float `model` in place as `recipe` says.

    Raises:
        ValueError: `model` is not the model the recipe was made for.
    """
    _models.check_structure(
        model,
        list(recipe.layers),
        "Applying a quantization recipe",
        "the quantization recipe",
    )
    apply_entries(model, _models.walk(model), recipe.entries)


# The attribute that held the attention quantizers of the hand-written
# attention twins of earlier releases (keras-hub's Gemma, Llama, T5,
# DeBERTaV3, ... attention): their files name the ranges under it.
LEGACY_ATTENTION_ATTR = "attention_quantizers"


def apply_entries(model, walked, entries):
    """Turns the layers of `walked` (`model`'s) that `entries` (a recipe's,
    or the record's quantization section's) name into their quantized
    twins, with the quantizers the entries turn off turned off.

    An entry of an earlier release for a layer that had a hand-written
    twin and is now reached at its op sites holds no sites: they are found
    again (`_legacy_sites`), and their quantizers keep the attribute the
    file names the ranges under."""
    entries = _legacy_sites(model, walked, entries)
    for entry in entries:
        layer, parents = walked[entry["index"]]
        row = legacy_twins.legacy_row(layer, entry) or quantizable_row(layer)
        attach(
            layer,
            row,
            QuantizeConfig.from_config(entry["config"]),
            entry["inputs"],
            _models.layer_path(layer, parents),
            entry.get("calls", 1),
            entry.get("sites", ()),
            entry.get("quantizer_attr"),
        )
        if entry.get("enabled", True) is False:
            layer.enabled = False
        named = layer.named_quantizers()
        for key in entry.get("off", ()):
            named[key].enabled = False
        if "pre_quant_scale" in entry:
            pre_scale.add(layer, entry["pre_quant_scale"])
        if entry.get("packed"):
            packed.mark(layer, entry["packed"])


def _legacy_sites(model, walked, entries):
    """`entries`, with the op sites of those that have neither a table row
    nor sites (a hand-written attention twin's, saved by an earlier
    release) probed again on the rebuilt `model`."""
    legacy = {
        e["index"]: e
        for e in entries
        if "sites" not in e
        and _at_op_sites(quantizable_row(walked[e["index"]][0]))
        and legacy_twins.legacy_row(walked[e["index"]][0], e) is None
    }
    if not legacy:
        return entries
    choices = {
        index: QuantizeConfig.from_config(e["config"])
        for index, e in legacy.items()
    }
    found, _ = _probe(model, walked, choices, choices)
    found = {e["index"]: e for e in _site_entries(walked, choices, *found)}
    updated = []
    for entry in entries:
        if entry["index"] in legacy:
            if entry["index"] not in found:
                layer, parents = walked[entry["index"]]
                raise ValueError(
                    f"Layer {_models.layer_path(layer, parents)!r} "
                    f"({type(layer).__name__}) was quantized by an earlier "
                    "keras_mp with a hand-written twin, and its code now "
                    "makes no matmul keras_mp can quantize: this keras-hub "
                    "release computes it differently. Quantize the float "
                    "model again with this keras_mp."
                )
            entry = {
                **entry,
                "sites": found[entry["index"]]["sites"],
                "quantizer_attr": LEGACY_ATTENTION_ATTR,
            }
        updated.append(entry)
    return updated


# The lengths a free (None) axis of the zero inputs takes, tried in turn:
# most models run at 1; a convolutional stem with large strides (Moonshine's
# audio encoder) needs a longer signal.
PROBE_LENGTHS = (1, 32, 1024)


def _zeros_like_inputs(model, length=1):
    """Zeros shaped like `model`'s inputs, batch 1, each other free axis
    `length` long."""

    def shape(dims):
        return [d or (1 if i == 0 else length) for i, d in enumerate(dims)]

    specs = _inputs.input_specs(model, "quantize_model")
    if specs is None:  # subclassed: the shape it was built with
        built = (model.get_build_config() or {})["input_shape"]
        return keras.tree.map_shape_structure(
            lambda s: np.zeros(shape(s), "float32"), built
        )
    arrays = [np.zeros(shape(s.shape), s.dtype) for s in specs]
    return _inputs.call_arg(model, arrays, specs)


def run_on_zeros(model, run):
    """`run(sample)` on `_zeros_like_inputs(model, length)` for each of
    `PROBE_LENGTHS` until one runs; the last error when none does."""
    for length in PROBE_LENGTHS:
        try:
            return run(_zeros_like_inputs(model, length))
        except Exception:
            if length == PROBE_LENGTHS[-1]:
                raise
    return None


def make_recipe(structure, choices):
    """The recipe for float model `structure`.

    Args:
        structure: the float model to be quantized (walked, probed).
        choices: `{walk index: QuantizeConfig}` of the selected layers: of a
            table row, or without one (their own ops are probed for sites).

    Returns:
        `Recipe`.
    """
    walked = _models.walk(structure)
    rows = {
        i: c
        for i, c in choices.items()
        if not _at_op_sites(quantizable_row(walked[i][0]))
    }
    others = {i: c for i, c in choices.items() if i not in rows}
    found, calls = _probe(structure, walked, choices, others)
    entries = []
    for index, inputs, count in placement.decide(walked, rows, calls):
        layer, _ = walked[index]
        entry = {
            "index": index,
            "class_name": _models.class_name(layer),
            "config": rows[index].get_config(),
            "inputs": inputs,
        }
        if count > 1:
            entry["calls"] = count
        entries.append(entry)
    entries += _site_entries(walked, others, *found)
    entries.sort(key=lambda entry: entry["index"])
    return Recipe(tuple(entries), tuple(_models.structure(structure)))


def _probe(structure, walked, choices, others):
    """Runs `structure` once on zeros (`op_probe.probe`) with every chosen
    layer recording its calls and the layers of `others` their op sites.

    Returns:
        `((sites, changed), calls)`: `op_probe.probe`'s sites and changed
        calls by layer id, and `{id(layer): number of calls}` (empty when
        the model cannot run on zeros: a warning says what stays float).
    """
    try:
        sites, changed, calls, _ = run_on_zeros(
            structure,
            lambda sample: op_probe.probe(
                lambda: structure(sample, training=False),
                [walked[i][0] for i in choices],
                [walked[i][0] for i in others],
            ),
        )
    except Exception as e:  # a model that needs real data: no probe
        if others:
            warnings.warn(
                f"Could not run model {structure.name!r} on zeros to find "
                "the GEMMs written in its layers' own code "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                "those stay float, the layers of the layer table are "
                "quantized.",
                stacklevel=5,
            )
        return ({}, {}), {}
    return (sites, changed), calls


def _site_entries(walked, choices, found, changed):
    """The entries of the layers of `choices` whose own code calls GEMM ops
    (`found`: their sites by layer id), each with its sites."""
    layers = {id(walked[i][0]): i for i in choices}
    entries = []
    for layer_id, sites in found.items():
        index = layers[layer_id]
        layer, parents = walked[index]
        if layer_id in changed:
            warnings.warn(
                f"Layer {_models.layer_path(layer, parents)!r} stays float: "
                f"{changed[layer_id]}, so no op of it has one identity.",
                stacklevel=5,
            )
            continue
        config = choices[index]
        row = quantizable_row(layer)
        for site in sites:
            reason = placement.site_float(site, config, row)
            if reason:
                site["float"] = reason
        if all(site.get("float") for site in sites):
            continue
        entries.append(
            {
                "index": index,
                "class_name": _models.class_name(layer),
                "config": config.get_config(),
                "inputs": [],
                "sites": sites,
            }
        )
    return entries
