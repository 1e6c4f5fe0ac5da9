"""`keras-mp sensitivity`: the per-layer sensitivity table of a model."""

from keras_mp.cli._files import load_inputs, load_keras_model


def sensitivity_command_parser(subparsers):
    parser = subparsers.add_parser(
        "sensitivity",
        help="score how much quantizing each layer alone hurts (INT8, FP8)",
    )
    parser.add_argument("model", help="a float .keras file")
    parser.add_argument(
        "--data",
        required=True,
        help="inputs (a .npy, or an .npz with one array per model input "
        "name): calibration and scoring data",
    )
    parser.add_argument(
        "--labels",
        help="a .npy of labels for --data: the gradient score (without: "
        "the KL divergence of the outputs)",
    )
    parser.add_argument(
        "--metric",
        choices=["top1"],
        help="score by the drop of this metric with each layer alone "
        "quantized (top1: top-1 accuracy on --labels, else agreement with "
        "the float model) instead of the gradient or KL score",
    )
    add_precision_arguments(parser, ("int8", "float8"))
    parser.add_argument(
        "--batches", type=int, default=4, help="scoring batches (4)"
    )
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--plot", help="also draw it to this .png")
    parser.set_defaults(func=sensitivity_command)


def add_precision_arguments(parser, default):
    parser.add_argument(
        "--precisions",
        default=",".join(default),
        help=f"comma-separated precisions ({','.join(default)})",
    )
    parser.add_argument(
        "--batch-size", type=int, default=64, help="batch size (64)"
    )


def load_labels(path):
    """The labels `.npy` of `--labels`, or None."""
    if path is None:
        return None
    labels = load_inputs(path)
    if isinstance(labels, dict):
        raise ValueError(
            f"{path} holds several arrays {sorted(labels)}: --labels takes "
            "one array of labels (a .npy)."
        )
    return labels


def _top1(y_true, y_pred):
    from keras_mp.precision import top1_accuracy

    return top1_accuracy(y_true, y_pred)


_METRICS = {"top1": _top1}


def sensitivity_command(args):
    import json

    import keras_mp
    from keras_mp.io import atomic_write_text

    model = load_keras_model(args.model)
    report = keras_mp.layer_sensitivity(
        model,
        load_inputs(args.data),
        load_labels(args.labels),
        precisions=tuple(args.precisions.split(",")),
        metric=_METRICS.get(args.metric),
        num_batches=args.batches,
        batch_size=args.batch_size,
    )
    print(report)
    if args.json:
        atomic_write_text(args.json, json.dumps(report.to_dict(), indent=2))
        print(f"Report written to {args.json}")
    if args.plot:
        report.plot(args.plot)
        print(f"Plot written to {args.plot}")
    return 0
