"""2:4 structured sparsity: masks, callback, save/load, resume, strip."""

import os

import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keras_mp.sparsity.callback import StructuredSparsity
from keras_mp.sparsity.masks import (
    SparsityMask,
    check_eligible,
    input_channel_axis,
    is_2_4_sparse,
    magnitude_mask,
    sparse_layers,
    strip_sparsity,
)
from keras_mp.sparsity.report import plot_sparsity, sparsity_report

IN, OUT = 8, 12
L = keras.layers

# One line per supported layer type: (layer, input shape, expected axis).
LAYER_CASES = {
    "Dense": (lambda: L.Dense(OUT), (IN,), 0),
    "Conv1D": (lambda: L.Conv1D(OUT, 3), (6, IN), 1),
    "Conv2D": (lambda: L.Conv2D(OUT, 3), (6, 6, IN), 2),
    "Conv3D": (lambda: L.Conv3D(OUT, 2), (4, 4, 4, IN), 3),
    "SeparableConv2D": (
        lambda: L.SeparableConv2D(OUT, 3, depth_multiplier=2),
        (6, 6, IN // 2),
        2,
    ),
    "Conv2DTranspose": (lambda: L.Conv2DTranspose(OUT, 3), (5, 5, IN), 3),
    "EinsumDense": (
        lambda: L.EinsumDense("abc,cd->abd", (None, OUT)),
        (5, IN),
        0,
    ),
    "EinsumDense2": (
        lambda: L.EinsumDense("abcd,cde->abe", (None, OUT)),
        (5, 2, IN),
        1,
    ),
}


def _built(case):
    make, shape, _ = LAYER_CASES[case]
    layer = make()
    layer.build((None,) + shape)
    return layer


def _groups(kernel, axis, n):
    w = np.moveaxis(np.asarray(kernel), axis, -1)
    return w.reshape(-1, n)


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_axis_is_the_input_channel_axis(case):
    layer = _built(case)
    kernel_attr, _, axis = input_channel_axis(layer)
    shape = getattr(layer, kernel_attr).shape
    assert axis % len(shape) == LAYER_CASES[case][2]
    assert shape[axis] == IN


kernel_values = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.floats(0.0, 0.9),  # share of exact zeros
    st.sampled_from([None, 1, 0]),  # round to create ties
    st.sampled_from([(2, 4), (1, 4), (3, 4), (1, 2), (4, 8)]),
)


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
@settings(max_examples=25, deadline=None)
@given(values=kernel_values)
def test_mask_keeps_m_largest_per_group(case, values):
    seed, zeros, decimals, (m, n) = values
    layer = _built(case)
    kernel_attr, _, axis = input_channel_axis(layer)
    shape = getattr(layer, kernel_attr).shape
    rng = np.random.default_rng(seed)
    w = rng.normal(size=shape) * (rng.random(shape) >= zeros)
    if decimals is not None:
        w = np.round(w, decimals)
    mask = magnitude_mask(w, axis, m, n)
    assert mask.shape == tuple(shape)
    g_mask, g_w = _groups(mask, axis, n), np.abs(_groups(w, axis, n))
    assert np.all(g_mask.sum(-1) == m)
    kept = np.count_nonzero(g_w * g_mask, axis=-1)
    assert np.array_equal(kept, np.minimum(m, np.count_nonzero(g_w, axis=-1)))
    smallest_kept = np.where(g_mask > 0, g_w, np.inf).min(-1)
    largest_pruned = np.where(g_mask > 0, -np.inf, g_w).max(-1)
    assert np.all(smallest_kept >= largest_pruned)
    assert is_2_4_sparse(w * mask, axis, m, n)
    assert np.array_equal(mask, magnitude_mask(w, axis, m, n))


def test_ties_go_to_lower_index():
    mask = magnitude_mask(np.ones((8, 1)), axis=0)
    assert mask[:, 0].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 11), st.integers(0, 1000))
def test_pad_keeps_at_most_m_in_short_group(channels, seed):
    w = np.random.default_rng(seed).normal(size=(3, 3, channels, 5))
    mask = magnitude_mask(w, -2, pad=True)
    assert is_2_4_sparse(w * mask, -2, pad=True)
    tail = mask[:, :, channels - channels % 4 :, :].sum(axis=2)
    assert np.all(tail == min(2, channels % 4))
    assert is_2_4_sparse(w * mask, -2) == (channels % 4 == 0)


def test_is_2_4_sparse():
    k = np.array([[0.0, 1], [1, 0], [2, 0], [0, 3]])
    assert is_2_4_sparse(k, axis=0)
    assert is_2_4_sparse(k.T, axis=1)
    assert not is_2_4_sparse(k.T, axis=0)  # 2 channels: not groups of 4
    square = np.array([[1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 1], [0, 0, 0, 1]])
    assert is_2_4_sparse(square, axis=0)
    assert not is_2_4_sparse(square, axis=1)
    assert not is_2_4_sparse(np.ones((4, 2)), axis=0)
    assert not is_2_4_sparse(np.ones((3, 2)), axis=0)
    assert is_2_4_sparse(np.zeros((3, 2)), axis=0, pad=True)


def _model(input_shape=(8, 8, 4), extra=None):
    layers = [
        keras.Input(input_shape),
        L.Conv2D(8, 3, padding="same", name="conv_a"),
        L.BatchNormalization(),
        L.ReLU(),
        L.SeparableConv2D(8, 3, padding="same", name="sep"),
        L.Conv2DTranspose(8, 3, strides=2, padding="same", name="deconv"),
        L.DepthwiseConv2D(3, name="dw"),
        L.GlobalAveragePooling2D(),
        L.Dense(16, activation="relu", name="fc"),
        L.Dense(4, name="head"),
    ]
    return keras.Sequential(layers + (extra or []))


def _data(n=64, shape=(8, 8, 4), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n,) + shape).astype("float32")
    return x, rng.integers(0, 4, n)


def _compile(model, **kwargs):
    model.compile(
        keras.optimizers.Adam(1e-2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **kwargs,
    )
    return model


def _masks(model):
    return {
        layer.name: (
            keras.ops.convert_to_numpy(c.mask),
            keras.ops.convert_to_numpy(k),
            c.axis,
        )
        for layer, k, c in sparse_layers(model)
    }


def _assert_sparse(model, names=("conv_a", "sep", "deconv", "fc", "head")):
    masks = _masks(model)
    assert sorted(masks) == sorted(names)
    for name, (mask, kernel, axis) in masks.items():
        assert is_2_4_sparse(mask, axis), name
        assert np.all(kernel[mask == 0] == 0), name
        assert np.count_nonzero(kernel) > 0.4 * kernel.size, name


def test_masks_hold_with_steps_per_execution_and_xla():
    x, y = _data()
    model = _compile(_model(), jit_compile=True, steps_per_execution=4)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # dense first
    callback = StructuredSparsity()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    first = _masks(model)
    before = {k: v[1].copy() for k, v in first.items()}
    # Fit again without the callback: the constraint alone keeps the masks.
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    _assert_sparse(model)
    for name, (mask, kernel, _) in _masks(model).items():
        assert np.array_equal(mask, first[name][0])
        assert not np.allclose(kernel, before[name])  # it did train
    assert [r.name for r in callback.report.rows if not r.eligible] == ["dw"]


def test_existing_constraint_is_kept_and_composed():
    x, y = _data()
    model = _model()
    model.get_layer("fc").kernel.constraint = keras.constraints.MaxNorm(0.5)
    model.get_layer("fc").kernel_constraint = model.get_layer(
        "fc"
    ).kernel.constraint
    _compile(model).fit(
        x, y, epochs=1, verbose=0, callbacks=[StructuredSparsity(layers="fc")]
    )
    kernel = keras.ops.convert_to_numpy(model.get_layer("fc").kernel)
    assert np.sqrt((kernel**2).sum(0)).max() <= 0.5 + 1e-5
    assert is_2_4_sparse(kernel, 0)
    stripped = strip_sparsity(model)
    assert isinstance(
        stripped.get_layer("fc").kernel.constraint, keras.constraints.MaxNorm
    )


def test_save_load_round_trip(tmp_path):
    x, y = _data()
    model = _compile(_model())
    model.fit(x, y, epochs=1, verbose=0, callbacks=[StructuredSparsity()])
    path = str(tmp_path / "sparse.keras")
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    before, after = _masks(model), _masks(loaded)
    assert sorted(before) == sorted(after)
    for name in before:
        assert np.array_equal(before[name][0], after[name][0])
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )
    # The loaded model enforces the masks by itself.
    loaded.fit(x, y, epochs=1, verbose=0)
    _assert_sparse(loaded)
    for name, (mask, _, _) in _masks(loaded).items():
        assert np.array_equal(mask, before[name][0])


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("sparsity_first", [True, False])
def test_backup_and_restore_resume_keeps_masks(tmp_path, sparsity_first):
    x, y = _data()
    backup = str(tmp_path / "backup")

    def callbacks(*extra):
        pair = [StructuredSparsity(), keras.callbacks.BackupAndRestore(backup)]
        return (pair if sparsity_first else pair[::-1]) + list(extra)

    model = _compile(_model())
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(
            x,
            y,
            batch_size=16,
            epochs=3,
            verbose=0,
            callbacks=callbacks(_Interrupt(1, 2)),
        )
    saved = {k: v[0] for k, v in _masks(model).items()}
    keras.utils.set_random_seed(123)  # new weights: new masks if recomputed
    resumed = _compile(_model())
    history = resumed.fit(
        x, y, batch_size=16, epochs=3, verbose=0, callbacks=callbacks()
    )
    assert len(history.history["loss"]) == 2  # resumed at epoch 1
    _assert_sparse(resumed)
    for name, (mask, _, _) in _masks(resumed).items():
        assert np.array_equal(mask, saved[name]), name


def test_mirrored_strategy_gives_identical_masks(mirrored_strategy):
    x, y = _data()
    reference = _compile(_model())
    weights = reference.get_weights()
    reference.fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        verbose=0,
        callbacks=[StructuredSparsity()],
    )
    with mirrored_strategy.scope():
        model = _compile(_model())
    model.set_weights(weights)
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        verbose=0,
        callbacks=[StructuredSparsity()],
    )
    _assert_sparse(model)
    expected = _masks(reference)
    for layer, kernel, constraint in sparse_layers(model):
        replicas = mirrored_strategy.experimental_local_results(
            constraint.mask.value
        )
        assert len(replicas) == 2
        for value in replicas:
            np.testing.assert_array_equal(value, expected[layer.name][0])
        kernels = mirrored_strategy.experimental_local_results(kernel.value)
        np.testing.assert_array_equal(kernels[0], kernels[1])


def test_strip_sparsity_outputs_equal_and_plain():
    x, y = _data()
    model = _compile(_model())
    model.fit(x, y, epochs=1, verbose=0, callbacks=[StructuredSparsity()])
    stripped = strip_sparsity(model)
    np.testing.assert_allclose(
        stripped.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )
    assert sparse_layers(stripped) == []
    assert "SparsityMask" not in str(stripped.get_config())
    for name in ("conv_a", "fc"):
        kernel = keras.ops.convert_to_numpy(stripped.get_layer(name).kernel)
        assert is_2_4_sparse(
            kernel, input_channel_axis(model.get_layer(name))[2]
        )


def test_gradual_schedule():
    callback = StructuredSparsity(schedule="gradual", begin_step=2, end_step=10)
    assert [callback.kept_at(s) for s in (0, 2, 5, 6, 9, 10, 50)] == [
        4,
        4,
        4,
        3,
        3,
        2,
        2,
    ]
    x, y = _data()
    model = _compile(_model())
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            c = sparse_layers(self.model)[0][2]
            seen.append(int(c.kept))

    model.fit(
        x, y, batch_size=8, epochs=2, verbose=0, callbacks=[callback, Record()]
    )
    assert seen[:3] == [4, 4, 4] and 3 in seen and seen[-1] == 2
    _assert_sparse(model)


def test_layer_selection():
    model = _model()
    by = {
        "name": "fc",
        "regex": "conv_.*|head",
        "class": L.Dense,
        "callable": lambda layer: layer.name.startswith("s"),
        "list": ["fc", L.Conv2DTranspose],
    }
    expected = {
        "name": ["fc"],
        "regex": ["conv_a", "head"],
        "class": ["fc", "head"],
        "callable": ["sep"],
        "list": ["deconv", "fc"],
    }
    for key, selection in by.items():
        rows = sparsity_report(model, layers=selection).rows
        assert sorted(r.name for r in rows) == expected[key], key


def test_pad_prunes_first_conv_on_rgb():
    x, y = _data(shape=(8, 8, 3))
    model = _compile(_model(input_shape=(8, 8, 3)))
    skipped = sparsity_report(model, layers="conv_a").rows[0]
    assert not skipped.eligible and "3 input channels" in skipped.reason
    model.fit(
        x,
        y,
        epochs=1,
        verbose=0,
        callbacks=[StructuredSparsity(layers="conv_a", pad=True)],
    )
    kernel = keras.ops.convert_to_numpy(model.get_layer("conv_a").kernel)
    assert is_2_4_sparse(kernel, -2, pad=True)
    assert np.count_nonzero(kernel) == 2 * 9 * 8


def test_report_and_plot(tmp_path):
    model = _model()
    report = sparsity_report(model)
    names = [r.name for r in report.rows]
    assert names == ["conv_a", "sep", "deconv", "dw", "fc", "head"]
    dw = report.rows[3]
    assert not dw.eligible and "depthwise" in dw.reason
    fc = report.rows[4]
    assert fc.eligible and not fc.pattern_valid and fc.fraction_zero == 0.0
    assert 0.5 < fc.kept_magnitude < 1.0
    table = str(report)
    assert "depthwise" in table and "kept |w|" in table
    assert report.to_dicts()[4]["name"] == "fc"
    path = str(tmp_path / "sparsity.png")
    assert plot_sparsity(report, path) == path
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path) == ["sparsity.png"]


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"keras-mp\[plot\]"):
        plot_sparsity(_model(), str(tmp_path / "x.png"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"m": 4, "n": 4}, "0 < m < n"),
        ({"m": 2, "n": 0}, "positive integer"),
        ({"schedule": "cubic"}, "one_shot"),
        ({"schedule": "gradual"}, "end_step"),
        ({"end_step": 10}, "only applies"),
        ({"begin_step": -1}, "begin_step"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredSparsity(**kwargs)


def test_bad_inputs():
    x, y = _data()
    model = _compile(_model())
    with pytest.raises(ValueError, match="matches no weighted layer.*conv_a"):
        model.fit(
            x,
            y,
            epochs=1,
            verbose=0,
            callbacks=[StructuredSparsity(layers="nope")],
        )
    with pytest.raises(TypeError, match="Received: 42"):
        sparsity_report(model, layers=42)
    for fn in (strip_sparsity, sparsity_report):
        with pytest.raises(TypeError, match="keras.Model"):
            fn(object())
    with pytest.raises(ValueError, match="not a multiple of n=4"):
        magnitude_mask(np.ones((6, 2)), axis=0)
    with pytest.raises(ValueError, match="axis=2"):
        magnitude_mask(np.ones((4, 2)), axis=2)
    with pytest.raises(ValueError, match="0 < m < n"):
        is_2_4_sparse(np.ones((4, 2)), 0, m=5)


def test_sparsity_mask_serializes():
    mask = SparsityMask((8, 4), 0, constraint="non_neg")
    config = keras.constraints.serialize(mask)
    assert config["registered_name"] == "keras_mp>SparsityMask"
    clone = keras.constraints.get(config)
    assert clone.shape == (8, 4) and clone.m == 2
    assert isinstance(clone.constraint, keras.constraints.NonNeg)


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda o: L.Dense(o), (16,)),
        (lambda o: L.Conv2D(o, 3), (6, 6, 16)),
        # kernel (3, 3, out, in): the output channels are axis -2
        (lambda o: L.Conv2DTranspose(o, 3), (5, 5, 16)),
        # pointwise kernel (1, 1, in, out)
        (lambda o: L.SeparableConv2D(o, 3), (6, 6, 16)),
        # kernel (out, in): the output axis comes first
        (lambda o: L.EinsumDense("ab,cb->ac", o), (16,)),
        # kernel (2, in, out): two contracted axes, only `e` reaches the output
        (lambda o: L.EinsumDense("abcd,cde->abe", (None, o)), (5, 2, 16)),
    ],
)
def test_skip_unaligned_reads_output_channels_per_layer_type(make, shape):
    # NVIDIA ASP's rule: output channels % 8 and input channels % 16.
    for out, aligned in ((8, True), (12, False), (4, False)):
        layer = make(out)
        layer.build((None,) + shape)
        spec = check_eligible(layer, skip_unaligned=True)
        assert isinstance(spec, tuple) == aligned, (out, spec)
        if not aligned:
            assert f"16 input / {out} output channels" in spec
        assert isinstance(check_eligible(layer), tuple)  # default: pruned


def test_skip_unaligned_callback_report_and_config():
    model = keras.Sequential(
        [
            keras.Input((6, 6, 16)),
            L.Conv2D(16, 3, padding="same", name="aligned"),
            L.GlobalAveragePooling2D(),
            L.Dense(16, name="fc"),
            L.Dense(4, name="head"),  # 16 inputs, 4 outputs
        ]
    )
    rows = {r.name: r for r in sparsity_report(model, skip_unaligned=True).rows}
    assert {n for n, r in rows.items() if r.eligible} == {"aligned", "fc"}
    assert "16 input / 4 output channels" in rows["head"].reason
    assert "pad=True" not in rows["head"].reason  # padding cannot help

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6, 6, 16)).astype("float32")
    y = rng.integers(0, 4, 32)
    sparsity = StructuredSparsity(
        skip_unaligned=True, layers=["aligned", "fc", "head"]
    )
    _compile(model).fit(x, y, epochs=1, verbose=0, callbacks=[sparsity])
    assert sorted(_masks(model)) == ["aligned", "fc"]
    assert np.all(model.get_layer("head").kernel.numpy() != 0)
    assert all(r.pattern_valid for r in sparsity.report.rows if r.eligible)

    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(sparsity)
    )
    assert restored.get_config() == sparsity.get_config()
    assert restored.skip_unaligned and restored.layers == [
        "aligned",
        "fc",
        "head",
    ]
    with pytest.raises(ValueError, match="by name or regex"):
        StructuredSparsity(layers=L.Dense).get_config()


def test_skipped_layer_with_an_earlier_mask_is_reported_and_warned():
    model = keras.Sequential(
        [keras.Input((16,)), L.Dense(16, name="fc"), L.Dense(4, name="head")]
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype("float32")
    y = rng.integers(0, 4, 32)
    _compile(model).fit(
        x, y, epochs=1, verbose=0, callbacks=[StructuredSparsity()]
    )
    head = sparsity_report(model, skip_unaligned=True).rows[1]
    assert not head.eligible and head.masked and head.fraction_zero == 0.5
    with pytest.warns(UserWarning, match="'head' is skipped here"):
        model.fit(
            x,
            y,
            epochs=1,
            verbose=0,
            callbacks=[StructuredSparsity(skip_unaligned=True)],
        )
