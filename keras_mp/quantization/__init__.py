"""INT8 fake quantization the way TensorRT wants it.

Annotate -> apply -> calibrate (PTQ) and/or `fit` (QAT) -> strip: the
quantizer (`TensorQuantizer`, its number format a row of `FORMATS`), the
quantize layers, their configuration, the calibrators and the report; any
Keras 3 model, layers at any depth (`attach.py`).
Guide: `docs/quantization.md`.
"""

# The modules renamed to say what they hold (issue #37): the old import
# paths still work for one release, with a DeprecationWarning naming the
# new one (`docs/migration.md`, "Module names").
from keras_mp._moved import alias_modules as _alias_modules
from keras_mp.quantization.activation import QuantizeActivation
from keras_mp.quantization.calibrate import (
    CalibrationReport,
    activation_quantizers,
    calibrate,
)
from keras_mp.quantization.config import QuantizeConfig
from keras_mp.quantization.formats import FORMATS, NumberFormat, number_format
from keras_mp.quantization.legacy import QuantizeAnnotate, QuantizeWrapper
from keras_mp.quantization.packed import pack_weights
from keras_mp.quantization.quantize import (
    quantize_annotate_layer,
    quantize_annotate_model,
    quantize_apply,
    quantize_model,
)
from keras_mp.quantization.recipe import register_twin
from keras_mp.quantization.record import QuantizedModel
from keras_mp.quantization.report import (
    QuantizationReport,
    quantization_report,
)
from keras_mp.quantization.strip import strip_quantization
from keras_mp.quantization.tensor_quantizer import TensorQuantizer
from keras_mp.quantization.twins import (
    QuantizedLayer,
    set_quantization_enabled,
)
from keras_mp.quantization.upgrade import upgrade

_alias_modules(
    __name__,
    {
        "annotate": "quantize",
        "inplace": "attach",
        "model": "record",
        "quantizer": "tensor_quantizer",
        "quantizers": "fake_quant",
        "layers": "activation",
        "block_calibrate": "calibrate_weights",
        "weight_calibration": "kernel_calibration",
    },
)
