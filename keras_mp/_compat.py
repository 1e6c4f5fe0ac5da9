"""Import-time checks and lazy imports of optional dependencies."""

import importlib

_EXTRAS = {
    "tf2onnx": "onnx",
    "onnx": "onnx",
    "onnxruntime": "onnx",
    "matplotlib": "plot",
    "sklearn": "data",
}


def check_tensorflow():
    """Fails early, with the install command, when TensorFlow is unusable."""
    try:
        import tensorflow as tf
    except ImportError as e:
        raise ImportError(
            "keras_mp needs TensorFlow >= 2.16: `pip install keras-mp[cpu]` "
            "(tensorflow-cpu) or `pip install keras-mp[gpu]`."
        ) from e
    major, minor = (int(p) for p in tf.__version__.split(".")[:2])
    if (major, minor) < (2, 16):
        raise ImportError(
            f"keras_mp needs TensorFlow >= 2.16 (Keras 3). Found "
            f"{tf.__version__}: `pip install -U keras-mp[cpu]`."
        )
    import keras

    if int(keras.__version__.split(".")[0]) < 3:
        raise ImportError(
            f"keras_mp needs Keras 3. Found keras {keras.__version__}; if "
            "TF_USE_LEGACY_KERAS=1 is set (tfmot sets it), unset it."
        )


def optional_import(name):
    """Imports an optional dependency or says which extra installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        extra = _EXTRAS.get(name.split(".")[0], "all")
        raise ImportError(
            f"This feature needs `{name}`: `pip install keras-mp[{extra}]`."
        ) from e
