"""Mixed-precision policy helpers, the Tensor Core alignment audit, TF32.

The AMP rules (seed tutorial): compute convolutions and matrix multiplies in
16-bit, keep master weights, normalization statistics, softmax and the
model's output in float32.
"""

import dataclasses

import keras
from keras.src.models.functional import Functional

POLICIES = ("mixed_float16", "mixed_bfloat16", "float32", "auto")

# Layer types whose math is precision-sensitive: they reduce over many values
# (normalizations) or exponentiate (softmax), so the AMP rules keep them in
# float32.
SENSITIVE_LAYER_TYPES = (
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
    keras.layers.UnitNormalization,
    keras.layers.Normalization,
    keras.layers.Softmax,
)
_SENSITIVE_ACTIVATIONS = ("softmax", "log_softmax")


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
    import tensorflow as tf

    caps = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        caps.append(tuple(details.get("compute_capability", (0, 0))))
    return caps


def _cpu_flags():
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
        ValueError: `policy` is not one of the names above.

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
        policy, reason = resolve_auto_policy()
    previous = keras.mixed_precision.global_policy().name
    keras.mixed_precision.set_global_policy(policy)
    return PreviousPolicy(previous, reason)


def is_precision_sensitive(layer, model=None):
    """True when the AMP rules keep `layer` in float32.

    Normalization layers, softmax (layer or activation) and, when `model` is
    given, every layer that produces one of the model's outputs.
    """
    if isinstance(layer, SENSITIVE_LAYER_TYPES):
        return True
    activation = getattr(layer, "activation", None)
    if getattr(activation, "__name__", None) in _SENSITIVE_ACTIVATIONS:
        return True
    if model is not None:
        return layer.name in _output_layer_names(model)
    return False


def _output_layer_names(model):
    names = set()
    for out in model.outputs or ():
        history = getattr(out, "_keras_history", None)
        if history is not None:
            names.add(history.operation.name)
    return names


def _check_model(model):
    if not isinstance(model, keras.Model):
        hint = ""
        if type(model).__module__.startswith(("tf_keras", "keras.src.engine")):
            hint = " tf_keras (Keras 2) models are not supported; rebuild it "
            "with Keras 3 (`import keras`)."
        raise TypeError(
            f"Expected a Keras 3 `keras.Model`. Received: "
            f"{type(model).__module__}.{type(model).__name__}.{hint}"
        )


def apply_mixed_precision(model, policy=None):
    """Copies `model` under a mixed policy, sensitive layers kept in float32.

    Every layer gets `policy`, except those `is_precision_sensitive` names
    (normalizations, softmax, the model's output layers), which get
    `"float32"`. Weights are carried over; variables stay float32 either way.

    Args:
        model: A Sequential or Functional `keras.Model`.
        policy: str. The policy for the other layers. Defaults to the global
            policy.

    Returns:
        A new `keras.Model` with the same weights.

    Raises:
        TypeError: `model` is not a Keras 3 model, or is subclassed.
        ValueError: `policy` is not a known policy name.
    """
    _check_model(model)
    if not isinstance(model, (keras.Sequential, Functional)):
        raise TypeError(
            f"Model {model.name!r} is a subclassed {type(model).__name__}: "
            "its layers are created in Python code, so they cannot be copied "
            "under a new policy. Call "
            "`keras_mp.enable_mixed_precision()` before constructing the "
            'model (and pass `dtype="float32"` to its normalization, '
            "softmax and output layers), or rebuild it as a Functional or "
            "Sequential model."
        )
    policy = policy or keras.mixed_precision.global_policy().name
    if policy not in POLICIES[:3]:
        raise ValueError(
            f"`policy` must be one of {POLICIES[:3]}. Received: "
            f"policy={policy!r}"
        )
    outputs = _output_layer_names(model)

    def clone(layer):
        config = layer.get_config()
        keep = isinstance(layer, SENSITIVE_LAYER_TYPES) or (
            layer.name in outputs
        )
        activation = config.get("activation")
        keep = keep or activation in _SENSITIVE_ACTIVATIONS
        config["dtype"] = "float32" if keep else policy
        return layer.__class__.from_config(config)

    new = keras.models.clone_model(model, clone_function=clone)
    new.set_weights(model.get_weights())
    return new


@dataclasses.dataclass
class LayerAudit:
    name: str
    class_name: str
    compute_dtype: str
    variable_dtype: str
    findings: list


@dataclasses.dataclass
class AuditReport:
    """Per-layer dtypes and Tensor Core alignment findings."""

    layers: list
    batch_size: int = None
    batch_finding: str = ""

    @property
    def findings(self):
        out = [f"{r.name}: {f}" for r in self.layers for f in r.findings]
        return out + ([self.batch_finding] if self.batch_finding else [])

    @property
    def summary(self):
        half = sum(
            r.compute_dtype in ("float16", "bfloat16") for r in self.layers
        )
        return (
            f"{len(self.layers)} layers: {half} compute in 16-bit, "
            f"{len(self.layers) - half} in float32; "
            f"{len(self.findings)} Tensor Core alignment finding(s)."
        )

    def to_table(self):
        rows = [("layer", "type", "compute", "variables", "alignment")]
        for r in self.layers:
            rows.append(
                (
                    r.name,
                    r.class_name,
                    r.compute_dtype,
                    r.variable_dtype,
                    "; ".join(r.findings) or "ok",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self.batch_finding:
            lines.append(self.batch_finding)
        lines.append(self.summary)
        return "\n".join(lines)

    def __str__(self):
        return self.to_table()


def _alignment_findings(layer):
    findings = []
    for attr in ("units", "filters"):
        value = getattr(layer, attr, None)
        if isinstance(value, int) and value % 8:
            findings.append(f"{attr}={value} not a multiple of 8")
    kernel = getattr(layer, "kernel", None)
    if kernel is not None and len(kernel.shape) >= 3:
        channels = kernel.shape[-2]
        if channels % 8:
            findings.append(f"input channels={channels} not a multiple of 8")
    elif kernel is not None and len(kernel.shape) == 2 and kernel.shape[0] % 8:
        findings.append(f"input features={kernel.shape[0]} not a multiple of 8")
    if isinstance(layer, keras.layers.Embedding) and layer.output_dim % 8:
        findings.append(f"output_dim={layer.output_dim} not a multiple of 8")
    return findings


def _flat_layers(model):
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            yield from _flat_layers(layer)
        else:
            yield layer


def mixed_precision_audit(model, batch_size=None, verbose=True):
    """Lists each layer's dtypes and its Tensor Core alignment findings.

    Tensor Cores run float16/bfloat16 (and INT8) matrix math when the
    matrix dimensions are multiples of 8: units, filters, input channels and
    the batch size. A misaligned dimension falls back to slower kernels or is
    padded.

    Args:
        model: A built `keras.Model`.
        batch_size: int. The training batch size, checked too when given.
        verbose: bool. Print the table and summary. Defaults to True.

    Returns:
        `AuditReport` with `.layers`, `.findings`, `.summary`, `.to_table()`.

    Example:

    >>> report = keras_mp.mixed_precision_audit(model, batch_size=128)
    >>> report.summary
    '9 layers: 7 compute in 16-bit, 2 in float32; 1 Tensor Core ...'
    """
    _check_model(model)
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so its weight shapes are "
            "unknown. Call it on a batch or call `model.build(input_shape)` "
            "first."
        )
    rows = []
    for layer in _flat_layers(model):
        if isinstance(layer, keras.layers.InputLayer):
            continue
        rows.append(
            LayerAudit(
                name=layer.name,
                class_name=type(layer).__name__,
                compute_dtype=layer.compute_dtype,
                variable_dtype=layer.variable_dtype,
                findings=_alignment_findings(layer),
            )
        )
    batch_finding = ""
    if batch_size is not None and batch_size % 8:
        batch_finding = f"batch_size={batch_size} not a multiple of 8"
    report = AuditReport(rows, batch_size, batch_finding)
    if verbose:
        print(report.to_table())
    return report


def set_tf32(enabled):
    """Turns TensorFloat-32 matrix math on or off; returns the previous state.

    TF32 (Ampere and newer) runs float32 matmuls and convolutions on Tensor
    Cores with a 10-bit mantissa. TensorFlow enables it by default; turn it
    off when a float32 baseline must be bit-faithful.
    """
    import tensorflow as tf

    previous = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(bool(enabled))
    return previous
