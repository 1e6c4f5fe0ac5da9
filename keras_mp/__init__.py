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

from keras_mp._compat import check_tensorflow as _check_tensorflow

_check_tensorflow()

from keras_mp._keras import check_versions as _check_versions

_check_versions()

from keras_mp import datasets, legacy
from keras_mp._record import RecordedModel
from keras_mp.mixed_precision import (
    AuditReport,
    LossScaleMonitor,
    LossScaleOptimizer,
    apply_mixed_precision,
    enable_mixed_precision,
    is_precision_sensitive,
    mixed_precision_audit,
    set_tf32,
)
from keras_mp.muppet import (
    PrecisionSwitching,
    estimate_speedup,
    fixed_point_model,
    plot_precision,
)
from keras_mp.onnx import (
    CompareReport,
    ExportError,
    Finding,
    LintReport,
    ParityError,
    ParityReport,
    TypedGraph,
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
    CalibrationReport,
    QuantizationReport,
    QuantizeActivation,
    QuantizeConfig,
    calibrate,
    pack_weights,
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
    SparsityReport,
    StructuredSparsity,
    is_2_4_sparse,
    permute_for_sparsity,
    plot_sparsity,
    search_permutation,
    sparsity_report,
    strip_sparsity,
)

# The public API: what `from keras_mp import *` gives, and what the docs
# list (`tests/test_public_api.py` checks each has a docstring with an
# example). Subpackages (`keras_mp.quantization`, `keras_mp.onnx`, ...)
# hold the building blocks; `keras_mp.datasets` the demo's data and
# `keras_mp.legacy` the classes only old files need.
__all__ = [
    # mixed precision
    "AuditReport",
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "apply_mixed_precision",
    "enable_mixed_precision",
    "is_precision_sensitive",
    "mixed_precision_audit",
    "set_tf32",
    # quantization
    "CalibrationReport",
    "QuantizationReport",
    "QuantizeActivation",
    "QuantizeConfig",
    "RecordedModel",
    "calibrate",
    "pack_weights",
    "quantization_report",
    "quantize_annotate_layer",
    "quantize_annotate_model",
    "quantize_apply",
    "quantize_model",
    "register_twin",
    "set_quantization_enabled",
    "strip_quantization",
    "upgrade",
    # sparsity
    "SparsityReport",
    "StructuredSparsity",
    "is_2_4_sparse",
    "permute_for_sparsity",
    "plot_sparsity",
    "search_permutation",
    "sparsity_report",
    "strip_sparsity",
    # MuPPET
    "PrecisionSwitching",
    "estimate_speedup",
    "fixed_point_model",
    "plot_precision",
    # export and checks
    "CompareReport",
    "ExportError",
    "Finding",
    "LintReport",
    "ParityError",
    "ParityReport",
    "TypedGraph",
    "check_tensorrt",
    "compare_onnx",
    "export_onnx",
    "export_saved_model",
    "trtexec_command",
    "typed_graph",
    "verify_onnx",
    # precision choice
    "AutoQuantizeReport",
    "SensitivityReport",
    "auto_quantize",
    "layer_sensitivity",
]

# Names that left the top level, still served for one release with a
# DeprecationWarning naming their new home (`docs/migration.md`).
_MOVED = {
    **dict.fromkeys(legacy.__all__, "keras_mp.legacy"),
    **dict.fromkeys(
        (
            "load_digits",
            "load_fashion_mnist",
            "load_images",
            "shuffled_batches",
        ),
        "keras_mp.datasets",
    ),
    "check_tensorflow": "keras_mp._compat",
}


def __getattr__(name):
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'keras_mp' has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(
        f"`keras_mp.{name}` moved to `{home}.{name}`; the old name will be "
        "removed in the next release.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(home), name)


def __dir__():
    return sorted(set(globals()) - set(_MOVED))
