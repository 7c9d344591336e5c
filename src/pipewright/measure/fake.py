"""A fake world for one rank: the ``fake`` process-group backend (every collective and point-to-point
completes at once, moving nothing) and tensors on the ``meta`` device (shapes, dtypes and storage sizes,
no data), so the real program of any rank of any layout runs in one small process.

Meta tensors rather than ``FakeTensorMode``: both give every op its output's shape without computing
it, but the fake mode does so in Python (about 0.4 ms an op here, most of a full-size rank's time),
the meta kernels in C++. What the meta device changes is made right here:

- ``F.scaled_dot_product_attention`` chooses its kernel by device, and the meta device has no fused
  one (it would run the math path, which stores the s × s probabilities). :func:`meta_world` runs the
  flash kernel the CPU runs (``_scaled_dot_product_flash_attention_for_cpu``; a GPU runs FlashAttention):
  the same saved tensors (output and log-sum-exp) and FLOPs.
- Reading a value (``.item()``, ``.tolist()``) is answered by :class:`~.tracker.ProgramTracker`;
  ``torch.nonzero`` counts every element as non-zero.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

META = torch.device("meta")


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """The default process group on the ``fake`` backend (for CPU and meta tensors) as ``rank`` of
    ``world_size``. NCCL's rules over gloo (:mod:`pipewright.runtime.setup.nccl_rules`), where this
    process had them installed, are lifted meanwhile: the fake backend moves nothing, and its meta
    tensors stand for the group's device."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pipewright.runtime.setup import nccl_rules

    if dist.is_initialized():
        from pipewright.errors import ConfigError

        raise ConfigError("--measure runs in a process of its own: this one already has a process group")
    ruled = nccl_rules.active()
    if ruled:
        nccl_rules.uninstall()
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if ruled:
            nccl_rules.install()


def _flash_attention(original):
    """``F.scaled_dot_product_attention`` that runs the flash kernel on meta tensors without a mask
    or dropout (module docstring), else ``original``."""

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        # the flash kernel reads grouped key/value heads itself (enable_gqa: k, v kept at kv_heads)
        if q.device.type == "meta" and attn_mask is None and not dropout_p and set(kwargs) <= {"enable_gqa"}:
            flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            return flash(q, k, v, 0.0, bool(is_causal), scale=scale)[0]
        return original(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)

    return attention


@contextmanager
def meta_world() -> Iterator[None]:
    """Tensors made without a device are meta tensors; attention runs the flash kernel. (The function
    is replaced in ``torch.nn.functional`` for the block, not wrapped in a mode: a recomputing backward
    runs the forward again on the autograd engine's thread, where modes entered here are not active.)"""
    from torch.fx.experimental import _config as fx_config

    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _flash_attention(original)
    try:
        # torch.nonzero's size depends on values: taken as every element non-zero (the vocabulary
        # shard's label rows: an index of every token rather than of the shard's, b·s·8 bytes)
        with META, fx_config.patch(meta_nonzero_assume_all_nonzero=True):
            yield
    finally:
        F.scaled_dot_product_attention = original
