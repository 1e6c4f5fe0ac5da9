"""Golden Q/DQ placement: the INT8 ONNX of a set of models, reduced to a
signature without any tensor or layer name, must match the one recorded.

Each model is quantized (`keras_mp.quantize_model`), calibrated (max, on a
small seeded random batch), exported (`keras_mp.export_onnx`) and linted
(`keras_mp.check_tensorrt`). Its signature:

- the number of QuantizeLinear and DequantizeLinear nodes, of weighted ops
  (Conv, ConvTranspose, MatMul, Gemm) and of those with both inputs
  quantized;
- for every DequantizeLinear: whether it dequantizes a weight (a constant:
  an INT8 initializer, or a QuantizeLinear of one) or an activation, the
  layout ops between its QuantizeLinear and it (tf2onnx's Reshape or
  Squeeze), its `axis` attribute (None when absent), the rank and length
  of its scale, and every consumer of its output as (op type, input slot);
  a multiset: identical entries are counted, not named;
- the lint verdict and its findings as (rule, severity), counted.

The models: the reference CNN (`keras_mp/reference.py`), every quantizable
row's sample of the layer-table conformance test (`SAMPLES` in
tests/test_layer_table.py), the zoo's fast subset (`QUICK` in
benchmarks/bench_zoo.py; its INT8 ONNX is the one tests/onnx/test_zoo.py
measures, shared through `zoo_measured` in tests/conftest.py) and a
keras-hub BERT classifier (tests/quantization/test_keras_hub.py) and tiny
keras-hub Gemma, Llama, Mixtral, DeBERTaV3 and T5 backbones (`HUB`).
Every model runs the small-GEMM rule as users get it (`gemm_rule`: a
Dense, EinsumDense or weight GEMM with K or N below 16 stays float).

The goldens record the placement of the code they were generated on (one
JSON file per model in `fixtures/golden_placement/`). A change of
placement fails with the difference: which (consumer op type, input slot)
gained or lost a DequantizeLinear, then the full entries gained and lost.
When a change is intended, regenerate them and review the JSON diff:

    KERAS_MP_REGEN_GOLDEN=1 python -m pytest -p no:cacheprovider \\
        tests/integration/test_golden_placement.py

Each file is replaced atomically (written beside it, then renamed); a
golden file whose model is gone is deleted.
"""

import collections
import json
import os
import tempfile

import keras
import numpy as np
import onnx
import pytest

import keras_mp
from benchmarks.bench_zoo import QUICK
from keras_mp.onnx.graph import LAYOUT_OPS, GraphIndex, attr
from keras_mp.reference import reference_cnn
from tests.test_layer_table import QUANTIZABLE, _build, quantize_sample

GOLDEN = os.path.join(os.path.dirname(__file__), "fixtures", "golden_placement")
REGEN = os.environ.get("KERAS_MP_REGEN_GOLDEN", "") not in ("", "0")


def _export(qmodel, data, path):
    keras_mp.calibrate(qmodel, data, method="max", verbose=0)
    keras_mp.export_onnx(qmodel, path)
    return path


def _reference_cnn(directory, zoo_measured):
    keras.utils.set_random_seed(0)
    model = reference_cnn()
    x = np.random.default_rng(0).random((32, 28, 28, 1), dtype=np.float32)
    qmodel = keras_mp.quantize_model(model)
    return _export(qmodel, x, os.path.join(directory, "model.onnx"))


def _layer_table(cls):
    def make(directory, zoo_measured):
        model, x = _build(cls)  # seeded
        qmodel = quantize_sample(cls, model)
        return _export(qmodel, x, os.path.join(directory, "model.onnx"))

    return make


def _zoo(name):
    def make(directory, zoo_measured):
        row = zoo_measured(name)
        assert row["int8_onnx"], row["int8_error"]
        return row["int8_onnx"]

    return make


def _bert_classifier(directory, zoo_measured):
    # imported here: without keras-hub, only this model is skipped
    from tests.quantization.test_keras_hub import bert_classifier, tokens

    keras.utils.set_random_seed(0)
    qmodel = keras_mp.quantize_model(bert_classifier())
    return _export(qmodel, tokens(), os.path.join(directory, "model.onnx"))


def _hub_backbone(cls, layers):
    """A tiny keras-hub backbone of `layers` layers, hidden 16
    (`benchmarks/hub_models.py`): the attention classes keras_mp reached
    through hand-written twins, then at their op sites."""

    def make(directory, zoo_measured):
        from benchmarks import hub_models

        hub_models.keras_hub()
        keras.utils.set_random_seed(0)
        model = hub_models.BACKBONES[cls](16, layers)
        qmodel = keras_mp.quantize_model(model)
        data = hub_models.inputs_for(model, 16, 0, seq=8)
        return _export(qmodel, data, os.path.join(directory, "model.onnx"))

    return make


HUB = {
    "GemmaBackbone": 1,
    "LlamaBackbone": 1,
    "MixtralBackbone": 1,
    "DebertaV3Backbone": 2,
    "T5Backbone": 1,
}

# Model id (its golden file's name) -> maker of its INT8 ONNX, called with a
# scratch directory and the `zoo_measured` fixture.
MODELS = {
    "reference_cnn": _reference_cnn,
    **{f"layer_table_{c.__name__}": _layer_table(c) for c in QUANTIZABLE},
    **{f"zoo_{name}": _zoo(name) for name in QUICK},
    "keras_hub_bert_classifier": _bert_classifier,
    **{f"keras_hub_{c}": _hub_backbone(c, n) for c, n in HUB.items()},
}


def _walk_layout(index, tensor):
    """From `tensor` back through layout ops: their op types (nearest
    first), and what is behind them: "constant", "graph input", or the
    first node that is not a layout op."""
    layout = []
    while index.const(tensor) is None:
        node = index.producers.get(tensor)
        if node is None:
            return layout, "graph input"
        if node.op_type not in LAYOUT_OPS:
            return layout, node
        layout.append(node.op_type)
        tensor = node.input[0]
    return layout, "constant"


def _dq_entry(index, dq, graph_outputs):
    layout, behind = _walk_layout(index, dq.input[0])
    if isinstance(behind, str):  # a folded INT8 weight, or a graph input
        weight = behind == "constant"
        source = "weight" if weight else "activation"
        quantized_by = "initializer" if weight else behind
    elif behind.op_type == "QuantizeLinear":
        weight = _walk_layout(index, behind.input[0])[1] == "constant"
        source = "weight" if weight else "activation"
        quantized_by = "QuantizeLinear"
    else:
        source, quantized_by = "activation", behind.op_type
    scale = index.const(dq.input[1])
    consumers = sorted(
        [c.op_type, slot] for c, slot in index.consumers.get(dq.output[0], [])
    )
    if dq.output[0] in graph_outputs:
        consumers.append(["<graph output>", 0])
    return {
        "source": source,
        "quantized_by": quantized_by,
        "layout_q_to_dq": layout[::-1],
        "axis": attr(dq, "axis", None),
        "scale_rank": None if scale is None else int(np.ndim(scale)),
        "scale_length": None if scale is None else int(np.size(scale)),
        "consumers": consumers,
    }


def _key(entry):
    return json.dumps(
        {k: v for k, v in entry.items() if k != "count"}, sort_keys=True
    )


def _counted(entries):
    """A multiset of dicts as a sorted list, each with its `count`."""
    entries = list(entries)
    counts = collections.Counter(_key(e) for e in entries)
    first = {_key(e): e for e in reversed(entries)}  # keeps the field order
    return [{"count": n, **first[k]} for k, n in sorted(counts.items())]


def signature(path):
    """The name-free placement signature of the INT8 ONNX at `path`."""
    proto = onnx.load(path)
    index = GraphIndex(proto)
    outputs = {o.name for o in proto.graph.output}
    report = keras_mp.check_tensorrt(path)
    dqs = [n for n in index.nodes if n.op_type == "DequantizeLinear"]
    findings = [
        {"rule": f.rule, "severity": f.severity}
        for f in report.violations + report.warnings
    ]
    return {
        "quantize_linear": sum(
            n.op_type == "QuantizeLinear" for n in index.nodes
        ),
        "dequantize_linear": len(dqs),
        "weighted_ops": report.weighted_ops,
        "weighted_ops_quantized": report.weighted_ops_quantized,
        "lint_ok": report.ok,
        "lint_findings": _counted(findings),
        "dequantize_linear_nodes": _counted(
            _dq_entry(index, dq, outputs) for dq in dqs
        ),
    }


def _golden_path(model_id):
    return os.path.join(GOLDEN, f"{model_id}.json")


def _dumps(data):
    """`data` (a signature) as JSON with one line per list entry: a
    regenerated golden's diff shows each entry gained or lost."""
    lines = []
    for key, value in data.items():
        if isinstance(value, list) and value:
            rows = ",\n".join(f"  {json.dumps(v)}" for v in value)
            lines.append(f" {json.dumps(key)}: [\n{rows}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _write_atomically(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(_dumps(data))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _describe(entry):
    layout = "".join(f" -> {op}" for op in entry["layout_q_to_dq"])
    consumers = ", ".join(f"{op}[{slot}]" for op, slot in entry["consumers"])
    return (
        f"{entry['source']} DQ (from {entry['quantized_by']}{layout}; "
        f"axis {entry['axis']}, scale rank {entry['scale_rank']} length "
        f"{entry['scale_length']}) -> {consumers or 'nothing'}"
    )


def _by_slot(entries):
    """(source, consumer op type, slot) -> DequantizeLinear outputs read."""
    tally = collections.Counter()
    for entry in entries:
        for op, slot in entry["consumers"]:
            tally[(entry["source"], op, slot)] += entry["count"]
    return tally


def placement_diff(golden, current):
    """The differences between two signatures, one line each ([] if none)."""
    lines = [
        f"{key}: {golden.get(key)} -> {current.get(key)}"
        for key in sorted(set(golden) | set(current))
        if key not in ("lint_findings", "dequantize_linear_nodes")
        and golden.get(key) != current.get(key)
    ]
    was, now = (
        _by_slot(s["dequantize_linear_nodes"]) for s in (golden, current)
    )
    for source, op, slot in sorted(set(was) | set(now)):
        a, b = was[(source, op, slot)], now[(source, op, slot)]
        if a != b:
            change = "gained" if b > a else "lost"
            lines.append(
                f"{op} input {slot} {change} {abs(b - a)} {source} DQ "
                f"({a} -> {b})"
            )
    for field, show in (
        ("lint_findings", lambda e: f"lint {e['severity']} [{e['rule']}]"),
        ("dequantize_linear_nodes", _describe),
    ):
        entries, was, now = {}, collections.Counter(), collections.Counter()
        for counts, signature_ in ((was, golden), (now, current)):
            for entry in signature_[field]:
                entries[_key(entry)] = entry
                counts[_key(entry)] += entry["count"]
        for key in sorted(entries):
            a, b = was[key], now[key]
            if a != b:
                sign = "+" if b > a else "-"
                lines.append(
                    f"{sign} {abs(b - a)}x {show(entries[key])} ({a} -> {b})"
                )
    return lines


@pytest.fixture(scope="module")
def signatures(tmp_path_factory, zoo_measured):
    """Model id -> its signature, computed once (the zoo's INT8 ONNX comes
    from the session's `zoo_measured`)."""
    cache = {}

    def get(model_id):
        if model_id not in cache:
            directory = str(tmp_path_factory.mktemp("golden"))
            path = MODELS[model_id](directory, zoo_measured)
            cache[model_id] = {"model": model_id, **signature(path)}
        return cache[model_id]

    return get


# Exported in the slow step of .ci/run (25 s on 2 cores: over `make test`'s
# budget); the other zoo models keep the fast golden and lint checks.
SLOW = {"zoo_MobileNetV3Small", "keras_hub_T5Backbone"}


def _param(model_id, marks=()):
    marks = list(marks) + ([pytest.mark.slow] if model_id in SLOW else [])
    # as users get it: the small-GEMM rule on (`placement.gemm_too_small`:
    # a GEMM with K or N below 16 stays float, the reference CNN's 10-class
    # head, the tiny layer-table samples' and keras-hub configs' small
    # Dense layers); the zoo's fast subset is measured with it too
    # (tests/onnx/test_zoo.py shares the measurement).
    marks.append(pytest.mark.gemm_rule)
    return pytest.param(model_id, marks=marks)


@pytest.mark.parametrize("model_id", [_param(m) for m in MODELS])
def test_placement_matches_golden(model_id, signatures):
    current = signatures(model_id)
    path = _golden_path(model_id)
    if REGEN:
        _write_atomically(path, current)
        return
    assert os.path.exists(path), (
        f"no golden for {model_id}: generate it with KERAS_MP_REGEN_GOLDEN=1"
    )
    with open(path) as f:
        golden = json.load(f)
    diff = placement_diff(golden, current)
    if diff:
        pytest.fail(
            f"Q/DQ placement of {model_id} changed against {path} "
            "(KERAS_MP_REGEN_GOLDEN=1 regenerates it if intended):\n  "
            + "\n  ".join(diff),
            pytrace=False,
        )


# keras_mp's own placement must lint clean: the layer table's conformance
# samples and the zoo's fast subset (signatures shared with the golden test
# above, so nothing is exported twice). Known gaps are strict xfails.
LINT_CLEAN_GAPS = {}


@pytest.mark.parametrize(
    "model_id",
    [
        _param(
            m,
            [pytest.mark.xfail(strict=True, reason=LINT_CLEAN_GAPS[m])]
            if m in LINT_CLEAN_GAPS
            else [],
        )
        for m in MODELS
        if m.startswith(("layer_table_", "zoo_"))
    ],
)
def test_own_placement_lints_clean(model_id, signatures):
    current = signatures(model_id)
    assert current["lint_ok"]
    assert current["lint_findings"] == [], current["lint_findings"]


def test_every_golden_has_a_model():
    stale = sorted(
        name[: -len(".json")]
        for name in os.listdir(GOLDEN)
        if name.endswith(".json") and name[: -len(".json")] not in MODELS
    )
    if REGEN:
        for model_id in stale:
            os.remove(_golden_path(model_id))
        return
    assert not stale, f"golden files without a model: {stale}"


def test_diff_names_the_slot_that_lost_a_dq():
    entry = {
        "source": "activation",
        "quantized_by": "QuantizeLinear",
        "layout_q_to_dq": [],
        "axis": None,
        "scale_rank": 0,
        "scale_length": 1,
    }
    golden = {
        "dequantize_linear": 2,
        "lint_findings": [],
        "dequantize_linear_nodes": [
            {**entry, "consumers": [["Add", 0], ["Conv", 0]], "count": 1},
            {**entry, "consumers": [["MatMul", 0]], "count": 1},
        ],
    }
    current = {
        "dequantize_linear": 2,
        "lint_findings": [
            {"rule": "residual_add", "severity": "warning", "count": 1}
        ],
        "dequantize_linear_nodes": [
            {**entry, "consumers": [["Conv", 0]], "count": 1},
            {**entry, "consumers": [["MatMul", 0]], "count": 1},
        ],
    }
    diff = placement_diff(golden, current)
    assert "Add input 0 lost 1 activation DQ (1 -> 0)" in diff
    assert "+ 1x lint warning [residual_add] (0 -> 1)" in diff
    assert any(line.startswith("- 1x activation DQ") for line in diff)
    assert placement_diff(golden, golden) == []
