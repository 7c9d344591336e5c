"""A fake world for one rank: the ``fake`` process-group backend (every collective and point-to-point
completes at once, moving nothing) and ``FakeTensorMode`` (tensors with shapes, dtypes and devices but
no storage), so the real program of any rank of any layout runs in one small process.

One adaptation of PyTorch for fake parameters: ``nn.Module._apply`` (``module.to(device)``,
``module.to(dtype)``) swaps a fake parameter for its converted copy with ``torch.utils.swap_tensors``,
which refuses tensors that the fake mode's memo holds weak references to. Within :func:`fake_world`
it sets ``param.data`` instead (what ``_apply`` does for ordinary tensors): the same parameter object,
converted, so optimizers built before a cast still hold the module's parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode


def _apply_by_data(self: nn.Module, fn, recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` that converts parameters in place (``.data``), buffers by replacement."""
    if recurse:
        for child in self.children():
            _apply_by_data(child, fn)
    with torch.no_grad():
        for param in self._parameters.values():
            if param is None:
                continue
            param.data = fn(param)
            if param.grad is not None:
                param.grad.data = fn(param.grad)
        for key, buf in self._buffers.items():
            if buf is not None:
                self._buffers[key] = fn(buf)
    return self


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """The default process group on the ``fake`` backend as ``rank`` of ``world_size``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def fake_tensors() -> Iterator[FakeTensorMode]:
    """``FakeTensorMode`` (real inputs converted as they are used) with modules converted in place."""
    original = nn.Module._apply
    nn.Module._apply = _apply_by_data
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        nn.Module._apply = original
