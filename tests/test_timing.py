"""The timer's CUDA-graph capture of a call that cannot be captured: it reports no graph time
and leaves the device as it found it (current stream, random ops), so the calls timed after
it run as they would alone."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from kvcanary_dispatch.cli.timing import graph_time_us

pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")


def test_a_call_that_cannot_be_captured_leaves_the_device_as_it_was():
    device = torch.device(DEVICE)
    x = torch.ones(1, device=device)
    stream = torch.cuda.current_stream(device)
    assert graph_time_us(lambda: x.item(), device) is None  # a host sync inside the capture
    assert torch.cuda.current_stream(device) == stream
    torch.cuda.manual_seed(1)
    first = torch.rand(4, device=device)  # needs the generator out of capture
    torch.cuda.manual_seed(1)
    assert torch.equal(torch.rand(4, device=device), first)
    assert graph_time_us(lambda: x.add_(1), device) is not None
    torch.cuda.synchronize(device)
    assert int(x.item()) > 3  # the graph replayed (the two warm-up calls bring x to 3)
