"""`keras-mp export`: a `.keras` file to Q/DQ ONNX and/or SavedModel."""

import sys

from keras_mp.cli._files import load_inputs, load_keras_model
from keras_mp.cli.sensitivity import add_precision_arguments, load_labels


def export_command_parser(subparsers):
    parser = subparsers.add_parser(
        "export", help="export a .keras model to Q/DQ ONNX or SavedModel"
    )
    parser.add_argument("model", help="a .keras file")
    parser.add_argument("--onnx", help="write this .onnx file")
    parser.add_argument("--saved-model", help="write this SavedModel folder")
    parser.add_argument(
        "--calibrate",
        help="inputs (a .npy, or an .npz with one array per model input "
        "name): quantize and calibrate first",
    )
    parser.add_argument(
        "--method",
        default=None,
        help="calibrator (max, percentile, entropy, mse, auto; default max, "
        "auto with --auto-quantize)",
    )
    parser.add_argument(
        "--auto-quantize",
        action="store_true",
        help="choose INT8 / FP8 / float per layer (keras_mp.auto_quantize) "
        "on the --calibrate data, within --max-drop of float",
    )
    parser.add_argument(
        "--max-drop",
        type=float,
        default=0.01,
        help="largest top-1 drop allowed, as a fraction (0.01)",
    )
    parser.add_argument(
        "--labels",
        help="a .npy of labels for --calibrate (without: top-1 agreement "
        "with the float model)",
    )
    parser.add_argument("--gpu", default="H100", help="the GPU priced (H100)")
    parser.add_argument(
        "--cost", choices=("latency", "bits"), default="latency"
    )
    add_precision_arguments(parser, ("int8", "float8", "float"))
    parser.add_argument(
        "--verify",
        help="inputs for the parity check, as --calibrate's (default: the "
        "--calibrate data)",
    )
    parser.add_argument(
        "--opset",
        type=int,
        default=None,
        help="ONNX opset (17; 19 with --dtype float16/bfloat16)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default=None,
        help="strongly typed graph: this type outside the INT8 layers, "
        "float32 islands where needed (listed with their reasons)",
    )
    parser.add_argument(
        "--fp16",
        action="store_true",
        help="deprecated alias of --dtype float16",
    )
    parser.add_argument("--overwrite", action="store_true")
    parser.set_defaults(func=export_command)


def export_command(args):
    import keras_mp

    if not (args.onnx or args.saved_model):
        raise ValueError(
            "Nothing to do: pass --onnx OUT.onnx and/or --saved-model DIR."
        )
    model = load_keras_model(args.model)
    if args.auto_quantize:
        if not args.calibrate:
            raise ValueError(
                "--auto-quantize needs data: pass --calibrate DATA.npy (and "
                "--labels LABELS.npy for top-1 accuracy)."
            )
        model, choice = keras_mp.auto_quantize(
            model,
            load_inputs(args.calibrate),
            load_labels(args.labels),
            max_drop=args.max_drop,
            precisions=tuple(args.precisions.split(",")),
            cost=args.cost,
            gpu=args.gpu,
            calibration=args.method or "auto",
            batch_size=args.batch_size,
        )
        print(choice)
    elif args.calibrate:
        model = keras_mp.quantize_model(model)
        print(
            keras_mp.calibrate(
                model, load_inputs(args.calibrate), method=args.method or "max"
            )
        )
    verify = (
        load_inputs(args.verify or args.calibrate)
        if (args.verify or args.calibrate)
        else None
    )
    if args.fp16:
        if args.dtype not in (None, "float16"):
            raise ValueError(
                f"--fp16 is an alias of --dtype float16, but --dtype "
                f"{args.dtype} was passed too. Pass only --dtype."
            )
        print(
            "note: --fp16 is deprecated; use --dtype float16", file=sys.stderr
        )
        args.dtype = "float16"
    if args.onnx:
        report = keras_mp.export_onnx(
            model,
            args.onnx,
            opset=args.opset,
            verify_data=verify,
            overwrite=args.overwrite,
            dtype=args.dtype,
        )
        typed = keras_mp.typed_graph(args.onnx)
        if report is not None:
            print(report)  # with the float32 nodes of a typed graph
        elif typed is not None:
            print(typed)
        if verify is None:
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
