"""Which layers of a model 2:4 sparsity prunes, and `strip_sparsity`."""

import keras

from keras_mp import _keras, _models, layer_table
from keras_mp.selection import layer_matcher
from keras_mp.sparsity.masks import SparsityMask, value

# NVIDIA ASP (apex.contrib.sparsity) prunes a weight only when its output
# channels are a multiple of 8 and its input channels a multiple of 16, the
# shapes sparse Tensor Core kernels take; TensorRT runs other layers dense.
ALIGNED_OUTPUT_CHANNELS = 8
ALIGNED_INPUT_CHANNELS = 16
_REGISTERED_NAME = "keras_mp>SparsityMask"


def prunable_kernel(layer):
    """The kernel variable 2:4 sparsity would prune in `layer`, or None
    when the layer type has none or the layer is not built."""
    verdict = layer_table.prunable_weight(layer)
    return getattr(layer, verdict.value.attr, None) if verdict.ok else None


def check_eligible(layer, m=2, n=4, pad=False, skip_unaligned=False):
    """Whether `layer` is pruned to m:n under these settings.

    Args:
        layer: a Keras layer.
        m: int. Weights kept per group. Defaults to 2.
        n: int. Group size. Defaults to 4.
        pad: bool. Channel counts that are not a multiple of `n` count as
            zero-padded. Defaults to False.
        skip_unaligned: bool. Apply NVIDIA ASP's alignment rule. Defaults
            to False.

    Returns:
        A `keras_mp.layer_table.Verdict`: the `Weight` to prune, or the
        reason the layer is skipped.
    """
    verdict = layer_table.prunable_weight(layer)
    if not verdict.ok:
        return verdict
    kernel = getattr(layer, verdict.value.attr, None)
    if kernel is None:
        return layer_table.Verdict(
            reason="layer is not built (call the model on data first)"
        )
    channels = kernel.shape[verdict.value.in_axis]
    outputs = layer_table.output_channels(layer, kernel)
    # Checked first: padding cannot make a layer aligned (pad is moot here).
    if skip_unaligned and (
        outputs % ALIGNED_OUTPUT_CHANNELS or channels % ALIGNED_INPUT_CHANNELS
    ):
        return layer_table.Verdict(
            reason=f"{channels} input / {outputs} output channels: sparse "
            f"Tensor Cores want multiples of {ALIGNED_INPUT_CHANNELS} / "
            f"{ALIGNED_OUTPUT_CHANNELS} (skip_unaligned=True, NVIDIA ASP's "
            "rule; TensorRT would run this layer dense)"
        )
    if channels % n and not pad:
        return layer_table.Verdict(
            reason=f"{channels} input channels, not a multiple of {n} "
            "(pass pad=True to zero-pad)"
        )
    return verdict


def weighted_layers(model):
    """The layers of `model` that are prunable or hold a kernel, in order.

    Nested models, `keras.layers.Wrapper`s and custom layers are entered;
    each layer is listed once.
    """
    return [
        layer
        for layer in _models.walk_layers(model)
        if layer_table.prunable_weight(layer).ok or hasattr(layer, "kernel")
    ]


def select_layers(model, layers=None):
    """The weighted layers of `model` matched by the `layers` selection.

    Args:
        model: a `keras.Model`.
        layers: a selection as in `StructuredSparsity`, or None for all.

    Returns:
        A list of layers, in model order.

    Raises:
        ValueError: the selection matches no layer; lists the names.
    """
    candidates = weighted_layers(model)
    chosen = [layer for layer in candidates if layer_matcher(layers)(layer)]
    if layers is not None and not chosen:
        names = ", ".join(layer.name for layer in candidates) or "(none)"
        raise ValueError(
            f"`layers={layers!r}` matches no weighted layer of model "
            f"'{model.name}'. Its weighted layers are: {names}."
        )
    return chosen


def sparse_layers(model):
    """`(layer, kernel_variable, SparsityMask)` for every masked kernel."""
    out = []
    for layer in weighted_layers(model):
        kernel = prunable_kernel(layer)
        constraint = getattr(kernel, "constraint", None)
        if isinstance(constraint, SparsityMask):
            out.append((layer, kernel, constraint))
    return out


def _strip_config(config):
    if isinstance(config, dict):
        if config.get("registered_name") == _REGISTERED_NAME:
            return config["config"]["constraint"]
        return {k: _strip_config(v) for k, v in config.items()}
    if isinstance(config, list):
        return [_strip_config(v) for v in config]
    return config


def strip_sparsity(model):
    """Returns a plain Keras copy of `model` with the 2:4 zeros baked in.

    The copy has no `SparsityMask` constraints (a previous kernel constraint
    is restored), its kernels hold the masked values, and it computes the
    same outputs. It is not compiled.

    Args:
        model: a `keras.Model`: Sequential, Functional, or any model that
            its config rebuilds (subclassed with `get_config`, keras-hub
            backbones), or a `keras_mp.RecordedModel` (its inner model is
            copied).

    Returns:
        A new `keras.Model`.

    Raises:
        TypeError: `model` is not a Keras 3 model.
        ValueError: a subclassed model that its config does not rebuild.

    Example:

    >>> deploy = strip_sparsity(model)  # doctest: +SKIP
    >>> deploy.export("model", format="onnx")  # doctest: +SKIP
    """
    _models.check_model(model, "strip_sparsity")
    model = _models.contents(model)  # a container only saves the masks
    if _keras.is_plain_graph_model(model):
        clone = keras.models.clone_model(
            model,
            clone_function=lambda layer: layer.__class__.from_config(
                _strip_config(layer.get_config())
            ),
            recursive=True,
        )
    else:
        # Its code rebuilds the layers it holds, without constraints.
        clone = _models.copy_model(model, "strip_sparsity", constraints=False)
    values = []
    for v in model.weights:
        w = value(v)
        if isinstance(getattr(v, "constraint", None), SparsityMask):
            w = w * value(v.constraint.mask)
        values.append(w)
    clone.set_weights(values)
    return clone
