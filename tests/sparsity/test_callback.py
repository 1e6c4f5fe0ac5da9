"""`StructuredSparsity`: pruning in `fit`, schedules, save/load, resume."""

import keras
import numpy as np
import pytest

from keras_mp._models import walk_layers
from keras_mp.sparsity import (
    StructuredSparsity,
    is_2_4_sparse,
    permute_for_sparsity,
    sparse_layers,
    sparsity_report,
    strip_sparsity,
)
from tests.quantization.test_nested import Net
from tests.sparsity.conftest import (
    assert_sparse,
    compile_model,
    data,
    layer_masks,
    sparse_model,
)

L = keras.layers


def test_masks_hold_with_steps_per_execution_and_xla():
    x, y = data()
    model = compile_model(
        sparse_model(), jit_compile=True, steps_per_execution=4
    )
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # dense first
    callback = StructuredSparsity()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    first = layer_masks(model)
    before = {k: v[1].copy() for k, v in first.items()}
    # Fit again without the callback: the constraint alone keeps the masks.
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert_sparse(model)
    for name, (mask, kernel, _) in layer_masks(model).items():
        assert np.array_equal(mask, first[name][0])
        assert not np.allclose(kernel, before[name])  # it did train
    assert [r.name for r in callback.report.rows if not r.eligible] == ["dw"]


def test_existing_constraint_is_kept_and_composed():
    x, y = data()
    model = sparse_model()
    model.get_layer("fc").kernel.constraint = keras.constraints.MaxNorm(0.5)
    model.get_layer("fc").kernel_constraint = model.get_layer(
        "fc"
    ).kernel.constraint
    compile_model(model).fit(
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
    x, y = data()
    model = compile_model(sparse_model())
    model.fit(x, y, epochs=1, verbose=0, callbacks=[StructuredSparsity()])
    path = str(tmp_path / "sparse.keras")
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    before, after = layer_masks(model), layer_masks(loaded)
    assert sorted(before) == sorted(after)
    for name in before:
        assert np.array_equal(before[name][0], after[name][0])
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )
    # The loaded model enforces the masks by itself.
    loaded.fit(x, y, epochs=1, verbose=0)
    assert_sparse(loaded)
    for name, (mask, _, _) in layer_masks(loaded).items():
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
    x, y = data()
    backup = str(tmp_path / "backup")

    def callbacks(*extra):
        pair = [StructuredSparsity(), keras.callbacks.BackupAndRestore(backup)]
        return (pair if sparsity_first else pair[::-1]) + list(extra)

    model = compile_model(sparse_model())
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(
            x,
            y,
            batch_size=16,
            epochs=3,
            verbose=0,
            callbacks=callbacks(_Interrupt(1, 2)),
        )
    saved = {k: v[0] for k, v in layer_masks(model).items()}
    keras.utils.set_random_seed(123)  # new weights: new masks if recomputed
    resumed = compile_model(sparse_model())
    history = resumed.fit(
        x, y, batch_size=16, epochs=3, verbose=0, callbacks=callbacks()
    )
    assert len(history.history["loss"]) == 2  # resumed at epoch 1
    assert_sparse(resumed)
    for name, (mask, _, _) in layer_masks(resumed).items():
        assert np.array_equal(mask, saved[name]), name


def test_mirrored_strategy_gives_identical_masks(mirrored_strategy):
    x, y = data()
    reference = compile_model(sparse_model())
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
        model = compile_model(sparse_model())
    model.set_weights(weights)
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        verbose=0,
        callbacks=[StructuredSparsity()],
    )
    assert_sparse(model)
    expected = layer_masks(reference)
    for layer, kernel, constraint in sparse_layers(model):
        replicas = mirrored_strategy.experimental_local_results(
            constraint.mask.value
        )
        assert len(replicas) == 2
        for value in replicas:
            np.testing.assert_array_equal(value, expected[layer.name][0])
        kernels = mirrored_strategy.experimental_local_results(kernel.value)
        np.testing.assert_array_equal(kernels[0], kernels[1])


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
    x, y = data()
    model = compile_model(sparse_model())
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            c = sparse_layers(self.model)[0][2]
            seen.append(int(c.kept))

    model.fit(
        x, y, batch_size=8, epochs=2, verbose=0, callbacks=[callback, Record()]
    )
    assert seen[:3] == [4, 4, 4] and 3 in seen and seen[-1] == 2
    assert_sparse(model)


def test_pad_prunes_first_conv_on_rgb():
    x, y = data(shape=(8, 8, 3))
    model = compile_model(sparse_model(input_shape=(8, 8, 3)))
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


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"m": 4}, r"0 < m < n, e.g. m=2, n=4. Received: m=4, n=4"),
        ({"m": 2, "n": 0}, "positive integer"),
        (
            {"schedule": "linear"},
            r"one of \('one_shot', 'gradual'\). Received: schedule='linear'",
        ),
        (
            {"schedule": "gradual"},
            "needs an integer `end_step` greater than `begin_step`. "
            "Received: begin_step=0, end_step=None",
        ),
        (
            {"end_step": 5},
            "`end_step` only applies to schedule='gradual'; one_shot prunes "
            "at `begin_step`. Received: end_step=5",
        ),
        (
            {"begin_step": -1},
            "`begin_step` must be an integer >= 0. Received: begin_step=-1",
        ),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredSparsity(**kwargs)


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
    compile_model(model).fit(x, y, epochs=1, verbose=0, callbacks=[sparsity])
    assert sorted(layer_masks(model)) == ["aligned", "fc"]
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
    compile_model(model).fit(
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


def test_nothing_prunable_is_an_error_with_each_reason():
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            L.Conv2D(6, 3, name="gray"),
            L.GlobalAveragePooling2D(),
            L.Dense(3, name="head"),
        ],
        name="gray_model",
    )
    model.compile("sgd", "mse")
    with pytest.raises(
        ValueError,
        match=r"no layer of model 'gray_model' that can be pruned to 2:4, so "
        r"`fit` would train it dense. Skipped: gray: 1 input channels, not a "
        r"multiple of 4 \(pass pad=True to zero-pad\); head: 6 input "
        r"channels",
    ):
        model.fit(
            np.ones((4, 8, 8, 1), "float32"),
            np.ones((4, 3), "float32"),
            epochs=1,
            verbose=0,
            callbacks=[StructuredSparsity()],
        )


def _nested_masks(model):
    return {
        layer.name: keras.ops.convert_to_numpy(c.mask)
        for layer, _, c in sparse_layers(model)
    }


def test_custom_layer_and_subclassed_model_masks_and_reload(tmp_path):
    """The callback reaches the Dense inside a custom layer and in a
    subclassed model; saved without a `RecordedModel` around it, their masks
    are not in the .keras file (their parent rebuilds them) and it says so,
    naming the fix; attaching the callback to the reloaded model gives the
    same masks back (restored from the kernels' zeros)."""
    model = Net(name="net")
    x, y = (
        np.random.default_rng(0).normal(size=(32, 8)).astype("float32"),
        (np.arange(32) % 3),
    )
    model(x[:1])
    compile_model(model)
    with pytest.warns(
        UserWarning,
        match=r"keeps the zeros.*not their SparsityMask.*: dense.*RecordedMod",
    ):
        model.fit(
            x,
            y,
            epochs=1,
            batch_size=16,
            verbose=0,
            callbacks=[StructuredSparsity()],
        )
    masks = _nested_masks(model)
    assert len(masks) == 3
    path = tmp_path / "net.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    np.testing.assert_array_equal(loaded(x), model(x))
    assert not sparse_layers(loaded)  # the masks did not come back
    loaded.compile(keras.optimizers.SGD(), "mse")
    again = StructuredSparsity()
    with pytest.warns(UserWarning, match="not their SparsityMask"):
        again.set_model(loaded)
    again.on_train_batch_begin(0)  # what `fit` does first: prune
    regained = _nested_masks(loaded)
    # in walk order: the reloaded layers' auto-generated names (dense_9,
    # dense_10, ...) need not sort like the originals'
    assert [m.tolist() for m in regained.values()] == [
        m.tolist() for m in masks.values()
    ]
    stripped = strip_sparsity(loaded)
    np.testing.assert_array_equal(stripped(x), loaded(x))
    assert not sparse_layers(stripped)


@pytest.mark.slow
def test_keras_hub_bert_and_vit_every_dense_pruned():
    keras_hub = pytest.importorskip("keras_hub")
    from tests.quantization.test_keras_hub import (
        bert_classifier,
        images,
        tokens,
        vit,
    )

    for model, inputs in ((bert_classifier(), tokens()), (vit(), images())):
        out = keras.ops.convert_to_numpy(model(inputs))
        rows = permute_for_sparsity(model)  # before pruning, as documented
        model.compile("adam", "mse")
        with pytest.warns(UserWarning, match="not their SparsityMask"):
            model.fit(
                inputs,
                np.zeros_like(out),
                epochs=1,
                batch_size=16,
                verbose=0,
                callbacks=[StructuredSparsity()],
            )
        dense = [
            x
            for x in walk_layers(model)
            if isinstance(x, (L.Dense, L.EinsumDense))
        ]
        assert {id(x) for x, _, _ in sparse_layers(model)} >= {
            id(x) for x in dense if x.name != "head"
        }, keras_hub.__name__
        assert not any(r.permuted for r in rows)
        assert len(rows) >= len(dense)
