"""MuPPET: multi-precision fixed-point training with precision switching.

`fixed_point_model` makes the fixed-point copy of a model, the
`PrecisionSwitching` callback moves it up the word-length schedule during
`fit`, and `estimate_speedup` prices a run with the GPU cost model. Guide:
`docs/muppet.md`.
"""

from keras_mp import _record
from keras_mp.muppet.callback import PrecisionSwitching
from keras_mp.muppet.cost import (
    GPU_THROUGHPUT,
    estimate_speedup,
    precision_unit,
)
from keras_mp.muppet.layers import (
    FixedPointInput,
    FixedPointWrapper,
    PrecisionState,
)
from keras_mp.muppet.legacy import upgrade_fixed_point as _upgrade_fixed_point
from keras_mp.muppet.model import (
    fixed_point_layers,
    fixed_point_model,
    precision_state,
    set_word_length,
)
from keras_mp.muppet.plot import plot_precision
from keras_mp.muppet.policy import (
    DEFAULT_SCHEDULE,
    SwitchingPolicy,
    gradient_diversity,
    switching_threshold,
)
from keras_mp.muppet.quantizer import fixed_point_quantize
from keras_mp.muppet.record import (
    apply_fixed_point_record,
    fixed_point_record,
)
from keras_mp.muppet.twins import (
    FixedPointLayer,
    FixedPointState,
    fixed_point_twin_class,
    is_fixed_point,
)


def upgrade_fixed_point(model):
    """Deprecated: `keras_mp.upgrade(model)` upgrades every legacy file
    kind, MuPPET's `FixedPointWrapper` models included (one name per
    job). Warns, then does what it did.

    Example:

    >>> model = keras_mp.upgrade(old)  # not upgrade_fixed_point(old)
    """
    import warnings

    warnings.warn(
        "`keras_mp.muppet.upgrade_fixed_point` is deprecated: use "
        "`keras_mp.upgrade(model)`, which upgrades every legacy file kind. "
        "It will be removed in the next release.",
        DeprecationWarning,
        stacklevel=2,
    )
    return _upgrade_fixed_point(model)


_record.register_section(
    "muppet", fixed_point_record, apply_fixed_point_record, order=30
)
