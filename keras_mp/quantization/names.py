"""The one vocabulary of number-format and precision names.

Every function that takes such a name (`QuantizeConfig(precision=)`,
`quantize_model(precision=)`, `TensorQuantizer(format=)`,
`auto_quantize(precisions=)`, the cost models, MuPPET) passes it through
`canonical_name`, which maps the old spellings and warns once per call.
The names (`docs/quantization.md`, "Number format names"):

- number formats: the rows of `formats.FORMATS`: `"int2"` ... `"int8"`,
  `"float8"` (FP8 E4M3), `"nvfp4"`, `"mxfp8"`. Where Keras has a name
  (its quantization modes `"int8"`, `"int4"`, `"float8"`) it is Keras';
  NVFP4 and MXFP8 have none in Keras and keep TensorRT's / ModelOpt's.
- `"float"` (`NOT_QUANTIZED`): a layer left unquantized, running in the
  graph's float type (float16 once TensorRT builds it).
- float compute types: Keras' dtype names `"float16"`, `"bfloat16"`,
  `"float32"`.
"""

import types
import warnings

NOT_QUANTIZED = "float"

# Old spelling -> name. Each is accepted for one release with a
# DeprecationWarning naming the new one (`docs/migration.md`).
ALIASES = types.MappingProxyType(
    {
        "fp8": "float8",
        "e4m3": "float8",
        "e4m3fn": "float8",
        "fp8_e4m3": "float8",
        "float8_e4m3fn": "float8",
        "fp16": "float16",
        "fp32": "float32",
        "bf16": "bfloat16",
    }
)
# "float16" said "not quantized" in the precision search and cost model
# before `NOT_QUANTIZED`; it stays a float compute type elsewhere.
_OLD_NOT_QUANTIZED = "float16"


def canonical_name(name, where, allowed=None, warn=True):
    """The name of the vocabulary for `name`, warning on an old spelling.

    Case and surrounding spaces are ignored (`"INT8"` is `"int8"`). An old
    spelling (`ALIASES`: `"fp8"` for `"float8"`, `"fp16"` for
    `"float16"`, ...; `"float16"` for `"float"` where `allowed` holds
    `"float"`) gives the new name and a `DeprecationWarning` that names
    it.

    Args:
        name: str. A format, precision or float type name.
        where: str. The argument that received it, for the messages
            (`"QuantizeConfig(precision=)"`).
        allowed: iterable of str or None. The names this argument takes;
            None accepts any name (after the mapping). Defaults to None.
        warn: bool. Warn on an old spelling; False for names read from a
            saved file, which load silently. Defaults to True.

    Returns:
        str.

    Raises:
        ValueError: `name` is not a string, or not in `allowed` after the
            mapping (the message lists `allowed`).

    Example:

    >>> canonical_name("int8", "precision")
    'int8'
    >>> canonical_name("fp8", "precision")  # DeprecationWarning: 'float8'
    'float8'
    """
    allowed = None if allowed is None else tuple(allowed)
    key = name.strip().lower() if isinstance(name, str) else name
    new = ALIASES.get(key, key)
    if (
        key == _OLD_NOT_QUANTIZED
        and allowed is not None
        and NOT_QUANTIZED in allowed
    ):
        new = NOT_QUANTIZED
    if not isinstance(new, str) or (allowed is not None and new not in allowed):
        listed = f"one of {list(allowed)}" if allowed is not None else "a str"
        raise ValueError(
            f"`{where}` must be {listed} (keras_mp's names, "
            "docs/quantization.md, 'Number format names'). Received: "
            f"{where.split('(')[-1].rstrip('=)')}={name!r}"
        )
    if new != key and warn:
        warnings.warn(
            f"`{where}`: {name!r} is deprecated and will be removed in the "
            f"next release; use {new!r}.",
            DeprecationWarning,
            stacklevel=3,
        )
    return new


def canonical_names(names, where, allowed=None):
    """`canonical_name` of each of `names` (a str is one name), as a
    tuple."""
    if isinstance(names, str):
        names = (names,)
    return tuple(canonical_name(n, where, allowed) for n in names)
