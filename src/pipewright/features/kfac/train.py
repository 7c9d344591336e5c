"""``pipewright train --optimizer kfac``: the feature's training plugin
(:mod:`pipewright.runtime.core.plugin`).

- build: the schedule with a ``KFAC_FILL`` in every predicted bubble and a ``KFAC_PRECOND`` after each
  stage's last W (:func:`~.fill.slot_schedule`, the one rewrite this feature makes);
- optimizer: K-FAC over the stages' covered linears with ``--kfac-base`` (sgd, adamw or lamb) as the base
  update; ``--kfac-fill all``: every bubble runs all pending tasks (reproducible). Mixed precision
  (``--precision bf16/fp16``): the base update steps the fp32 masters, and the masters' optimizer
  becomes this one (:class:`~pipewright.runtime.parallel.zero.MasterOptimizer` calls its ``step`` once the
  unscaled, clipped fp32 master gradients are set), so preconditioning and KL-clipping act on them;
  fp16's saved output gradients are unscaled by the loss scale;
- executor parts: the bubble handlers (``--kfac-opportunistic``: also the waiting receives').

The optimizer implements :class:`~pipewright.runtime.checkpointing.checkpoint.ExtraState` itself (factors,
inverses,
a refresh in progress), so checkpoints carry it without a plugin call.
"""

from __future__ import annotations

import math
from typing import Any

from pipewright.errors import ConfigError
from pipewright.features.kfac.options import KfacOptions
from pipewright.options import section_of
from pipewright.runtime.core.plugin import (
    BuildContext,
    Built,
    ExecutorParts,
    OptimizerContext,
    TrainingPlugin,
)


class KfacPlugin(TrainingPlugin):
    """K-FAC in the bubbles of the trainer's schedule (see the module)."""

    @classmethod
    def active(cls, config: Any, schedule: Any) -> bool:
        return config.optimizer == "kfac"

    def build(self, ctx: BuildContext) -> Built:
        from pipewright.features.kfac.fill import slot_schedule

        self.compute = ctx.schedule
        slotted, self.budgets = slot_schedule(ctx.schedule)
        return Built(schedule=slotted)

    def optimizer(self, ctx: OptimizerContext) -> Any:
        from pipewright.features.kfac.kfac import covered_layers
        from pipewright.features.kfac.optimizer import build_base
        from pipewright.features.kfac.runtime import attach_slotted
        from pipewright.features.kfac.state import StateNames, layout_name
        from pipewright.runtime.parallel.tp import sharded_parameters

        options = section_of(ctx.config, KfacOptions)
        c, b = ctx.config, ctx.build
        mesh, master, stages = b.mesh, ctx.master, b.stages
        if master is not None and master.shard:
            raise ConfigError("--optimizer kfac does not combine with --shard-optimizer; drop one of them")
        stepped = master.masters if master is not None else ctx.params
        base = build_base(options.base, stepped.items(), c.lr, c.weight_decay)
        sharded = {id(p) for mod in stages.values() for p in sharded_parameters(mod)}
        suffix = f"#tp{mesh.tp_rank}of{mesh.tp}"
        layers = tuple(
            name + (suffix if id(m.weight) in sharded else "")
            for _, mod in sorted(stages.items())
            for name, m in covered_layers(mod)
        )
        sched = self.compute
        layout = layout_name(
            sched.name,
            sched.num_stages,
            sched.num_microbatches,
            (mesh.pp, mesh.tp, mesh.dp),
            str(b.run.layout),
        )
        names = StateNames(layout, f"pp{mesh.pp_rank}.tp{mesh.tp_rank}.dp{mesh.dp_rank}", layers)
        scaler = ctx.options.scaler
        opt, self.handlers = attach_slotted(
            dict(stages),
            sched,
            self.budgets,
            base,
            dp_group=mesh.dp_group,
            dp=mesh.dp,
            grad_scale=float(sched.num_microbatches * c.microbatch_size * b.boundary_shape[1]),
            opportunistic=options.opportunistic,
            loss_scale=(lambda: scaler.scale) if scaler is not None else None,
            names=names,
        )
        if options.fill == "all":
            opt.worker.fill_scale = math.inf
        self.opt = opt
        if master is not None:
            opt.kfac.set_masters({id(master.params[n]): m for n, m in master.masters.items()})
            master.optimizer = opt  # MasterOptimizer.step: masters' gradients set, then this step
        return opt

    def follow_plan(self, plan: Any) -> None:
        """Under ``--measure`` (meta tensors: nothing can be timed): the bubbles run ``plan``'s tasks
        (a :class:`~.memory.FillPlan`, the simulator's placement by predicted durations) and the
        factors and inverses exist as a finished refresh leaves them (fp32, d_a² and d_out² a layer),
        so the step measured is a steady recording iteration."""
        import torch

        from pipewright.features.kfac.factors import factor_dtype

        kfac = self.opt.kfac
        if plan.layers != len(kfac.layers):
            raise ConfigError(
                f"K-FAC's bubble plan counts {plan.layers} covered layers, this rank has {len(kfac.layers)}"
            )
        self.opt.worker.planned = dict(plan.fills)
        for st in kfac.layers:
            w = st.module.weight
            dims = {"a": w.shape[1] + int(st.bias), "b": w.shape[0]}
            for name, n in (("a", dims["a"]), ("b", dims["b"]), ("a_inv", dims["a"]), ("b_inv", dims["b"])):
                setattr(st, name, torch.zeros(n, n, dtype=factor_dtype(w.dtype), device=w.device))

    def executor_parts(self, ctx: OptimizerContext) -> ExecutorParts:
        return ExecutorParts(handlers=self.handlers)
