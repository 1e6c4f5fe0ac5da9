"""The door to keras-hub's attention internals.

keras-hub's own attention layers (Gemma, Llama, T5, DeBERTaV3, ...) compute
their two attention matmuls in private methods; keras_mp reaches them by
class and method (`hub_attention_kind`) and, where no method boundary sits
between a matmul input and the matmul, by a copy of keras-hub's code with
a hook on each matmul input (`gemma_einsum_attention`,
`deberta_relative_scores`, `t5_attention`, `t5gemma_attention`). Read from
keras-hub 0.32 on Keras 3.15.1; tests in
`tests/quantization/test_hub_attention.py` check each copy against
keras-hub's code bit for bit, so a keras-hub release that changes one
fails there. Keras' own internals stay in `keras_mp/_keras.py`.
"""

import functools
import sys

import keras

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
    position embeddings; they take hooks of their own (their ranges are
    those of position embeddings, not of the content).

    Args:
        layer: the `DisentangledSelfAttention`.
        query, key: the projected content tensors, `(B, T, N, H)`, already
            through their hooks.
        rel_embeddings: the relative position embeddings, `(B, 2 * span,
            hidden)`.
        quantize: dict of callables by `"position_query"` and
            `"position_key"`.

    Returns:
        The summed relative scores, `(B, N, T, T)`.
    """
    from keras import ops

    batch_size = ops.shape(query)[0]
    num_positions = ops.shape(query)[1]
    rel_pos = layer._get_rel_pos(num_positions)
    span = layer.bucket_size
    shape = (batch_size, layer.num_heads, num_positions, num_positions)
    pos_query = quantize["position_query"](layer._query_dense(rel_embeddings))
    pos_key = quantize["position_key"](layer._key_dense(rel_embeddings))

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
