"""How much a layer computes and moves in one call: `layer_work`.

The GEMM (or convolution) FLOPs, the quantized weight elements and the
tensor sizes of a layer, from the concrete shapes of one call; the input of
the latency and effective-bits costs of `keras_mp.precision.cost`.
"""

import dataclasses
import math

import keras

from keras_mp import layer_table
from keras_mp.quantization import placement

L = keras.layers
KINDS = ("conv", "gemm", "attention", "dot", "elementwise")


@dataclasses.dataclass(frozen=True)
class LayerWork:
    """The work of one layer, for one call or summed over its calls.

    Attributes:
        flops: int. 2 x the multiply-adds of its GEMMs or convolutions.
        weight_elements: int. Elements of the weights that get quantized
            (kernels, not biases), counted once however many calls.
        input_elements: int. Elements of its tensor inputs.
        output_elements: int. Elements of its tensor outputs.
        gemm_k: int or None. The GEMM reduction size (attention: the key
            head size, the K of Q.K^T); None without a GEMM.
        gemm_n: int or None. The GEMM output channels (attention: the
            value head size, the N of probs.V); None without a GEMM.
        kind: str. One of `KINDS`.
        no_fp8: str. Why TensorRT has no FP8 kernel for this convolution
            (its FP8 is priced as INT8, as keras_mp places it), or "".
        calls: int. How many calls the work sums (each reads the weights).

    `a + b` sums two calls of one layer; `sum(works)` works too.
    """

    flops: int
    weight_elements: int
    input_elements: int
    output_elements: int
    gemm_k: int
    gemm_n: int
    kind: str
    no_fp8: str = ""
    calls: int = 1

    def __add__(self, other):
        if not isinstance(other, LayerWork):
            return NotImplemented
        if (self.kind, self.weight_elements) != (
            other.kind,
            other.weight_elements,
        ):
            raise ValueError(
                "LayerWork + LayerWork sums the calls of one layer (its "
                "weights counted once). Received works of different layers: "
                f"kind={self.kind!r}, weight_elements={self.weight_elements}"
                f" and kind={other.kind!r}, weight_elements="
                f"{other.weight_elements}. Price layers one by one."
            )
        return LayerWork(
            flops=self.flops + other.flops,
            weight_elements=self.weight_elements,
            input_elements=self.input_elements + other.input_elements,
            output_elements=self.output_elements + other.output_elements,
            gemm_k=_smaller(self.gemm_k, other.gemm_k),
            gemm_n=_smaller(self.gemm_n, other.gemm_n),
            kind=self.kind,
            no_fp8=self.no_fp8 or other.no_fp8,
            calls=self.calls + other.calls,
        )

    def __radd__(self, other):
        return self if other == 0 else self.__add__(other)


def _smaller(a, b):
    sizes = [s for s in (a, b) if s is not None]
    return min(sizes) if sizes else None


def _size(variable):
    return math.prod(int(d) for d in variable.shape)


def _shapes(shapes, argument):
    """`shapes` as a list of tuples of positive ints."""
    try:
        result = [tuple(int(d) for d in shape) for shape in shapes]
    except (TypeError, ValueError):
        result = None
    if not result or any(not s or min(s) < 1 for s in result):
        raise ValueError(
            f"`{argument}` must be a non-empty list of concrete shapes, one "
            "tuple of positive ints per tensor, batch included, e.g. "
            f"[(64, 28, 28, 1)]. Received: {argument}={shapes!r}. Record "
            "them from a real call (no None dimensions)."
        )
    return result


def _conv(layer, inputs, outputs):
    kernel = layer.kernel
    channels = int(kernel.shape[-1])
    k = _size(kernel) // channels
    return 2 * outputs * k, k, channels


def _transposed(layer, inputs, outputs):
    # Each input element meets every tap of every output channel once (a
    # strided transposed convolution has fewer MACs than its output times
    # its filter, which counts the inserted zeros).
    kernel = layer.kernel
    channels_in, channels_out = int(kernel.shape[-1]), int(kernel.shape[-2])
    flops = 2 * math.prod(inputs[0]) * (_size(kernel) // channels_in)
    return flops, _size(kernel) // channels_out, channels_out


def _depthwise(layer, inputs, outputs):
    kernel = layer.kernel
    channels = int(kernel.shape[-2]) * int(kernel.shape[-1])
    taps = _size(kernel) // channels
    return 2 * outputs * taps, taps, channels


def _separable(layer, inputs, outputs):
    # depthwise then pointwise; K and N are the pointwise GEMM's
    depthwise, pointwise = layer.depthwise_kernel, layer.pointwise_kernel
    middle, channels = int(pointwise.shape[-2]), int(pointwise.shape[-1])
    positions = outputs // channels
    flops = 2 * positions * _size(depthwise) + 2 * outputs * middle
    return flops, middle, channels


def _dense(layer, inputs, outputs):
    k, n = (int(d) for d in layer.kernel.shape)
    return 2 * outputs * k, k, n


def _einsum(layer, inputs, outputs):
    # K: the kernel axes contracted with the input; N: those reaching the
    # output only (an axis in input, kernel and output is a batch of GEMMs)
    x_spec, kernel_spec, output = layer_table._einsum_parts(layer.equation)
    sizes = dict(zip(kernel_spec, (int(d) for d in layer.kernel.shape)))
    k = math.prod(
        size
        for axis, size in sizes.items()
        if axis in x_spec and axis not in output
    )
    n = layer_table.output_channels(layer, layer.kernel)
    return 2 * outputs * k, k, int(n)


def _attention(heads, key_size, value_size, axes, inputs):
    """Q.K^T and probs.V of `heads` heads: 2*B*H*T*S*(dk + dv)."""
    query = inputs[0]
    value = inputs[1] if len(inputs) > 1 else query
    rows = math.prod(query[:-1])
    keys = math.prod(value[a] for a in axes)
    return 2 * heads * rows * keys * (key_size + value_size)


def _multi_head(layer, inputs, outputs):
    axes = layer.attention_axes or tuple(range(1, len(inputs[0]) - 1))
    k, n = layer.key_dim, layer.value_dim
    return _attention(layer.num_heads, k, n, axes, inputs), k, n


def _grouped_query(layer, inputs, outputs):
    size = layer.head_dim
    flops = _attention(layer.num_query_heads, size, size, (1,), inputs)
    return flops, size, size


def _dot(layer, inputs, outputs):
    if len(inputs) != 2:
        raise ValueError(
            f"A Dot layer multiplies two tensors; `input_shapes` of "
            f"{layer.name} holds {len(inputs)}. Pass both inputs' shapes."
        )
    first, second = inputs
    axes = (
        layer.axes
        if isinstance(layer.axes, (list, tuple))
        else [layer.axes] * 2
    )
    k = first[axes[0] % len(first)]
    n = math.prod(second[1:]) // second[axes[1] % len(second)]
    return 2 * outputs * k, k, n


# (layer types, counter, kind); a quantized twin is a subclass of its type
_COUNTERS = (
    ((L.Conv1D, L.Conv2D, L.Conv3D), _conv, "conv"),
    (
        (L.Conv1DTranspose, L.Conv2DTranspose, L.Conv3DTranspose),
        _transposed,
        "conv",
    ),
    ((L.DepthwiseConv1D, L.DepthwiseConv2D), _depthwise, "conv"),
    ((L.SeparableConv1D, L.SeparableConv2D), _separable, "conv"),
    (L.Dense, _dense, "gemm"),
    (L.EinsumDense, _einsum, "gemm"),
    (L.MultiHeadAttention, _multi_head, "attention"),
    (L.GroupQueryAttention, _grouped_query, "attention"),
    (L.Dot, _dot, "dot"),
)


def _counter(layer):
    for types, count, kind in _COUNTERS:
        if isinstance(layer, types):
            return count, kind
    row = layer_table.row_for(layer)
    if row is not None and row.attention:
        raise ValueError(
            f"layer_work() counts the attention matmuls of "
            f"MultiHeadAttention (and its subclasses) and "
            f"GroupQueryAttention; {layer.name} is a "
            f"{type(layer).__name__}. Price its projections (EinsumDense "
            "or Dense layers) on their own and leave it out."
        )
    return None, "elementwise"


def layer_work(layer, input_shapes, output_shapes):
    """The GEMM work and tensor sizes of one call of `layer`.

    FLOPs are 2 x multiply-adds: 2 * output elements * (kernel elements /
    output channels) for Dense, EinsumDense (the contracted kernel axes),
    convolutions and depthwise convolutions (`depth_multiplier` included);
    depthwise plus pointwise for separable convolutions; 2 * input
    elements * (kernel elements / input channels) for transposed
    convolutions (no MACs on the zeros a stride inserts); for
    MultiHeadAttention only its two attention matmuls, 2*B*H*T*S*key_dim +
    2*B*H*T*S*value_dim (its projections are EinsumDense layers of their
    own); for Dot, from its input shapes. Layers without a GEMM (Add,
    pooling, Concatenate, normalizations) have none: `kind="elementwise"`.

    Args:
        layer: a built Keras layer, float or keras_mp's quantized twin.
        input_shapes: list of tuples. The concrete shape of each tensor
            input of one call, batch included, e.g. `[(64, 28, 28, 1)]`;
            MultiHeadAttention: query, value (and key).
        output_shapes: list of tuples. The same for its outputs.

    Returns:
        A `LayerWork`. Sum the works of a layer's calls with `+`.

    Raises:
        ValueError: a shape that is not concrete, a layer with weights that
            is not built, or an attention layer whose matmuls are not
            modelled (keras-hub's, Keras' Attention).

    Example:

    >>> dense = keras.layers.Dense(10)
    >>> dense.build((None, 128))
    >>> work = layer_work(dense, [(64, 128)], [(64, 10)])
    >>> work.flops, work.weight_elements, work.gemm_k, work.gemm_n
    (163840, 1280, 128, 10)
    """
    inputs = _shapes(input_shapes, "input_shapes")
    outputs = _shapes(output_shapes, "output_shapes")
    output_elements = sum(math.prod(s) for s in outputs)
    count, kind = _counter(layer)
    row = layer_table.row_for(layer)
    weights = row.weights if row is not None else ()
    if weights and not layer.built:
        raise ValueError(
            f"layer_work() reads the weights of {layer.name} "
            f"({type(layer).__name__}), which is not built. Call the model "
            "(or the layer) once first."
        )
    flops, k, n = 0, None, None
    if count is not None:
        flops, k, n = count(layer, inputs, output_elements)
    return LayerWork(
        flops=int(flops),
        weight_elements=sum(_size(getattr(layer, w.attr)) for w in weights),
        input_elements=sum(math.prod(s) for s in inputs),
        output_elements=output_elements,
        gemm_k=k,
        gemm_n=n,
        kind=kind,
        no_fp8=placement.conv_limit(layer, "float8") if kind == "conv" else "",
    )
