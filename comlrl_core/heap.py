"""Freed memory stays mapped while a trainer trains (glibc only).

Every optimizer step frees and reallocates the same gradients and activations. glibc hands the top
of its heap back to the OS once enough of it is free, so the next step touches fresh pages again:
a page fault per 4 KiB page, about 8% of an IAC step with separate critics on the benchmark's small
model. Inside :func:`retained_heap` the heap is never trimmed; at its end the free memory goes back
at once and glibc keeps the thresholds its own adjustment converges to. A process whose malloc the
user tuned (its trim, mmap or top-pad threshold, by ``MALLOC_*_`` or ``GLIBC_TUNABLES``) is left as it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for its moving threshold on 64-bit; setting one freezes it
_NEVER = 2**31 - 1  # mallopt takes an int
_TUNED = ("trim_threshold", "mmap_threshold", "top_pad")  # the user's setting of any of these wins


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), or not glibc
        libc = ""
    if not libc.startswith("glibc"):
        return None
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(f"MALLOC_{name.upper()}_" in os.environ or f"glibc.malloc.{name}" in tunables for name in _TUNED):
        return None
    return ctypes.CDLL("libc.so.6")


_LIBC = _glibc()


@contextlib.contextmanager
def retained_heap() -> Iterator[None]:
    """Inside: glibc keeps freed memory mapped. After: the free memory goes back to the OS."""
    if _LIBC is None:
        yield
        return
    _LIBC.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    _LIBC.mallopt(_M_TRIM_THRESHOLD, _NEVER)
    try:
        yield
    finally:
        _LIBC.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD)  # glibc's own rule: twice the mmap threshold
        _LIBC.malloc_trim(0)
