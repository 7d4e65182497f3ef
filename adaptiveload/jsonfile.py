"""The project's JSON files (calibrations, plans, results, checkpoint metadata): atomic writes and
reads whose errors name the file."""
from __future__ import annotations

import json
import os


def _to_builtin(o):
    """numpy / torch scalars and arrays as plain Python values."""
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"cannot write {type(o).__name__} to JSON")


def write_json_atomic(path, data) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and ``os.replace``, so a crash
    never leaves a half-written file (numpy and torch values are converted); missing parent folders
    are created."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=_to_builtin)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path, what: str):
    """Parse the JSON file at ``path``.

    Args:
        path: file path.
        what: what the file should hold, for the error message ("calibration", "plan").

    Raises:
        FileNotFoundError: no such file ("<what> not found: <path>").
        ValueError: not valid JSON (the message starts with the path and gives the line).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} not found: {path}")
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON (line {err.lineno}: {err.msg})") from None


def check_header(doc, *, fmt: str, version: int, what: str, where: str, required=()) -> None:
    """Check a parsed project file's ``format``, ``version`` and required top-level fields.

    Args:
        doc: the parsed JSON.
        fmt, version: the expected ``format`` and ``version`` fields.
        what: the kind of file, for messages ("calibration", "plan").
        where: where it came from (a path), prefixed to every message.
        required: field names that must be present.

    Raises:
        ValueError: not a dict or another format, an unsupported version, a missing field (named).
    """
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise ValueError(f"{where}: not an adaptiveload {what} (field 'format' must be {fmt!r})")
    if doc.get("version") != version:
        raise ValueError(f"{where}: {what} format version {doc.get('version')!r} is not supported (expected {version})")
    for key in required:
        if key not in doc:
            raise ValueError(f"{where}: missing field '{key}'")
