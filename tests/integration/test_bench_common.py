"""The command line and results writer every benchmark shares
(`benchmarks/_common.py`): each `bench_*.py` parses its options with
`bench_parser` and writes with `write_results`, and a `--quick` run never
replaces the measured figures. Nothing is measured here."""

import ast
import json
import os
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)

import _common  # noqa: E402

SCRIPTS = sorted(
    f for f in os.listdir(BENCH) if f.startswith("bench_") and f.endswith(".py")
)


def _calls(tree):
    """{name: [call nodes]} of the functions `tree` calls by name."""
    calls = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = getattr(func, "attr", None) or getattr(func, "id", None)
            calls.setdefault(name, []).append(node)
    return calls


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_uses_the_shared_command_line(script):
    with open(os.path.join(BENCH, script)) as f:
        source = f.read()
    calls = _calls(ast.parse(source))
    assert "bench_parser" in calls, f"{script}: parse with bench_parser"
    assert "ArgumentParser" not in calls, script
    assert '"--quick" in sys.argv' not in source, script
    for call in calls.get("write_results", []):
        keywords = {k.arg for k in call.keywords}
        assert "quick" in keywords, f"{script}: write_results(..., quick=)"


def test_bench_parser_gives_quick_and_the_docstring():
    parser = _common.bench_parser("First line.\n\nMore.", "smoke run: 1 row")
    _common.add_only(parser, ["a", "b"])
    args = parser.parse_args(["--quick", "--only", "b"])
    assert args.quick and args.only == ["b"]
    assert not parser.parse_args([]).quick
    text = parser.format_help()
    assert "More." in text and "smoke run: 1 row" in text
    with pytest.raises(SystemExit):
        parser.parse_args(["--only", "c"])


def test_modelopt_options(tmp_path):
    parser = _common.bench_parser("Doc.")
    _common.add_modelopt(parser, str(tmp_path / "none"))
    assert _common.modelopt_venv(parser.parse_args(["--no-modelopt"])) == (
        None,
        "not run (--no-modelopt)",
    )
    venv, status = _common.modelopt_venv(parser.parse_args([]))
    assert venv == str(tmp_path / "none")
    assert status == f"not run: no ModelOpt environment at {venv}"


def test_verdicts_json():
    checks = {"top1": (True, "85.0%"), "lint": (False, "2 violations")}
    assert _common.verdicts_json(checks) == {
        "top1": {"pass": True, "measured": "85.0%"},
        "lint": {"pass": False, "measured": "2 violations"},
    }
    assert _common.verdicts_json(checks, "figures")["lint"] == {
        "pass": False,
        "figures": "2 violations",
    }


@pytest.mark.parametrize("quick", [True, False])
def test_write_results(quick, tmp_path, monkeypatch, capsys):
    rendered = []
    monkeypatch.setattr(_common, "RESULTS", str(tmp_path))
    monkeypatch.setattr(_common, "versions", lambda: {"keras_mp": "0.1.0"})
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_x.py", "--quick"])
    monkeypatch.setitem(
        sys.modules,
        "render_docs",
        types.SimpleNamespace(render=lambda: rendered.append(True)),
    )
    _common.write_results("x", {"rows": [1]}, "| a |", quick=quick)
    name = "x_quick" if quick else "x"
    assert sorted(os.listdir(tmp_path)) == [f"{name}.json", f"{name}.md"]
    with open(tmp_path / f"{name}.json") as f:
        assert json.load(f) == {
            "rows": [1],
            "command": "python benchmarks/bench_x.py --quick",
            "versions": {"keras_mp": "0.1.0"},
        }
    with open(tmp_path / f"{name}.md") as f:
        assert f.read() == (
            "Command: `python benchmarks/bench_x.py --quick`\n\n"
            "Versions: keras_mp 0.1.0\n\n| a |\n"
        )
    assert capsys.readouterr().out == "| a |\n"
    assert rendered == ([] if quick else [True])  # docs after full runs only
