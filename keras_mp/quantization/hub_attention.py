"""Quantized twins of keras-hub's own attention layers (Gemma, Llama, T5,
DeBERTaV3, ...).

keras-hub's decoder LLMs, T5 and DeBERTaV3 compute attention in plain
`keras.layers.Layer` classes, not `MultiHeadAttention`: their query, key,
value and output projections are Dense or EinsumDense sublayers (quantized
as any, each with its own input Q/DQ), and the attention matmuls are
`ops.einsum` calls inside the layer. These twins put TensorRT's
Q/DQ on the inputs of both matmuls (the query and key; the softmax output
and the value), force the einsum path over `ops.dot_product_attention`,
and with their quantizers off are the float layer exactly. Which classes
are reached, and how, is `keras_mp._keras_hub.hub_attention_kind`.
"""

from keras_mp import _keras_hub
from keras_mp.quantization.attention import (
    ATTENTION_MATMUL_INPUTS,
    MatmulAttention,
)


class _HubAttention(MatmulAttention):
    """What the keras-hub attention twins share: the einsum path while
    quantizing."""

    def _use_fused_attention_op(self):
        # `ops.dot_product_attention` has no hook between its matmuls.
        if self._quantizing():
            return False
        return super()._use_fused_attention_op()


class QuantizedHookedAttention(_HubAttention):
    """The twin of a keras-hub attention layer whose `_compute_attention`
    takes the projected query, key and value, and scales the scores after
    the first matmul (Llama, Mistral, Mixtral, Qwen, Phi-3,
    GPT-NeoX): Q/DQ on those three arguments and on the output of its
    `_masked_softmax`; the exported graph reads `Q/DQ -> MatMul -> Mul
    (scale) -> Softmax -> Q/DQ -> MatMul`. The layer's own code runs
    unchanged in between."""

    def _compute_attention(self, query, key, value, *args, **kwargs):
        if not self._quantizing():
            return super()._compute_attention(
                query, key, value, *args, **kwargs
            )
        hooks = self._hooks()
        self._probs_quantized = False
        output = super()._compute_attention(
            hooks["query"](query),
            hooks["key"](key),
            hooks["value"](value),
            *args,
            **kwargs,
        )
        if not self._probs_quantized:
            raise RuntimeError(
                f"Layer {self.name!r} ({self.float_class.__name__}) computed "
                "attention without calling `_masked_softmax`, so its softmax "
                "output has no Q/DQ: this keras-hub release computes "
                "attention differently from the one keras_mp was checked "
                "against (keras_mp/_keras_hub.py). Quantize the model with "
                "`QuantizeConfig(attention=False)` for this layer, and "
                "report it."
            )
        return output

    def _masked_softmax(self, attention_scores, attention_mask=None):
        probs = super()._masked_softmax(attention_scores, attention_mask)
        if not self._quantizing():
            return probs
        self._probs_quantized = True
        return self._hooks()["probs"](probs)


class QuantizedGemmaAttention(_HubAttention):
    """The twin of keras-hub's `CachedGemmaAttention` (and Gemma 3's): the
    query is scaled before the first matmul, so the einsum path is
    reimplemented (`_keras_hub.gemma_einsum_attention`) with the Q/DQ after
    the scale multiply: `Mul(scale) -> Q/DQ -> MatMul -> Softmax -> Q/DQ
    -> MatMul`."""

    def _compute_attention(
        self,
        q,
        k,
        v,
        attention_mask,
        training=False,
        cache_update_index=0,
    ):
        if not self._quantizing():
            return super()._compute_attention(
                q,
                k,
                v,
                attention_mask,
                training=training,
                cache_update_index=cache_update_index,
            )
        return _keras_hub.gemma_einsum_attention(
            self,
            q,
            k,
            v,
            attention_mask,
            training,
            cache_update_index,
            self._hooks(),
        )


class QuantizedDisentangledAttention(QuantizedHookedAttention):
    """The twin of keras-hub's `DisentangledSelfAttention` (DeBERTaV3): the
    content matmuls as `QuantizedHookedAttention`, and Q/DQ on the
    position query and key of its content-to-position and
    position-to-content matmuls (`_keras_hub.deberta_relative_scores`),
    each with a range of its own: all four activation matmuls read
    `Q/DQ -> MatMul`."""

    matmul_inputs = ATTENTION_MATMUL_INPUTS + ("position_query", "position_key")

    def _compute_disentangled_attention(self, query, key, rel_embeddings):
        if not self._quantizing():
            return super()._compute_disentangled_attention(
                query, key, rel_embeddings
            )
        return _keras_hub.deberta_relative_scores(
            self, query, key, rel_embeddings, self._hooks()
        )


class QuantizedT5Attention(_HubAttention):
    """The twin of keras-hub's `T5MultiHeadAttention`: its matmuls are
    inline in `call`, reimplemented (`_keras_hub.t5_attention`) with Q/DQ on
    both inputs of each; the relative position bias is added to the
    scores in float: `Q/DQ -> MatMul -> Add(bias) -> Softmax -> Q/DQ ->
    MatMul`."""

    def call(
        self,
        hidden_states,
        mask=None,
        key_value_states=None,
        position_bias=None,
        cache=None,
        cache_update_index=None,
        training=False,
    ):
        arguments = (
            hidden_states,
            mask,
            key_value_states,
            position_bias,
            cache,
            cache_update_index,
        )
        if not self._quantizing():
            return super().call(*arguments, training=training)
        return _keras_hub.t5_attention(
            self, *arguments, training, self._hooks()
        )


class QuantizedT5GemmaAttention(_HubAttention):
    """The twin of keras-hub's `T5GemmaAttention`, `T5Gemma2Attention` and
    `T5Gemma2MergedAttention`: their einsum path applies a `Softmax`
    sublayer in place of `_masked_softmax`, so it is reimplemented
    (`_keras_hub.t5gemma_attention`) with Q/DQ on both inputs of each matmul:
    `Q/DQ -> MatMul -> Mul (scale) -> Add (mask) -> Softmax -> Q/DQ ->
    MatMul`."""

    def _compute_attention(
        self, query_states, key_states, value_states, attention_mask, training
    ):
        if not self._quantizing():
            return super()._compute_attention(
                query_states, key_states, value_states, attention_mask, training
            )
        return _keras_hub.t5gemma_attention(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            training,
            self._hooks(),
        )


_TWINS = {
    "hooks": QuantizedHookedAttention,
    "gemma": QuantizedGemmaAttention,
    "deberta": QuantizedDisentangledAttention,
    "t5": QuantizedT5Attention,
    "t5gemma": QuantizedT5GemmaAttention,
}


def twin_base(cls):
    """The twin base class for keras-hub attention class `cls`, or None
    for a class keras_mp does not reach."""
    return _TWINS.get(_keras_hub.hub_attention_kind(cls))
