import json
import resource
import subprocess
import sys

import pytest

# Mallocs 64 MB three times, as MLX's CPU allocator does, writes every page and frees
# it, and prints the page faults of each round (the kernel's count, not a timing).
# Transparent huge pages are off for it (prctl PR_SET_THP_DISABLE), so that a fault is
# one 4 KB page on every machine.
ROUNDS = """
import ctypes, json, resource, sys
from mlx_grpo.cpu.allocator import keep_freed_memory
libc = ctypes.CDLL(None)
assert libc.prctl(41, 1, 0, 0, 0) == 0
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(64 << 20)
    ctypes.memset(block, 1, 64 << 20)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""
PAGES = (64 << 20) // resource.getpagesize()


def rounds(way: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", ROUNDS, way], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_memory_is_reused_without_page_faults():
    kept = rounds("keep")
    if not kept["applied"]:
        pytest.skip("not glibc: mallopt did not apply")
    # The first round grows the heap (a fault a page); the next reuse those pages.
    assert kept["faults"][0] > PAGES / 2
    assert max(kept["faults"][1:]) < PAGES / 100, kept
    # Without it, glibc maps a block this large on its own and unmaps it when freed:
    # every round faults on every page again.
    plain = rounds("plain")
    assert min(plain["faults"]) > PAGES / 2, plain
