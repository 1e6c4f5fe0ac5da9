"""The peers benchmark's goal logic, on synthetic rows (no tool is run)."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)

import bench_peers  # noqa: E402
import render  # noqa: E402


def _row(label, peer, kind, ort=None, keras_top1=None):
    return {
        "label": label,
        "peer": peer,
        "kind": kind,
        "test_top1_ort_reference": ort,
        "test_top1_keras": keras_top1,
        "lint": None,
    }


def _tool(qat, control):
    runs = [
        {"order": k, "qat_keras_test_top1": q, "control_keras_test_top1": c}
        for k, (q, c) in enumerate(zip(qat, control))
    ]
    return {"runs": runs, "qat_parity": "top-1 agreement 100.00%"}


ROWS = [
    _row("keras_mp QAT", "keras_mp", "QAT", ort=86.5, keras_top1=86.52),
    _row("ORT minmax", "ONNX Runtime", "PTQ", ort=85.0),
    _row("ModelOpt entropy", "ModelOpt", "PTQ", ort=85.1),
    _row("tfmot QAT", "tfmot", "QAT", ort=86.7, keras_top1=86.6),
]


def test_qat_goal_judges_means_over_orders():
    kmp = _tool([86.5, 86.7, 86.6], [86.7, 86.8, 86.8])
    tfmot = _tool([86.6, 86.4, 86.5], [86.7, 86.7, 86.8])
    goal = bench_peers.qat_mean_goal(ROWS, kmp, tfmot)
    assert goal["pass"] and goal["best_peer"] == "tfmot QAT"
    assert goal["keras_mp_qat_mean"] == 86.6 and goal["tfmot_qat_mean"] == 86.5
    assert goal["keras_mp_qat_keras_minus_onnx_order0_points"] == 0.02
    # One order alone (the old verdict) would have failed: 86.5 < 86.7.
    assert not bench_peers.qat_onnx_order0_goal(ROWS)["pass"]
    gap = bench_peers.control_gap(kmp)
    assert gap["per_order_points"] == [-0.2, -0.1, -0.2]

    worse = _tool([86.4, 86.4, 86.5], [86.7, 86.8, 86.8])
    assert not bench_peers.qat_mean_goal(ROWS, worse, tfmot)["pass"]
    title, text, verdict = render._goal_row(
        "keras_mp_qat_top1_at_least_every_peer",
        bench_peers.qat_mean_goal(ROWS, worse, tfmot),
    )
    assert verdict == "FAIL" and "-0.07 points" in text


@pytest.mark.parametrize("kmp_ok, tfmot_ok", [(False, True), (True, False)])
def test_a_failed_tool_never_drops_a_goal(kmp_ok, tfmot_ok):
    kmp = _tool([86.6], [86.7]) if kmp_ok else None
    tfmot = _tool([86.5], [86.7]) if tfmot_ok else None
    rows = [r for r in ROWS if kmp_ok or r["peer"] != "keras_mp"]
    goals = bench_peers.goals(rows, kmp, tfmot)
    verdict = goals["keras_mp_qat_top1_at_least_every_peer"]
    if kmp_ok:  # judged against the PTQ peers alone
        assert verdict["pass"] and verdict["tfmot_qat_mean"] is None
    else:
        assert verdict == {
            "pass": False,
            "reason": "not measured: keras_mp QAT failed",
        }
        row = render._goal_row("keras_mp_qat_top1_at_least_every_peer", verdict)
        assert row[1:] == ("not measured: keras_mp QAT failed", "FAIL")


def test_calibrator_goals_and_table():
    rows = ROWS + [_row("float32", "float32", "float32", ort=85.0)]
    kmp = {
        "ptq": {
            "max": {"keras_test_top1": 84.9},
            "entropy": {"keras_test_top1": 84.6},
            "auto": {"keras_test_top1": 85.2},
        },
        "best_ptq_method": "auto",
    }
    table = bench_peers.calibrator_table(rows, kmp)
    assert table == {
        "float32": 85.0,
        "keras_mp max": 84.9,
        "keras_mp entropy": 84.6,
        "keras_mp auto": 85.2,
        "ORT minmax": 85.0,
        "ModelOpt entropy": 85.1,
    }
    goals = bench_peers.calibrator_goals(rows, kmp)
    within = goals["every_keras_mp_calibrator_within_0.3_point_of_float32"]
    assert within["measured"]["keras_mp entropy"] == -0.4
    assert within["pass"] is False  # entropy is 0.4 below
    best = goals["keras_mp_best_ptq_at_least_modelopt_best"]
    assert best["pass"] is True and best["modelopt"] == "ModelOpt entropy 85.10"
    kmp["best_ptq_method"] = "max"  # chosen on validation: 84.9 < 85.1
    assert not bench_peers.calibrator_goals(rows, kmp)[
        "keras_mp_best_ptq_at_least_modelopt_best"
    ]["pass"]
    title, text, verdict = render._goal_row(
        "keras_mp_best_ptq_at_least_modelopt_best", best
    )
    assert "keras_mp auto 85.20 vs ModelOpt entropy 85.10" in text
    assert verdict == "PASS"
