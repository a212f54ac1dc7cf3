"""Host memory available to a new allocation (HiSparse sizes its host mirror against it)."""

from __future__ import annotations

import os
from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def available_host_bytes() -> int:
    """Bytes of host memory a new allocation can take without swapping: Linux's MemAvailable
    (free memory plus reclaimable caches); elsewhere the free physical pages (`sysconf`)."""
    if MEMINFO.is_file():
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024          # reported in kB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
