"""The `trtexec` command line that builds an exported ONNX file."""

import os

from keras_mp.onnx.tensorrt import check_tensorrt, load_onnx


def _dynamic_shapes(proto, batch):
    """`--minShapes/--optShapes/--maxShapes` for inputs with a dynamic
    batch axis (Keras exports batch as `None`)."""
    initializers = {i.name for i in proto.graph.initializer}
    specs = {"min": [], "opt": [], "max": []}
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        if not dims or any(d.dim_value <= 0 for d in dims[1:]):
            continue  # unknown non-batch dims: the user has to say
        if dims[0].dim_value > 0:
            continue  # static batch: nothing to choose
        rest = "x".join(str(d.dim_value) for d in dims[1:])
        for key, size in zip(("min", "opt", "max"), batch):
            specs[key].append(f"{value.name}:{size}x{rest}")
    if not specs["min"]:
        return ""
    return "".join(
        f" --{key}Shapes={','.join(values)}" for key, values in specs.items()
    )


def trtexec_command(onnx_path, report=None, batch=(1, 32, 128), legacy=False):
    """The TensorRT `trtexec` command that fits this ONNX file.

    `--stronglyTyped` takes the precisions from the Q/DQ graph (TensorRT 10
    and 11; TensorRT 11 removed `--int8 --fp16`); `--sparsity=enable` when
    2:4 weights are present; `--minShapes/--optShapes/--maxShapes` for a
    dynamic batch axis.

    Args:
        onnx_path: str. The ONNX file.
        report: `LintReport` of that file, if already computed.
        batch: (min, opt, max) batch sizes of the optimization profile.
            Defaults to (1, 32, 128).
        legacy: bool. Use TensorRT 8-10's weakly typed `--int8 --fp16`
            instead of `--stronglyTyped`. Defaults to False.

    Returns:
        The command line, as a string.

    Raises:
        ValueError: `batch` is not three increasing positive ints.

    Example:

    >>> keras_mp.trtexec_command("model.onnx")
    'trtexec --onnx=model.onnx --saveEngine=model.engine --stronglyTyped ...'
    """
    if (
        len(batch) != 3
        or not all(isinstance(b, int) and b > 0 for b in batch)
        or not batch[0] <= batch[1] <= batch[2]
    ):
        raise ValueError(
            "batch must be three positive ints (min, opt, max) with min <= "
            f"opt <= max. Received: batch={batch!r}"
        )
    proto, _ = load_onnx(onnx_path)
    report = report or check_tensorrt(proto)
    engine = os.path.splitext(os.fspath(onnx_path))[0] + ".engine"
    command = f"trtexec --onnx={onnx_path} --saveEngine={engine}"
    command += " --int8 --fp16" if legacy else " --stronglyTyped"
    command += _dynamic_shapes(proto, batch)
    if report.sparse_weights:
        command += " --sparsity=enable"
    return command
