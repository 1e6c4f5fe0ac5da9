"""Mixed-precision policies: set one, pick one for this machine, apply the
AMP rules (16-bit compute, sensitive layers in float32) to a model, TF32.
Guide: `docs/mixed-precision.md`.
"""

import warnings

import keras

from keras_mp import _keras, _models, layer_table
from keras_mp._compat import require_tensorflow

POLICIES = ("mixed_float16", "mixed_bfloat16", "float32", "auto")


class PreviousPolicy(str):
    """The policy name in force before `enable_mixed_precision`.

    A `str` (compare it, print it) that is also a context manager: leaving
    the `with` block restores this policy.
    """

    def __new__(cls, name, reason=""):
        obj = super().__new__(cls, name)
        obj.reason = reason
        return obj

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        keras.mixed_precision.set_global_policy(str(self))
        return False


def _gpu_compute_capabilities():
    """`(major, minor)` compute capability of each visible GPU."""
    import tensorflow as tf

    caps = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        caps.append(tuple(details.get("compute_capability", (0, 0))))
    return caps


def _cpu_flags():
    """The CPU feature flags of `/proc/cpuinfo` (empty where it is absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def resolve_auto_policy():
    """Picks the policy this machine gains from, and says why.

    Returns:
        `(policy_name, reason)`. bfloat16 on Ampere or newer GPUs (compute
        capability >= 8.0: same exponent range as float32, no loss scaling
        needed); float16 on Volta/Turing (7.x: Tensor Cores, needs loss
        scaling); float32 on older GPUs and on CPUs without native bfloat16
        (AMX or AVX512_BF16), where 16-bit math is emulated and slower.
    """
    caps = _gpu_compute_capabilities()
    if caps:
        cap = min(caps)
        if cap >= (8, 0):
            return "mixed_bfloat16", (
                f"GPU compute capability {cap[0]}.{cap[1]} >= 8.0 has "
                "bfloat16 Tensor Cores; bfloat16 needs no loss scaling."
            )
        if cap >= (7, 0):
            return "mixed_float16", (
                f"GPU compute capability {cap[0]}.{cap[1]} has float16 "
                "Tensor Cores but no bfloat16; use loss scaling."
            )
        return "float32", (
            f"GPU compute capability {cap[0]}.{cap[1]} < 7.0 has no Tensor "
            "Cores; 16-bit math would not be faster."
        )
    flags = _cpu_flags()
    if flags & {"amx_bf16", "avx512_bf16"}:
        return "mixed_bfloat16", (
            "No GPU; this CPU has native bfloat16 instructions "
            f"({', '.join(sorted(flags & {'amx_bf16', 'avx512_bf16'}))})."
        )
    return "float32", (
        "No GPU and no native bfloat16 on this CPU: 16-bit math would be "
        "emulated and slower than float32."
    )


def enable_mixed_precision(policy="mixed_float16"):
    """Sets Keras' global dtype policy and returns the previous one.

    The return value is a `str` naming the previous policy that is also a
    context manager: leaving the `with` block restores it.

    Args:
        policy: str. One of `"mixed_float16"`, `"mixed_bfloat16"`,
            `"float32"` or `"auto"` (picks what this hardware gains from;
            the reason is on the result's `.reason`). Defaults to
            `"mixed_float16"`.

    Returns:
        `PreviousPolicy`: the previous policy name, with `.reason` set to why
        `"auto"` chose what it chose (empty otherwise).

    Raises:
        ValueError: `policy` is not one of the names above, or is `"auto"`
            on a Keras backend other than TensorFlow (it reads
            TensorFlow's list of GPUs).

    Example:

    >>> with keras_mp.enable_mixed_precision("mixed_bfloat16"):
    ...     model = build_model()
    """
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(
            f"Unknown mixed-precision policy. Expected one of {POLICIES}. "
            f"Received: policy={policy!r}"
        )
    reason = ""
    if policy == "auto":
        require_tensorflow('keras_mp.enable_mixed_precision("auto")')
        policy, reason = resolve_auto_policy()
    previous = keras.mixed_precision.global_policy().name
    keras.mixed_precision.set_global_policy(policy)
    return PreviousPolicy(previous, reason)


def is_precision_sensitive(layer, model=None):
    """True when the AMP rules keep `layer` in float32.

    Normalization layers, softmax (layer or activation) and, when `model` is
    given, every layer that produces one of the model's outputs.

    Args:
        layer: `keras.layers.Layer`.
        model: optional `keras.Model` holding `layer`. Defaults to None.

    Returns:
        bool.

    Example:

    >>> keras_mp.is_precision_sensitive(keras.layers.Softmax())
    True
    """
    if layer_table.keeps_float32(layer):
        return True
    return model is not None and layer.name in _output_layer_names(model)


def _output_layer_names(model):
    """Names of the layers that produce `model`'s outputs."""
    producers = (_keras.producer(out) for out in model.outputs or ())
    return {layer.name for layer in producers if layer is not None}


# Keras computes these in float32 whatever their policy (their math upcasts
# half inputs), so inside a custom layer they may share its 16-bit policy.
_UPCASTING = (keras.layers.BatchNormalization, keras.layers.LayerNormalization)


def _dtype_for(layer, policy, outputs):
    """The `dtype` a layer with sublayers is rebuilt with. Inside a custom
    layer's code one dtype must run throughout (keras-hub's residual adds do
    not cast), so it gets `policy` (or float32 when it is sensitive itself).
    A Functional one (a keras-hub backbone) gets a `DTypePolicyMap`: its
    graph's own sensitive leaf layers, between which Keras casts, in
    float32 (a custom layer in its graph runs in `policy`, even when it
    makes an output: the paths of its sublayers are its code's)."""
    if layer_table.keeps_float32(layer) or layer.name in outputs:
        return "float32"
    if not _keras.is_graph_model(layer):
        return policy
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy=policy)
    for x in layer.layers:
        sensitive = layer_table.keeps_float32(x) or x.name in outputs
        if x.path and sensitive and not _keras.sublayers(x):
            policy_map[x.path] = "float32"
    return policy_map


# Layers that build their sublayers from the config of the layer they
# wrap, dtype included: the wrapped layer's config gets the dtype.
_WRAPPERS = (keras.layers.Wrapper, keras.layers.Bidirectional)


def _wrapped_dtypes(layer, config, dtype):
    """Gives the configs of the layers `layer` wraps (TimeDistributed's
    `layer`, Bidirectional's `layer` and `backward_layer`) `dtype`, or
    float32 for a sensitive one, as its own config has."""
    if not isinstance(layer, _WRAPPERS) or not isinstance(dtype, str):
        return
    inner = {"layer": getattr(layer, "layer", None)}
    if isinstance(layer, keras.layers.Bidirectional):
        inner = {
            "layer": layer.forward_layer,
            "backward_layer": layer.backward_layer,
        }
    for key, sub in inner.items():
        sub_config = config.get(key)
        if sub is None or not isinstance(sub_config, dict):
            continue
        keep = layer_table.keeps_float32(sub)
        sub_config["config"]["dtype"] = "float32" if keep else dtype


def _rebuild(layer, policy, outputs):
    """`layer` rebuilt from its config under `policy`. keras-hub layers pass
    their `dtype` to their sublayers; a layer whose code does not is copied
    as it was (`_check_reached` names what stayed float32)."""
    if not _keras.sublayers(layer):
        keep = layer_table.keeps_float32(layer) or layer.name in outputs
        config = layer.get_config()
        config["dtype"] = "float32" if keep else policy
        return layer.__class__.from_config(config)
    config = keras.saving.serialize_keras_object(layer)
    config["config"]["dtype"] = _dtype_for(layer, policy, outputs)
    _wrapped_dtypes(layer, config["config"], config["config"]["dtype"])
    try:
        new = keras.saving.deserialize_keras_object(config, safe_mode=False)
    except Exception as e:  # any from_config can fail its own way
        raise TypeError(
            f"`apply_mixed_precision` copies {type(layer).__name__} "
            f"{layer.name!r} under the new policy through its config, and "
            f"that failed ({type(e).__name__}: {e}). Give it a `get_config()` "
            "returning its constructor arguments (with `**kwargs` passed to "
            "`super().__init__`), or call `keras_mp.enable_mixed_precision()` "
            "before constructing the model."
        ) from e
    if isinstance(new, keras.Model) and not _keras.is_graph_model(new):
        return new  # a subclassed model: `_check_reached` says what it did
    wanted = {"float32", keras.DTypePolicy(policy).compute_dtype}
    if not any(
        x.compute_dtype in wanted - {layer.compute_dtype}
        for x in _models.walk_layers(new)
        if x.weights
    ):
        # Its code makes its sublayers without its dtype: a 16-bit layer
        # around float32 ones would mix dtypes in its own math.
        return layer.__class__.from_config(layer.get_config())
    return new


def _check_reached(model, new, policy, outputs):
    """Warns about the layers of `new` whose compute dtype is not what the
    AMP rules want: left float32 (not reached) or sensitive in 16-bit.

    Raises:
        TypeError: no weighted layer was reached at all.
    """
    half = keras.DTypePolicy(policy).compute_dtype
    missed, exposed, reached = [], [], 0
    for old, layer in zip(
        _models.walk_layers(model), _models.walk_layers(new), strict=True
    ):
        if old.name in outputs or layer_table.keeps_float32(old):
            if layer.compute_dtype != "float32" and not isinstance(
                layer, _UPCASTING
            ):
                exposed.append(layer.name)
        elif old.weights and not _keras.sublayers(old):
            if layer.compute_dtype == half:
                reached += 1
            else:
                missed.append(layer.name)
    if missed and not reached:
        raise TypeError(
            f"`apply_mixed_precision` could not give any layer of model "
            f"{model.name!r} the policy {policy!r}: its layers are made by "
            f"{type(model).__name__}'s code, which does not pass the model's "
            "`dtype` to them. Call `keras_mp.enable_mixed_precision()` "
            'before constructing the model (and pass `dtype="float32"` to '
            "its normalization, softmax and output layers), or rebuild it as "
            "a Functional or Sequential model."
        )
    if missed:
        warnings.warn(
            f"apply_mixed_precision: these layers stay float32, their parent "
            f"layer does not pass its dtype policy to them: "
            f"{', '.join(missed)}. Construct them with "
            f"`dtype={policy!r}` to run them in {half}.",
            stacklevel=3,
        )
    if exposed:
        warnings.warn(
            f"apply_mixed_precision: these layers compute in {half} although "
            f"the AMP rules keep them in float32: their parent layer's code "
            f"runs them in its own dtype: {', '.join(exposed)}.",
            stacklevel=3,
        )


def apply_mixed_precision(model, policy=None):
    """Copies `model` under a mixed policy, sensitive layers kept in float32.

    Every layer gets `policy`, except those `is_precision_sensitive` names
    (normalizations, softmax, the model's output layers), which get
    `"float32"`. Weights are carried over; variables stay float32 either way.
    A Sequential or Functional model is copied layer by layer (nested ones
    entered); a layer with sublayers (a custom layer, a nested keras-hub
    backbone) and any other model (subclassed, keras-hub backbones) are
    rebuilt from their config with a `keras.DTypePolicyMap` as `dtype`:
    `policy` by default, float32 at the paths of sensitive sublayers. That
    reaches every layer of a keras-hub model, whose layers pass `dtype` on;
    a layer whose parent does not pass it on stays as it was, and a warning
    names it. The copy saves to `.keras` with its policies.

    Args:
        model: a built `keras.Model`.
        policy: str. The policy for the other layers. Defaults to the global
            policy.

    Returns:
        A new `keras.Model` with the same weights.

    Raises:
        TypeError: `model` is not a Keras 3 model, or is a model none of
            whose layers can take the policy (a subclassed model whose code
            makes its layers without passing `dtype`).
        ValueError: `policy` is not a known policy name.

    Example:

    >>> mixed = keras_mp.apply_mixed_precision(model, "mixed_bfloat16")
    """
    _models.check_model(model, "apply_mixed_precision")
    policy = policy or keras.mixed_precision.global_policy().name
    if policy not in POLICIES[:3]:
        raise ValueError(
            f"`policy` must be one of {POLICIES[:3]}. Received: "
            f"policy={policy!r}"
        )
    outputs = (
        _output_layer_names(model) if _keras.is_graph_model(model) else set()
    )

    def clone(layer):
        if not isinstance(layer, keras.layers.Layer):
            # An operation of the graph (`GetItem` in keras-hub): no dtype.
            return layer.__class__.from_config(layer.get_config())
        if _keras.is_plain_graph_model(layer):
            return keras.models.clone_model(layer, clone_function=clone)
        return _rebuild(layer, policy, outputs)

    if _keras.is_plain_graph_model(model):
        new = keras.models.clone_model(model, clone_function=clone)
    else:
        new = _rebuild(model, policy, outputs)
    new.set_weights(model.get_weights())
    if policy != "float32":
        _check_reached(model, new, policy, outputs)
    return new


def set_tf32(enabled):
    """Turns TensorFloat-32 matrix math on or off; returns the previous state.

    TF32 (Ampere and newer) runs float32 matmuls and convolutions on Tensor
    Cores with a 10-bit mantissa. TensorFlow enables it by default; turn it
    off when a float32 baseline must be bit-faithful.

    Args:
        enabled: bool. Whether TF32 math is allowed.

    Returns:
        bool. The previous state.

    Example:

    >>> previous = keras_mp.set_tf32(False)
    """
    require_tensorflow("keras_mp.set_tf32")
    import tensorflow as tf

    previous = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(bool(enabled))
    return previous
