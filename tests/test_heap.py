"""While a trainer trains, freed memory stays mapped (no page faults to touch it again); after, it goes back."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

_PROBE = textwrap.dedent("""
    import os, torch
    from comlrl_core.heap import _LIBC, retained_heap

    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def freed_then_rss():
        blocks = [torch.ones(1 << 20) for _ in range(64)]  # 256 MiB in 4 MiB blocks
        full = rss_mb()
        del blocks
        return full, rss_mb()

    print("tuned" if _LIBC is None else "managed")
    with retained_heap():
        full, kept = freed_then_rss()
    after = rss_mb()
    print(f"{full:.0f} {kept:.0f} {after:.0f}")
""")


def _probe(**env) -> tuple[str, list[float]]:
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    return out[0], [float(x) for x in out[1].split()]


def test_freed_memory_stays_mapped_inside_and_goes_back_after():
    mode, (full, kept, after) = _probe()
    assert mode == "managed"
    assert kept > full - 32, "freed blocks were handed back to the OS inside retained_heap()"
    assert after < full - 200, "the free memory was not handed back when retained_heap() ended"


def test_a_user_tuned_malloc_is_left_alone():
    for env in ({"MALLOC_TRIM_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}):
        mode, (full, kept, _) = _probe(**env)
        assert mode == "tuned"
        assert kept < full - 200  # glibc's own behaviour: 4 MiB blocks are mapped and unmapped one by one
