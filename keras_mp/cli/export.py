"""`keras-mp export`: a `.keras` file to Q/DQ ONNX and/or SavedModel."""

from keras_mp.cli._files import load_inputs, load_keras_model


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
        "--method", default="max", help="calibrator (max, percentile, ...)"
    )
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
        "--fp16", action="store_true", help="alias of --dtype float16"
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
    if args.calibrate:
        model = keras_mp.quantize_model(model)
        print(
            keras_mp.calibrate(
                model, load_inputs(args.calibrate), method=args.method
            )
        )
    verify = (
        load_inputs(args.verify or args.calibrate)
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
