"""`keras-mp compare`: a `.keras` model against its ONNX export, by layer."""


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


def _load_data(path):
    import numpy as np

    try:
        data = np.load(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"Could not read {path} as .npy or .npz: {e}") from e
    if isinstance(data, np.ndarray):
        return data
    with data:
        arrays = {k: data[k] for k in data.files}
    return next(iter(arrays.values())) if len(arrays) == 1 else arrays


def compare_command(args):
    import keras

    import keras_mp

    if args.samples is not None and args.samples < 1:
        raise ValueError(f"--samples must be >= 1. Received: {args.samples}")
    data = _load_data(args.data)
    try:
        model = keras.saving.load_model(args.model, safe_mode=True)
    except Exception as e:  # a damaged file fails anywhere in Keras
        raise ValueError(
            f"Could not load {args.model} as a Keras model "
            f"({type(e).__name__}: {e})"
        ) from e
    report = keras_mp.compare_onnx(model, args.onnx, data, samples=args.samples)
    print(report)
    if args.plot:
        print(f"Plot written to {report.plot(args.plot)}")
    return 0 if report.first_divergence is None else 1
