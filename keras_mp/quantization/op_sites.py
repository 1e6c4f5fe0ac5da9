"""Quantization at the op call: the matmuls, einsums and attention written
inside any layer's `call`.

A layer without a row in the layer table (a custom layer, a keras-hub
attention layer, a recommender's interaction, a mixture of experts) does
its GEMMs in `keras.ops` calls in its own code. Those calls are
intercepted (`_keras.intercept_ops`: the `keras.ops` module attributes are
wrapped once, and pass straight through unless a quantized layer's call
is running in this thread), so no class is needed per kind of layer:

- At quantize time a *probe* (`op_probe.py`) runs the model once on zeros
  and records, for
  each candidate layer, the sequence of `matmul` / `einsum` /
  `dot_product_attention` calls its own code makes (the nearest frame
  whose `self` is a layer owns a call), and the role of each operand: a
  *weight* (one of the layer's variables, or a tensor moved from one by
  transpose/reshape/cast: `MOVES`), a softmax output (*probs*), another
  float *input*, or none (integers, symbolic).
- Each site is identified by the layer's path, the op's source location
  (function, file and line of the call) and its occurrence there within
  one call (a loop or generator calls one line several times); it is named
  by its ordinal among the layer's sites (`einsum_2/operand_1`). A call
  of a layer may skip sites (a shared embedding called forward, then
  reversed); an op at a location the probe never saw is an error naming
  the layer. Each site gets `TensorQuantizer`s, saved in the record and
  the layer's weights: a weight per output channel (the operand's axes
  that reach the output and no other operand), an input or probs per
  tensor.
- At call time the site's operands are fake-quantized and the original op
  runs on them; `dot_product_attention` runs as matmul-softmax-matmul
  with Q/DQ on the scaled query, the key, the softmax output and the
  value (`quantized_attention`), TensorRT's fused-attention pattern.

Guide and limits: `docs/architecture.md`.
"""

import inspect
import os
import sys
import threading

import keras
import numpy as np
import tensorflow as tf

from keras_mp import _keras

# The ops whose operands get Q/DQ.
GEMMS = ("matmul", "einsum", "dot_product_attention")
# Ops that only move a weight's values (its operand is still "a weight").
MOVES = (
    "transpose",
    "reshape",
    "cast",
    "expand_dims",
    "squeeze",
    "swapaxes",
    "moveaxis",
    "convert_to_tensor",
    "take",  # rows of a table: relative-position embeddings (ViTDet)
)
# The operand names of `dot_product_attention`'s quantizers.
ATTENTION_OPERANDS = ("query", "key", "value", "probs")

_local = threading.local()
_ORIGINALS = {}


def _state():
    if not hasattr(_local, "scopes"):
        _local.scopes = {}  # id(layer) -> CallScope of its running call
        _local.probe = None
    return _local


def install():
    """Intercepts the `keras.ops` functions op-level quantization reads
    (once per process)."""
    if not _ORIGINALS:
        _ORIGINALS.update(
            _keras.intercept_ops(GEMMS + MOVES + ("softmax",), _wrapper)
        )
        operator = _keras.intercept_tensor_matmul(_tensor_matmul)
        _ORIGINALS["@"] = lambda x1, x2: operator(x1, x2)


def _tensor_matmul(x1, x2):
    """`x1 @ x2` on TensorFlow tensors: a `matmul` site like `ops.matmul`
    (the frame that wrote `@` calls this one directly)."""
    state = _state()
    op = _ORIGINALS["@"]
    if not state.scopes and state.probe is None:
        return op(x1, x2)
    # frames: _dispatch, this, the operator in `_keras`, the caller
    return _dispatch(state, "matmul", op, (x1, x2), {}, depth=3)


def original(name):
    install()
    return _ORIGINALS[name]


def _wrapper(name, op):
    def intercepted(*args, **kwargs):
        state = _state()
        if not state.scopes and state.probe is None:
            return op(*args, **kwargs)
        return _dispatch(state, name, op, args, kwargs)

    intercepted.__name__ = op.__name__
    intercepted.__doc__ = op.__doc__
    intercepted.__signature__ = inspect.signature(op)
    return intercepted


def _owner(frame):
    """`(layer, function name)`: the nearest layer whose code is running
    (the first frame whose `self` is a Keras layer), and the name of the
    function that called the op."""
    code = frame.f_code
    where = f"{code.co_name} ({os.path.basename(code.co_filename)}:"
    where += f"{frame.f_lineno})"
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.layers.Layer):
            return owner, where
        frame = frame.f_back
    return None, where


def _dispatch(state, name, op, args, kwargs, depth=2):
    if _is_symbolic(args, kwargs):
        return op(*args, **kwargs)
    owner, where = _owner(sys._getframe(depth))
    if state.probe is not None:
        return state.probe.record(owner, name, op, args, kwargs, where)
    scope = state.scopes.get(id(owner))
    if scope is None or name not in GEMMS:
        return op(*args, **kwargs)
    return scope.run(name, op, args, kwargs, where)


def _is_symbolic(args, kwargs):
    values = list(args) + list(kwargs.values())
    return any(isinstance(v, keras.KerasTensor) for v in values)


def _bind(name, op, args, kwargs):
    """`(operands, rebuild)`: the tensor operands of a GEMM call, and a
    function that calls `op` with replaced operands."""
    if name == "einsum":
        equation, operands = args[0], list(args[1:])
        return operands, lambda new: op(equation, *new, **kwargs)
    if name == "matmul" and not kwargs:  # `ops.matmul(a, b)`, `a @ b`
        return list(args[:2]), lambda new: op(*new)
    bound = inspect.signature(op).bind(*args, **kwargs)
    keys = ("x1", "x2") if name == "matmul" else ("query", "key", "value")
    operands = [bound.arguments[k] for k in keys]

    def rebuild(new):
        arguments = dict(bound.arguments)
        arguments.update(zip(keys, new))
        return op(**arguments)

    return operands, rebuild


def _is_float(x):
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    return "float" in keras.backend.standardize_dtype(dtype)


def site_index(sites):
    """`{(where, occurrence): site ordinal}` of a layer's `sites`, plus
    `(where, "last")` for the last occurrence at each location (a loop
    longer than the probe's shares it)."""
    index = {(s["where"], s["occurrence"]): k for k, s in enumerate(sites)}
    for k, site in enumerate(sites):  # sites are in occurrence order
        index[(site["where"], "last")] = k
    return index


class CallScope:
    """One running call of an op-quantized layer: how often each call site
    ran so far (a site is its source location and occurrence), and the
    quantized operands already computed in this call."""

    def __init__(self, layer):
        self.layer = layer
        self.seen = {}  # where -> ops called there so far in this call
        self.done = {}  # (site, operand) -> (raw tensor, quantized)

    def run(self, name, op, args, kwargs, where):
        layer = self.layer
        occurrence = self.seen.get(where, 0)
        self.seen[where] = occurrence + 1
        k = layer.op_site_index.get((where, occurrence))
        if k is None:
            # A loop whose trip count follows a shape (the probe's call
            # was shorter): the loop body's op shares its last recorded
            # occurrence's quantizers, one range over every iteration.
            k = layer.op_site_index.get((where, "last"))
        sites = layer.op_sites
        if k is None or sites[k]["op"] != name:
            recorded = ", ".join(
                f"{s['op']} in {s['where']}" for s in sites[:4]
            )
            raise ValueError(
                f"Layer {layer.quantize_path!r} "
                f"({layer.float_class.__name__}) called `ops.{name}` in "
                f"{where} (time {occurrence + 1} in this call), an op it "
                f"was not quantized with (it was: {recorded}): its code "
                "takes another path now (a Python branch on `training` or "
                "a shape, or a changed library). Quantize the model again "
                "from the float model, calling it as it will be used, or "
                "leave this layer out with `QuantizeConfig(skip=True)`."
            )
        site = sites[k]
        quantizers = layer.op_quantizers_by_site.get(k)
        if not quantizers or not layer.enabled:
            return op(*args, **kwargs)
        if name == "dot_product_attention":
            return quantized_attention(op, args, kwargs, quantizers)
        operands, rebuild = _bind(name, op, args, kwargs)
        calibrating = layer._calibrating()
        new = list(operands)
        for i, spec in enumerate(site["operands"]):
            q = quantizers.get(i)
            if q is not None:
                new[i] = self._quantize(k, i, spec, q, operands[i], calibrating)
        return rebuild(new)

    def _quantize(self, k, i, spec, q, x, calibrating):
        if spec["role"] == "weight":
            value = x.value if isinstance(x, keras.Variable) else x
            if calibrating or tf.executing_eagerly():
                q.update(value)  # the weights' max|w| now
            if calibrating:
                return value
            return _same_dtype(q(value), value)
        same = tuple(spec.get("same") or (k, i))
        raw, quantized = self.done.get(same, (None, None))
        if raw is x:  # one tensor, one Q/DQ
            return quantized
        quantized = _same_dtype(q(x), x)
        self.done[(k, i)] = (x, quantized)
        return quantized


def _same_dtype(quantized, x):
    if quantized.dtype != x.dtype:
        quantized = keras.ops.cast(quantized, x.dtype)
    return quantized


class scope:
    """Context manager: op-level quantization of `layer`'s own ops during
    one call."""

    def __init__(self, layer):
        self.layer = layer

    def __enter__(self):
        install()
        state = _state()
        self.previous = state.scopes.get(id(self.layer))
        state.scopes[id(self.layer)] = CallScope(self.layer)

    def __exit__(self, *exc):
        state = _state()
        if self.previous is None:
            state.scopes.pop(id(self.layer), None)
        else:
            state.scopes[id(self.layer)] = self.previous
        return False


def quantized_attention(op, args, kwargs, quantizers):
    """`keras.ops.dot_product_attention` with fake-quantized operands, as
    matmul -> softmax -> matmul with the math of Keras' TensorFlow backend
    (`_dot_product_attention_xla`: scale, bias, mask, causal mask, grouped
    key/value heads, softmax in float32), except that the scale multiplies
    the query before the first matmul, where TensorRT's fused attention
    wants it: Q/DQ on the scaled query (`quantizers[0]`), the key (1), the
    value (2) and the softmax output (`"probs"`)."""
    arguments = inspect.signature(op).bind(*args, **kwargs).arguments
    ops = keras.ops
    einsum, softmax = original("einsum"), original("softmax")

    def fake_quant(key, x):
        q = quantizers.get(key)
        return x if q is None else _same_dtype(q(x), x)

    query, key, value = (
        ops.convert_to_tensor(arguments[n]) for n in ("query", "key", "value")
    )
    dtype = keras.backend.result_type(query.dtype, key.dtype, value.dtype)
    query, key, value = (ops.cast(x, dtype) for x in (query, key, value))
    heads, kv_heads = query.shape[2], key.shape[2]
    if heads and kv_heads and heads > kv_heads > 1:
        key = ops.repeat(key, heads // kv_heads, axis=2)
        value = ops.repeat(value, heads // kv_heads, axis=2)
    scale = arguments.get("scale")
    if scale is None:
        scale = 1.0 / float(np.sqrt(int(key.shape[-1])))
    query = fake_quant(0, query * ops.cast(scale, dtype))
    logits = einsum("BTNH,BSNH->BNTS", query, fake_quant(1, key))
    logits = ops.cast(logits, keras.backend.result_type(dtype, "float32"))
    bias = arguments.get("bias")
    if bias is not None:
        logits = logits + ops.cast(bias, logits.dtype)
    logits = _masked(logits, arguments.get("mask"), arguments.get("is_causal"))
    probs = ops.cast(softmax(ops.cast(logits, "float32"), axis=-1), dtype)
    probs = fake_quant("probs", probs)
    return einsum("BNTS,BSNH->BTNH", probs, fake_quant(2, value))


def _masked(logits, mask, is_causal):
    if mask is None and not is_causal:
        return logits
    ops = keras.ops
    keep = ops.ones_like(logits, dtype="bool")
    if mask is not None:
        keep = ops.logical_and(keep, ops.cast(mask, "bool"))
    if is_causal:
        t, s = ops.shape(logits)[2], ops.shape(logits)[3]
        causal = ops.tril(ops.ones((t, s), "bool"))
        keep = ops.logical_and(keep, causal[None, None])
    # Keras' `_get_large_negative`
    dtype = keras.backend.standardize_dtype(logits.dtype)
    large = (65500.0 if dtype == "float16" else 3.38953e38) * -0.7
    return ops.where(keep, logits, ops.cast(large, dtype))


def site_key(site, k, i):
    """The quantizer's name in reports: `<op>_<ordinal>/<operand>`."""
    operand = (
        ATTENTION_OPERANDS[i]
        if site["op"] == "dot_product_attention"
        else f"operand_{i}"
    )
    return f"{site['op']}_{k}/{operand}"
