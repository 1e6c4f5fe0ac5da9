"""Per-layer precision choice (INT8 / FP8 / FP16) for TensorRT GPUs:
`layer_sensitivity` scores each layer, `auto_quantize` chooses under an
accuracy budget with the cost model of `cost.py`. Guide:
`docs/precision.md`."""

from keras_mp.precision.cost import (
    GPU,
    GPUS,
    LayerWork,
    check_precisions,
    effective_bits,
    gpu_spec,
    latency,
    layer_work,
)
from keras_mp.precision.metrics import threshold_accuracy, top1_accuracy
from keras_mp.precision.reports import (
    AutoQuantizeReport,
    Choice,
    SensitivityReport,
    SensitivityRow,
)
from keras_mp.precision.search import auto_quantize
from keras_mp.precision.sensitivity import layer_sensitivity
