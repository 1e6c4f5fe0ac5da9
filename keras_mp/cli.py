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
    from keras_mp.info import environment_info

    for key, value in environment_info().items():
        print(f"{key:>22}: {value}")
    return 0


def demo_command_parser(subparsers):
    parser = subparsers.add_parser(
        "demo", help="the end-to-end pipeline on Fashion-MNIST"
    )
    parser.add_argument("--output", default="demo-report", help="report folder")
    parser.add_argument(
        "--quick", action="store_true", help="about a minute: fewer images"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing report in --output",
    )
    parser.set_defaults(func=demo_command)


def demo_command(args):
    from keras_mp.demo import run_demo

    run_demo(output=args.output, quick=args.quick, overwrite=args.overwrite)
    return 0


_PARSERS = (info_command_parser, demo_command_parser)


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
