"""Export: SavedModel and Q/DQ ONNX, ONNX Runtime parity, the TensorRT
explicit-quantization lint. Guides: `docs/export.md`, `docs/tensorrt.md`."""

from keras_mp.onnx.export import (
    ExportError,
    ParityError,
    export_onnx,
    export_saved_model,
    strip_quantization,
    verify_onnx,
)
from keras_mp.onnx.tensorrt import (
    Finding,
    LintReport,
    check_tensorrt,
    trtexec_command,
)
