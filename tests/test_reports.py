"""Every report a public function returns has one shape (issue #37): an
exported class with `rows`, `to_dict()` (plain Python, JSON-ready) and a
table as `print(report)`.

`CASES` says how to call each reporting function on one tiny model: a new
public function whose docstring's `Returns:` names a report, or a new
exported report class, is one line there. The renamed members still work
for one release with a `DeprecationWarning` naming the new one."""

import collections
import inspect
import json
import re

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.onnx.islands import METADATA_KEY

KERAS_OBJECTS = (
    keras.layers.Layer,
    keras.callbacks.Callback,
    keras.optimizers.Optimizer,
    Exception,
)


def _returns(function):
    """The `Returns:` section of `function`'s docstring."""
    doc = inspect.getdoc(function) or ""
    found = re.search(r"^Returns:\n(.*?)(?=^\S|\Z)", doc, re.S | re.M)
    return found.group(1) if found else ""


def _exported_report_classes(text):
    """The exported classes `text` names in backticks, but for Keras
    objects (models, layers, callbacks, optimizers) and errors."""
    spans = re.findall(r"`([^`]*)`", text)
    names = {n for span in spans for n in re.findall(r"\b[A-Z]\w*", span)}
    return {
        name
        for name in names
        if name in keras_mp.__all__
        and isinstance(getattr(keras_mp, name), type)
        and not issubclass(getattr(keras_mp, name), KERAS_OBJECTS)
    }


PUBLIC_FUNCTIONS = {
    name: getattr(keras_mp, name)
    for name in keras_mp.__all__
    if inspect.isfunction(getattr(keras_mp, name))
}
# A function reports when its `Returns:` names an exported report class or
# any `...Report`, or when its name says it reports.
REPORTING = sorted(
    name
    for name, function in PUBLIC_FUNCTIONS.items()
    if _exported_report_classes(_returns(function))
    or re.search(r"\w+Report\b", _returns(function))
    or re.search(r"report|audit", name)
)
EXPORTED_REPORTS = {
    name
    for name in keras_mp.__all__
    if name.endswith("Report") and isinstance(getattr(keras_mp, name), type)
} | {
    name
    for function in PUBLIC_FUNCTIONS.values()
    for name in _exported_report_classes(_returns(function))
}

Tiny = collections.namedtuple("Tiny", "model qmodel x y int8_onnx fp16_onnx")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A two-layer MLP, its calibrated INT8 copy and their ONNX files."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.integers(0, 4, 64)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="fc"),
            keras.layers.Dense(4, name="logits"),
        ]
    )
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    folder = tmp_path_factory.mktemp("reports")
    int8_onnx, fp16_onnx = str(folder / "int8.onnx"), str(folder / "fp16.onnx")
    keras_mp.export_onnx(qmodel, int8_onnx)
    keras_mp.export_onnx(model, fp16_onnx, dtype="float16", verify_data=x)
    return Tiny(model, qmodel, x, y, int8_onnx, fp16_onnx)


Case = collections.namedtuple("Case", "function report call")

CASES = [
    Case(
        "mixed_precision_audit",
        "AuditReport",
        lambda t: keras_mp.mixed_precision_audit(t.model, verbose=False),
    ),
    Case(
        "quantization_report",
        "QuantizationReport",
        lambda t: keras_mp.quantization_report(t.qmodel, verbose=False),
    ),
    Case(
        "calibrate",
        "CalibrationReport",
        lambda t: keras_mp.calibrate(
            keras_mp.quantize_model(t.model), t.x, verbose=0
        ),
    ),
    Case(
        "sparsity_report",
        "SparsityReport",
        lambda t: keras_mp.sparsity_report(t.model),
    ),
    Case(
        "check_tensorrt",
        "LintReport",
        lambda t: keras_mp.check_tensorrt(t.int8_onnx),
    ),
    Case(
        "export_onnx",
        "ParityReport",
        lambda t: keras_mp.export_onnx(
            t.qmodel, t.int8_onnx, verify_data=t.x, overwrite=True
        ),
    ),
    Case(
        "verify_onnx",
        "ParityReport",
        lambda t: keras_mp.verify_onnx(t.qmodel, t.int8_onnx, t.x),
    ),
    Case(
        "compare_onnx",
        "CompareReport",
        lambda t: keras_mp.compare_onnx(t.qmodel, t.int8_onnx, t.x[:16]),
    ),
    Case(
        "typed_graph",
        "TypedGraph",
        lambda t: keras_mp.typed_graph(t.fp16_onnx),
    ),
    Case(
        "layer_sensitivity",
        "SensitivityReport",
        lambda t: keras_mp.layer_sensitivity(
            t.model, t.x, t.y, num_batches=1, calibration_batches=1, verbose=0
        ),
    ),
    Case(
        "auto_quantize",
        "AutoQuantizeReport",
        lambda t: keras_mp.auto_quantize(
            t.model,
            t.x,
            t.y,
            num_batches=1,
            calibration_batches=1,
            verbose=0,
        )[1],
    ),
]


def _case(entry):
    return entry.values[0] if hasattr(entry, "values") else entry


def test_every_reporting_function_has_a_case():
    assert sorted(_case(c).function for c in CASES) == REPORTING


def test_the_cases_return_every_exported_report_class():
    assert EXPORTED_REPORTS <= {_case(c).report for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.function)
def test_a_report_has_the_common_shape(case, tiny):
    report = case.call(tiny)
    assert case.report in keras_mp.__all__, f"{case.report} is not exported"
    assert isinstance(report, getattr(keras_mp, case.report))
    assert isinstance(report.rows, list)
    data = report.to_dict()
    assert isinstance(data, dict)
    json.dumps(data)  # plain Python: no NumPy scalars or objects
    text = str(report)
    assert text != repr(report)
    assert len(text.splitlines()) >= len(report.rows), text


def test_the_quantization_report_prints_its_table(tiny, capsys):
    report = keras_mp.quantization_report(tiny.qmodel)
    assert capsys.readouterr().out == f"{report}\n"
    assert [(r["path"], r["quantized"]) for r in report.rows] == [
        ("fc", True),
        ("logits", True),
    ]
    assert str(report).splitlines()[0].startswith("Q fc ")
    markdown = report.to_markdown().splitlines()
    assert len(markdown) == 2 + len(report.rows)
    assert markdown[2].startswith("| Q | fc | Dense | int8 | in0=")
    assert report.to_dict()["rows"][0]["weights"]["kernel"] == list(
        report.rows[0]["weights"]["kernel"]
    )


def test_the_quantization_report_still_reads_as_its_list(tiny):
    report = keras_mp.quantization_report(tiny.qmodel, verbose=False)
    with pytest.warns(DeprecationWarning, match=r"report\.rows"):
        assert list(report) == report.rows
    with pytest.warns(DeprecationWarning, match=r"report\.rows"):
        assert report[0] is report.rows[0]
    with pytest.warns(DeprecationWarning, match=r"report\.rows"):
        assert len(report) == len(report.rows)


OLD_NAMES = [
    (
        "AuditReport.layers",
        lambda t: keras_mp.mixed_precision_audit(t.model, verbose=False),
        lambda r: r.layers,
    ),
    (
        "ParityReport.outputs",
        lambda t: keras_mp.verify_onnx(t.qmodel, t.int8_onnx, t.x),
        lambda r: r.outputs,
    ),
    (
        "TypedGraph.float32_nodes",
        lambda t: keras_mp.typed_graph(t.fp16_onnx),
        lambda r: r.float32_nodes,
    ),
    (
        "SparsityReport.to_dicts",
        lambda t: keras_mp.sparsity_report(t.model),
        lambda r: r.to_dicts(),
    ),
]


@pytest.mark.parametrize(
    "old, make, read", OLD_NAMES, ids=[o[0] for o in OLD_NAMES]
)
def test_an_old_member_still_works_with_a_warning(old, make, read, tiny):
    report = make(tiny)
    with pytest.warns(DeprecationWarning, match=re.escape(old)):
        got = read(report)
    want = report.to_dict()["rows"] if old.endswith("to_dicts") else None
    assert got == (want if want is not None else report.rows)


def test_the_typed_metadata_keeps_its_key(tiny):
    import onnx

    proto = onnx.load(tiny.fp16_onnx)
    stored = {p.key: p.value for p in proto.metadata_props}[METADATA_KEY]
    typed = keras_mp.typed_graph(proto)
    assert len(json.loads(stored)["float32_nodes"]) == len(typed.rows) > 0
