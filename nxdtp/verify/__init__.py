"""``nxdtp verify``: does a model's tensor-parallel run equal the dense model, before accelerator hours are spent on it?

``verify(model, tp=2, dp=1, steps=3)`` builds the dense model once (a Hugging Face config, shrunk to a tiny one of the
same architecture unless ``full_size``, or ``factory=``'s model), starts ``tp * dp`` CPU processes over gloo, and on
each runs the dense model and its parallelized copy (the family's plan, HF's tp_plan, or ``plan=``) for ``steps``
optimizer steps on the same global batch, each DP rank its rows. It reports per step the losses, the gradient norms, the
largest parameter and gradient difference by name, and the replicated parameters whose copies drift apart across TP
ranks; ``report.passed`` says whether everything is within ``atol + rtol * |dense|``. The command line
(``nxdtp verify``) is ``nxdtp.verify.cli``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, List, Optional

from .compare import StepRow, failures, run_in_world, worst_parameter
from .models import Job, build_dense, check_job, default_model_class, plan_of, read_hf_config, tiny_config


@dataclasses.dataclass
class VerifyReport:
    """What ``verify`` found: ``rows`` (one ``StepRow`` per step completed), ``shrunk`` (the config changes of the
    tiny config), ``failures`` (each out-of-tolerance value, in step order), ``worst`` (the parameter to blame, None
    when none is), ``error`` (a step that raised, on the first rank that did)."""

    job: Job
    rows: List[StepRow]
    shrunk: List[str]
    failures: List[str]
    worst: Optional[str]
    error: Optional[str] = None

    @property
    def passed(self) -> bool:
        return not self.failures and self.error is None

    def lines(self) -> List[str]:
        """The report as printed: what ran, one line per step, the drift, PASS or FAIL."""
        job = self.job
        what = job.factory or getattr(job.config, "model_type", "?") + f" ({job.model_class})"
        lines = [f"nxdtp verify: {what}, tp={job.tp} x dp={job.dp}, {job.steps} {job.optimizer} steps, "
                 f"atol {job.atol:g}, rtol {job.rtol:g}"]
        if self.shrunk:
            lines.append("tiny config (--full-size keeps the real one): " + ", ".join(self.shrunk))
        for row in self.rows:
            lines.append(f"step {row.step}: loss dense {row.loss_dense:.8g} TP {row.loss_tp:.8g} | grad norm dense "
                         f"{row.norm_dense:.8g} TP {row.norm_tp:.8g} | max param diff {row.param.diff:.2e} "
                         f"({row.param.name}) | max grad diff {row.grad.diff:.2e} ({row.grad.name})")
        drift = {name: diff for row in self.rows for name, diff in row.drift.items()}
        lines.append("replicated parameters drifting across TP ranks: "
                     + (", ".join(f"{name} ({diff:.2e})" for name, diff in sorted(drift.items())) or "none"))
        if self.error is not None:
            lines.append(f"FAIL: the run raised at {self.error}")
        elif self.failures:
            lines += [f"  {failure}" for failure in self.failures[:10]]
            blame = f"; worst parameter: {self.worst}" if self.worst else ""
            lines.append(f"FAIL: {len(self.failures)} value(s) out of tolerance{blame}")
        else:
            lines.append("PASS")
        return lines


def verify(model: Any = None, *, factory: Optional[str] = None, plan: Optional[str] = None,
           batch: Optional[str] = None, model_class: Optional[str] = None, tp: int = 2, dp: int = 1, steps: int = 3,
           full_size: bool = False, seed: int = 0, batch_size: int = 2, seq_len: int = 16, atol: float = 1e-5,
           rtol: float = 1e-5, optimizer: str = "adamw", lr: float = 1e-3, timeout_s: float = 1800) -> VerifyReport:
    """Verify that the model's TP (x DP) run equals the dense model's, on ``tp * dp`` CPU processes started for it.

    ``model``: a Hugging Face model directory, a config.json, a model type ('llama'), or a transformers config
    (``model_class``: the class to build; default its first architecture, else its causal-LM, else masked-LM class);
    or ``factory``: 'module:function' returning the model. ``plan``: 'module:attr', an ``nxdtp.Plan`` or a function
    returning one (default: the family's plan, or HF's tp_plan). ``batch``: 'module:function' called as
    ``function(rows, seq_len, generator)`` for the global batch (default: token ids as inputs and labels).
    ``batch_size`` is per DP rank. Raises ValueError naming the value for bad input; returns the report otherwise.
    """
    from .launch import launch

    job = Job(tp=tp, dp=dp, steps=steps, seed=seed, batch_size=batch_size, seq_len=seq_len, atol=atol, rtol=rtol,
              optimizer=optimizer, lr=lr, factory=factory, plan=plan, batch=batch)
    check_job(job)
    if (model is None) == (factory is None):
        raise ValueError("give a model (directory, config.json, model type or transformers config) or factory= "
                         "('module:function'), not both and not neither")
    shrunk: List[str] = []
    if factory is None:
        config, model_class = (read_hf_config(model, model_class) if isinstance(model, str)
                               else (model, model_class or default_model_class(model)))
        config, shrunk = (copy.deepcopy(config), []) if full_size else tiny_config(config, tp, seq_len)
        config._attn_implementation = "eager"
        job = dataclasses.replace(job, config=config, model_class=model_class)
    plan_of(job)   # resolves, or names the value, before any process starts
    dense_state = build_dense(job).state_dict()
    rows, error = launch(job, dense_state, timeout_s=timeout_s)
    rows = rows or []
    return VerifyReport(job, rows, shrunk, failures(rows, job), worst_parameter(rows, job), error)


__all__ = ["verify", "VerifyReport", "Job", "run_in_world", "StepRow"]
