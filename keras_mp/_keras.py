"""The one door to Keras and TensorFlow internals.

Every private attribute, `keras.src` or `tensorflow.python` import that
keras_mp relies on is here, so a Keras or TensorFlow release that moves one
breaks this module only, loudly. Read from Keras 3.15.1 and TensorFlow
2.21.0 (tested there), and keras-hub 0.32 for its attention layers;
`check_versions` warns once on a Keras outside the range below and fails
on one that lacks a method keras_mp overrides.
"""

import contextlib
import functools
import re
import sys
import warnings

import keras
from keras.src.models.functional import Functional
from keras.src.saving.keras_saveable import KerasSaveable

# Keras (major, minor) releases whose internals match what is used here.
VERIFIED_KERAS = ((3, 3), (3, 15))
# Private LossScaleOptimizer hooks that keras_mp.LossScaleOptimizer
# overrides (scale bounds, skipped-step count): renamed, they would be
# silently bypassed, so their absence stops the import.
LOSS_SCALE_HOOKS = (
    "_stateful_handle_finite_grads",
    "_stateful_handle_non_finite_grads",
)
_warned = []


def check_versions():
    """Fails when Keras lacks a hook keras_mp overrides; warns, once, when
    Keras is outside the releases checked here."""
    missing = [
        name
        for name in LOSS_SCALE_HOOKS
        if not hasattr(keras.optimizers.LossScaleOptimizer, name)
    ]
    if missing:
        raise ImportError(
            f"keras {keras.__version__} has no "
            f"LossScaleOptimizer.{', '.join(missing)}, which "
            "keras_mp.LossScaleOptimizer overrides. Install a Keras between "
            f"{VERIFIED_KERAS[0][0]}.{VERIFIED_KERAS[0][1]} and "
            f"{VERIFIED_KERAS[1][0]}.{VERIFIED_KERAS[1][1]}."
        )
    version = tuple(int(p) for p in keras.__version__.split(".")[:2])
    outside = not VERIFIED_KERAS[0] <= version <= VERIFIED_KERAS[1]
    if outside and not _warned:
        _warned.append(version)
        warnings.warn(
            f"keras_mp was verified with Keras {VERIFIED_KERAS[0][0]}."
            f"{VERIFIED_KERAS[0][1]} to {VERIFIED_KERAS[1][0]}."
            f"{VERIFIED_KERAS[1][1]}; found {keras.__version__}. If a "
            "feature fails with an AttributeError from keras_mp/_keras.py, "
            "pin keras<=3.15 and report it.",
            stacklevel=2,
        )


def is_graph_model(model):
    """True for Sequential and Functional models (their graph is data)."""
    return isinstance(model, (keras.Sequential, Functional))


def functional_graph(model):
    """The Functional graph of a Sequential or Functional model, or None
    for a Sequential model built without an input shape."""
    if isinstance(model, keras.Sequential):
        return model._functional
    return model


def nodes_by_depth(graph):
    """The nodes of a Functional graph, deepest first: lists of nodes."""
    return list(graph._nodes_by_depth.values())


def inbound_nodes(layer):
    """The nodes at which `layer` was called in Functional graphs."""
    return list(layer._inbound_nodes)


def outbound_nodes(layer):
    """The nodes at which outputs of `layer` were taken as inputs."""
    return list(layer._outbound_nodes)


def keras_history(tensor):
    """`(operation, node_index, tensor_index)` of a symbolic tensor, or
    None for a tensor no layer produced."""
    return getattr(tensor, "_keras_history", None)


def producer(tensor):
    """The layer (operation) that produced a symbolic tensor, or None."""
    history = keras_history(tensor)
    return None if history is None else history.operation


def own_variables(layer):
    """The variables `layer` created itself (not its sublayers'), in the
    order its weights file stores them."""
    return layer._trainable_variables + layer._non_trainable_variables


def sublayers(layer):
    """The layers `layer` tracks directly (attributes, lists, a wrapper's
    inner layer), in tracking order: Keras' own layer tracker."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def call_training():
    """The `training` flag of the Keras call in progress (None outside one):
    what a layer's sublayers receive when the call passes it on."""
    from keras.src.backend.common import global_state

    context = global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.get_value("training")


def in_xla_context():
    """True while tracing a function compiled with XLA (`jit_compile`)."""
    try:
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:
        # Moved in a later TensorFlow: assume XLA. The caller then adds a
        # select that is correct either way, only slower without XLA.
        return True
    return control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


class SaveableState(KerasSaveable):
    """Base for a non-layer object (a constraint) whose variables must be
    saved in the `.keras` weights file beside its layer's.

    Keras' weights saver visits every `KerasSaveable` attribute of a layer;
    `_obj_type` picks which attributes of the object it skips, and "Loss"
    is the plain list. The subclass implements `save_own_variables` and
    `load_own_variables`.
    """

    def _obj_type(self):
        return "Loss"


# Function attributes that keep grappler from inlining a call: Keras' TF
# backend runs grouped convolutions through `tf.function(jit_compile=True)`,
# whose call nodes carry them, and tf2onnx cannot convert the
# `(Stateful)PartitionedCall` nodes left behind.
NO_INLINE_ATTRS = ("_XlaMustCompile", "_noinline")


def frozen_graph_def(concrete_function):
    """A concrete function frozen to a GraphDef that grappler can inline.

    Variables and captured eager tensors (the mean and variance of
    `keras.layers.Normalization`) become constants, so the graph's only
    inputs are the function's own arguments; `NO_INLINE_ATTRS` are removed
    from every call node and library function.

    Control flow stays functional (`While`, `If`): lowered, a recurrent
    layer's loop becomes TensorList ops that tf2onnx cannot convert,
    while a `While` tf2onnx turns into an ONNX `Loop`, or an `LSTM`/`GRU`/
    `RNN` op when it recognizes the cell (`docs/export.md`, "Recurrent
    layers"). A graph without control flow freezes the same either way.

    Args:
        concrete_function: a `tf.function`'s concrete function.

    Returns:
        `(graph_def, input_names, output_names)`, tensor names such as
        `"input_0:0"`.
    """
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2,
    )

    frozen = convert_variables_to_constants_v2(
        concrete_function, lower_control_flow=False
    )
    graph_def = frozen.graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
        for attr in NO_INLINE_ATTRS:
            if attr in function.attr:
                del function.attr[attr]
    for node in nodes:
        for attr in NO_INLINE_ATTRS:
            if attr in node.attr:
                del node.attr[attr]
    inputs = [t.name for t in frozen.inputs if t.dtype.name != "resource"]
    return graph_def, inputs, [t.name for t in frozen.outputs]


def inputs_are_dict(model):
    """Whether a Functional `model` was built from a dict of inputs (and so
    is called with a dict keyed like it), e.g. keras-hub backbones."""
    return isinstance(getattr(model, "_inputs_struct", None), dict)


_AUTO_INPUT_NAME = re.compile(r"(keras_tensor|input_layer)(_\d+)?")


def input_names(model):
    """The names of `model.inputs`, in order, as a user calls them: the
    dict keys of a model built from a dict (flattened sorted, as Keras
    does), else the input tensors' names. An input Keras named itself
    (`keras_tensor_<n>`, `input_layer_<n>`: a counter that changes with
    what the process built before, e.g. on reload) is `input_<i>`."""
    if inputs_are_dict(model):
        return sorted(model._inputs_struct)
    return [
        f"input_{i}" if _AUTO_INPUT_NAME.fullmatch(t.name) else t.name
        for i, t in enumerate(model.inputs)
    ]


@contextlib.contextmanager
def unlocked(layer):
    """Lets `layer` take new sublayers and variables after it was built
    (Keras locks a layer's tracker at the end of `build`)."""
    tracker = layer._tracker
    was_locked = tracker.locked
    tracker.unlock()
    try:
        yield layer
    finally:
        if was_locked:
            tracker.lock()


def attention_projections(layer):
    """The query, key and value projections (EinsumDense) of a built
    `keras.layers.MultiHeadAttention`, and its gate projection or None:
    the layers whose input the attention layer receives. `()` for a
    keras-hub attention layer that is not a MultiHeadAttention: its
    projections quantize their own inputs."""
    if not isinstance(layer, keras.layers.MultiHeadAttention):
        return ()
    return (
        layer._query_dense,
        layer._key_dense,
        layer._value_dense,
        getattr(layer, "_gate_dense", None),
    )


def einsum_attention(
    layer, query, key, value, attention_mask, training, quantize
):
    """`MultiHeadAttention._compute_attention`'s einsum path, with a hook on
    each input of the two attention matmuls.

    Keras takes `ops.dot_product_attention` (no hook) for 4-D inputs with
    dropout 0 and no attention scores; this always computes
    `einsum(dot, key, query * scale)`, the masked softmax and
    `einsum(combine, probs, value)`, as Keras does otherwise.

    Args:
        layer: the `MultiHeadAttention` (or a subclass, e.g. keras-hub's
            `CachedMultiHeadAttention`).
        query, key, value: the projected tensors, `(B, T, N, H)`.
        attention_mask: boolean mask `(B, T, S)` or None.
        training: bool or None, for the attention dropout.
        quantize: dict of callables by `"query"` (the scaled query),
            `"key"`, `"probs"` (the softmax output, after dropout) and
            `"value"`.

    Returns:
        `(attention_output, attention_scores)`.
    """
    from keras import ops

    query = ops.multiply(
        query, ops.cast(layer._inverse_sqrt_key_dim, query.dtype)
    )
    scores = ops.einsum(
        layer._dot_product_equation,
        quantize["key"](key),
        quantize["query"](query),
    )
    scores = layer._masked_softmax(scores, attention_mask)
    probs = scores
    if layer._dropout > 0.0:
        probs = layer._dropout_layer(scores, training=training)
    output = ops.einsum(
        layer._combine_equation,
        quantize["probs"](probs),
        quantize["value"](value),
    )
    return output, scores


def causal_mask(layer, query, value):
    """`MultiHeadAttention`'s causal mask for `query` and `value`."""
    return layer._compute_causal_mask(query, value)


def copy_mask(source, target):
    """Gives tensor `target` the Keras mask of `source`, if it has one."""
    from keras.src import backend

    mask = backend.get_keras_mask(source)
    if mask is not None:
        backend.set_keras_mask(target, mask)


def float_value(variable):
    """A Keras variable's value in its own dtype, also inside an autocast
    scope (a mixed-precision layer's call reads float16 otherwise)."""
    from keras.src import backend

    with backend.AutocastScope(None):
        return variable.value


def is_plain_graph_model(model):
    """True for a `keras.Sequential` or a model built by
    `keras.Model(inputs, outputs)`, not a subclass of either (keras-hub
    backbones are Functional subclasses with their own config)."""
    return type(model) in (keras.Sequential, Functional)


# keras-hub attention layers that are not MultiHeadAttention subclasses,
# by how keras_mp reaches their two attention matmuls (keras-hub 0.32):
# "hooks": `_compute_attention(query, key, value, ...)` computes
# `einsum(q, k)`, the scale multiply on the scores, `_masked_softmax` and
# `einsum(probs, v)`, so Q/DQ on its q, k, v arguments and on
# `_masked_softmax`'s output sit on the matmul inputs;
# "gemma": the scale multiplies the query inside `_compute_attention`,
# which `gemma_einsum_attention` reimplements;
# "deberta": "hooks" for the content matmuls, and the two relative-position
# matmuls of `_compute_disentangled_attention`, which
# `deberta_relative_scores` reimplements;
# "t5": the two matmuls are inline in `call`, which `t5_attention`
# reimplements;
# "t5gemma": Gemma subclasses whose `_compute_attention_without_fused_op`
# applies a `Softmax` sublayer (no `_masked_softmax`), which
# `t5gemma_attention` reimplements.
_HUB_ATTENTION = {
    "hooks": (
        ("llama.llama_attention", "LlamaAttention"),
        ("mistral.mistral_attention", "CachedMistralAttention"),
        ("mixtral.mixtral_attention", "CachedMixtralAttention"),
        ("qwen.qwen_attention", "QwenAttention"),
        ("qwen_moe.qwen_moe_attention", "QwenMoeAttention"),
        ("qwen3.qwen3_attention", "Qwen3Attention"),
        ("qwen3_moe.qwen3_moe_attention", "Qwen3MoeAttention"),
        ("phi3.phi3_attention", "Phi3Attention"),
        ("gpt_neo_x.gpt_neo_x_attention", "GPTNeoXAttention"),
        ("smollm3.smollm3_layers", "SmolLM3Attention"),
        ("qwen3_5.qwen3_5_attention", "Qwen3_5Attention"),
    ),
    "gemma": (
        ("gemma.gemma_attention", "CachedGemmaAttention"),
        ("gemma3.gemma3_attention", "CachedGemma3Attention"),
    ),
    "deberta": (
        ("deberta_v3.disentangled_self_attention", "DisentangledSelfAttention"),
    ),
    "t5": (("t5.t5_multi_head_attention", "T5MultiHeadAttention"),),
    "t5gemma": (
        ("t5gemma.t5gemma_attention", "T5GemmaAttention"),
        ("t5gemma2.t5gemma2_attention", "T5Gemma2Attention"),
        ("t5gemma2.t5gemma2_attention", "T5Gemma2MergedAttention"),
    ),
}
# The methods of each kind keras_mp overrides or reimplements: a subclass
# that overrides one computes attention its own way (not reached).
_HUB_ATTENTION_METHODS = {
    "hooks": ("_compute_attention", "_masked_softmax"),
    "gemma": ("_compute_attention",),
    "deberta": (
        "_compute_attention",
        "_masked_softmax",
        "_compute_disentangled_attention",
    ),
    "t5": ("call",),
    "t5gemma": ("_compute_attention", "_compute_attention_without_fused_op"),
}


@functools.cache
def _hub_attention_methods():
    """`{kind: [(float class, its methods keras_mp relies on)]}` of the
    keras-hub classes in `_HUB_ATTENTION` this keras-hub has."""
    import importlib

    found = {}
    for kind, names in _HUB_ATTENTION.items():
        found[kind] = []
        for module, name in names:
            try:
                cls = getattr(
                    importlib.import_module(f"keras_hub.src.models.{module}"),
                    name,
                )
            except (ImportError, AttributeError):
                continue  # moved in another keras-hub: not supported
            methods = [getattr(cls, m) for m in _HUB_ATTENTION_METHODS[kind]]
            found[kind].append((cls, methods))
    return found


def hub_attention_kind(cls):
    """How keras_mp reaches the attention matmuls of layer class `cls`:
    a kind of `_HUB_ATTENTION` (`"hooks"`, `"gemma"`, `"deberta"`, `"t5"`,
    `"t5gemma"`) for a keras-hub attention
    class listed there, or a subclass that keeps its attention methods;
    None otherwise (keras-hub not imported, or a class that computes
    attention its own way)."""
    if "keras_hub" not in sys.modules:
        return None  # no keras-hub layer can exist
    for kind, classes in _hub_attention_methods().items():
        for base, methods in classes:
            if issubclass(cls, base) and all(
                getattr(cls, m.__name__) is m for m in methods
            ):
                return kind
    return None


def gemma_einsum_attention(
    layer, q, k, v, attention_mask, training, cache_update_index, quantize
):
    """keras-hub `CachedGemmaAttention._compute_attention`'s einsum path
    (Gemma, Gemma 2, Gemma 3), with a hook on each input of the two
    attention matmuls.

    The same operations in the same order as keras-hub 0.32 when
    `_use_fused_attention_op()` is False: the query scaled, the grouped
    query einsum, the optional logit soft cap, the masked `Softmax`
    sublayer, dropout, the value einsum (a test checks the outputs are
    identical with the hooks the identity).

    Args:
        layer: the attention layer.
        q, k, v: the projected, rotated tensors, `(B, T, N, H)`, `(B, S,
            K, H)`.
        attention_mask: boolean mask `(B, T, S)` or None.
        training: bool or None, for the attention dropout.
        cache_update_index: int or tensor, for the sliding window.
        quantize: dict of callables by `"query"` (the scaled query),
            `"key"`, `"probs"` (the softmax output, after dropout) and
            `"value"`.

    Returns:
        The attention output, `(B, T, N, H)`.
    """
    import numpy as np
    from keras import ops

    if layer.query_head_dim_normalize:
        query_normalization = 1 / np.sqrt(layer.head_dim)
    else:
        query_normalization = 1 / np.sqrt(
            layer.hidden_dim // layer.num_query_heads
        )
    if layer.use_sliding_window_attention and attention_mask is not None:
        attention_mask = layer._mask_sliding_window(
            attention_mask, cache_update_index=cache_update_index
        )
    q = q * ops.cast(query_normalization, dtype=q.dtype)
    q = quantize["query"](q)
    q_shape = ops.shape(q)
    q = ops.reshape(
        q,
        (
            *q_shape[:-2],
            layer.num_key_value_heads,
            layer.num_query_heads // layer.num_key_value_heads,
            q_shape[-1],
        ),
    )
    b, q_len, _, _, h = ops.shape(q)
    logits = ops.einsum("btkgh,bskh->bkgts", q, quantize["key"](k))
    if layer.logit_soft_cap is not None:
        logits = ops.divide(logits, layer.logit_soft_cap)
        logits = ops.multiply(ops.tanh(logits), layer.logit_soft_cap)
    if attention_mask is not None:
        attention_mask = attention_mask[:, None, None, :, :]
    probs = layer.softmax(logits, mask=attention_mask)
    probs = ops.cast(probs, logits.dtype)
    if layer.dropout:
        probs = layer.dropout_layer(probs, training=training)
    results = ops.einsum(
        "bkgts,bskh->btkgh", quantize["probs"](probs), quantize["value"](v)
    )
    return ops.reshape(results, (b, q_len, layer.num_query_heads, h))


def deberta_relative_scores(layer, query, key, rel_embeddings, quantize):
    """keras-hub `DisentangledSelfAttention._compute_disentangled_attention`
    (DeBERTaV3's content-to-position and position-to-content scores), with
    a hook on each input of its two matmuls.

    The same operations in the same order as keras-hub 0.32 (a test checks
    the scores are identical with the hooks the identity). The position
    query and key are the query and key projections of the relative
    position embeddings; they take the hooks of the content query and key
    (one range each for a projection's two outputs).

    Args:
        layer: the `DisentangledSelfAttention`.
        query, key: the projected content tensors, `(B, T, N, H)`, already
            through their hooks.
        rel_embeddings: the relative position embeddings, `(B, 2 * span,
            hidden)`.
        quantize: dict of callables by `"query"` and `"key"` (applied to
            the position query and key).

    Returns:
        The summed relative scores, `(B, N, T, T)`.
    """
    from keras import ops

    batch_size = ops.shape(query)[0]
    num_positions = ops.shape(query)[1]
    rel_pos = layer._get_rel_pos(num_positions)
    span = layer.bucket_size
    shape = (batch_size, layer.num_heads, num_positions, num_positions)
    pos_query = quantize["query"](layer._query_dense(rel_embeddings))
    pos_key = quantize["key"](layer._key_dense(rel_embeddings))

    c2p = ops.einsum("aecd,abcd->acbe", pos_key, query)
    c2p_pos = ops.broadcast_to(ops.clip(rel_pos + span, 0, span * 2 - 1), shape)
    c2p = _take_along_last_axis(c2p, c2p_pos)
    score = ops.multiply(c2p, layer.scale_factor)

    p2c = ops.einsum("aecd,abcd->acbe", pos_query, key)
    p2c_pos = ops.broadcast_to(
        ops.clip(-rel_pos + span, 0, span * 2 - 1), shape
    )
    p2c = ops.transpose(_take_along_last_axis(p2c, p2c_pos), [0, 1, 3, 2])
    return score + ops.multiply(p2c, layer.scale_factor)


def _take_along_last_axis(x, indices):
    # keras-hub's own choice per backend (DeBERTaV3's relative scores).
    if keras.config.backend() == "tensorflow":
        import tensorflow as tf

        return tf.gather(x, indices=indices, batch_dims=3)
    return keras.ops.take_along_axis(x, indices=indices, axis=3)


def t5_attention(
    layer,
    hidden_states,
    mask,
    key_value_states,
    position_bias,
    cache,
    cache_update_index,
    training,
    quantize,
):
    """keras-hub `T5MultiHeadAttention.call`, with a hook on each input of
    the two attention matmuls.

    The same operations in the same order as keras-hub 0.32 (a test checks
    the outputs are identical with the hooks the identity): T5 adds the
    relative position bias (and the mask) to the unscaled scores, so the
    graph reads `Q/DQ -> MatMul -> Add(bias) -> Softmax -> Q/DQ -> MatMul`.

    Args:
        layer: the `T5MultiHeadAttention`.
        hidden_states, mask, key_value_states, position_bias, cache,
            cache_update_index, training: its call arguments.
        quantize: dict of callables by `"query"`, `"key"`, `"probs"` (the
            softmax output, after dropout) and `"value"`.

    Returns:
        `(attention_output, position_bias, cache)`, as the layer.
    """
    import numpy as np
    from keras import ops

    batch_size, seq_length = ops.shape(hidden_states)[:2]

    def shape(states):
        return ops.reshape(
            states, (batch_size, -1, layer.num_heads, layer.key_value_dim)
        )

    query_states = shape(layer.query_projector(hidden_states))
    inputs = hidden_states if key_value_states is None else key_value_states
    if cache is not None:
        key_states, value_states = cache[:, 0, ...], cache[:, 1, ...]
        if cache_update_index is not None:
            start = [0, cache_update_index, 0, 0]
            key_states = ops.slice_update(
                key_states, start, shape(layer.key_projector(inputs))
            )
            value_states = ops.slice_update(
                value_states, start, shape(layer.value_projector(inputs))
            )
            cache = ops.stack((key_states, value_states), axis=1)
    else:
        if cache_update_index is not None:
            raise ValueError(
                "`cache_update_index` should not be set if `cache` is "
                f"`None`. Received: cache={cache}, "
                f"cache_update_index={cache_update_index}"
            )
        key_states = shape(layer.key_projector(inputs))
        value_states = shape(layer.value_projector(inputs))
    key_length = ops.shape(key_states)[1]
    scores = ops.einsum(
        "bqnd,bknd->bnqk",
        quantize["query"](query_states),
        quantize["key"](key_states),
    )
    if position_bias is None:
        if not layer.use_relative_attention_bias:
            position_bias = ops.zeros(
                (1, layer.num_heads, seq_length, key_length),
                layer.compute_dtype,
            )
        else:
            position_bias = layer.compute_bias(
                seq_length,
                key_length,
                query_start_index=(
                    0 if cache_update_index is None else cache_update_index
                ),
            )
        if mask is not None:
            mask = mask[:, np.newaxis, :, :]
            mask = (1.0 - ops.cast(mask, position_bias.dtype)) * -1e9
            position_bias = position_bias + mask
    scores += ops.cast(position_bias, scores.dtype)
    weights = ops.nn.softmax(scores, axis=-1)
    weights = layer.dropout_layer(weights, training=training)
    output = ops.einsum(
        "bnqk,bknd->bqnd",
        quantize["probs"](weights),
        quantize["value"](value_states),
    )
    output = ops.reshape(output, (batch_size, -1, layer.inner_dim))
    return layer.output_projector(output), position_bias, cache


def t5gemma_attention(
    layer, query, key, value, attention_mask, training, quantize
):
    """keras-hub `T5GemmaAttention._compute_attention_without_fused_op`
    (and T5Gemma 2's two attention classes, the same code), with a hook on
    each input of the two attention matmuls.

    The same operations in the same order as keras-hub 0.32 (a test checks
    the outputs are identical with the hooks the identity): the scale and
    the optional logit soft cap on the scores, the additive mask, the
    `Softmax` sublayer, dropout: `Q/DQ -> MatMul -> Mul -> Add -> Softmax
    -> Q/DQ -> MatMul`.

    Args:
        layer: the attention layer.
        query, key, value: the projected, rotated tensors, `(B, T, N, H)`
            and `(B, S, N, H)` (key/value heads already repeated).
        attention_mask: additive mask broadcastable to `(B, N, T, S)`, or
            None.
        training: bool or None, for the attention dropout.
        quantize: dict of callables by `"query"`, `"key"`, `"probs"` (the
            softmax output, after dropout) and `"value"`.

    Returns:
        The attention output, `(B, T, N, H)`.
    """
    from keras import ops

    scores = ops.einsum(
        "btnh,bsnh->bnts", quantize["query"](query), quantize["key"](key)
    )
    scores *= layer.scaling
    if layer.logit_soft_cap is not None:
        scores = scores / layer.logit_soft_cap
        scores = ops.tanh(scores)
        scores = scores * layer.logit_soft_cap
    if attention_mask is not None:
        scores += attention_mask
    probs = ops.cast(layer.softmax(scores), query.dtype)
    probs = layer.dropout_layer(probs, training=training)
    return ops.einsum(
        "bnts,bsnh->btnh", quantize["probs"](probs), quantize["value"](value)
    )


def to_numpy(x):
    """A Keras or TensorFlow variable or eager tensor as a NumPy array.

    Keras 3.15's `ops.convert_to_numpy` of a variable calls
    `np.array(x, copy=False)`, which a TensorFlow variable's `__array__`
    does not accept under NumPy 2 (a DeprecationWarning at every call);
    the variable's own `numpy()` reads the same value without it.
    """
    numpy = getattr(x, "numpy", None)
    if callable(numpy):
        import numpy as np

        return np.asarray(numpy())
    return keras.ops.convert_to_numpy(x)
