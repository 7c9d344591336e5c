"""Mixed precision for the pipeline runtime: compute dtype, dynamic loss scaling, fp32 gradient reduction.

Scheme (Micikevicius et al., "Mixed Precision Training", 2018; Megatron-LM's bf16/fp16 modes):

- The stage modules hold their parameters in the compute dtype (bf16 or fp16), so the forward, the
  backward and what crosses a stage boundary (activations forward, their gradients backward) are in
  that dtype; the loss is computed in fp32 from the logits (``loss_fn`` upcasts).
- fp32 master weights and fp32 optimizer state live in
  :class:`pipewright.runtime.parallel.zero.MasterOptimizer`;
  after the step, the masters are cast back into the compute-dtype parameters.
- fp16 only: dynamic loss scaling. The loss is multiplied by S before the backward; the gradients
  are divided by S on their way into the fp32 master gradients. If any gradient is inf/NaN (the global
  gradient norm is not finite: the same verdict on every rank), the step is skipped and S halves;
  after ``growth_interval`` good steps in a row S doubles. bf16 has fp32's exponent range: S = 1.
- On request (``reduce_fp32``), the data-parallel gradient reduction sums in fp32: a REDUCE_GRAD
  handler that upcasts the flattened gradients before the all-reduce (the executor's own handler
  reduces in the gradients' dtype).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Mapping as MappingT
from types import MappingProxyType

import torch

from pipewright.errors import ConfigError
from pipewright.runtime.core.executor import start_reduction

PRECISIONS: MappingT[str, torch.dtype] = MappingProxyType(
    {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the stages compute in for ``--precision``."""
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)} (got {precision!r})") from None


class LossScaler:
    """Dynamic loss scale S (fp16): halve on overflow (the step is skipped), double after
    ``growth_interval`` finite steps in a row."""

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 1000) -> None:
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped = 0

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps, so a resumed fp16 run continues with the same scale."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state["skipped"])

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(self.scale / 2, 1.0)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2


class ScaledLoss:
    """``loss_fn(output, target) · S``: what the executor backpropagates under fp16 (S read at call
    time, so the scaler may change it between iterations); unscaled when gradients are off."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], scaler: LossScaler) -> None:
        self.loss_fn, self.scaler = loss_fn, scaler

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(output, target)
        # a forward-only pass (evaluation, no_grad) reports the plain loss; only backward needs S
        return loss * self.scaler.scale if torch.is_grad_enabled() else loss


def is_finite(value: float) -> bool:
    return math.isfinite(value)


def reduce_grad_fp32(state, action) -> None:
    """REDUCE_GRAD handler: the executor's asynchronous data-parallel all-reduce of the stage's
    gradients, summed in fp32 (the averaged result is written back into the compute-dtype gradients
    by the executor's ``finish_reduction``)."""
    start_reduction(state, action.stage, torch.float32)
