"""The one record: quantization, 2:4 masks (and MuPPET) of a model, at any
depth, saved by one container (`keras_mp.RecordedModel`) with one walk."""

import json
import warnings

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import _models, _record
from tests.quantization.test_nested import Net

L = keras.layers


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    return x, rng.normal(size=(64, 3)).astype("float32")


def _masks(model):
    """Per masked kernel, in walk order (automatic names differ after a
    load): mask, kept, kept_magnitude."""
    return [
        [keras.ops.convert_to_numpy(v) for v in c._state()]
        for _, _, c in keras_mp.sparsity.sparse_layers(model)
    ]


def _ranges(model):
    return [
        keras.ops.convert_to_numpy(q.quantizer.amax)
        for q in keras_mp.quantization.twins.quantizers(model)
    ]


@pytest.fixture(scope="module")
def pruned_and_quantized():
    """A subclassed model (Dense inside a custom layer), pruned 2:4 in
    `fit`, then quantized, calibrated and trained a step."""
    x, y = _data()
    net = Net(8, name="net")
    net(x[:1])
    sparse = keras_mp.RecordedModel(net)
    sparse.compile(keras.optimizers.SGD(1e-2), "mse")
    sparse.fit(
        x,
        y,
        batch_size=16,
        verbose=0,
        callbacks=[keras_mp.StructuredSparsity()],
    )
    q = keras_mp.quantize_model(sparse)
    keras_mp.calibrate(q, x, verbose=0)
    q.compile(keras.optimizers.SGD(1e-2), "mse")
    q.fit(
        x[:32],
        y[:32],
        batch_size=16,
        verbose=0,
        callbacks=[keras_mp.StructuredSparsity()],
    )
    return q


def test_one_record_holds_quantization_and_masks(pruned_and_quantized):
    q = pruned_and_quantized
    assert isinstance(q, keras_mp.RecordedModel)
    assert not isinstance(q.model, keras_mp.RecordedModel)  # not nested
    record = q.get_config()["record"]
    assert record["version"] == _record.RECORD_VERSION
    assert {"quantization", "sparsity"} <= set(record)
    assert len(record["layers"]) == len(record["paths"])
    walked = _models.walk(q.model)
    for entry in record["quantization"]["entries"]:
        assert entry["class_name"] == record["layers"][entry["index"]]
    for entry in record["sparsity"]["masks"]:
        layer, _ = walked[entry["index"]]
        assert record["paths"][entry["index"]].endswith(layer.name)
    json.dumps(record)  # JSON as it is saved


def test_pruned_quantized_model_round_trips(pruned_and_quantized, tmp_path):
    q = pruned_and_quantized
    x, _ = _data()
    path = tmp_path / "q.keras"
    q.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert isinstance(loaded, keras_mp.RecordedModel)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), q(x))
    masks, want = _masks(loaded), _masks(q)
    assert len(masks) == len(want) == 3
    for state, got in zip(want, masks):
        for a, b in zip(state, got):
            np.testing.assert_array_equal(a, b)
        assert np.isfinite(got[2]).all()  # kept_magnitude
    ranges, want = _ranges(loaded), _ranges(q)
    assert len(ranges) == len(want) == 6
    for got, value in zip(ranges, want):
        np.testing.assert_array_equal(got, value)


def test_quantizers_turned_off_stay_off(tmp_path):
    x, _ = _data()
    net = Net(8, name="net")
    net(x[:1])
    q = keras_mp.quantize_model(net)
    keras_mp.calibrate(q, x, verbose=0)
    layer = keras_mp.quantization.twins.quantized_layers(q)[0]
    layer.named_quantizers()["input_0"].enabled = False
    q.save(tmp_path / "q.keras")
    loaded = keras.saving.load_model(tmp_path / "q.keras", safe_mode=True)
    again = keras_mp.quantization.twins.quantized_layers(loaded)[0]
    assert again.enabled
    assert not again.named_quantizers()["input_0"].enabled
    np.testing.assert_array_equal(loaded(x), q(x))
    keras_mp.set_quantization_enabled(q, False)
    q.save(tmp_path / "off.keras")
    off = keras.saving.load_model(tmp_path / "off.keras", safe_mode=True)
    assert not any(
        t.enabled for t in keras_mp.quantization.twins.quantized_layers(off)
    )
    np.testing.assert_array_equal(off(x), net(x))


def _record_config():
    model = keras.Sequential(
        [keras.Input((8,)), L.Dense(4, name="fc")], name="seq"
    )
    return keras_mp.quantize_model(model).get_config()


def test_record_from_a_newer_keras_mp_is_refused():
    config = _record_config()
    config["record"]["version"] = _record.RECORD_VERSION + 1
    with pytest.raises(ValueError, match="record has version 3; this"):
        keras_mp.RecordedModel.from_config(config)


def test_record_with_an_unknown_section_is_refused():
    config = _record_config()
    config["record"]["fp4_magic"] = {"entries": []}
    with pytest.raises(ValueError, match="does not know \\(fp4_magic\\)"):
        keras_mp.RecordedModel.from_config(config)


def test_record_of_another_model_names_the_recorded_layer():
    config = _record_config()
    config["model"] = keras.saving.serialize_keras_object(
        keras.Sequential([keras.Input((8,)), L.Dropout(0.1), L.Dense(4)])
    )
    with pytest.raises(ValueError, match="is Dropout, expected Dense 'fc'"):
        keras_mp.RecordedModel.from_config(config)


def test_old_containers_are_load_only_and_say_so():
    net = Net(8, name="net")
    net(np.zeros((1, 8), "float32"))
    for cls in (keras_mp.legacy.QuantizedModel, keras_mp.legacy.SparseModel):
        with pytest.raises(TypeError, match="load-only.*RecordedModel"):
            cls(net)
        with keras_mp.legacy.loading():  # as a file of that release held it
            old = cls(net)
        assert isinstance(old, keras_mp.RecordedModel)


def test_a_plain_model_records_nothing_but_its_walk():
    model = keras.Sequential([keras.Input((8,)), L.Dense(4)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        record = keras_mp.RecordedModel(model).get_config()["record"]
    assert set(record) == {"version", "layers", "paths"}


def test_task_methods_of_the_wrapped_model_are_forwarded():
    """A quantized keras-hub CausalLM generates with its quantized layers;
    private and unknown names still fail, naming the wrapped model."""
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=32,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=16,
    )
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    ids = np.random.default_rng(0).integers(1, 32, (4, 8)).astype("int32")
    mask = np.ones_like(ids)
    mask[:, 5:] = 0
    q = keras_mp.quantize_model(lm)
    keras_mp.calibrate(q, {"token_ids": ids, "padding_mask": mask}, verbose=0)
    q.model.compile(sampler="greedy")  # the task's own compile
    prompt = {"token_ids": ids, "padding_mask": mask.astype(bool)}
    got = q.generate(prompt, max_length=8, stop_token_ids=None)
    want = q.model.generate(prompt, max_length=8, stop_token_ids=None)
    np.testing.assert_array_equal(got["token_ids"], want["token_ids"])
    np.testing.assert_array_equal(got["token_ids"][:, :5], ids[:, :5])
    assert q.backbone is q.model.backbone and q.preprocessor is None
    assert not hasattr(q, "_not_an_attribute")
    with pytest.raises(AttributeError, match="nor has the model it holds"):
        q.not_an_attribute  # noqa: B018


def test_save_to_h5_is_refused_before_writing(tmp_path):
    x, _ = _data()
    q = keras_mp.quantize_model(
        keras.Sequential([keras.Input((8,)), L.Dense(4, name="fc")])
    )
    keras_mp.calibrate(q, x, verbose=0)
    for name in ("q.h5", "q.HDF5"):
        with pytest.raises(
            ValueError,
            match=r"only the `.keras` format .* Received: filepath='.*q."
            r"(h5|HDF5)'. Save it as '.*q.keras', or its weights only",
        ):
            q.save(tmp_path / name)
    assert list(tmp_path.iterdir()) == []
