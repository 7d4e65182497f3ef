"""What every CPU benchmark records beside its numbers, and how it writes them (JSON + markdown)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys

import numpy as np
import torch


def run_context(script: str, argv: list[str] | None) -> dict:
    """Date (UTC), the exact command, and the machine and library versions of this run."""
    args = sys.argv[1:] if argv is None else argv
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", os.path.relpath(script), *args]),
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__}


def write_json_and_markdown(out_dir: str, stem: str, doc: dict, text: str) -> None:
    """Write ``doc`` to ``<out_dir>/<stem>.json`` and ``text`` to ``<out_dir>/<stem>.md``."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, stem)
    with open(path + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(path + ".md", "w") as f:
        f.write(text + "\n")
    print(f"wrote {path}.json and {path}.md")
