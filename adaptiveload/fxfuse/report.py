"""What the fusion pass found: one :class:`ChainRecord` per chain a pattern matched (a norm→modulate
chain for the built-in patterns), gathered in a :class:`FusionReport` with counts, the log summary
line and a printable table."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class ChainRecord:
    """One chain seen by the pass.

    Attributes:
        graph: the graph holding it: "" for the top-level graph, else the subgraph's attribute path
            (e.g. "wrap_body_0" for an activation-checkpointed region under Dynamo).
        node: the norm node's name in that graph.
        source: where the modulate was written, "file.py:123" (empty when the graph has no stack traces).
        norm: how the norm was written ("F.layer_norm", "nn.LayerNorm", "aten.layer_norm",
            "aten.native_layer_norm", "F.rms_norm", "nn.RMSNorm", "aten.rms_norm",
            "aten._fused_rms_norm", "x*rsqrt(mean(x²)+eps)"; a registered pattern's own words).
        affine: whether the norm has weight/bias.
        variant: the modulate's form, e.g. "norm*(1+scale)+shift", "addcmul", "norm+norm*scale".
        layout: the modulation layout ("per-sample", "per-token", "shared", or one per tensor).
        reason: why it was left alone; None when it was fused.
        pattern: the name of the pattern that matched it ("adaln_modulate", "rms_norm_modulate", or
            one added with ``register_pattern``).
    """

    graph: str
    node: str
    source: str
    norm: str
    affine: bool
    variant: str
    layout: str
    reason: Optional[str]
    pattern: str

    @property
    def fused(self) -> bool:
        return self.reason is None

    @property
    def location(self) -> str:
        return f"{self.graph}/{self.node}" if self.graph else self.node


@dataclass
class FusionReport:
    """Every chain one run of :func:`adaptiveload.fxfuse.fuse_adaln` saw, in graph order.

    Attributes:
        chains: the chains a pattern claimed, fused or skipped (what ``seen``, ``fused`` and
            ``skipped`` count).
        deferred: matches of a pattern registered ``falls_through`` that it rejected (each record's
            reason says why), so that the node went on to the next patterns; their chains, if any
            pattern claimed them, are also in ``chains``.
    """

    chains: list[ChainRecord] = field(default_factory=list)
    deferred: list[ChainRecord] = field(default_factory=list)

    @property
    def seen(self) -> int:
        return len(self.chains)

    @property
    def fused(self) -> int:
        return sum(c.fused for c in self.chains)

    @property
    def skipped(self) -> int:
        return self.seen - self.fused

    def patterns(self) -> list[str]:
        """The names of the patterns that matched a chain (or deferred one), in order of first appearance."""
        return list(dict.fromkeys(c.pattern for c in [*self.chains, *self.deferred]))

    def of_pattern(self, name: str) -> "FusionReport":
        """The report of the chains pattern ``name`` matched (and deferred)."""
        return FusionReport([c for c in self.chains if c.pattern == name],
                            [c for c in self.deferred if c.pattern == name])

    def skip_reasons(self) -> Counter:
        """How many chains were left alone for each reason."""
        return Counter(c.reason for c in self.chains if not c.fused)

    def summary(self) -> str:
        """One line: "fused N chains (M seen, K skipped: reasons)", then per pattern "[name: fused/seen, ...]",
        then, if any, "; D deferred to the next pattern: reasons"."""
        text = f"fused {self.fused} chains ({self.seen} seen, {self.skipped} skipped"
        reasons = self.skip_reasons()
        if reasons:
            text += ": " + "; ".join(f"{n}× {reason}" for reason, n in reasons.most_common())
        text += ")"
        if self.chains:
            parts = (f"{name} {part.fused}/{part.seen}" for name in self.patterns()
                     for part in [self.of_pattern(name)] if part.seen)
            text += " [fused/seen: " + ", ".join(parts) + "]"
        if self.deferred:
            deferred = Counter(f"{c.pattern}: {c.reason}" for c in self.deferred)
            text += f"; {len(self.deferred)} deferred to the next pattern: " + "; ".join(
                f"{n}× {reason}" for reason, n in deferred.most_common())
        return text

    def table(self) -> str:
        """A fixed-width table, one row per chain, then one per deferred match ("d0", ...), then the
        summary line."""
        header = ("#", "pattern", "location", "source", "norm", "variant", "modulation", "status")
        rows = [
            (
                str(i),
                c.pattern,
                c.location,
                c.source or "-",
                c.norm + (" (affine)" if c.affine else ""),
                c.variant,
                c.layout,
                "fused" if c.fused else f"skipped: {c.reason}",
            )
            for i, c in enumerate(self.chains)
        ] + [
            (f"d{i}", c.pattern, c.location, c.source or "-", c.norm + (" (affine)" if c.affine else ""), c.variant,
             c.layout, f"deferred: {c.reason}")
            for i, c in enumerate(self.deferred)
        ]
        widths = [max(len(r[k]) for r in rows + [header]) for k in range(len(header) - 1)]
        lines = []
        for row in [header] + rows:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
        return "\n".join(lines + [self.summary()])

    def __str__(self) -> str:
        return self.table()
