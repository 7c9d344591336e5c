"""DeepSeek-V3 on 2048 H800s as docs/moe.md simulates it, and with the compute on 112 of the 132 SMs.

DeepSeek-V3's report (arXiv 2412.19437, §3.2.2) runs its all-to-all kernels on 20 of an H800's 132
streaming multiprocessors while DualPipe overlaps them with computation; the computation keeps 112. The
cost model has no flag for that: this script prices it as GEMM and attention rates × 112/132 (the
memory-bound kernels are bandwidth-bound and keep their rate) and prints both iteration times beside
the published rate. Nothing is fitted: 20 SMs is the report's figure.

    PYTHONPATH=src python tools/deepseek_v3_sms.py
"""

from __future__ import annotations

from dataclasses import replace

from pipewright.cost.efficiency import default_efficiency
from pipewright.hardware import accelerator
from pipewright.mesh import Mesh
from pipewright.models.presets import resolve_model
from pipewright.plan.setup import cluster_topology, model_setup
from pipewright.schedules import build_schedule

GLOBAL_BATCH, SEQ, GPUS = 15360, 4096, 2048
PUBLISHED_TOKENS_PER_GPU = 14.8e12 / (2.664e6 * 3600)  # pre-training GPU-hours, Table 1


def iteration_time(compute_sms: int | None) -> float:
    """Seconds per iteration of the docs' FP8 DualPipeV row; ``compute_sms`` of 132 run the compute."""
    topo, gpu = cluster_topology("h800", 256, 8)
    efficiency = default_efficiency(accelerator("h800"))
    if compute_sms is not None:
        share = compute_sms / gpu.sms
        efficiency = replace(
            efficiency, gemm=efficiency.gemm * share, attention=efficiency.attention_rate * share
        )
    mesh = Mesh(1, 16, 128, ep=64)
    schedule = build_schedule("dualpipev", 16, GLOBAL_BATCH // 128)
    setup = model_setup(
        resolve_model("deepseek-v3"),
        topo,
        mesh,
        schedule,
        1,
        gpu=gpu,
        dtype="fp8",
        efficiency=efficiency,
        optimizer_sharding="zero1",
    )
    return setup.simulate().makespan


def main() -> None:
    for label, sms in (("all 132 SMs compute", None), ("112 SMs compute, 20 communicate", 112)):
        t = iteration_time(sms)
        rate = GLOBAL_BATCH * SEQ / t / GPUS
        print(f"{label:34s} {t:6.2f} s  {rate:6.0f} tokens/s/GPU  {rate / PUBLISHED_TOKENS_PER_GPU - 1:+.0%}")
    published = GLOBAL_BATCH * SEQ / GPUS / PUBLISHED_TOKENS_PER_GPU
    label, rate = "published (pre-training average)", PUBLISHED_TOKENS_PER_GPU
    print(f"{label:34s} {published:6.2f} s  {rate:6.0f} tokens/s/GPU")


if __name__ == "__main__":
    main()
