"""Fixtures shared by the unit tests."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module")
def pg():
    """A real world-size-1 gloo process group in the test process."""
    torch.set_num_threads(1)
    fd, path = tempfile.mkstemp(prefix="spotlight-pg-")
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
