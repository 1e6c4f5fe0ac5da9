"""`keras-mp` command line: a thin argparse front end over the public API.

One `<name>_command_parser` / `<name>_command` pair per subcommand; the
commands parse arguments and call public functions, nothing more.
"""

import argparse
import sys


def info_command_parser(subparsers):
    parser = subparsers.add_parser(
        "info", help="versions, devices and supported precision policies"
    )
    parser.set_defaults(func=info_command)


def info_command(args):
    from keras_mp.cli.info import environment_info

    for key, value in environment_info().items():
        print(f"{key:>22}: {value}")
    return 0


def demo_command_parser(subparsers):
    parser = subparsers.add_parser(
        "demo", help="the end-to-end pipeline on Fashion-MNIST"
    )
    parser.add_argument("--output", default="demo-report", help="report folder")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="about 90 s on 2 CPU cores: 6,000 images",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing report in --output",
    )
    parser.set_defaults(func=demo_command)


def demo_command(args):
    from keras_mp.cli.demo import run_demo

    run_demo(output=args.output, quick=args.quick, overwrite=args.overwrite)
    return 0


def export_command_parser(subparsers):
    parser = subparsers.add_parser(
        "export", help="export a .keras model to Q/DQ ONNX or SavedModel"
    )
    parser.add_argument("model", help="a .keras file")
    parser.add_argument("--onnx", help="write this .onnx file")
    parser.add_argument("--saved-model", help="write this SavedModel folder")
    parser.add_argument(
        "--calibrate", help="a .npy of inputs: quantize and calibrate first"
    )
    parser.add_argument(
        "--method", default="max", help="calibrator (max, percentile, ...)"
    )
    parser.add_argument(
        "--verify",
        help="a .npy of inputs for the parity check (default: the "
        "--calibrate data)",
    )
    parser.add_argument(
        "--opset",
        type=int,
        default=None,
        help="ONNX opset (17; 19 with --fp16)",
    )
    parser.add_argument(
        "--fp16",
        action="store_true",
        help="float16 outside the INT8 layers, for strongly typed TensorRT",
    )
    parser.add_argument("--overwrite", action="store_true")
    parser.set_defaults(func=export_command)


def _load_npy(path):
    import numpy as np

    try:
        return np.load(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"Could not read {path} as a .npy array: {e}") from e


def export_command(args):
    import keras

    import keras_mp

    if not (args.onnx or args.saved_model):
        raise ValueError(
            "Nothing to do: pass --onnx OUT.onnx and/or --saved-model DIR."
        )
    try:
        model = keras.saving.load_model(args.model, safe_mode=True)
    except Exception as e:  # a damaged file fails anywhere in Keras
        raise ValueError(
            f"Could not load {args.model} as a Keras model "
            f"({type(e).__name__}: {e})"
        ) from e
    if args.calibrate:
        model = keras_mp.quantize_model(model)
        print(
            keras_mp.calibrate(
                model, _load_npy(args.calibrate), method=args.method
            )
        )
    verify = (
        _load_npy(args.verify or args.calibrate)
        if (args.verify or args.calibrate)
        else None
    )
    if args.onnx:
        report = keras_mp.export_onnx(
            model,
            args.onnx,
            opset=args.opset,
            verify_data=verify,
            overwrite=args.overwrite,
            fp16=args.fp16,
        )
        if report is not None:
            print(report)
        else:
            print(
                "No parity check: pass --verify DATA.npy (or --calibrate) to "
                "compare ONNX Runtime with Keras."
            )
        lint = keras_mp.check_tensorrt(args.onnx)
        print(lint)
        print("TensorRT build:", keras_mp.trtexec_command(args.onnx, lint))
    if args.saved_model:
        keras_mp.export_saved_model(
            model,
            args.saved_model,
            overwrite=args.overwrite,
            verify_data=verify,
        )
        print(f"SavedModel written to {args.saved_model}")
    return 0


def lint_command_parser(subparsers):
    parser = subparsers.add_parser(
        "lint", help="check an ONNX file against TensorRT's Q/DQ rules"
    )
    parser.add_argument("onnx", help="an .onnx file")
    parser.set_defaults(func=lint_command)


def lint_command(args):
    from keras_mp.onnx.tensorrt import check_tensorrt

    report = check_tensorrt(args.onnx)
    print(report)
    return 0 if report.ok else 1


_PARSERS = (
    info_command_parser,
    demo_command_parser,
    export_command_parser,
    lint_command_parser,
)


def build_parser():
    parser = argparse.ArgumentParser(
        prog="keras-mp",
        description="Mixed precision, INT8 quantization, 2:4 sparsity and "
        "TensorRT-ready ONNX export for Keras 3 models.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in _PARSERS:
        add(subparsers)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError, ImportError) as e:
        print(f"keras-mp {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
