"""``--compile``: ``torch.compile`` of each pipeline stage's forward, under every synchronous schedule.

The executor calls a stage as before (``stage(x)``); :func:`compile_stages` sets the instance's
``forward`` to a :class:`CompiledForward` (parameter names and state dicts are unchanged, like
:mod:`pipewright.runtime.core.stage_recompute`'s wrapper, so checkpoints of compiled and eager runs are the
same).
The backward is the one AOTAutograd derives from the compiled forward.

The split backward of the zero-bubble schedules (I now, W later; :mod:`pipewright.models.wgrad`) needs
its deferrable linear layers to run their own ``autograd.Function``: its backward hands (x, ∂L/∂y) to the
stage's weight-gradient store, a side effect a traced backward would replay on fake tensors at compile
time. Those layers are therefore left out of the graph (``torch.compiler.disable``): the code between
them is compiled, and I and W do exactly what they do without ``--compile``. A schedule without the
split uses plain ``nn.Linear`` layers, which compile with the rest.

A stage whose forward cannot be compiled (an unsupported construct, no C++ compiler for the CPU
backend) runs eagerly from then on; the warning names the stage and the first line of the reason.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from pipewright.models.wgrad import deferrable_layers

log = logging.getLogger(__name__)

#: The environment variable naming the ``torch.compile`` backend (default: PyTorch's, inductor).
BACKEND_ENV = "PIPEWRIGHT_COMPILE_BACKEND"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def _is_compile_error(exc: BaseException) -> bool:
    """An error raised by the compiler stack (dynamo, AOTAutograd, inductor) rather than the model."""
    module = type(exc).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor", "torch._functorch", "torch.fx"))


class CompiledForward:
    """A stage's forward through ``torch.compile`` (built on first use), falling back to the eager
    forward for good after a compiler error (:func:`_is_compile_error`), with one warning line."""

    def __init__(self, eager: Callable[..., Any], stage: int, **options: Any) -> None:
        self.eager, self.stage, self.options = eager, stage, options
        self.compiled: Callable[..., Any] | None = None
        self.failed: str | None = None

    def __call__(self, *args: Any) -> Any:
        if self.failed is not None:
            return self.eager(*args)
        try:
            if self.compiled is None:
                self.compiled = torch.compile(self.eager, **self.options)
            return self.compiled(*args)
        except Exception as exc:
            if not _is_compile_error(exc):
                raise
            self.failed = _first_line(exc)
            log.warning("--compile: stage %d runs eagerly (%s)", self.stage, self.failed)
            return self.eager(*args)


def compile_options() -> dict[str, Any]:
    """``torch.compile``'s options: the backend named by the environment variable
    ``PIPEWRIGHT_COMPILE_BACKEND`` (e.g. ``aot_eager``: tracing and AOTAutograd without code
    generation), else PyTorch's default (inductor)."""
    backend = os.environ.get(BACKEND_ENV)
    return {"backend": backend} if backend else {}


def compile_stages(stages: Mapping[int, nn.Module], **options: Any) -> dict[int, CompiledForward]:
    """Compile each stage's forward (in place; ``options`` go to ``torch.compile``, default
    :func:`compile_options`); the deferrable linear layers stay outside the graph (see the module
    docstring). Returns the wrappers by stage."""
    options = options or compile_options()
    out = {}
    for s, module in stages.items():
        for layer in deferrable_layers(module):
            layer.forward = torch.compiler.disable(layer.forward)
        out[s] = module.forward = CompiledForward(module.forward, s, **options)
    return out
