"""The default group joined through `join_default_group` is freed by `destroy_process_group`
even when `torch.distributed.nn.functional` is first imported while it exists (torch._dynamo's
import does that): no gloo thread is left to abort the process at exit (`distributed/group.py`).

Each case runs in a fresh interpreter (the import happens once per process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).parents[2] / "src")
SCRIPT = """
import os, sys
import torch.distributed as dist
join = sys.argv[1] == "join"
if join:
    from dsv4.distributed.group import join_default_group
    join_default_group("gloo", "file://" + sys.argv[2], 0, 1)
else:
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
import torch._dynamo  # imports torch.distributed.nn.functional, if nothing did before
dist.destroy_process_group()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(",".join(n for n in names if "gloo" in n))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
@pytest.mark.parametrize("how", ["join", "plain"])
def test_destroy_frees_the_group(tmp_path: Path, how: str) -> None:
    """`join`: no gloo thread survives the destroy. `plain` (init_process_group directly) shows
    the hazard the module exists for: the threads survive, so this test can tell the two apart;
    if a torch release stops binding the group there, `plain` fails and the module can go."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=SRC)
    out = subprocess.run([sys.executable, "-c", SCRIPT, how, str(tmp_path / "store")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    left = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if how == "join":
        assert left == "", f"threads of the destroyed group still run: {left}"
    else:
        assert "pt_gloo_runloop" in left, out.stdout
