"""Training frameworks (``--framework NAME`` on ``pipewright simulate`` and ``pipewright plan``): what each
runs by default, and its calibration.

The analytical cost model is calibrated on Megatron-Core with Transformer Engine (the rows docs/fidelity.md
marks "fit"). Another framework differs in two ways, kept apart here:

- **What it runs** (``defaults``): inputs the cost model already has, set the way the framework sets them
  unless the user gives the flag: ``--kernels`` (eager PyTorch or ``torch.compile``'d blocks against
  fused Transformer Engine kernels), ``--attention-kernel``, ``--grad-dtype``, ``--fsdp-grad-sync``,
  ``--stage-outputs``, ``--cp-comm`` (the context-parallel implementation, :mod:`pipewright.cost.cp_impls`).
  Each is stated by the framework's code or configs (the entry's ``summary`` says where).
- **Its tensor-parallel overlap** (``tp_overlap``): the :mod:`pipewright.cost.tp_overlap` mode a bare
  ``--tp-comm-overlap`` names (:func:`tp_comm_overlap`): Megatron-Core's ``--tp-comm-overlap`` is
  Transformer Engine's userbuffers overlap (``te``), torchtitan's ``enable_async_tensor_parallel`` is
  PyTorch's asynchronous TP (``async-tp``); None where the framework's code has none (then the bare
  flag is a one-line error and a mode must be named). A mode given explicitly always wins.
- **How fast its step runs beyond that** (two calibration parameters, least-squares fitted by
  ``tools/fit_frameworks.py`` on at most half of the framework's published rows; the entry's
  ``fitted_on`` names them): a compute factor c that scales the GEMM efficiency (every GEMM takes 1/c of
  its Megatron time; the attention kernels keep their published rates) and a fixed τ_f seconds per layer
  and forward (2τ_f more per backward, as :attr:`~pipewright.cost.efficiency.Efficiency.layer_overhead`
  prices it): the per-step host, launch and per-parameter costs the fused Megatron rows do not have. So
  a layer's pass costs ``GEMM / c + attention + memory traffic + communication + (τ + τ_f) · n_pass``.

New frameworks are added with :func:`register`; ``megatron`` (the default) changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from pipewright.cost import tp_overlap as tp_modes
from pipewright.cost.dispatch import dispatch as dispatch_model
from pipewright.cost.efficiency import Efficiency
from pipewright.errors import ConfigError
from pipewright.named_registry import Registry

#: the command-line inputs a framework may set by default (argparse ``dest`` names; each defaults to
#: None on ``simulate`` and ``plan``, so a flag the user gives always wins)
DEFAULTABLE = ("kernels", "attention_kernel", "grad_dtype", "fsdp_grad_sync", "stage_outputs", "cp_comm")
DEFAULT_FRAMEWORK = "megatron"


@dataclass(frozen=True)
class Framework:
    """One training framework (module docstring). ``compute`` c > 0 scales the GEMM efficiency;
    ``overhead`` τ_f ≥ 0 is added to the per-layer overhead (seconds per layer and forward);
    ``dispatch``: how its code launches kernels (a :mod:`pipewright.cost.dispatch` model) and
    ``host_per_kernel`` δ the host seconds per launch (0: the launches' floor is not priced, for want of
    measured small-work runs of the framework); ``fitted_measured``: the measured runs c and δ were
    fitted on (``pipewright calibrate``) where they were not fitted on published rows;
    ``tp_overlap``: the registered ``--tp-comm-overlap`` mode the framework runs (None: it has none)."""

    name: str
    summary: str
    defaults: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    compute: float = 1.0
    overhead: float = 0.0
    fitted_on: tuple[str, ...] = ()
    tp_overlap: str | None = None
    dispatch: str = "fused"
    host_per_kernel: float = 0.0
    fitted_measured: str = ""  # the measured sweep c and δ were fitted on instead of published rows
    optimizer_bytes: float = 0.0  # bytes per parameter its optimizer step moves (0: not priced)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.defaults) - set(DEFAULTABLE))
        if unknown:
            raise ConfigError(f"framework {self.name}: cannot set {', '.join(unknown)} by default")
        dispatch_model(self.dispatch)  # one line for an unknown model
        if not self.compute > 0 or self.overhead < 0 or self.host_per_kernel < 0:
            raise ConfigError(f"framework {self.name}: compute must be > 0 and overhead ≥ 0")
        if self.tp_overlap is not None and self.tp_overlap not in set(tp_modes.modes()) - {"none"}:
            known = ", ".join(m for m in tp_modes.modes() if m != "none")
            raise ConfigError(f"framework {self.name}: tp_overlap must be one of {known} or None")
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))

    @property
    def neutral(self) -> bool:
        """True when the calibration changes nothing (c = 1, τ_f = 0, no launches or step priced)."""
        return (
            self.compute == 1.0
            and self.overhead == 0.0
            and self.host_per_kernel == 0.0
            and not self.optimizer_bytes
        )

    def efficiency(self, base: Efficiency) -> Efficiency:
        """``base`` (the accelerator's Megatron calibration) as this framework runs: GEMM efficiency × c,
        per-layer overhead + τ_f; eager attention (no separate rate) follows the GEMMs."""
        if self.neutral:
            return base
        overhead = base.layer_overhead + self.overhead
        return replace(
            base,
            gemm=base.gemm * self.compute,
            layer_overhead=overhead,
            dispatch=self.dispatch,
            host_per_kernel=self.host_per_kernel,
            optimizer_bytes=self.optimizer_bytes,
        )


_REGISTRY: Registry[Framework] = Registry("framework", "--framework")


def register(fw: Framework, *, override: bool = False) -> Framework:
    """Add ``fw`` to the registry (``override``: replace an entry of the same name)."""
    return _REGISTRY.add(fw.name, fw, override=override)


def unregister(name: str) -> None:
    """Remove ``name`` from the registry (the default stays)."""
    if name == DEFAULT_FRAMEWORK:
        raise ConfigError(f"the default framework {name!r} cannot be removed")
    _REGISTRY.remove(name)


def names() -> tuple[str, ...]:
    """The registered frameworks' names, the default first."""
    return _REGISTRY.names()


def framework(name: str | None) -> Framework:
    """The registered framework ``name`` (None: the default); a one-line ConfigError otherwise."""
    return _REGISTRY.get(name or DEFAULT_FRAMEWORK)


def tp_comm_overlap(value: bool | str | None, name: str | None) -> str:
    """The ``--tp-comm-overlap`` mode priced under ``--framework name`` (None: the default): the bare
    flag (True) names the framework's own mode, a one-line error where it has none; an explicit mode
    wins whatever the framework (:func:`pipewright.cost.tp_overlap.resolve`)."""
    if value is not True:
        return tp_modes.resolve(value)
    fw = framework(name)
    if fw.tp_overlap is None:
        named = "|".join(m for m in tp_modes.modes() if m != "none")
        raise ConfigError(
            f"--framework {fw.name} runs no tensor-parallel overlap; name the mode to price "
            f"(--tp-comm-overlap {named}) or drop --tp-comm-overlap"
        )
    return fw.tp_overlap


def fit_rows() -> frozenset[str]:
    """The published rows (docs/fidelity.md) some framework's calibration was fitted on."""
    return frozenset(row for fw in _REGISTRY.view().values() for row in fw.fitted_on)


register(
    Framework(
        DEFAULT_FRAMEWORK,
        "Megatron-LM / Megatron-Core with Transformer Engine (also NeMo and Megatron-Bridge): fused kernels, "
        "the GPU's usual attention kernel; the calibration the cost model's defaults were fitted on; "
        "--tp-comm-overlap is Transformer Engine's userbuffers overlap",
        tp_overlap="te",
    )
)
# Fitted by `PYTHONPATH=src python tools/fit_frameworks.py` (docs/fidelity.md, "Frameworks"), on
# torchtitan's rows of every second id within each source, asynchronous TP and cp ≥ 4 rows left out:
register(
    Framework(
        "torchtitan",
        "PyTorch torchtitan: eager PyTorch blocks (compile = false in its train configs; --kernels "
        "compiled for torch.compile), FSDP2 with torch.distributed.pipelining (gradients reduced once "
        "per step: backward_maybe_with_nosync; each stage output kept in output_chunks until the step "
        "ends, a receive buffer per microbatch); its tensor-parallel overlap is PyTorch's asynchronous TP "
        "(parallelism.enable_async_tensor_parallel, the Inductor micro-pipeline pass); context parallelism "
        "through PyTorch's context_parallel with its allgather rotate method "
        "(experimental.context_parallel_rotate_method's default)",
        {"kernels": "eager", "fsdp_grad_sync": "step", "stage_outputs": "step", "cp_comm": "torch-allgather"},
        compute=0.7805,
        overhead=2.096e-3,
        fitted_on=(
            "trainy25-h200-8b-64gpu",
            "tt24-8b-128gpu-t3-0",
            "tt24-8b-128gpu-t3-2",
            "tt24-8b-8gpu-cp2-t2",
            "tt24-8b-8gpu-t1-1",
            "tt25-70b-256gpu-fp8-asynctp-false",
            "tt25-8b-64gpu-fp8-asynctp-false",
        ),
        tp_overlap="async-tp",
    )
)
# Fitted on llm-foundry's rows of every second id (tools/fit_frameworks.py):
register(
    Framework(
        "llm-foundry",
        "MosaicML llm-foundry on Composer: PyTorch FSDP, eager PyTorch (scripts/train/benchmarking/"
        "submit_benchmarks.py: no torch.compile, low_precision_layernorm, flash-attn 2); no tensor-parallel "
        "overlap (tp_config's one strategy, llmfoundry/tp/ffn_tp_strategy.py, plans PyTorch's Colwise/"
        "RowwiseParallel on the MLP and enables no asynchronous TP)",
        {"kernels": "eager"},
        compute=0.9753,
        overhead=1.878e-3,
        fitted_on=(
            "mpt-a100-40gb-30b-s2048-128gpu",
            "mpt-a100-40gb-7b-s2048-128gpu",
            "mpt-a100-80gb-70b-s2048-64gpu",
            "mpt-h100-sxm-13b-s2048-256gpu",
            "mpt-h100-sxm-1b-s2048-128gpu",
            "mpt-h100-sxm-1b-s2048-512gpu",
            "mpt-h100-sxm-30b-s2048-256gpu",
            "mpt-h100-sxm-3b-s2048-128gpu",
            "mpt-h100-sxm-3b-s2048-512gpu",
            "mpt-h100-sxm-70b-s2048-256gpu",
            "mpt-h100-sxm-7b-s2048-128gpu",
            "mpt-h100-sxm-7b-s2048-512gpu",
        ),
    )
)
# c and δ fitted by `PYTHONPATH=src python tools/fit_frameworks.py --only deepspeed-megatron` on the fit
# half of vTrain's 720 measured single-node runs (cost/data/vtrain_single_node_hidden1024.csv) and the
# DeepSpeed + Megatron rows of every second id within each source, each set weighted alike
# (docs/fidelity.md, "Ranking"); A100 only: no other GPU generation has measured Megatron-DeepSpeed
# runs here, so neither constant is known to carry over to one.
register(
    Framework(
        "deepspeed-megatron",
        "Megatron-DeepSpeed (MT-NLG, BLOOM): Megatron's fused kernels, DeepSpeed's pipeline engine and "
        "ZeRO-1 optimizer with fp32 gradient accumulation; no tensor-parallel overlap of GEMMs with their "
        "collectives (megatron/arguments.py has no --tp-comm-overlap: no Transformer Engine userbuffers)",
        {"grad_dtype": "fp32"},
        compute=0.7869,
        overhead=0.0,
        fitted_on=("mtnlg-a100-530b-2800gpu",),
        dispatch="megatron-eager",
        host_per_kernel=4.2495e-5,
        optimizer_bytes=38.0,
        fitted_measured="vTrain's single-node runs, hidden 1024: the fit half (pipewright.cost.measured)",
    )
)
