"""The planner's estimate and its simulation of one candidate layout of GPT hidden 1024 (16 layers, global
batch 16) on one node of 8 A100s under vTrain's setup (deepspeed-megatron's registered constants, fp16,
eager attention, full recomputation): what the measured-runs tests compare."""

from __future__ import annotations


def estimate_and_simulation(tp: int, pp: int, microbatch: int, calibration: str | None = None):
    """(the planner's estimate, its simulation) in seconds of tp × pp (dp = 8 / (tp · pp)) at
    ``microbatch``, priced with ``calibration`` (a `pipewright calibrate` file) where given."""
    from pipewright.cost import frameworks
    from pipewright.cost.efficiency import default_efficiency
    from pipewright.hardware import accelerator
    from pipewright.models.presets import resolve_model
    from pipewright.plan.mapping import device_order
    from pipewright.plan.problem import Candidate, Problem
    from pipewright.plan.search import _Context, estimate
    from pipewright.plan.simulated import simulate_plan
    from pipewright.topology import cluster

    eff = frameworks.framework("deepspeed-megatron").efficiency(default_efficiency(accelerator("a100-80gb")))
    spec = resolve_model("gpt", layers=16, hidden=1024, heads=16, vocab=50257, seq_len=1024)
    topo = cluster(1, 8, "a100-80gb")
    prob = Problem(
        spec,
        topo,
        16,
        recompute=("full",),
        schedules=("1f1b",),
        efficiency=eff,
        dtype="fp16",
        attention="eager",
        calibration=calibration,
    )
    dp = 8 // (tp * pp)
    candidate = Candidate(tp, pp, dp, microbatch, 16 // (dp * microbatch), "1f1b", 1, "full", False, "pp")
    ev = estimate(_Context(prob, device_order(topo)), candidate)
    simulate_plan(prob, ev)
    return ev.estimate, ev.simulated
