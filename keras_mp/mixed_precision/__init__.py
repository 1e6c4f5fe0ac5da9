"""Mixed-precision training: policies, the alignment audit, TF32, loss
scaling. Guide: `docs/mixed-precision.md`."""

from keras_mp.mixed_precision.loss_scale import (
    LossScaleMonitor,
    LossScaleOptimizer,
)
from keras_mp.mixed_precision.policy import (
    apply_mixed_precision,
    enable_mixed_precision,
    is_precision_sensitive,
    mixed_precision_audit,
    set_tf32,
)
