"""The quantized twin of `keras.layers.MultiHeadAttention`.

TensorRT's transformer placement (`docs/quantization.md`): one Q/DQ per
distinct input tensor in front of the query, key and value projections, and
Q/DQ on the inputs of both attention matmuls, with the scale multiply before
the first one, so the exported graph shows the fused-attention pattern.
"""

import functools

import keras

from keras_mp import _keras
from keras_mp.quantization.twins import QuantizedLayer, _like, bind_call

# The inputs of a MultiHeadAttention call that feed its projections.
ATTENTION_INPUTS = ("query", "value", "key")
# The inputs of its two matmuls: scaled query and key, softmax output and
# value.
ATTENTION_MATMUL_INPUTS = ("query", "key", "probs", "value")


class QuantizedAttention(QuantizedLayer):
    """The quantized twin of a `keras.layers.MultiHeadAttention` (or of a
    subclass calling `_compute_attention`, as keras-hub's
    `CachedMultiHeadAttention` does).

    Its call inputs are fake-quantized once per distinct tensor before the
    query, key and value projections (`input_names`: which of `query`,
    `value`, `key` own a `QuantizeActivation`; a self-attention call feeds
    one shared Q/DQ to all three), so TensorRT can fuse that one DQ into
    each GEMM. With `quantize_config.attention`, the attention takes the
    einsum path and `attention_quantizers` fake-quantize the scaled query,
    the key, the softmax output and the value.
    """

    def named_quantizers(self):
        named = {
            f"input_{name}": q
            for name, q in zip(self.input_names, self.input_quantizers)
        }
        for name, q in zip(ATTENTION_MATMUL_INPUTS, self.attention_quantizers):
            named[f"attention_{name}"] = q
        return named

    def __call__(self, *args, **kwargs):
        # The inputs' identity, before Keras casts them (a cast makes two
        # tensors of one): which call inputs are one tensor.
        arguments = bind_call(self.float_class, self, args, kwargs)
        self._input_sources = attention_sources(arguments)
        return super().__call__(*args, **kwargs)

    def call(self, *args, **kwargs):
        if not self.input_quantizers:
            return super(QuantizedLayer, self).call(*args, **kwargs)
        arguments = bind_call(self.float_class, self, args, kwargs)
        sources = getattr(self, "_input_sources", None)
        sources = sources or attention_sources(arguments)
        if arguments.get("key") is None:
            arguments["key"] = arguments.get("value")  # as the layer does
        quantized = {}
        for name in ATTENTION_INPUTS:
            if arguments.get(name) is None:
                continue
            source = name if name in self.input_names else sources[name]
            if source not in self.input_names:
                raise ValueError(
                    f"Layer {self.name!r} was quantized with one input Q/DQ "
                    f"for {', '.join(self.input_names)} (as it was called "
                    f"then), but is now called with a `{name}` tensor of "
                    "its own. Quantize the model again from the float "
                    "model, calling the layer as it will be used."
                )
            if source not in quantized:
                q = self.input_quantizers[self.input_names.index(source)]
                quantized[source] = _like(
                    q(arguments[source]), arguments[source]
                )
            arguments[name] = quantized[source]
        return super(QuantizedLayer, self).call(**arguments)

    def _compute_attention(
        self,
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
        use_causal_mask=False,
    ):
        if not self.attention_quantizers or not self.enabled:
            kwargs = {"use_causal_mask": True} if use_causal_mask else {}
            return super()._compute_attention(
                query,
                key,
                value,
                attention_mask,
                training,
                return_attention_scores,
                **kwargs,
            )
        if use_causal_mask:
            causal = _keras.causal_mask(self, query, value)
            attention_mask = (
                causal
                if attention_mask is None
                else keras.ops.logical_and(
                    keras.ops.cast(attention_mask, "bool"), causal
                )
            )
        return _keras.einsum_attention(
            self,
            query,
            key,
            value,
            attention_mask,
            training,
            matmul_hooks(self.attention_quantizers),
        )


def matmul_hooks(quantizers, names=ATTENTION_MATMUL_INPUTS):
    """`{name: callable}` for the attention matmul inputs `names`, each
    fake-quantizing a tensor with its quantizer of `quantizers` (in that
    order) and keeping its dtype and Keras mask."""
    return {
        name: functools.partial(_quantize_like, q)
        for name, q in zip(names, quantizers)
    }


def _quantize_like(quantizer, x):
    return _like(quantizer(x), x)


def attention_sources(arguments):
    """For `query`, `value` and `key` of a MultiHeadAttention call: the
    first of them that is the same tensor (`key` defaults to `value`)."""
    query, value, key = (arguments.get(n) for n in ATTENTION_INPUTS)
    sources = {"query": "query"}
    sources["value"] = "query" if value is query else "value"
    if key is None or key is value:
        sources["key"] = sources["value"]
    else:
        sources["key"] = "query" if key is query else "key"
    return sources
