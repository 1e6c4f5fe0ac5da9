"""Load-only twins: `keras.layers.MultiHeadAttention` and `keras.layers.Dot`
as releases before op-level quantization saved them.

Those releases gave a MultiHeadAttention one input Q/DQ per distinct call
input (`input_quantizers`, named after `query`, `value`, `key`) and Q/DQ
on its two attention matmuls (`attention_quantizers`), and a `Dot` a Q/DQ
per input. Today both are quantized at their op sites
(`quantization/op_sites.py`) like every other layer, and their
projections quantize their own inputs. A record entry of such a layer
saved without `sites` is applied with these twins and the rows they had
(`LEGACY_ROWS`), so an old file loads with its ranges and computes what
it computed; `quantize_model` never picks them, and constructing one
raises a `TypeError` (`_load_only.LoadOnly`): layers become these twins
in place, on load.
"""

import functools

import keras

from keras_mp._load_only import LoadOnly
from keras_mp.layer_table import ALL_INPUTS, LayerRow
from keras_mp.quantization.twins import QuantizedLayer, _like, bind_call

# The rows those releases had for the two layers.
LEGACY_ROWS = (
    (
        keras.layers.MultiHeadAttention,
        LayerRow(
            inputs=ALL_INPUTS, quantizable=True, weighted=True, attention=True
        ),
    ),
    (
        keras.layers.Dot,
        LayerRow(
            inputs=ALL_INPUTS, quantizable=True, weighted=True, matmul=True
        ),
    ),
)


def legacy_row(layer, entry):
    """The row an old record `entry` of `layer` was made with, or None when
    the entry is today's (it has op `sites`) or the layer is of neither
    kind."""
    if "sites" in entry:
        return None
    return next(
        (row for cls, row in LEGACY_ROWS if isinstance(layer, cls)), None
    )


# The inputs of a MultiHeadAttention call that feed its projections.
ATTENTION_INPUTS = ("query", "value", "key")
# The inputs of its two matmuls: scaled query and key, softmax output and
# value.
ATTENTION_MATMUL_INPUTS = ("query", "key", "probs", "value")


class _LegacyTwin(LoadOnly, QuantizedLayer):
    REPLACEMENT = (
        "`keras_mp.quantize_model(model)` quantizes MultiHeadAttention and "
        "Dot at their op sites."
    )
    HOME = "keras_mp.quantization.legacy_twins"


class QuantizedAttention(_LegacyTwin):
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
            causal = self._compute_causal_mask(query, value)
            attention_mask = (
                causal
                if attention_mask is None
                else keras.ops.logical_and(
                    keras.ops.cast(attention_mask, "bool"), causal
                )
            )
        return einsum_attention(
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
        query: the projected query, `(B, T, N, H)`.
        key: the projected key, `(B, S, N, H)`.
        value: the projected value, `(B, S, N, H)`.
        attention_mask: boolean mask `(B, T, S)` or None.
        training: bool or None, for the attention dropout.
        quantize: dict of callables by `"query"` (the scaled query),
            `"key"`, `"probs"` (the softmax output, after dropout) and
            `"value"`.

    Returns:
        `(attention_output, attention_scores)`.
    """
    ops = keras.ops
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


class QuantizedDot(_LegacyTwin):
    """The quantized twin of a `keras.layers.Dot` (or a subclass).

    Both inputs get a Q/DQ (`input_indices` `[0, 1]`, set by the placement
    unless `QuantizeConfig(dot=False)`); a `normalize=True` Dot quantizes
    them after its l2-normalization, right before the matmul.
    """

    def call(self, inputs, **kwargs):
        if not self.normalize:
            return super().call(inputs, **kwargs)
        # `_merge_function` quantizes, after normalizing.
        return super(QuantizedLayer, self).call(inputs, **kwargs)

    def _merge_function(self, inputs):
        if not self.normalize or not self.input_quantizers:
            return super()._merge_function(inputs)
        axes = dot_axes(self.axes, inputs)
        values = [
            keras.utils.normalize(x, axis=a) for x, a in zip(inputs, axes)
        ]
        (values,), _ = self._quantize_inputs((values,), {})
        # The float matmul of the normalized, quantized inputs: the float
        # class normalizes only when `normalize` is set.
        self.normalize = False
        try:
            return super()._merge_function(values)
        finally:
            self.normalize = True


def dot_axes(axes, inputs):
    """A Dot's `axes` as one non-negative axis per input, as Keras reads
    them."""
    if isinstance(axes, int):
        axes = (axes, axes)
    return [a % len(x.shape) for a, x in zip(axes, inputs)]


# (layer class, load-only twin base), for `recipe.twin_class(legacy=True)`.
LEGACY_TWINS = (
    (keras.layers.MultiHeadAttention, QuantizedAttention),
    (keras.layers.Dot, QuantizedDot),
)
