"""`StructuredSparsity` restores a mask from the zeros of a kernel that lost
it: a bare `.keras` reload of nested layers, `load_weights` before the
callback attached."""

import warnings

import keras
import numpy as np
import pytest

from keras_mp.sparsity import (
    StructuredSparsity,
    magnitude_mask,
    sparse_layers,
    sparsity_report,
)
from tests.quantization.test_nested import Net
from tests.sparsity.conftest import compile_model
from tests.sparsity.test_saving import _block_model, _data

L = keras.layers
# 32 samples in batches of 8: 4 steps an epoch. The gradual schedule prunes
# to 3:4 at step 3 (epoch 1) and to 2:4 at step 6 (epoch 2).
SCHEDULE = {"schedule": "gradual", "end_step": 6}
# The re-prune and the relaxed-mask warnings.
NEW_WARNINGS = r"StructuredSparsity: (model '\w+' is )?at step"


def _fit(model, epoch, callback):
    x, y = _data()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "StructuredSparsity: saved as")
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=epoch + 1,
            initial_epoch=epoch,
            shuffle=False,
            verbose=0,
            callbacks=[callback],
        )


def _masks(model):
    """Per masked kernel, in walk order: (mask, kept, kept_magnitude)."""
    return [
        (
            keras.ops.convert_to_numpy(c.mask),
            int(c.kept),
            float(c.kept_magnitude),
        )
        for _, _, c in sparse_layers(model)
    ]


def _assert_same_masks(got, want):
    assert len(got) == len(want) == 3
    for (mask, kept, _), (mask_0, kept_0, _) in zip(got, want):
        np.testing.assert_array_equal(mask, mask_0)
        assert kept == kept_0


def _reload(make, path, how):
    if how == "keras":
        return keras.saving.load_model(path + ".keras", safe_mode=True)
    model = compile_model(make())
    model(_data()[0][:1])
    # Keras loads the optimizer's state only into a built optimizer.
    model.optimizer.build(model.trainable_variables)
    model.load_weights(path + ".weights.h5")
    return model


@pytest.mark.parametrize(
    "make, how",
    [(_block_model, ("keras", "weights")), (Net, ("weights", "keras"))],
    ids=["custom", "sub"],
)
def test_resume_from_bare_save_or_weights_continues_bit_for_bit(
    make, how, tmp_path
):
    """Saved mid-schedule (3:4) and after it (2:4), one by a bare
    `model.save`, the other by `save_weights` loaded into a rebuilt model
    before the callback attaches (each model both ways round): the callback
    gives back the saved masks and `kept` when it attaches, and the run
    continues with the masks, `kept` and weights of the uninterrupted run,
    bit for bit (same optimizer state, unshuffled data). `kept_magnitude`
    of a restored mask cannot come back (the dense kernel it is a share of
    is gone): it is NaN, shown as unknown in the report."""
    x, _ = _data()
    model = compile_model(make())
    model(x[:1])
    callback = StructuredSparsity(**SCHEDULE)
    saved = []
    for epoch in range(3):
        _fit(model, epoch, callback)
        if epoch < 2:
            path = str(tmp_path / f"e{epoch}")
            if how[epoch] == "keras":
                model.save(path + ".keras")
            else:
                model.save_weights(path + ".weights.h5")
            saved.append((epoch + 1, path, _masks(model)))
    assert [kept for _, kept, _ in saved[0][2]] == [3, 3, 3]
    assert [kept for _, kept, _ in saved[1][2]] == [2, 2, 2]
    final, weights = _masks(model), model.get_weights()
    for (epoch, path, at_save), way in zip(saved, how):
        resumed = _reload(make, path, way)
        # Only the layers of the Functional graph keep their masks.
        kept_before = {layer.name for layer, _, _ in sparse_layers(resumed)}
        assert kept_before == (
            {"stem", "head"}
            if way == "keras" and make is _block_model
            else set()
        )
        again = StructuredSparsity(**SCHEDULE)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "StructuredSparsity: saved")
            again.set_model(resumed)
        _assert_same_masks(_masks(resumed), at_save)
        for layer, _, c in sparse_layers(resumed):
            assert np.isnan(c.kept_magnitude) != (layer.name in kept_before)
        unknown = [r.kept_magnitude is None for r in again.report.rows]
        assert sum(unknown) == 3 - len(kept_before)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", NEW_WARNINGS)
            for e in range(epoch, 3):
                _fit(resumed, e, again)
        _assert_same_masks(_masks(resumed), final)
        for have, want in zip(resumed.get_weights(), weights):
            np.testing.assert_array_equal(have, want)


def test_restored_mask_follows_the_tie_rule_and_dense_kernels_stay_dense():
    """More zeros than the level (dead weights): the mask keeps every
    non-zero and the lowest-index zeros, the rule of `magnitude_mask`; with
    `pad`, the short group counts its real channels only. A dense kernel,
    or an all-zero one (an initializer, not a prune), gets the ordinary
    dense mask; so does a kernel before `begin_step`."""
    inputs = keras.Input((6,))
    model = keras.Model(inputs, L.Dense(2, name="fc")(inputs))
    kernel = np.array(
        [[0, 0], [0, 5], [0, 0], [3, 0], [0, 0], [0, 2]], "float32"
    )
    model.get_layer("fc").kernel.assign(kernel)
    StructuredSparsity(pad=True).set_model(model)
    ((mask, kept, magnitude),) = _masks(model)
    want = np.array([[1, 1], [0, 1], [0, 0], [1, 0], [1, 1], [1, 1]])
    np.testing.assert_array_equal(mask, want)
    np.testing.assert_array_equal(
        mask, magnitude_mask(kernel, 0, 2, 4, pad=True)
    )
    assert kept == 2 and np.isnan(magnitude)
    row = sparsity_report(model, pad=True).rows[0]
    assert row.masked and row.kept_magnitude is None
    assert "-" in str(sparsity_report(model, pad=True)).splitlines()[2]

    dense = keras.Sequential(
        [keras.Input((8,)), L.Dense(4), L.Dense(4, kernel_initializer="zeros")]
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "StructuredSparsity")
        StructuredSparsity().set_model(dense)
    for mask, kept, magnitude in _masks(dense):
        assert np.all(mask == 1) and kept == 4 and magnitude == 1.0


def test_dense_weights_past_the_schedule_warn_once_and_prune_again():
    """Dense weights in a model whose optimizer is past `end_step` (as
    `load_weights` of a dense checkpoint into it leaves it): pruned again
    from magnitudes at the next batch, which the callback says once. A
    pruned kernel at a step where the schedule keeps it dense (an optimizer
    whose step was not restored) keeps its mask (pruning never loosens
    one), and that is said too."""
    model = compile_model(_block_model())
    model.optimizer.build(model.trainable_variables)
    model.optimizer.iterations.assign(8)  # past end_step=6
    dense = model.get_layer("head").kernel.numpy()
    callback = StructuredSparsity(**SCHEDULE)
    with pytest.warns(UserWarning, match=r"at step 8.*: stem, .*, head\."):
        callback.set_model(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", NEW_WARNINGS)
        callback.on_train_batch_begin(0)
        StructuredSparsity().set_model(model)  # masks reused: no warning
    masks = {layer.name: c for layer, _, c in sparse_layers(model)}
    np.testing.assert_array_equal(
        masks["head"].mask.numpy(), magnitude_mask(dense, 0)
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", NEW_WARNINGS)  # the default: none
        StructuredSparsity().set_model(compile_model(_block_model()))

    pruned = compile_model(_block_model())  # a fresh optimizer: step 0
    for layer in (pruned.get_layer("stem"), pruned.get_layer("head")):
        w = layer.kernel.numpy()
        layer.kernel.assign(w * magnitude_mask(w, 0))
    again = StructuredSparsity(**SCHEDULE, layers=["stem", "head"])
    again.set_model(pruned)
    assert [kept for _, kept, _ in _masks(pruned)] == [2, 2]
    with pytest.warns(UserWarning, match="keeps 4 of 4.*: stem/kernel, head"):
        again.on_train_batch_begin(0)
    assert [kept for _, kept, _ in _masks(pruned)] == [2, 2]
