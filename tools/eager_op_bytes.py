"""Recount pipewright.cost.kernels' eager byte table from the ATen operators PyTorch dispatches.

    PYTHONPATH=src python tools/eager_op_bytes.py

Runs torchtitan's RMSNorm, rotary embedding, SwiGLU and the fp32 cross-entropy (as written in its
``models/norms.py``, ``models/llama/model.py`` and ``train.py``) forward and backward on bf16 CPU
tensors under a ``TorchDispatchMode`` that adds up every non-view operator's tensor inputs and outputs
(broadcast operands once), and prints bytes per element next to ``EAGER_BYTES``. The input gradients
are taken with ``torch.autograd.grad`` (no accumulation into leaves' ``.grad``, which a model's
activations do not have). Exits 1 when a count is more than 5 % off the table.
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipewright.cost.kernels import EAGER_BYTES

TOKENS, HIDDEN, HEADS = 16, 4096, 32  # the rotary table is per head dimension, shared by the heads
_VIEWS = ("view", "expand", "alias", "detach", "reshape", "t.")


def touched(t: torch.Tensor) -> int:
    """Bytes of ``t`` read or written once: broadcast (stride-0) dimensions count once."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        n *= size if stride else 1
    return n * t.element_size()


class Count(TorchDispatchMode):
    """Adds up the tensor inputs and outputs of every non-view ATen operator dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(v in func.__name__ for v in _VIEWS):
            flat = tree_flatten((args, kwargs, out))[0]
            self.total += sum(touched(x) for x in flat if isinstance(x, torch.Tensor))
        return out


def aten_bytes(fn, *shapes: tuple[int, ...]) -> tuple[int, int]:
    """(forward, backward) bytes ``fn`` dispatches on bf16 inputs of ``shapes``."""
    xs = [torch.randn(*s, dtype=torch.bfloat16, requires_grad=True) for s in shapes]
    forward, backward = Count(), Count()
    with forward:
        y = fn(*xs)
    grad = torch.randn_like(y)
    with backward:
        torch.autograd.grad(y, xs, grad)
    return forward.total, backward.total


def rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * w


_FREQS = torch.polar(
    torch.ones(TOKENS, 1, HIDDEN // HEADS // 2), torch.randn(TOKENS, 1, HIDDEN // HEADS // 2)
)


def rotary(x: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(TOKENS, HEADS, -1, 2))
    return torch.view_as_real(xc * _FREQS).flatten(2).type_as(x)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(a) * b


def cross_entropy(logits: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float(), torch.arange(TOKENS) % HIDDEN)


CASES = {
    "rmsnorm": (rmsnorm, [(TOKENS, HIDDEN), (HIDDEN,)]),
    "rotary": (rotary, [(TOKENS, HEADS, HIDDEN // HEADS)]),
    "swiglu": (swiglu, [(TOKENS, HIDDEN)] * 2),
    "cross_entropy": (cross_entropy, [(TOKENS, HIDDEN)]),
}


def main() -> int:
    torch.set_num_threads(1)
    worst = 0.0
    print(f"{'operator':15s} {'forward':>9s} {'table':>6s} {'backward':>9s} {'table':>6s}")
    for name, (fn, shapes) in CASES.items():
        fwd, bwd = (b / (TOKENS * HIDDEN) for b in aten_bytes(fn, *shapes))
        want = EAGER_BYTES[name]
        worst = max(worst, abs(fwd / want[0] - 1), abs(bwd / want[1] - 1))
        print(f"{name:15s} {fwd:9.2f} {want[0]:6.1f} {bwd:9.2f} {want[1]:6.1f}")
    print(f"largest difference {worst:.1%}")
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
