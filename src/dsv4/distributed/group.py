"""The default process group, joined so that destroying it frees it.

`torch.distributed.nn.functional` binds `group.WORLD` into its functions' default arguments when
it is first imported (torch._dynamo and the functional collectives import it, lazily). Imported
after `init_process_group`, it holds the default group for the rest of the process: then
`destroy_process_group` frees nothing, the gloo group's worker threads run on into interpreter
finalisation, and one that drops a collective's last tensor reference there needs the GIL and
aborts the process ("terminate called without an active exception", at random, at exit). So this
module imports it before any group exists, and every default group of the project is joined
through `join_default_group`. Test: tests/distributed/test_group.py."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401  before the group exists: see above


def join_default_group(backend: str, init_method: str, rank: int, world_size: int,
                       timeout: timedelta | None = None) -> None:
    """`dist.init_process_group` with the module's import done first."""
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)
