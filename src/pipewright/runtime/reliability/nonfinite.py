"""Non-finite loss or gradients, detected on every rank before the optimizer step.

Each rank tests its own gradients (one fused ``isfinite`` reduction per stage, read in one device
transfer); one all-reduce (MAX) over all ranks makes every rank agree whether anyone saw a NaN or inf,
and only then (the rare path) the ranks exchange which step, stage and parameter it was. The
all-reduce also carries other per-step flags (preemption: :mod:`pipewright.runtime.reliability.elastic`), so
the
agreement costs one small collective per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pipewright.errors import ConfigError
from pipewright.runtime.core.distributed_errors import DistributedError
from pipewright.runtime.reliability.timeouts import wait_or_raise

POLICIES = ("stop", "skip")

#: steps in a row that ``--on-nonfinite skip`` may skip before the run stops: a spike skips a step or
#: two; ten without an update mean broken weights or data, and a run would otherwise end with exit 0
#: having learnt nothing
MAX_SKIPPED_IN_A_ROW = 10


class NonFiniteError(DistributedError):
    """The loss or a gradient is NaN or inf and the policy is ``stop``."""


@dataclass(frozen=True)
class Finding:
    """One non-finite value: where it appeared."""

    rank: int
    stage: int | None  # None: the loss
    parameter: str
    what: str  # "nan" or "inf"

    def describe(self) -> str:
        if self.stage is None:
            return f"loss is {self.what}"
        return f"{self.what} gradient in stage {self.stage}, parameter {self.parameter} (rank {self.rank})"


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ConfigError(f"--on-nonfinite {policy!r}: choose one of {', '.join(POLICIES)}")
    return policy


def local_flag(stages: Mapping[int, nn.Module]) -> bool:
    """True when any gradient of this rank's stages holds a NaN or inf (one device sync)."""
    oks = [
        torch.isfinite(p.grad).all() for m in stages.values() for p in m.parameters() if p.grad is not None
    ]
    return bool(oks) and not bool(torch.stack(oks).all())


def local_findings(stages: Mapping[int, nn.Module], rank: int) -> list[Finding]:
    """Every parameter of this rank's stages whose gradient is not finite (slow path: per parameter)."""
    found = []
    for s, module in sorted(stages.items()):
        for name, p in module.named_parameters():
            g = p.grad
            if g is not None and not bool(torch.isfinite(g).all()):
                found.append(Finding(rank, s, name, "nan" if bool(torch.isnan(g).any()) else "inf"))
    return found


def agree_flags(flags: Sequence[bool], device: torch.device, timeout_s: float | None = None) -> list[bool]:
    """Collective over all ranks: each flag OR-ed over the ranks (one all-reduce), waited at most
    ``timeout_s`` seconds (:class:`~pipewright.runtime.core.distributed_errors.CollectiveTimeout` after)."""
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    if dist.is_initialized():
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
        wait_or_raise(work, timeout_s, device, "the per-step flag all-reduce (non-finite values, preemption)")
    return [bool(v) for v in t.tolist()]


def gather_findings(mine: list[Finding]) -> list[Finding]:
    """Collective: every rank's findings, by rank."""
    if not dist.is_initialized():
        return mine
    everyone: list[list[Finding] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [f for part in everyone for f in part or []]


def report(step: int, findings: list[Finding], policy: str) -> str:
    """One line: the step, the first finding (stage and parameter) and how many more; the action taken."""
    if not findings:
        findings = [Finding(-1, None, "loss", "not finite")]
    first = findings[0].describe()
    more = f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""
    action = (
        "skipped the optimizer step (--on-nonfinite skip)"
        if policy == "skip"
        else "stopped; pass --on-nonfinite skip to skip such steps"
    )
    return f"step {step}: non-finite values: {first}{more}; {action}"


def loss_finding(loss: float) -> list[Finding]:
    return [] if math.isfinite(loss) else [Finding(0, None, "loss", "nan" if math.isnan(loss) else "inf")]


def skip_streak_error(in_a_row: int, steps: int | None, limit: int = MAX_SKIPPED_IN_A_ROW) -> str | None:
    """The line that stops a ``--on-nonfinite skip`` run whose last ``in_a_row`` steps were all
    skipped, once that reaches ``limit`` or every one of the run's ``steps`` (None: not known); else
    None."""
    whole_run = steps is not None and 0 < steps <= in_a_row
    if in_a_row < limit and not whole_run:
        return None
    what = f"all {in_a_row} steps of the run" if whole_run else f"{in_a_row} steps in a row"
    return (
        f"--on-nonfinite skip skipped {what} (non-finite values every time, no update applied); stopped "
        f"(the limit is {limit} in a row)"
    )
