"""How a CPU worker's allocator treats freed tensor memory: ``retain`` (the default) or ``system``.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves an allocation of 128 KiB or
more (its threshold grows with use, up to 32 MiB) with a fresh ``mmap`` and gives it back to the kernel
on ``free``; its heap is trimmed whenever the free top exceeds a threshold. A training step allocates
and frees the same large tensors every microbatch (logits, softmax, activations), so each one is
faulted in again page by page: 4 KiB per minor fault, each zero-filled by the kernel. Measured on this
project's CPU machine (``benchmarks/bench_host_memory.py``): the output layer's S + T passes for 256
tokens and 128k vocabulary rows run 769 ms with 172,000 page faults per iteration, 376 ms with none
once freed memory stays in the process; in the vocabulary-parallel pipeline the faults fell unevenly
on the ranks (their allocation histories differ), which made equal work look up to 1.6× unequal.

``retain`` sets glibc's ``M_MMAP_MAX`` to 0 (every block comes from the heap, none is unmapped on
free) and ``M_TRIM_THRESHOLD`` to its maximum (the heap is never given back): after the first steps a
worker reuses its own pages. The price is memory: a process keeps its peak heap until it exits, and
torch's 64-byte-aligned requests cannot reuse a freed block of the same size until it has coalesced
with a neighbour, so the heap settles above the live peak (measured: +5 % for the S + T passes, +9 % /
+43 % on the two ranks of ``bench_vocab.py``). ``system`` leaves glibc's defaults. On a C library
other than glibc (macOS, musl) both are the platform's allocator and ``retain`` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

#: The choices of ``--cpu-allocator`` (TrainConfig.cpu_allocator).
ALLOCATORS: tuple[str, ...] = ("retain", "system")

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1


def _glibc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 — only glibc has it
    except (OSError, AttributeError):
        return None
    return libc


def retain_freed_memory() -> bool:
    """Keep freed memory in this process (see the module): True if glibc accepted both settings."""
    libc = _glibc()
    if libc is None:
        log.debug("not glibc: the CPU allocator keeps its own policy")
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX))


def use_cpu_allocator(policy: str) -> bool:
    """Apply ``policy`` (one of :data:`ALLOCATORS`) to this process; True if the allocator changed."""
    if policy not in ALLOCATORS:
        raise ValueError(f"cpu allocator {policy!r}: choose one of {', '.join(ALLOCATORS)}")
    return retain_freed_memory() if policy == "retain" else False
