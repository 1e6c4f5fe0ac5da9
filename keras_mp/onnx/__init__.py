"""Export: SavedModel and Q/DQ ONNX, ONNX Runtime parity, the TensorRT
explicit-quantization lint. Guides: `docs/export.md`, `docs/tensorrt.md`."""

from keras_mp.onnx.compare import CompareReport, LayerError, compare_onnx
from keras_mp.onnx.errors import ExportError, ParityError
from keras_mp.onnx.export import export_onnx, export_saved_model
from keras_mp.onnx.islands import Float32Node, TypedGraph, typed_graph
from keras_mp.onnx.parity import ParityReport, verify_onnx
from keras_mp.onnx.rules import Finding
from keras_mp.onnx.tensorrt import LintReport, check_tensorrt
from keras_mp.onnx.trtexec import trtexec_command
