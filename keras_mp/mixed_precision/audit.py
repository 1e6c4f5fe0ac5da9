"""The mixed-precision audit: per-layer dtypes and Tensor Core alignment.
Guide: `docs/mixed-precision.md`.
"""

import dataclasses
import warnings

import keras

from keras_mp import _models


@dataclasses.dataclass
class LayerAudit:
    """One row of an `AuditReport`: a layer's dtypes and findings. `name`
    is the layer's name, or for a layer inside a nested model or custom
    layer its path from the top-level layer (`"encoder/block_0/query"`)."""

    name: str
    class_name: str
    compute_dtype: str
    variable_dtype: str
    findings: list


@dataclasses.dataclass
class AuditReport:
    """Per-layer dtypes and Tensor Core alignment findings.

    Attributes:
        rows: list of `LayerAudit`, one per layer at any depth, in the
            model's order.
        batch_size: int or None. The batch size checked, when given.
        batch_finding: str. Its finding ("" when aligned or not given).

    Example:

    >>> report = keras_mp.mixed_precision_audit(model, verbose=False)
    >>> print(report)  # one line per layer, then the summary
    >>> [r.name for r in report.rows if r.findings]
    """

    rows: list
    batch_size: int = None
    batch_finding: str = ""

    @property
    def layers(self):
        """Deprecated: `report.rows`."""
        warnings.warn(
            "AuditReport.layers is deprecated: use `report.rows`. It will "
            "be removed in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.rows

    @property
    def findings(self):
        out = [f"{r.name}: {f}" for r in self.rows for f in r.findings]
        return out + ([self.batch_finding] if self.batch_finding else [])

    @property
    def summary(self):
        half = sum(
            r.compute_dtype in ("float16", "bfloat16") for r in self.rows
        )
        return (
            f"{len(self.rows)} layers: {half} compute in 16-bit, "
            f"{len(self.rows) - half} in float32; "
            f"{len(self.findings)} Tensor Core alignment finding(s)."
        )

    def to_dict(self):
        """The report as plain Python (JSON-ready), with its `findings`
        and `summary`."""
        return dict(
            dataclasses.asdict(self),
            findings=self.findings,
            summary=self.summary,
        )

    def to_table(self):
        rows = [("layer", "type", "compute", "variables", "alignment")]
        for r in self.rows:
            rows.append(
                (
                    r.name,
                    r.class_name,
                    r.compute_dtype,
                    r.variable_dtype,
                    "; ".join(r.findings) or "ok",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self.batch_finding:
            lines.append(self.batch_finding)
        lines.append(self.summary)
        return "\n".join(lines)

    def __str__(self):
        return self.to_table()


def _alignment_findings(layer):
    """Dimensions of `layer` that are not multiples of 8."""
    findings = []
    for attr in ("units", "filters"):
        value = getattr(layer, attr, None)
        if isinstance(value, int) and value % 8:
            findings.append(f"{attr}={value} not a multiple of 8")
    kernel = getattr(layer, "kernel", None)
    if kernel is not None and len(kernel.shape) >= 3:
        channels = kernel.shape[-2]
        if channels % 8:
            findings.append(f"input channels={channels} not a multiple of 8")
    elif kernel is not None and len(kernel.shape) == 2 and kernel.shape[0] % 8:
        findings.append(f"input features={kernel.shape[0]} not a multiple of 8")
    if isinstance(layer, keras.layers.Embedding) and layer.output_dim % 8:
        findings.append(f"output_dim={layer.output_dim} not a multiple of 8")
    return findings


def mixed_precision_audit(model, batch_size=None, verbose=True):
    """Lists each layer's dtypes and its Tensor Core alignment findings.

    Tensor Cores run float16/bfloat16 (and INT8) matrix math when the
    matrix dimensions are multiples of 8: units, filters, input channels and
    the batch size. A misaligned dimension falls back to slower kernels or is
    padded. Layers are listed at any depth: inside nested models,
    wrappers and custom layers.

    Args:
        model: A built `keras.Model`.
        batch_size: int. The training batch size, checked too when given.
        verbose: bool. Print the table and summary. Defaults to True.

    Returns:
        `AuditReport` with `.rows`, `.findings`, `.summary`, `.to_dict()`;
        `print(report)` shows the table.

    Example:

    >>> report = keras_mp.mixed_precision_audit(model, batch_size=128)
    >>> report.summary
    '9 layers: 7 compute in 16-bit, 2 in float32; 1 Tensor Core ...'
    """
    _models.check_model(model, "mixed_precision_audit")
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so its weight shapes are "
            "unknown. Call it on a batch or call `model.build(input_shape)` "
            "first."
        )
    from keras_mp.quantization.activation import QuantizeActivation
    from keras_mp.quantization.twins import WeightQuantizer

    quantizers = (QuantizeActivation, WeightQuantizer)

    rows = []
    # A wrapper (quantize, fixed point) is one row: its inner layer and
    # quantizers are not layers of the model's own; nor are the quantizers
    # a layer quantized in place owns. Nested layers are named by path.
    for layer, parents in _models.walk_layers(
        model, stop_at=(keras.layers.Wrapper,), with_parents=True
    ):
        if isinstance(layer, (keras.layers.InputLayer, *quantizers)):
            continue
        rows.append(
            LayerAudit(
                name=_models.layer_path(layer, parents),
                class_name=type(layer).__name__,
                compute_dtype=layer.compute_dtype,
                variable_dtype=layer.variable_dtype,
                findings=_alignment_findings(layer),
            )
        )
    batch_finding = ""
    if batch_size is not None and batch_size % 8:
        batch_finding = f"batch_size={batch_size} not a multiple of 8"
    report = AuditReport(rows, batch_size, batch_finding)
    if verbose:
        print(report.to_table())
    return report
