"""`keras-mp` command line: a thin argparse front end over the public API.

One module per subcommand, each with a `<name>_command_parser` /
`<name>_command` pair; the commands parse arguments and call public
functions, nothing more.
"""

import argparse
import sys

from keras_mp.cli.compare import compare_command_parser
from keras_mp.cli.demo import demo_command_parser
from keras_mp.cli.export import export_command_parser
from keras_mp.cli.info import info_command_parser
from keras_mp.cli.lint import lint_command_parser
from keras_mp.cli.sensitivity import sensitivity_command_parser

_PARSERS = (
    info_command_parser,
    demo_command_parser,
    export_command_parser,
    lint_command_parser,
    compare_command_parser,
    sensitivity_command_parser,
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
