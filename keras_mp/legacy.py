"""Classes only files saved by earlier keras_mp releases need.

Each is still registered with Keras, so `keras.saving.load_model` reads
an old file as it was written; `keras_mp.upgrade(model)` turns such a
model into today's form (a `keras_mp.RecordedModel` with the same
placement and outputs). Constructing one outside Keras loading raises a
`TypeError` naming what to use instead: `keras_mp.quantize_model`,
`keras_mp.RecordedModel`, `keras_mp.fixed_point_model`. Code that writes
a file the way an earlier release did (a test of `upgrade`) builds them
inside `with keras_mp.legacy.loading():`. `PrecisionState` is the MuPPET
switching state a fixed-point model owns (read it with
`keras_mp.muppet.precision_state(model)`).

Example:

>>> old = keras.saving.load_model("old_release.keras", safe_mode=True)
>>> model = keras_mp.upgrade(old)
"""

from keras_mp._load_only import loading as loading  # re-exported
from keras_mp.muppet.layers import (
    FixedPointInput,
    FixedPointWrapper,
    PrecisionState,
)
from keras_mp.quantization.legacy import QuantizeAnnotate, QuantizeWrapper
from keras_mp.quantization.record import QuantizedModel
from keras_mp.sparsity.saving import SparseModel

__all__ = [
    "FixedPointInput",
    "FixedPointWrapper",
    "PrecisionState",
    "QuantizeAnnotate",
    "QuantizeWrapper",
    "QuantizedModel",
    "SparseModel",
]
