"""Mixed-precision training: policies, the alignment audit, TF32, loss
scaling. Guide: `docs/mixed-precision.md`."""

from keras_mp.mixed_precision.audit import AuditReport, mixed_precision_audit
from keras_mp.mixed_precision.loss_scale import (
    LossScaleMonitor,
    LossScaleOptimizer,
)
from keras_mp.mixed_precision.policy import (
    apply_mixed_precision,
    enable_mixed_precision,
    is_precision_sensitive,
    set_tf32,
)
