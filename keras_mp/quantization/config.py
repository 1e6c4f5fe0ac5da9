"""`QuantizeConfig` and the per-layer-type defaults table.

Supporting a new layer type is one `LayerSpec` row in `LAYER_SPECS`: which
weights to quantize, the output-channel axis of each, and which inputs get a
Q/DQ by default.
"""

import dataclasses

import keras

# Input placements a LayerSpec can ask for.
ALL_INPUTS = "all"  # every input (weighted layers, Concatenate)
SKIP_INPUTS = "skip"  # the residual Add rule: inputs not fused with a conv
NO_INPUTS = "none"


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """How TensorRT wants one layer type quantized.

    Attributes:
        weights: tuple of (attribute name, output-channel axis or None for
            per-tensor) pairs, axes in the Keras kernel layout.
        inputs: which inputs get a Q/DQ: `"all"`, `"skip"` (residual Add) or
            `"none"`.
        weighted: True for layers TensorRT runs as a Conv/MatMul.
    """

    weights: tuple = ()
    inputs: str = ALL_INPUTS
    weighted: bool = True


def _einsum_spec(layer):
    """EinsumDense: per-channel on the one kernel axis that reaches the
    output; per-tensor when several do (no single channel axis)."""
    inputs, output = layer.equation.split("->")
    kernel = inputs.split(",")[1]
    axes = [i for i, c in enumerate(kernel) if c in output]
    return LayerSpec(weights=(("kernel", axes[0] if len(axes) == 1 else None),))


LAYER_SPECS = {
    # Keras kernel layouts: ConvND (..., in, out); Conv2DTranspose
    # (kh, kw, out, in); DepthwiseConv2D (kh, kw, in, multiplier), whose
    # output channel is in * multiplier: per-channel over the flattened
    # last two axes (see layers.py); Dense (in, out).
    keras.layers.Conv1D: LayerSpec(weights=(("kernel", -1),)),
    keras.layers.Conv2D: LayerSpec(weights=(("kernel", -1),)),
    keras.layers.Conv3D: LayerSpec(weights=(("kernel", -1),)),
    keras.layers.Conv1DTranspose: LayerSpec(weights=(("kernel", -2),)),
    keras.layers.Conv2DTranspose: LayerSpec(weights=(("kernel", -2),)),
    keras.layers.Conv3DTranspose: LayerSpec(weights=(("kernel", -2),)),
    keras.layers.DepthwiseConv2D: LayerSpec(weights=(("kernel", "depthwise"),)),
    keras.layers.SeparableConv2D: LayerSpec(
        weights=(("depthwise_kernel", "depthwise"), ("pointwise_kernel", -1))
    ),
    keras.layers.Dense: LayerSpec(weights=(("kernel", -1),)),
    keras.layers.EinsumDense: _einsum_spec,
    keras.layers.Add: LayerSpec(inputs=SKIP_INPUTS, weighted=False),
    keras.layers.Concatenate: LayerSpec(inputs=ALL_INPUTS, weighted=False),
    # Pooling runs in INT8 when its input is quantized, but TensorRT moves
    # the next layer's Q/DQ across max pooling by itself: off by default
    # (extra Q/DQ pairs only add latency), on with QuantizeConfig.
    keras.layers.MaxPooling2D: LayerSpec(inputs=NO_INPUTS, weighted=False),
    keras.layers.AveragePooling2D: LayerSpec(inputs=NO_INPUTS, weighted=False),
    keras.layers.GlobalAveragePooling2D: LayerSpec(
        inputs=NO_INPUTS, weighted=False
    ),
}


def layer_spec(layer):
    """The `LayerSpec` of `layer`'s type, or None when unsupported."""
    for cls in type(layer).__mro__:
        spec = LAYER_SPECS.get(cls)
        if spec is not None:
            return spec(layer) if callable(spec) else spec
    return None


@keras.saving.register_keras_serializable(package="keras_mp")
@dataclasses.dataclass
class QuantizeConfig:
    """Per-layer quantization settings.

    Args:
        skip: bool. Leave the layer in float. Defaults to False.
        num_bits: int. Bits of the weights and activations (2..8; TensorRT
            runs 8). Defaults to 8.
        per_channel: bool. Per-channel weight ranges (on the output-channel
            axis); False for one range per weight tensor. Defaults to True.
        quantize_inputs: bool or None. Override the layer type's default
            input placement (e.g. True to quantize a pooling input). Defaults
            to None (the table's default).
        learned_range: bool. Train the activation ranges (PACT-style)
            instead of freezing them after calibration. Defaults to False.

    Example:

    >>> config = keras_mp.QuantizeConfig(per_channel=False)
    >>> qmodel = keras_mp.quantize_model(model, config={"fc": config})
    """

    skip: bool = False
    num_bits: int = 8
    per_channel: bool = True
    quantize_inputs: bool = None
    learned_range: bool = False

    def __post_init__(self):
        if not isinstance(self.num_bits, int) or not 2 <= self.num_bits <= 8:
            raise ValueError(
                "`num_bits` must be an integer in [2, 8] (TensorRT runs 8). "
                f"Received: num_bits={self.num_bits!r}"
            )

    def get_config(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config):
        return cls(**config)
