"""Atomic file writing: a temporary file in the target folder, then rename.

A failure mid-write leaves the previous file intact and no partial file.
"""

import contextlib
import os
import shutil
import tempfile


@contextlib.contextmanager
def atomic_path(path, suffix="", is_dir=False):
    """Yields a temporary path beside `path`; renames it over `path` on success.

    Args:
        path: str. Final file or folder path.
        suffix: str. Suffix for the temporary name (some writers check the
            extension, e.g. `.keras`).
        is_dir: bool. The writer creates a folder (e.g. a SavedModel).

    Raises:
        FileNotFoundError: the parent folder does not exist.
        PermissionError: the parent folder is not writable.
    """
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(
            f"Cannot write {path}: folder {parent} does not exist. Create it "
            "first."
        )
    if not os.access(parent, os.W_OK):
        raise PermissionError(
            f"Cannot write {path}: folder {parent} is not writable."
        )
    base = os.path.basename(path)
    tmp_dir = tempfile.mkdtemp(prefix=f".{base}.", dir=parent)
    tmp = os.path.join(tmp_dir, base + suffix if suffix else base)
    try:
        yield tmp
        if is_dir and os.path.isdir(path):
            old = tmp_dir + ".old"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def atomic_write_text(path, text):
    """Writes `text` to `path` atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
