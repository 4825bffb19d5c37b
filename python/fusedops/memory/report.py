"""MemoryReport: the peak memory of one training step, broken down by what holds it."""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass, field

# Category keys, in the order tables and plots show them, and their printed names.
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "logits_loss",
              "attention", "other")
LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "logits_loss": "logits/loss scratch",
    "attention": "attention scratch",
    "other": "other",
}
COLORS = {
    "parameters": "#4c72b0",
    "gradients": "#55a868",
    "optimizer_state": "#8172b2",
    "activations": "#ccb974",
    "logits_loss": "#c44e52",
    "attention": "#dd8452",
    "other": "#9d9d9d",
}
GIB = float(1 << 30)
MIB = float(1 << 20)


def format_bytes(n: float) -> str:
    """1.23 GiB, 45.6 MiB or 789 KiB."""
    n = float(n)
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.0f} KiB"


@dataclass
class Breakdown:
    """Bytes per category at the peak of a step, the peak and its moment: what a measured
    report and a plan share."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    logits_loss: int = 0
    attention: int = 0
    other: int = 0
    peak_bytes: int = 0
    peak_phase: str = ""

    def categories(self) -> dict:
        """{category: bytes at the peak}, in CATEGORIES order."""
        return {k: int(getattr(self, k)) for k in CATEGORIES}


@dataclass
class MemoryReport(Breakdown):
    """Peak memory of one training step and what held it at that moment (bytes).

    The seven category fields add up to `peak_bytes`. `details` splits "other" by what
    allocated it; `at_forward_end` is the same breakdown once the first forward pass has
    returned, just before the next allocation (what the forward leaves for the backward);
    `totals` are the exact sizes of the parameters, the gradients (at the end of the backward
    pass) and the optimizer state (at the end of the step), whatever the peak held. `method`
    says how it was measured ("cuda-snapshot" or "cpu-dispatch-tracker") and `notes` what the
    measurement cannot see. `largest` lists the biggest blocks live at the peak (bytes,
    category, phase, region, the innermost stack frame outside torch).
    """

    device: str = "cpu"
    method: str = ""
    label: str = ""
    step_seconds: float | None = None
    max_allocated_bytes: int | None = None  # CUDA: torch.cuda.max_memory_allocated in the step
    details: dict = field(default_factory=dict)
    at_forward_end: dict = field(default_factory=dict)
    totals: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    largest: list = field(default_factory=list, repr=False)
    snapshot: dict | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        """Everything but the snapshot, as plain JSON-able values."""
        return dict(label=self.label, device=self.device, method=self.method,
                    peak_bytes=int(self.peak_bytes), peak_phase=self.peak_phase,
                    categories=self.categories(), details=dict(self.details),
                    at_forward_end=dict(self.at_forward_end), totals=dict(self.totals),
                    max_allocated_bytes=self.max_allocated_bytes,
                    step_seconds=self.step_seconds, notes=list(self.notes),
                    largest=[dict(b) for b in self.largest])

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    def table(self, plan=None) -> str:
        """The breakdown as text; with `plan` (a MemoryPlan) its estimate in a second column."""
        title = f"peak memory of one training step{f' ({self.label})' if self.label else ''}"
        head = f"{'':22}{'measured':>12}{'share':>7}"
        if plan is not None:
            head += f"{'planned':>12}"
        lines = [title, f"  device {self.device}, {self.method}, peak during {self.peak_phase}",
                 head]
        planned = plan.categories() if plan is not None else {}
        for k, v in self.categories().items():
            share = 100.0 * v / self.peak_bytes if self.peak_bytes else 0.0
            row = f"  {LABELS[k]:20}{format_bytes(v):>12}{share:6.1f}%"
            if plan is not None:
                row += f"{format_bytes(planned[k]):>12}"
            lines.append(row)
        row = f"  {'total at peak':20}{format_bytes(self.peak_bytes):>12}{'':7}"
        if plan is not None:
            err = (plan.peak_bytes - self.peak_bytes) / self.peak_bytes if self.peak_bytes else 0
            row += (f"{format_bytes(plan.peak_bytes):>12}  ({err:+.0%}, peak during "
                    f"{plan.peak_phase})")
        lines.append(row)
        if self.max_allocated_bytes is not None:
            lines.append("  torch.cuda.max_memory_allocated: "
                         f"{format_bytes(self.max_allocated_bytes)}")
        if self.details:
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.details.items() if v)
            if parts:
                lines.append(f"  other: {parts}")
        return "\n".join(lines)

    def save_snapshot(self, path: str) -> str:
        """Writes the CUDA allocator snapshot (a pickle that pytorch.org/memory_viz opens).
        Raises when the step ran without CUDA (the CPU tracker keeps no snapshot)."""
        if self.snapshot is None:
            raise ValueError("this report has no CUDA memory snapshot (it was measured on "
                             f"{self.device} with {self.method})")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump(self.snapshot, f)
        return path

    def plot(self, path: str, other: MemoryReport | None = None, *, plans=None) -> str:
        """Stacked bars of the categories at the peak (GiB or MiB), this report next to `other`
        (e.g. fusedops off vs on) when given; `plans` (one MemoryPlan per bar, or None) adds
        the planner's total as a marker. Needs matplotlib."""
        reports = [self] if other is None else [self, other]
        return plot_reports(path, reports, plans=plans)


def plot_reports(path: str, reports, *, plans=None, title: str | None = None) -> str:
    """Stacked bars of several MemoryReports (or MemoryPlans: anything with categories(),
    peak_bytes and label) side by side, written as a PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("MemoryReport.plot needs matplotlib: pip install matplotlib") from exc
    reports = list(reports)
    top = max([r.peak_bytes for r in reports] + [p.peak_bytes for p in plans or () if p])
    unit, scale = ("GiB", GIB) if top >= GIB else ("MiB", MIB)
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(reports), 4.8))
    xs = range(len(reports))
    bottoms = [0.0] * len(reports)
    for k in CATEGORIES:
        vals = [r.categories()[k] / scale for r in reports]
        ax.bar(xs, vals, bottom=bottoms, color=COLORS[k], label=LABELS[k], width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    for x, r in zip(xs, reports, strict=True):
        ax.text(x, r.peak_bytes / scale, f"{r.peak_bytes / scale:.2f}", ha="center",
                va="bottom", fontsize=9)
    if plans:
        for x, p in zip(xs, plans, strict=False):
            if p is not None:
                ax.plot([x - 0.35, x + 0.35], [p.peak_bytes / scale] * 2, "k--", lw=1)
        ax.plot([], [], "k--", lw=1, label="planner estimate")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r.label or f"run {i}" for i, r in enumerate(reports)])
    ax.set_ylabel(f"{unit} at the peak")
    ax.set_title(title or "peak memory of one training step", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], fontsize=8, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
