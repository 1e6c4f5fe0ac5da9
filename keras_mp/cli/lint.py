"""`keras-mp lint`: an ONNX file against TensorRT's Q/DQ rules."""

from keras_mp.onnx.tensorrt import check_tensorrt


def lint_command_parser(subparsers):
    parser = subparsers.add_parser(
        "lint", help="check an ONNX file against TensorRT's Q/DQ rules"
    )
    parser.add_argument("onnx", help="an .onnx file")
    parser.set_defaults(func=lint_command)


def lint_command(args):
    report = check_tensorrt(args.onnx)
    print(report)
    return 0 if report.ok else 1
