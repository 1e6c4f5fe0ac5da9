"""The per-layer cost model: FLOPs and weights counted from real Keras
layers, the roofline with TensorRT's rules, effective bits, and the errors
a caller sees."""

import math
import pathlib
import re

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.precision.cost import (
    GPUS,
    LayerWork,
    bits_cost,
    check_precisions,
    effective_bits,
    gpu_spec,
    latency,
    layer_work,
)
from keras_mp.precision.gpus import GPU
from keras_mp.quantization import placement

# the small-GEMM threshold of 16 (tests/conftest.py lowers it elsewhere)
pytestmark = pytest.mark.gemm_rule

L = keras.layers
H100 = GPUS["H100"]


def _built(layer, input_shape):
    layer.build(input_shape)
    return layer


def test_dense_counts_2_m_k_n_and_its_kernel():
    dense = _built(L.Dense(10), (None, 128))
    work = layer_work(dense, [(64, 128)], [(64, 10)])
    assert work == LayerWork(
        flops=2 * 64 * 128 * 10,
        weight_elements=128 * 10,
        input_elements=64 * 128,
        output_elements=64 * 10,
        gemm_k=128,
        gemm_n=10,
        kind="gemm",
    )
    # a sequence: every position is a row of the GEMM
    wide = _built(L.Dense(32), (None, 20, 48))
    assert layer_work(wide, [(4, 20, 48)], [(4, 20, 32)]).flops == (
        2 * 4 * 20 * 48 * 32
    )


def test_conv2d_and_grouped_conv():
    conv = _built(L.Conv2D(32, 3, padding="same"), (None, 28, 28, 3))
    work = layer_work(conv, [(8, 28, 28, 3)], [(8, 28, 28, 32)])
    assert work.flops == 2 * (8 * 28 * 28 * 32) * (3 * 3 * 3)
    assert work.weight_elements == 3 * 3 * 3 * 32  # no bias
    assert (work.gemm_k, work.gemm_n, work.kind) == (27, 32, "conv")
    grouped = _built(L.Conv2D(32, 3, groups=4), (None, 10, 10, 16))
    work = layer_work(grouped, [(2, 10, 10, 16)], [(2, 8, 8, 32)])
    assert work.flops == 2 * (2 * 8 * 8 * 32) * (3 * 3 * 4)
    assert (work.gemm_k, work.gemm_n) == (3 * 3 * 4, 32)


def test_depthwise_with_depth_multiplier():
    layer = _built(L.DepthwiseConv2D(3, depth_multiplier=2), (None, 10, 10, 4))
    work = layer_work(layer, [(2, 10, 10, 4)], [(2, 8, 8, 8)])
    # each of the 4 * 2 output channels: a 3x3 filter over one input channel
    assert work.flops == 2 * (2 * 8 * 8 * 8) * 9
    assert work.weight_elements == 3 * 3 * 4 * 2
    assert (work.gemm_k, work.gemm_n) == (9, 8)


def test_separable_counts_depthwise_plus_pointwise():
    layer = _built(L.SeparableConv2D(16, 3), (None, 10, 10, 4))
    work = layer_work(layer, [(2, 10, 10, 4)], [(2, 8, 8, 16)])
    positions = 2 * 8 * 8
    assert work.flops == 2 * positions * 4 * 9 + 2 * positions * 4 * 16
    assert work.weight_elements == 3 * 3 * 4 + 4 * 16
    assert (work.gemm_k, work.gemm_n) == (4, 16)  # the pointwise GEMM
    assert "per group" in work.no_fp8


def test_einsum_dense_contracts_only_the_input_axes():
    projection = L.EinsumDense("abc,cde->abde", output_shape=(None, 4, 16))
    _built(projection, (None, 10, 32))
    work = layer_work(projection, [(2, 10, 32)], [(2, 10, 4, 16)])
    assert work.flops == 2 * (2 * 10 * 4 * 16) * 32
    assert (work.weight_elements, work.gemm_k, work.gemm_n) == (2048, 32, 64)
    # "b" is in input, kernel and output: a batch of b GEMMs, not K
    batched = _built(
        L.EinsumDense("abc,bcd->abd", output_shape=(5, 6)), (None, 5, 8)
    )
    work = layer_work(batched, [(3, 5, 8)], [(3, 5, 6)])
    assert work.flops == 2 * 3 * 5 * 8 * 6
    assert (work.gemm_k, work.gemm_n) == (8, 6)


def test_conv2d_transpose_counts_no_macs_on_inserted_zeros():
    layer = L.Conv2DTranspose(8, 3, strides=2, padding="same")
    _built(layer, (None, 7, 7, 4))
    work = layer_work(layer, [(2, 7, 7, 4)], [(2, 14, 14, 8)])
    # every input element times every tap of every output channel; the
    # output-based count would be 4x (stride 2 squared)
    assert work.flops == 2 * (2 * 7 * 7 * 4) * (3 * 3 * 8)
    assert 2 * (2 * 14 * 14 * 8) * (3 * 3 * 4) == 4 * work.flops
    assert (work.weight_elements, work.gemm_k, work.gemm_n) == (288, 36, 8)


def test_multi_head_attention_counts_its_two_matmuls_only():
    mha = L.MultiHeadAttention(num_heads=4, key_dim=16, value_dim=8)
    query = np.zeros((2, 10, 32), "float32")
    value = np.zeros((2, 6, 32), "float32")
    output = mha(query, value)
    work = layer_work(mha, [query.shape, value.shape], [output.shape])
    b, h, t, s = 2, 4, 10, 6
    assert work.flops == 2 * b * h * t * s * 16 + 2 * b * h * t * s * 8
    assert work.weight_elements == 0  # the projections are their own rows
    assert (work.gemm_k, work.gemm_n, work.kind) == (16, 8, "attention")
    projection = layer_work(mha.query_dense, [query.shape], [(2, 10, 4, 16)])
    assert projection.flops == 2 * (2 * 10 * 4 * 16) * 32


def test_grouped_query_attention_and_dot():
    gqa = L.GroupQueryAttention(
        head_dim=16, num_query_heads=4, num_key_value_heads=2
    )
    query = np.zeros((2, 10, 32), "float32")
    value = np.zeros((2, 6, 32), "float32")
    output = gqa(query, value)
    work = layer_work(gqa, [query.shape, value.shape], [output.shape])
    assert work.flops == 2 * (2 * 2 * 4 * 10 * 6 * 16)
    dot = L.Dot(axes=(2, 2))
    work = layer_work(dot, [(2, 5, 8), (2, 7, 8)], [(2, 5, 7)])
    assert work == LayerWork(2 * 2 * 5 * 7 * 8, 0, 192, 70, 8, 7, "dot")


def test_a_quantized_twin_has_the_work_of_its_float_layer():
    inputs = keras.Input((32,))
    outputs = L.Dense(64, name="fc")(inputs)
    model = keras.Model(inputs, outputs)
    float_work = layer_work(model.get_layer("fc"), [(8, 32)], [(8, 64)])
    qmodel = keras_mp.quantize_model(model)
    twin = qmodel.model.get_layer("fc")
    assert type(twin) is not L.Dense and isinstance(twin, L.Dense)
    assert layer_work(twin, [(8, 32)], [(8, 64)]) == float_work


def test_a_large_gemm_is_compute_bound_and_int8_twice_as_fast():
    m = k = n = 8192
    big = LayerWork(2 * m * k * n, k * n, m * k, m * n, k, n, "gemm")
    fp16 = latency(big, "float", "H100")
    assert fp16 == 2 * m * k * n / (989e12)
    int8 = latency(big, "int8", "H100", fused_input=True)
    assert int8 == 2 * m * k * n / (1979e12)
    assert fp16 / int8 == pytest.approx(2.0, rel=1e-3)
    # a stand-alone Quantize of the input: read 2 bytes, write 1
    quantize = 3 * m * k / 3350e9
    assert latency(big, "int8", "H100") == pytest.approx(int8 + quantize)


def test_a_10_class_head_is_slower_in_int8_than_in_float16(monkeypatch):
    head = _built(L.Dense(10), (None, 128))
    work = layer_work(head, [(64, 128)], [(64, 10)])
    fp16 = latency(work, "float", "H100")
    # memory bound: 128*10 weights, 64*128 inputs, 64*10 outputs, 2 bytes
    assert fp16 == (1280 + 8192 + 640) * 2 / 3350e9
    assert latency(work, "int8", "H100") > fp16
    assert latency(work, "float8", "H100") > fp16
    # N=10 < 16: even with a fused Q, never faster than float16
    assert latency(work, "int8", "H100", fused_input=True) == fp16
    monkeypatch.setattr(placement, "MIN_GEMM_DIM", 0)
    assert latency(work, "int8", "H100", fused_input=True) < fp16


def test_padding_to_tensor_core_tiles():
    gpu = GPU("Fast memory", {"float": 1.0, "int8": 2.0}, 1e12, "", "X")
    work = LayerWork(2 * 1000 * 24 * 40, 0, 0, 0, 24, 40, "gemm")
    # float16 tiles of 8 fit 24 and 40; int8 pads them to 32 and 48
    assert latency(work, "float", gpu) == 2 * 1000 * 24 * 40 / 1e12
    assert latency(work, "int8", gpu, fused_input=True) == pytest.approx(
        2 * 1000 * 32 * 48 / 2e12
    )


def test_an_add_costs_its_bytes():
    add = L.Add()
    work = layer_work(add, [(64, 1000), (64, 1000)], [(64, 1000)])
    assert (work.flops, work.kind, work.gemm_k) == (0, "elementwise", None)
    assert latency(work, "float", "L4") == (128000 + 64000) * 2 / 300e9
    int8 = (128000 * 1 + 64000 * 2 + 128000 * 3) / 300e9
    assert latency(work, "int8", "L4") == pytest.approx(int8)


def test_batch_scale_scales_activations_not_weights():
    dense = _built(L.Dense(256), (None, 512))
    at_8 = layer_work(dense, [(8, 512)], [(8, 256)])
    at_64 = layer_work(dense, [(64, 512)], [(64, 256)])
    for precision in ("float", "int8"):
        assert latency(at_8, precision, "A100", batch_scale=8) == (
            pytest.approx(latency(at_64, precision, "A100"), rel=1e-12)
        )
    with pytest.raises(ValueError, match="batch_scale"):
        latency(at_8, "int8", "A100", batch_scale=0)


@pytest.mark.parametrize("name", ["T4", "A100"])
def test_fp8_on_a_gpu_without_fp8_names_the_gpus_that_have_it(name):
    with pytest.raises(
        ValueError,
        match=rf"float8 cannot run on {name} .*Ada Lovelace, Hopper.*"
        r"GPUs that run float8: L4, L40S, H100, H200, B200",
    ):
        check_precisions(name, ["int8", "float8"])
    work = LayerWork(0, 0, 10, 10, None, None, "elementwise")
    with pytest.raises(ValueError, match="float8 cannot run"):
        latency(work, "float8", name)
    check_precisions(name, ["float", "int8"])


def test_unknown_gpu_and_precision():
    assert gpu_spec("h100") is H100
    with pytest.raises(
        ValueError,
        match=r"Unknown GPU: 'V100'. Known GPUs: T4, A100, L4, L40S, H100, "
        "H200, B200",
    ):
        gpu_spec("V100")
    with pytest.raises(
        ValueError,
        match=r"one of \['float', 'int8', 'float8'\].*precision='bf16'",
    ):
        check_precisions("H100", ["bf16"])


def test_old_precision_spellings_warn_and_name_the_new_ones():
    work = LayerWork(0, 0, 10, 10, None, None, "elementwise")
    with pytest.warns(DeprecationWarning, match="use 'float8'"):
        assert latency(work, "fp8", "H100") == latency(work, "float8", "H100")
    with pytest.warns(DeprecationWarning, match="use 'float'"):
        assert check_precisions("T4", ["float16", "int8"]) == (
            "float",
            "int8",
        )
    with pytest.warns(DeprecationWarning, match="'float16' is deprecated"):
        gpu = GPU("Old", {"float16": 1.0, "fp8": 2.0}, 1e12, "", "Ada")
    assert gpu.peak == {"float": 1.0, "float8": 2.0}


def test_fp8_conv_with_3_input_channels_is_priced_as_int8():
    # FP8 four times INT8 and no memory limit: the formats differ clearly
    gpu = GPU(
        "Test", {"float": 1.0, "int8": 2.0, "float8": 8.0}, 1e12, "", "Ada"
    )
    stem = _built(L.Conv2D(64, 3, padding="same"), (None, 32, 32, 3))
    work = layer_work(stem, [(8, 32, 32, 3)], [(8, 32, 32, 64)])
    assert "3 channels" in work.no_fp8
    assert latency(work, "float8", gpu) == latency(work, "int8", gpu)
    body = _built(L.Conv2D(64, 3, padding="same"), (None, 32, 32, 64))
    work = layer_work(body, [(8, 32, 32, 64)], [(8, 32, 32, 64)])
    assert work.no_fp8 == ""
    assert latency(work, "float8", gpu) < latency(work, "int8", gpu)


def test_effective_bits_of_a_mixed_choice():
    fc = _built(L.Dense(64), (None, 32))
    head = _built(L.Dense(10), (None, 64))
    add = L.Add()
    choice = [
        (layer_work(fc, [(8, 32)], [(8, 64)]), "float8"),
        (layer_work(head, [(8, 64)], [(8, 10)]), "float"),
        (layer_work(add, [(8, 10), (8, 10)], [(8, 10)]), "int8"),
    ]
    assert bits_cost(choice[0][0], "float8") == 2048 * 8
    assert effective_bits(choice) == (2048 * 8 + 640 * 16) / (2048 + 640)
    with pytest.raises(ValueError, match="at least one layer with weights"):
        effective_bits(choice[2:])
    with pytest.raises(ValueError, match="Received: precision='int4'"):
        bits_cost(choice[0][0], "int4")


def test_calls_of_a_shared_layer_add_up():
    dense = _built(L.Dense(32), (None, 16))
    first = layer_work(dense, [(4, 16)], [(4, 32)])
    second = layer_work(dense, [(12, 16)], [(12, 32)])
    both = first + second
    assert both == sum([first, second])
    assert both == LayerWork(
        2 * 16 * 16 * 32, 512, 16 * 16, 16 * 32, 16, 32, "gemm", calls=2
    )
    # weights once for effective bits, read once per call for latency
    assert effective_bits([(both, "int8")]) == 8.0
    weights_again = 512 * 2 / H100.bandwidth / 1e9
    one_call = layer_work(dense, [(16, 16)], [(16, 32)])
    assert latency(both, "float", H100) == pytest.approx(
        latency(one_call, "float", H100) + weights_again
    )
    other = layer_work(_built(L.Dense(8), (None, 16)), [(4, 16)], [(4, 8)])
    with pytest.raises(ValueError, match="sums the calls of one layer"):
        first + other


def test_errors_a_caller_can_fix():
    with pytest.raises(ValueError, match="concrete shapes.*None"):
        layer_work(L.Add(), [(None, 4), (None, 4)], [(None, 4)])
    with pytest.raises(ValueError, match="dense_unbuilt .*not built"):
        layer_work(L.Dense(4, name="dense_unbuilt"), [(2, 3)], [(2, 4)])
    attention = L.Attention()
    attention([np.zeros((1, 2, 4), "float32")] * 2)
    with pytest.raises(ValueError, match="counts the attention matmuls"):
        layer_work(attention, [(1, 2, 4)] * 2, [(1, 2, 4)])
    with pytest.raises(ValueError, match="multiplies two tensors"):
        layer_work(L.Dot(axes=1), [(2, 3)], [(2, 1)])


def test_gpu_table_matches_the_docs_page():
    page = pathlib.Path(__file__).parents[2] / "docs" / "latency_model.md"
    rows = re.findall(
        r"^\| (\w+) \| [^|]+ \| ([\d.,]+) \| ([\d.,]+) \| ([\d.,]+|-) \| "
        r"([\d.,]+) \| \[datasheet\]\((\S+)\) \|$",
        page.read_text(),
        re.MULTILINE,
    )
    documented = {
        name: (
            {
                p: float(v.replace(",", ""))
                for p, v in zip(("float", "int8", "float8"), values)
                if v != "-"
            },
            float(bandwidth.replace(",", "")),
            url,
        )
        for name, *values, bandwidth, url in rows
    }
    assert documented == {
        gpu.name: (gpu.peak, gpu.bandwidth, gpu.source) for gpu in GPUS.values()
    }
    # dense, not sparse: 8-bit peaks are twice float16's, never four times
    for gpu in GPUS.values():
        for precision in ("int8", "float8"):
            if precision in gpu.peak:
                ratio = gpu.peak[precision] / gpu.peak["float"]
                assert math.isclose(ratio, 2.0, rel_tol=0.02), gpu.name
