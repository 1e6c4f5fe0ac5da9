"""The GPU cost model of a MuPPET run."""

import pytest

from keras_mp.muppet import GPU_THROUGHPUT, estimate_speedup, precision_unit


def test_cost_model_hand_computed():
    # RTX 2080 Ti, 60% compute: INT8 0.4 + 0.6*13.4/215.2, FP16
    # 0.4 + 0.6*13.4/53.8, FP32 1.
    est = estimate_speedup([8, 8, 16, None])
    int8, fp16 = 0.4 + 0.6 * 13.4 / 215.2, 0.4 + 0.6 * 13.4 / 53.8
    assert est["speedup"] == pytest.approx(4 / (2 * int8 + fp16 + 1))
    assert est["epochs_per_precision"] == {8: 2, 16: 1, 32: 1}
    assert estimate_speedup([32, None])["speedup"] == 1.0


def test_word_lengths_map_to_gpu_units():
    units = [precision_unit(b) for b in (None, 4, 5, 8, 9, 16, 17, 32)]
    assert (
        units
        == ["float32", "int4", "int8", "int8"]
        + ["float16"] * 2
        + ["float32"] * 2
    )


def test_a_gpu_row_with_the_old_keys_warns_and_prices_the_same(monkeypatch):
    old = {
        ("fp32" if k == "float32" else "fp16" if k == "float16" else k): v
        for k, v in GPU_THROUGHPUT["t4"].items()
    }
    monkeypatch.setitem(GPU_THROUGHPUT, "old_t4", old)
    with pytest.warns(DeprecationWarning, match="use 'float32'"):
        got = estimate_speedup([8, 16, None], gpu="old_t4")
    assert got == estimate_speedup([8, 16, None], gpu="t4")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"precisions": [8], "gpu": "cpu"},
            r"Unknown `gpu`: 'cpu'. Choose one of \['rtx2080ti', 't4'\]",
        ),
        ({"precisions": []}, "needs at least one epoch"),
        (
            {"precisions": [8], "compute_fraction": 2},
            r"`compute_fraction` must be in \[0, 1\]. Received: "
            "compute_fraction=2",
        ),
        (
            {"precisions": [40]},
            r"2\.\.32, or None for float32. Received: word_length=40",
        ),
    ],
)
def test_bad_arguments_say_what_to_do(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_speedup(**kwargs)
