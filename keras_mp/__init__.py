"""keras_mp: from float32 Keras training to TensorRT-ready INT8.

Mixed precision, TensorRT-style INT8 quantization (PTQ and QAT), 2:4
structured sparsity, MuPPET multi-precision fixed-point training, and Q/DQ
ONNX export, all for Keras 3 models and `model.fit`.
"""

__version__ = "0.1.0"

import os as _os

# Quiet TensorFlow's C++ start-up and grappler logs unless the user chose a
# level (this only takes effect when keras_mp is imported before TF).
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from keras_mp._compat import check_tensorflow

check_tensorflow()

from keras_mp._keras import check_versions as _check_versions

_check_versions()

from keras_mp._record import RecordedModel
from keras_mp.datasets import (
    load_digits,
    load_fashion_mnist,
    load_images,
    shuffled_batches,
)
from keras_mp.mixed_precision import (
    LossScaleMonitor,
    LossScaleOptimizer,
    apply_mixed_precision,
    enable_mixed_precision,
    is_precision_sensitive,
    mixed_precision_audit,
    set_tf32,
)
from keras_mp.muppet import (
    FixedPointInput,
    FixedPointWrapper,
    PrecisionState,
    PrecisionSwitching,
    estimate_speedup,
    fixed_point_model,
    plot_precision,
)
from keras_mp.onnx import (
    ExportError,
    Finding,
    LintReport,
    ParityError,
    check_tensorrt,
    compare_onnx,
    export_onnx,
    export_saved_model,
    trtexec_command,
    typed_graph,
    verify_onnx,
)
from keras_mp.precision import (
    AutoQuantizeReport,
    SensitivityReport,
    auto_quantize,
    layer_sensitivity,
)
from keras_mp.quantization import (
    QuantizeActivation,
    QuantizeAnnotate,
    QuantizeConfig,
    QuantizedModel,
    QuantizeWrapper,
    calibrate,
    quantization_report,
    quantize_annotate_layer,
    quantize_annotate_model,
    quantize_apply,
    quantize_model,
    register_twin,
    set_quantization_enabled,
    strip_quantization,
    upgrade,
)
from keras_mp.sparsity import (
    SparseModel,
    StructuredSparsity,
    is_2_4_sparse,
    permute_for_sparsity,
    plot_sparsity,
    search_permutation,
    sparsity_report,
    strip_sparsity,
)
