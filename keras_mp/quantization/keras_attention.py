"""Quantized twins of Keras' other attention layers: `GroupQueryAttention`
(class `GroupedQueryAttention`), `Attention` (Luong) and
`AdditiveAttention` (Bahdanau).

Their weights, if any, are not matmul weights: GroupedQueryAttention's
projections are EinsumDense sublayers (quantized on their own rows, each
with its own input Q/DQ); Attention has at most a scalar scale. What these
twins add is TensorRT's Q/DQ on both inputs of every matmul of two
activations, as for `MultiHeadAttention` (`attention.py`): the scaled query
and the key, the softmax output and the value. AdditiveAttention's scores
are `sum(tanh(query + key))`, no matmul: only its `probs @ value` gets
them, and so does `Attention(score_mode="concat")`'s. With
`QuantizeConfig(attention=False)` the layer is not quantized at all.
The code around the matmuls is copied from Keras with hooks
(`keras_mp._keras_attention`).
"""

import keras

from keras_mp import _keras_attention
from keras_mp.quantization.attention import MatmulAttention

# The inputs of the one matmul of AdditiveAttention: softmax output, value.
PROBS_VALUE = ("probs", "value")


class QuantizedGroupedQueryAttention(MatmulAttention):
    """The twin of a `keras.layers.GroupedQueryAttention`: Q/DQ on the
    scaled query, the key and the value (repeated to the query heads) and
    the softmax output (after dropout), on the einsum path (never
    `ops.dot_product_attention` or a flash kernel):
    `Mul(scale) -> Q/DQ -> MatMul -> Softmax -> Q/DQ -> MatMul`."""

    def _compute_attention(
        self,
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        use_causal_mask=False,
    ):
        if not self._quantizing():
            return super()._compute_attention(
                query,
                key,
                value,
                attention_mask=attention_mask,
                training=training,
                use_causal_mask=use_causal_mask,
            )
        return _keras_attention.grouped_query_attention(
            self,
            query,
            key,
            value,
            attention_mask,
            training,
            use_causal_mask,
            self._hooks(),
        )


class QuantizedDotProductAttention(MatmulAttention):
    """The twin of a `keras.layers.Attention`: Q/DQ on the query and the
    transposed key of its score matmul (`score_mode="dot"`; `"concat"`
    scores have none), then on the softmax output (after dropout) and the
    value: `Q/DQ -> MatMul -> [Mul(scale)] -> Softmax -> Q/DQ -> MatMul`."""

    def used_matmul_inputs(self):
        if self.score_mode == "dot":
            return self.matmul_inputs
        return PROBS_VALUE

    def _calculate_scores(self, query, key):
        if not self._quantizing() or "query" not in self.used_matmul_inputs():
            return super()._calculate_scores(query, key)
        return _keras_attention.dot_product_scores(
            self, query, key, self._hooks()
        )

    def _apply_scores(self, scores, value, scores_mask=None, training=False):
        if not self._quantizing():
            return super()._apply_scores(
                scores, value, scores_mask=scores_mask, training=training
            )
        return _keras_attention.apply_scores(
            self, scores, value, scores_mask, training, self._hooks()
        )


class QuantizedAdditiveAttention(QuantizedDotProductAttention):
    """The twin of a `keras.layers.AdditiveAttention`: its scores are
    `sum(scale * tanh(query + key))`, computed in float; Q/DQ on the softmax
    output and the value of `probs @ value`."""

    matmul_inputs = PROBS_VALUE

    def used_matmul_inputs(self):
        return PROBS_VALUE


# Float class -> (twin base, the float methods the twin replaces with
# `_keras_attention`'s copies). Most specific class first.
TWINS = (
    (
        keras.layers.GroupQueryAttention,  # class GroupedQueryAttention
        QuantizedGroupedQueryAttention,
        ("_compute_attention",),
    ),
    (
        keras.layers.AdditiveAttention,
        QuantizedAdditiveAttention,
        ("_apply_scores",),
    ),
    (
        keras.layers.Attention,
        QuantizedDotProductAttention,
        ("_calculate_scores", "_apply_scores"),
    ),
)


def twin_base(cls):
    """The twin base class for `cls`, a subclass of one of Keras'
    `GroupQueryAttention`, `AdditiveAttention` or `Attention`; None for
    another class.

    Raises:
        ValueError: `cls` overrides a method the twin replaces with a copy
            of Keras' (its own attention math would be lost).
    """
    for float_cls, base, methods in TWINS:
        if not issubclass(cls, float_cls):
            continue
        changed = [
            m for m in methods if getattr(cls, m) is not getattr(float_cls, m)
        ]
        if changed:
            raise ValueError(
                f"Cannot quantize the attention matmuls of {cls.__name__}: "
                f"it overrides `{'`, `'.join(changed)}` of "
                f"{float_cls.__name__}, which keras_mp replaces "
                "with a copy of Keras' code that has Q/DQ hooks. Quantize "
                "it with `keras_mp.QuantizeConfig(attention=False)` to keep "
                "its attention in float."
            )
        return base
    return None
