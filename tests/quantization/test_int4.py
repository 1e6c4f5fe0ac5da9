"""INT4 weight-only (`precision="int4"`): block-scaled Dense/EinsumDense
kernels, float inputs, INT8 for what TensorRT runs no INT4 on."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.quantization.blocks import block_quantize_dequantize

INT4 = keras_mp.QuantizeConfig(precision="int4", block_size=64)


def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 128))
    h = keras.layers.Dense(128, activation="relu", name="fc1")(inputs)
    h = keras.layers.EinsumDense("btk,kn->btn", (8, 64), name="ein")(h)
    h = keras.layers.Conv1D(32, 3, padding="same", name="conv")(h)
    h = keras.layers.Dense(64, name="fc2")(h)
    return keras.Model(inputs, h)


def _data(n=16, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 8, 128)).astype("f4")


def _rows(qmodel):
    report = keras_mp.quantization_report(qmodel, verbose=False)
    return {r["layer"]: r for r in report.rows}


def test_int4_blocks_gemm_weights_and_mixes_with_int8_and_fp8():
    model = _mlp()
    qmodel = keras_mp.quantize_model(
        model,
        precision="int4",
        config={
            "fc1": keras_mp.QuantizeConfig(precision="int4", block_size=128),
            "fc2": keras_mp.QuantizeConfig(precision="float8"),
        },
    )
    keras_mp.calibrate(qmodel, _data(), verbose=0)
    rows = _rows(qmodel)
    assert (rows["fc1"]["format"], rows["fc1"]["block_size"]) == ("int4", 128)
    assert (rows["ein"]["format"], rows["ein"]["block_size"]) == ("int4", 128)
    # weight-only: no input Q/DQ on the INT4 GEMMs
    assert rows["fc1"]["inputs"] == {} and rows["ein"]["inputs"] == {}
    # a convolution asked for INT4 takes INT8, input Q/DQ included
    assert rows["conv"]["format"] == "int8" and list(rows["conv"]["inputs"])
    assert "INT4 asked, INT8 here" in rows["conv"]["note"]
    assert (
        rows["fc2"]["format"] == "float8" and rows["fc2"]["block_size"] is None
    )
    # the kernel is fake-quantized in blocks of 128 along K, as ONNX reads it
    fc1 = qmodel.get_layer("fc1")
    kernel = np.asarray(fc1.kernel)
    got = np.asarray(fc1.weight_quantizers[0](kernel))
    want = block_quantize_dequantize(kernel, "int4", 128).numpy()
    np.testing.assert_array_equal(got, want)
    x = _data(4, seed=1)
    out, ref = np.asarray(qmodel(x)), np.asarray(model(x))
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert 0 < rel < 0.2


def test_block_size_not_dividing_k_is_refused_before_anything_changes():
    model = _mlp()
    config = {"fc2": keras_mp.QuantizeConfig(precision="int4", block_size=64)}
    with pytest.raises(
        ValueError,
        match=r"Layer 'fc2'.*K=32, not a multiple of block_size=64.*"
        r"\[32\] of \[128, 64, 32\].*Nothing was quantized",
    ):
        keras_mp.quantize_model(model, config=config, in_place=True)
    assert type(model.get_layer("fc1")) is keras.layers.Dense


def test_block_size_is_for_int4_and_one_of_its_sizes():
    assert keras_mp.QuantizeConfig(precision="INT4").block_size == 128
    with pytest.raises(ValueError, match=r"block_size in \[128, 64, 32\]"):
        keras_mp.QuantizeConfig(precision="int4", block_size=16)
    with pytest.raises(ValueError, match="`block_size` is for the block-"):
        keras_mp.QuantizeConfig(block_size=64)


def test_int4_model_saves_loads_safe_mode_and_trains(tmp_path):
    qmodel = keras_mp.quantize_model(
        _mlp(),
        precision="int4",
        config={
            "conv": keras_mp.QuantizeConfig(),
            "fc2": keras_mp.QuantizeConfig(),
        },
    )
    x = _data()
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = tmp_path / "int4.keras"
    qmodel.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(qmodel(x)))
    q = loaded.get_layer("ein").weight_quantizers[0]
    assert q.block_size == 128 and tuple(q.amax.shape) == (1, 64)
    np.testing.assert_array_equal(
        q.amax.numpy(),
        qmodel.get_layer("ein").weight_quantizers[0].amax.numpy(),
    )
    # QAT: the straight-through gradient reaches the INT4 kernels
    loaded.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    before = np.asarray(loaded.get_layer("fc1").kernel).copy()
    loaded.fit(x, np.zeros((16, 8, 64), "f4"), epochs=1, verbose=0)
    after = np.asarray(loaded.get_layer("fc1").kernel)
    assert np.all(np.isfinite(after)) and not np.array_equal(before, after)


@keras.saving.register_keras_serializable(package="test_int4")
class _OwnEinsum(keras.layers.Layer):
    """A layer computing its GEMM in its own code (an op site)."""

    def build(self, shape):
        self.w = self.add_weight(name="w", shape=(shape[-1], 32))

    def call(self, x):
        return keras.ops.einsum("btk,kn->btn", x, self.w)


def test_op_site_weight_takes_int8_and_says_so():
    inputs = keras.Input((8, 128))
    h = keras.layers.Dense(64, name="fc")(inputs)
    model = keras.Model(inputs, _OwnEinsum(name="own")(h))
    qmodel = keras_mp.quantize_model(model, precision="int4")
    keras_mp.calibrate(qmodel, _data(), verbose=0)
    rows = _rows(qmodel)
    assert rows["fc"]["format"] == "int4"
    assert rows["own"]["format"] == "int8"
    assert "INT4 asked, INT8 here" in rows["own"]["note"]


def test_llama_backbone_int4_blocks_projections_and_keeps_attention_float():
    pytest.importorskip("keras_hub")
    from benchmarks.hub_models import BACKBONES, inputs_for

    model = BACKBONES["LlamaBackbone"](hidden_dim=64, num_layers=1)
    x = inputs_for(model, 4)
    # weight-only: no activation range, nothing to calibrate
    qmodel = keras_mp.quantize_model(model, config=INT4)
    report = keras_mp.quantization_report(qmodel, verbose=False)
    quantized = [r for r in report.rows if r["quantized"]]
    assert quantized and all(
        (r["format"], r["block_size"], r["inputs"]) == ("int4", 64, {})
        for r in quantized
    ), [(r["path"], r["format"], r["inputs"]) for r in quantized]
    assert {r["type"] for r in quantized} >= {"EinsumDense", "Dense"}
    out, ref = qmodel(x), model(x)
    rel = np.linalg.norm(np.asarray(out) - np.asarray(ref))
    assert 0 < rel / np.linalg.norm(np.asarray(ref)) < 0.3


@pytest.mark.parametrize(
    "precision, block", [("int4", 128), ("nvfp4", 16), ("mxfp8", 32)]
)
def test_block_precisions_report_save_and_load(precision, block, tmp_path):
    qmodel = keras_mp.quantize_model(
        _mlp(), precision=precision, config={"fc2": keras_mp.QuantizeConfig()}
    )
    rows = _rows(qmodel)
    assert (rows["fc1"]["format"], rows["fc1"]["block_size"]) == (
        precision,
        block,
    )
    assert f"{precision.upper()} asked, INT8 here" in rows["conv"]["note"]
    x = _data(4)
    keras_mp.calibrate(qmodel, x, verbose=0)
    qmodel.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras", safe_mode=True)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(qmodel(x)))
    kernel = np.asarray(qmodel.get_layer("ein").kernel)
    np.testing.assert_array_equal(
        np.asarray(qmodel.get_layer("ein").weight_quantizers[0](kernel)),
        block_quantize_dequantize(kernel, precision, block).numpy(),
    )


def test_calibrate_on_a_weight_only_model_warns_and_changes_nothing():
    # quantize -> calibrate -> export runs for INT4 as for INT8: nothing
    # to observe, said in a warning, every weight and output unchanged
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 128))
    h = keras.layers.Dense(128, name="fc1")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(64, name="fc2")(h))
    qmodel = keras_mp.quantize_model(model, precision="int4")
    x = _data()
    before = np.asarray(qmodel(x))
    with pytest.warns(UserWarning, match="weight-only.*gptq"):
        report = keras_mp.calibrate(qmodel, x, verbose=0)
    assert report.rows == [] and report.method == "max"
    np.testing.assert_array_equal(np.asarray(qmodel(x)), before)
    with pytest.raises(ValueError, match="no activation quantizer"):
        keras_mp.calibrate(model, x, verbose=0)


def test_an_int4_causal_lm_generates_the_float_models_greedy_tokens():
    # generate() runs the cached path (call_with_cache) through the INT4
    # twins, their AWQ pre-scales and packed kernels. A tiny Llama trained
    # for seconds on a successor rule (next = previous + 7): its logits
    # are peaked, so INT4's ~10% output error keeps every greedy token.
    # (Untrained, the logits are nearly flat: INT4 flips ~1/3 of the
    # teacher-forced argmaxes, and one flipped token changes the rest of
    # a greedy sequence.)
    keras_hub = pytest.importorskip("keras_hub")
    from benchmarks.hub_models import BACKBONES

    keras.utils.set_random_seed(0)
    lm = keras_hub.models.LlamaCausalLM(
        backbone=BACKBONES["LlamaBackbone"](64, 2), preprocessor=None
    )
    vocab = lm.backbone.vocabulary_size
    start = np.random.default_rng(0).integers(1, vocab, size=(2048, 1))
    ids = (start + 7 * np.arange(17)) % (vocab - 1) + 1
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((2048, 16), "i4")}
    lm.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampler="greedy",
    )
    lm.fit(x, ids[:, 1:], batch_size=64, epochs=2, verbose=0)
    qlm = keras_mp.quantize_model(
        lm, config=keras_mp.QuantizeConfig(precision="int4", block_size=32)
    )
    calibration = {k: v[:16] for k, v in x.items()}
    keras_mp.calibrate(qlm, calibration, method="awq", verbose=0)
    prompt = {
        "token_ids": np.pad(ids[:8, :3], ((0, 0), (0, 13))),
        "padding_mask": np.pad(np.ones((8, 3), "i4"), ((0, 0), (0, 13))),
    }
    qlm.model.compile(sampler="greedy")
    want = np.asarray(lm.generate(prompt, stop_token_ids=None)["token_ids"])
    got = np.asarray(qlm.generate(prompt, stop_token_ids=None)["token_ids"])
    np.testing.assert_array_equal(want, ids[:8, :16])  # learned the rule
    assert np.mean(got[:, 3:] == want[:, 3:]) >= 0.95
    keras_mp.pack_weights(qlm)
    packed = qlm.generate(prompt, stop_token_ids=None)["token_ids"]
    np.testing.assert_array_equal(np.asarray(packed), got)
