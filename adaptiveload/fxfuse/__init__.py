"""Find the norm→modulate chains of an FX graph and rewrite each into one fused op: every
``LayerNorm(x) * (1 + scale) + shift`` into ``torch.ops.adaptiveload.adaln_modulate``, every
``rms_norm(x) * (1 + scale) [+ shift]`` into ``torch.ops.adaptiveload.rms_norm_modulate``, the
residual update in front of a site with it (``residual_*_modulate``), Wan's q/k RMSNorm → RoPE into
``rms_norm_rope`` (on CPU), and what any pattern added with :func:`register_pattern` matches into its op.

* :func:`fuse_adaln` -- the standalone rewrite of a ``torch.fx.GraphModule`` (Dynamo,
  ``symbolic_trace`` or ``torch.export`` graphs), returning a :class:`FusionReport`.
* :func:`adaptiveload_backend` -- the ``torch.compile`` backend (``backend="adaptiveload"``):
  the rewrite, then Inductor.
* :func:`collect_reports` -- a context manager yielding the list of the :class:`FusionReport` of
  every backend call made inside it.
* :func:`register_pattern` / :func:`unregister_pattern` / :func:`patterns` -- the pattern registry
  (see :mod:`adaptiveload.fxfuse.registry` for what a pattern is).
"""
from adaptiveload.fxfuse.backend import adaptiveload_backend, collect_reports
from adaptiveload.fxfuse.registry import Match, Pattern, patterns, register_pattern, unregister_pattern
from adaptiveload.fxfuse.report import ChainRecord, FusionReport
from adaptiveload.fxfuse.rewrite import fuse_adaln

__all__ = ["fuse_adaln", "FusionReport", "ChainRecord", "adaptiveload_backend", "collect_reports",
           "register_pattern", "unregister_pattern", "patterns", "Match", "Pattern"]
