"""The train job's printed report (adaptiveload/train/report.py)."""
from adaptiveload.train.report import _rows


def _run(**fields):
    return {"backend": "adaptiveload(inductor)", "policy": "dual", "status": "ok", **fields}


def test_compiles_in_timed_steps_name_their_steps():
    rows = dict(_rows(_run(compiled_graphs=7, compiled_graphs_in_training=2, compile_steps=[4, 9])))
    assert rows["compiled graphs (in timed steps)"] == "7 (2; steps 4, 9)"
    rows = dict(_rows(_run(compiled_graphs=6, compiled_graphs_in_training=0, compile_steps=[])))
    assert rows["compiled graphs (in timed steps)"] == "6 (0)"
    rows = dict(_rows(_run(compiled_graphs=6, compiled_graphs_in_training=0)))  # results written before the field
    assert rows["compiled graphs (in timed steps)"] == "6 (0)"
