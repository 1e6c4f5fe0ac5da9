"""Tolerances for comparing a model's outputs with outputs saved elsewhere.

A result read back from a file (a range, a mask, a quantization code, a
weight) is the same on every CPU and is compared exactly. A result a model
*computes* is not: oneDNN and Eigen choose kernels, summation orders and
16-bit conversion paths by CPU, so a float16 model computes outputs one or
two float16 steps apart on two machines, and a float32 one a few float32
steps apart (measured on the fixtures with `TF_ENABLE_ONEDNN_OPTS=0`, which
changes kernels the way another CPU does: 0.55 float16 steps, 1.5 float32
steps at the output's scale).

So a saved output is compared within a tolerance derived from the dtype the
model computes in: `steps` rounding steps of that dtype at the output's
scale (its largest magnitude). A fake-quantized model also computes in
float32 but rounds to a grid: a float32 difference at a rounding boundary
moves one activation to the next code, so a few outputs may move by one
step of an 8-bit grid at the output's scale while the rest stay within the
float32 tolerance.
"""

import numpy as np

# Rounding steps allowed at the output's scale: a handful of roundings in
# each of a few layers, well below what a 1% change of one layer's weights
# gives (10 float16 steps on the loss-scaled fixture; test_fixtures.py
# checks that such a change fails). Whether a mixed-precision model still
# computes in float16 is checked on its layers' dtypes, not on its outputs:
# float32 and float16 compute differ by less than one float16 step there.
STEPS = {"float16": 4, "bfloat16": 4, "float32": 64}
# Outputs a code flip may move, as a share of all outputs.
FLIPPED_SHARE = 0.05


# Machine epsilon: one rounding step at 1.0.
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23}


def step(dtype, expected):
    """One rounding step of `dtype` at the scale of `expected`."""
    return EPS[dtype] * float(np.max(np.abs(expected)))


def assert_computes_like(actual, expected, dtype, quantized=False):
    """Asserts `actual` is `expected` recomputed in `dtype` on another CPU.

    Args:
        actual: the outputs computed now.
        expected: the outputs saved when the file was written.
        dtype: the dtype the model computes in (its compute dtype; the
            narrowest one for a mixed-precision model).
        quantized: the model fake-quantizes its activations on an 8-bit
            grid: up to `FLIPPED_SHARE` of the outputs may differ by one
            grid step at the output's scale (a code moved by a rounding
            difference upstream).
    """
    actual = np.asarray(actual, dtype="float64")
    expected = np.asarray(expected, dtype="float64")
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    atol = STEPS[dtype] * step(dtype, expected)
    off = np.abs(actual - expected) > atol
    if not quantized:
        np.testing.assert_allclose(
            actual,
            expected,
            rtol=0,
            atol=atol,
            err_msg=f"{STEPS[dtype]} {dtype} steps at the output's scale",
        )
        return
    grid = float(np.max(np.abs(expected))) / 127
    assert off.mean() <= FLIPPED_SHARE, (
        f"{off.sum()} of {off.size} outputs beyond {STEPS[dtype]} {dtype} "
        f"steps: more than a code flip explains"
    )
    np.testing.assert_allclose(
        actual,
        expected,
        rtol=0,
        atol=grid + atol,
        err_msg="one 8-bit step at the output's scale",
    )
