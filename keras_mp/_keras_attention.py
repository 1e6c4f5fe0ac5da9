"""Keras core attention layers' matmuls, copied with a hook on each input.

`keras.layers.GroupedQueryAttention`, `keras.layers.Attention` and
`keras.layers.AdditiveAttention` compute their attention matmuls inline,
with no place for a Q/DQ between a tensor and the matmul that reads it.
These are copies of the code around those matmuls (Keras 3.15.1,
`keras/src/layers/attention/`), with `quantize[name](x)` on every matmul
input; with identity hooks they compute what Keras does
(tests/quantization/test_keras_attention.py checks it, so a Keras release
that changes the math fails there). Like `keras_mp._keras`, this module
touches private attributes of Keras layers; nothing else does.
"""

from keras import ops


def grouped_query_attention(
    layer,
    query,
    key,
    value,
    attention_mask,
    training,
    use_causal_mask,
    quantize,
):
    """`GroupedQueryAttention._compute_attention`'s einsum path, with a hook
    on each input of the two attention matmuls.

    Keras takes `ops.dot_product_attention` (no hook, or a flash kernel)
    for 4-D inputs with dropout 0 and no attention scores; this always
    computes `einsum(dot, query * scale, key)`, the masked softmax and
    `einsum(combine, probs, value)`, as Keras does otherwise.

    Args:
        layer: the `GroupedQueryAttention`.
        query: the projected query, `(B, T, N, H)`.
        key, value: the projected key and value, repeated to the query's
            `N` heads, `(B, S, N, H)`.
        attention_mask: boolean mask `(B, T, S)` or None.
        training: bool or None, for the attention dropout.
        use_causal_mask: bool. Combine a causal mask with `attention_mask`.
        quantize: dict of callables by `"query"` (the scaled query),
            `"key"`, `"probs"` (the softmax output, after dropout) and
            `"value"`.

    Returns:
        `(attention_output, attention_scores)`.
    """
    if layer._flash_attention and layer._return_attention_scores:
        raise ValueError(
            "Returning attention scores is not supported when flash "
            "attention is enabled. Please disable flash attention to access"
            " attention scores."
        )
    if use_causal_mask:
        causal_mask = layer._compute_causal_mask(query, value)
        attention_mask = (
            causal_mask
            if attention_mask is None
            else ops.logical_and(ops.cast(attention_mask, "bool"), causal_mask)
        )
    query = ops.multiply(
        query, ops.cast(layer._inverse_sqrt_head_dim, query.dtype)
    )
    scores = ops.einsum(
        layer._dot_product_equation,
        quantize["query"](query),
        quantize["key"](key),
    )
    scores = layer._masked_softmax(scores, attention_mask=attention_mask)
    probs = scores
    if layer.dropout > 0.0:
        probs = layer._dropout_layer(scores, training=training)
    output = ops.einsum(
        layer._combine_equation,
        quantize["probs"](probs),
        quantize["value"](value),
    )
    return output, scores


def dot_product_scores(layer, query, key, quantize):
    """`Attention._calculate_scores` for `score_mode="dot"`, with a hook on
    the query and on the transposed key (the matmul's inputs).

    Returns:
        The scores, `(B, Tq, Tv)`, times the layer's `scale` if it has one.
    """
    scores = ops.matmul(
        quantize["query"](query),
        quantize["key"](ops.swapaxes(key, -2, -1)),
    )
    if layer.scale is not None:
        scores = ops.multiply(scores, layer.scale)
    return scores


def apply_scores(layer, scores, value, scores_mask, training, quantize):
    """`Attention._apply_scores` (and `AdditiveAttention`'s, the same
    method): masked softmax, dropout and `matmul(probs, value)`, with a hook
    on the probabilities (after dropout) and on the value.

    Returns:
        `(attention_output, attention_scores)`: the scores after masking,
        softmax and dropout, before the hook, as Keras returns them.
    """
    from keras.src import backend

    if scores_mask is not None:
        padding_mask = ops.logical_not(scores_mask)
        max_value = 65504.0 if scores.dtype == "float16" else 1.0e9
        if len(padding_mask.shape) == 2:
            padding_mask = ops.expand_dims(padding_mask, axis=-2)
        scores = ops.where(padding_mask, scores - max_value, scores)
    weights = ops.softmax(scores, axis=-1)
    if training and layer.dropout > 0:
        weights = backend.random.dropout(
            weights, layer.dropout, seed=layer.seed_generator
        )
    output = ops.matmul(quantize["probs"](weights), quantize["value"](value))
    return output, weights
