"""The GPUs the latency model knows: dense Tensor Core peaks and bandwidth.

Every figure is from NVIDIA's datasheet or product page (`GPU.source`);
those pages quote FP16/FP8/INT8 "with sparsity" (2:4 sparse Tensor Cores),
so the peaks here are those figures halved, except the T4's (Turing has no
sparse Tensor Cores). `docs/latency_model.md` lists them with their sources.
"""

import dataclasses

from keras_mp.quantization.names import NOT_QUANTIZED, canonical_name

# "float": not quantized, run in the graph's float type, priced at the
# float16 Tensor Core rate (TensorRT builds the unquantized layers in
# float16); int8 and float8: quantized (`quantization.config.PRECISIONS`).
PRECISIONS = (NOT_QUANTIZED, "int8", "float8")


@dataclasses.dataclass(frozen=True)
class GPU:
    """One GPU as the latency model sees it.

    Args:
        name: str. The name `gpu_spec` finds it by, e.g. `"H100"`.
        peak: dict. Dense (no sparsity) Tensor Core peak by precision,
            TFLOPS for `"float"` (not quantized: the float16 rate) and
            `"float8"`, TOPS for `"int8"`; a precision the GPU cannot run
            is absent. The old keys `"float16"` and `"fp8"` are read as
            `"float"` and `"float8"`, with a `DeprecationWarning`.
        bandwidth: float. Memory bandwidth, GB/s.
        source: str. URL of the datasheet the figures come from.
        arch: str. The architecture, e.g. `"Hopper"`.

    Example:

    >>> gpu = GPU("X", {"float": 100.0, "int8": 200.0}, 1000.0, "", "X")
    >>> check_precisions(gpu, ["int8"])
    """

    name: str
    peak: dict
    bandwidth: float
    source: str
    arch: str

    def __post_init__(self):
        peak = {
            canonical_name(key, "GPU(peak=)", PRECISIONS): value
            for key, value in self.peak.items()
        }
        object.__setattr__(self, "peak", peak)


GPUS = {
    gpu.name: gpu
    for gpu in (
        GPU(
            "T4",
            {"float": 65.0, "int8": 130.0},
            320.0,
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
            "tesla-t4/t4-tensor-core-datasheet-951643.pdf",
            "Turing",
        ),
        # the SXM 80GB board (the PCIe one has 1,935 GB/s)
        GPU(
            "A100",
            {"float": 312.0, "int8": 624.0},
            2039.0,
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
            "a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
            "Ampere",
        ),
        # 485 sparse FP8/INT8 halved: 242.5
        GPU(
            "L4",
            {"float": 121.0, "int8": 242.5, "float8": 242.5},
            300.0,
            "https://www.nvidia.com/en-us/data-center/l4/",
            "Ada Lovelace",
        ),
        GPU(
            "L40S",
            {"float": 362.0, "int8": 733.0, "float8": 733.0},
            864.0,
            "https://www.nvidia.com/en-us/data-center/l40s/",
            "Ada Lovelace",
        ),
        GPU(
            "H100",
            {"float": 989.0, "int8": 1979.0, "float8": 1979.0},
            3350.0,
            "https://www.nvidia.com/en-us/data-center/h100/",
            "Hopper",
        ),
        # the H100's GH100 chip with HBM3e
        GPU(
            "H200",
            {"float": 989.0, "int8": 1979.0, "float8": 1979.0},
            4800.0,
            "https://www.nvidia.com/en-us/data-center/h200/",
            "Hopper",
        ),
        # one GPU of HGX B200 (1,000 W); DGX B200's datasheet gives 8 TB/s
        # per GPU, the current HGX table 7.7 TB/s
        GPU(
            "B200",
            {"float": 2250.0, "int8": 4500.0, "float8": 4500.0},
            8000.0,
            "https://www.nvidia.com/en-us/data-center/hgx/",
            "Blackwell",
        ),
    )
}


def gpu_spec(name):
    """The `GPU` called `name` (any case), or `name` itself if a `GPU`.

    Args:
        name: str or `GPU`. A key of `GPUS`, e.g. `"H100"`, or a `GPU` of
            your own.

    Returns:
        The `GPU`.

    Raises:
        ValueError: `name` is not a known GPU.

    Example:

    >>> gpu_spec("h100").bandwidth
    3350.0
    """
    if isinstance(name, GPU):
        return name
    by_lower = {key.lower(): gpu for key, gpu in GPUS.items()}
    if isinstance(name, str) and name.lower() in by_lower:
        return by_lower[name.lower()]
    raise ValueError(
        f"Unknown GPU: {name!r}. Known GPUs: {', '.join(GPUS)}. For another "
        "one pass a `GPU(name, peak, bandwidth, source, arch)` with its "
        "datasheet's dense (not sparse) peaks."
    )


def check_precisions(gpu, precisions):
    """Fails when one of `precisions` cannot run on `gpu`.

    FP8 Tensor Cores came with Ada Lovelace and Hopper: a T4 (Turing) or an
    A100 (Ampere) runs float (float16) and int8 only.

    Args:
        gpu: str, `GPU` or None. See `gpu_spec`; None checks that each
            precision is one of `PRECISIONS` only.
        precisions: iterable of str, each one of `PRECISIONS` (old
            spellings: `"float16"` for `"float"`, `"fp8"` for `"float8"`,
            with a `DeprecationWarning`).

    Returns:
        tuple of str: `precisions` by their names.

    Raises:
        ValueError: an unknown precision, or one `gpu` has no Tensor Cores
            for (the message names the GPUs that have them).

    Example:

    >>> check_precisions("H100", ["float", "float8"])
    ('float', 'float8')
    >>> check_precisions("T4", ["float8"])
    Traceback (most recent call last):
    ValueError: float8 cannot run on T4 (Turing) (FP8 Tensor Cores need ...
    """
    gpu = None if gpu is None else gpu_spec(gpu)
    if isinstance(precisions, str):
        precisions = (precisions,)
    precisions = tuple(
        canonical_name(p, "precision", PRECISIONS) for p in precisions
    )
    for precision in precisions:
        if gpu is None or precision in gpu.peak:
            continue
        able = [g.name for g in GPUS.values() if precision in g.peak]
        why = (
            " (FP8 Tensor Cores need Ada Lovelace, Hopper or newer)"
            if precision == "float8"
            else ""
        )
        raise ValueError(
            f"{precision} cannot run on {gpu.name} ({gpu.arch}){why}. GPUs "
            f"that run {precision}: {', '.join(able)}. Choose one of them, "
            f"or leave {precision} out of the precisions for {gpu.name}."
        )
    return precisions
