"""`keras-mp compare`: a `.keras` model against its ONNX export, by layer."""

from keras_mp.cli._files import load_inputs, load_keras_model


def compare_command_parser(subparsers):
    parser = subparsers.add_parser(
        "compare",
        help="compare a .keras model with its ONNX export layer by layer",
    )
    parser.add_argument("model", help="a .keras file")
    parser.add_argument("onnx", help="the .onnx file exported from it")
    parser.add_argument(
        "--data",
        required=True,
        help="a .npy of inputs, or a .npz of arrays named after the "
        "model's inputs",
    )
    parser.add_argument("--plot", help="write the error by depth to this PNG")
    parser.add_argument(
        "--samples", type=int, default=None, help="compare on N inputs only"
    )
    parser.set_defaults(func=compare_command)


def compare_command(args):
    import keras_mp

    if args.samples is not None and args.samples < 1:
        raise ValueError(f"--samples must be >= 1. Received: {args.samples}")
    data = load_inputs(args.data)
    model = load_keras_model(args.model)
    report = keras_mp.compare_onnx(model, args.onnx, data, samples=args.samples)
    print(report)
    if args.plot:
        print(f"Plot written to {report.plot(args.plot)}")
    return 0 if report.first_divergence is None else 1
