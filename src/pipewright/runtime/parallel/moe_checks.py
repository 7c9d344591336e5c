"""The checks a mixture-of-experts training run's options get before any worker starts (pure Python,
so the configuration imports no torch)."""

from __future__ import annotations

from typing import Any

from pipewright.errors import ConfigError
from pipewright.mesh import check_ep
from pipewright.models.spec import ModelSpec


def check_moe_run(config: Any, spec: ModelSpec) -> None:
    """One-line ConfigErrors for the training options a mixture of experts (or ep) cannot take."""
    ep = config.ep
    if ep < 1:
        raise ConfigError(f"--ep must be at least 1 (got {ep})")
    if not spec.is_moe:
        if ep > 1:
            raise ConfigError(f"--ep {ep} shards experts; add --moe-experts E (a multiple of {ep})")
        return
    check_ep(ep, config.dp)
    if spec.moe_experts % ep:
        raise ConfigError(
            f"--moe-experts {spec.moe_experts} is not divisible by --ep {ep}; choose ep dividing it"
        )
    for name, value in (
        ("--moe-ffn-hidden", spec.expert_ffn),
        ("shared experts' hidden size", spec.moe_shared_experts * spec.expert_ffn),
    ):
        if value % config.tp:
            raise ConfigError(f"{name} {value} is not divisible by --tp {config.tp}; choose t dividing it")
    if config.cp > 1 and spec.moe_capacity > 0:
        raise ConfigError(
            f"--moe-capacity {spec.moe_capacity:g} with --cp {config.cp} would cap each cp rank's own "
            "tokens, not the sequence's; use --moe-capacity 0 (dropless) with --cp"
        )
    if config.sequence_parallel:
        raise ConfigError(
            "--sequence-parallel splits the tokens a router sees over tp; drop it with --moe-experts"
        )
    if config.recompute == "full":
        raise ConfigError(
            "--recompute full would route every MoE layer twice; use selective or none with experts"
        )
    if ep > 1 and (config.shard_optimizer or config.reduce_fp32):
        flag = "--shard-optimizer" if config.shard_optimizer else "--reduce-fp32"
        raise ConfigError(f"{flag} reduces every gradient over dp; with --ep {ep} drop {flag}")
