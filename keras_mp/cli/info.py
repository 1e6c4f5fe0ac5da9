"""What this machine runs: versions, devices, supported policies."""

import importlib
import platform

import keras

import keras_mp
from keras_mp.mixed_precision.policy import resolve_auto_policy


def _version(module):
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return "not installed"


def supported_policies():
    """Policies that run here, and which one `"auto"` picks (with why)."""
    auto, reason = resolve_auto_policy()
    return {
        "runs": ["float32", "mixed_float16", "mixed_bfloat16"],
        "auto": auto,
        "reason": reason,
    }


def environment_info():
    """Versions of keras_mp and its stack, devices, precision support."""
    import tensorflow as tf

    devices = [
        f"{d.device_type}:{d.name.split(':')[-1]}"
        for d in tf.config.list_physical_devices()
    ]
    policies = supported_policies()
    return {
        "keras_mp": keras_mp.__version__,
        "keras": _version("keras"),
        # keras_mp's training and export entry points need "tensorflow".
        "keras backend": keras.config.backend(),
        "tensorflow": tf.__version__,
        "tf2onnx": _version("tf2onnx"),
        "onnx": _version("onnx"),
        "onnxruntime": _version("onnxruntime"),
        "python": platform.python_version(),
        "devices": ", ".join(devices),
        "policies that run": ", ".join(policies["runs"]),
        "auto policy": f"{policies['auto']} ({policies['reason']})",
    }


def info_command_parser(subparsers):
    parser = subparsers.add_parser(
        "info", help="versions, devices and supported precision policies"
    )
    parser.set_defaults(func=info_command)


def info_command(args):
    for key, value in environment_info().items():
        print(f"{key:>22}: {value}")
    return 0
