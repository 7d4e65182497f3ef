"""adaptiveload.jsonfile: atomic JSON writes."""
import json

import numpy as np

from adaptiveload.jsonfile import write_json_atomic


def test_write_creates_missing_folders_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "runs" / "a" / "plan.json"
    write_json_atomic(path, {"m_mem": np.int64(2100), "b": np.array([1, 2])})
    assert json.loads(path.read_text()) == {"m_mem": 2100, "b": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]
