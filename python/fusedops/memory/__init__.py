"""Memory of a training step: measured (profile_step -> MemoryReport) and planned (plan ->
MemoryPlan), in the same categories: parameters, gradients, optimizer state, activations,
logits/loss scratch, attention scratch and other.

    from fusedops.memory import plan, profile_step
    report = profile_step(model, {"input_ids": ids, "labels": ids})
    print(report.table())
    print(plan(model.config, batch=1, seq=8192).table())

`python -m fusedops.memory --help` compares stock transformers with fusedops on a Llama model.
"""

from fusedops.memory.planner import MemoryPlan, ModelShape, Switch, plan
from fusedops.memory.profile import default_step, profile_step
from fusedops.memory.report import CATEGORIES, LABELS, MemoryReport, format_bytes, plot_reports

__all__ = ["CATEGORIES", "LABELS", "MemoryPlan", "MemoryReport", "ModelShape", "Switch",
           "default_step", "format_bytes", "plan", "plot_reports", "profile_step"]
