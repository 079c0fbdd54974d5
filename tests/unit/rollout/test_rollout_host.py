"""rollout.host: the GPU engine's host-thread setting."""

import pytest
import torch

from megatron_tlt.errors import ConfigError
from megatron_tlt.rollout.host import HOST_THREADS_ENV, int64_tensor, limit_host_threads


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_limit_host_threads_default_is_one(threads, monkeypatch):
    monkeypatch.delenv(HOST_THREADS_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    assert limit_host_threads() == 1 and torch.get_num_threads() == 1


def test_limit_host_threads_respects_the_environment(threads, monkeypatch):
    torch.set_num_threads(2)
    monkeypatch.delenv(HOST_THREADS_ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user chose: left alone
    assert limit_host_threads() == 2
    monkeypatch.setenv(HOST_THREADS_ENV, "3")  # ours wins over OMP_NUM_THREADS
    assert limit_host_threads() == 3 and torch.get_num_threads() == 3
    monkeypatch.setenv(HOST_THREADS_ENV, "0")  # 0: torch's setting stays
    assert limit_host_threads() == 3
    monkeypatch.setenv(HOST_THREADS_ENV, "two")
    with pytest.raises(ConfigError, match=HOST_THREADS_ENV):
        limit_host_threads()


def test_int64_tensor_equals_torch_tensor():
    rows = [[1, -2, 3], [4, 5, 1 << 40]]
    assert torch.equal(int64_tensor(rows), torch.tensor(rows, dtype=torch.int64))
