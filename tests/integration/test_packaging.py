"""The wheel users install holds the whole package and the command."""

import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_wheel_ships_every_module_and_the_keras_mp_command(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "--wheel-dir",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("keras_mp-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "keras-mp = keras_mp.cli:main" in z.read(entry_points).decode()
    modules = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "keras_mp").rglob("*.py")
    }
    assert modules <= names, sorted(modules - names)
