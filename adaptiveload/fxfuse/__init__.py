"""Find every adaptive-LayerNorm modulate chain ``LayerNorm(x) * (1 + scale) + shift`` of an FX graph
and rewrite it into ``torch.ops.adaptiveload.adaln_modulate``.

* :func:`fuse_adaln` -- the standalone rewrite of a ``torch.fx.GraphModule`` (Dynamo,
  ``symbolic_trace`` or ``torch.export`` graphs), returning a :class:`FusionReport`.
* :func:`adaptiveload_backend` -- the ``torch.compile`` backend (``backend="adaptiveload"``):
  the rewrite, then Inductor.
* :func:`collect_reports` -- a context manager yielding the list of the :class:`FusionReport` of
  every backend call made inside it.
"""
from adaptiveload.fxfuse.backend import adaptiveload_backend, collect_reports
from adaptiveload.fxfuse.report import ChainRecord, FusionReport
from adaptiveload.fxfuse.rewrite import fuse_adaln

__all__ = ["fuse_adaln", "FusionReport", "ChainRecord", "adaptiveload_backend", "collect_reports"]
