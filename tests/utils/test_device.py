"""`utils/device.py`: host-to-device copies (pinned and non-blocking on CUDA)."""

from __future__ import annotations

import pytest
import torch

from dsv4.utils.device import copy_from_host, to_device


def test_to_device_and_copy_from_host_on_cpu() -> None:
    host = torch.tensor([3, 1, 2])
    assert torch.equal(to_device(host, "cpu"), host)
    dst = torch.zeros(3, dtype=torch.int64)
    assert copy_from_host(dst, host) is dst and torch.equal(dst, host)


@pytest.mark.gpu
def test_copies_to_cuda_do_not_wait_for_the_stream() -> None:
    """With the stream busy (a long sleep kernel), both copies return before it is done and
    land after it, in stream order."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dst = torch.zeros(4, dtype=torch.int64, device="cuda")
    torch.cuda._sleep(1 << 30)                       # about a second of GPU time
    a = to_device(torch.arange(4), "cuda")
    copy_from_host(dst, torch.arange(4) + 10)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "a copy waited for the stream"
    assert a.tolist() == [0, 1, 2, 3] and dst.tolist() == [10, 11, 12, 13]
