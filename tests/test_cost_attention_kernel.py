"""The attention kernel as an input: published per-generation rates, the time they price, the CLI."""

import contextlib
import io
import json

import pytest

from pipewright.cli import main
from pipewright.cost.attention_kernels import kernel_efficiency
from pipewright.cost.layer import attention_flops
from pipewright.cost.transformer import TransformerCost
from pipewright.errors import ConfigError
from pipewright.hardware import accelerator
from pipewright.ir import F
from pipewright.mesh import Mesh
from pipewright.models.presets import resolve_model

LLAMA = resolve_model("llama3-8b")


def test_published_rates_and_defaults():
    assert kernel_efficiency("h100-sxm", None) == 0.64  # cuDNN, Transformer Engine's on Hopper
    assert kernel_efficiency("h100-hbm2e-96gb-500w", "fa2") == 0.35
    assert kernel_efficiency("h200", "fa3") == 0.66
    assert kernel_efficiency("a100-80gb", None) == 0.62
    assert kernel_efficiency("b200", None) is None  # no figure: the GEMM efficiency


@pytest.mark.parametrize(
    "gpu, kernel, message",
    [
        ("a100-80gb", "fa3", "no published fa3 attention figure for a100-80gb (kernels with one: fa2)"),
        ("b200", "fa2", "no published fa2 attention figure for b200"),
        ("h100-sxm", "xformers", "--attention-kernel must be one of fa2, fa3, cudnn"),
    ],
)
def test_unknown_or_unpublished_kernel_is_one_line(gpu, kernel, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kernel_efficiency(gpu, kernel)


def _f_time(kernel: str | None, attention: str = "flash") -> float:
    cost = TransformerCost(
        LLAMA, gpu="h100-sxm", mesh=Mesh(pp=1), attention=attention, attention_kernel=kernel
    )
    return cost.kind_time(cost.chunk_costs(1, (0, 1, 0)), F, 0)


def test_the_kernel_prices_exactly_the_flash_attention_core():
    peak = accelerator("h100-sxm").peak("bf16")
    core = attention_flops(LLAMA, 1) * 0.5  # the causal half the fused kernel runs
    gap = _f_time("fa2") - _f_time("fa3")
    assert gap == pytest.approx(core / peak * (1 / 0.35 - 1 / 0.66), rel=1e-9)
    # eager attention's batched GEMMs run at the GEMM efficiency, whatever the kernel
    assert _f_time("fa2", "eager") == pytest.approx(_f_time("fa3", "eager"), rel=1e-12)


def test_simulate_takes_the_kernel_and_refuses_one_without_a_figure(capsys):
    argv = ["simulate", "--model", "llama3-8b", "--gpu", "h100-sxm", "--nodes", "1", "--pp", "8"]
    argv += ["--schedule", "1f1b", "--global-batch-size", "8"]
    times = {}
    for kernel in ("fa2", "cudnn", None):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main([*argv, "--json"] + (["--attention-kernel", kernel] if kernel else [])) == 0
        times[kernel] = json.loads(out.getvalue())["iteration_time_s"]
    assert times["fa2"] > times["cudnn"] == times[None]
    a100 = ["--gpu", "a100-80gb", "--attention-kernel", "cudnn"]
    assert main([*argv, *a100]) != 0
    err = capsys.readouterr().err.strip()
    assert "no published cudnn attention figure for a100-80gb" in err and "\n" not in err


def test_the_cli_flag_lists_every_kernel_with_a_rate():
    import typing

    from pipewright.cost.attention_kernels import KERNEL_NAMES
    from pipewright.runspec.choices import AttentionKernel

    assert typing.get_args(AttentionKernel) == KERNEL_NAMES
