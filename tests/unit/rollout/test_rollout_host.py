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


def test_graph_capture_pauses_garbage_collection(monkeypatch):
    """graph_capture: the collector is off inside the capture (a collection there could
    destroy an unreachable object's CUDA graph and invalidate the capture) and back on
    after it, also when the capture raises; a collector already off stays off.
    Control: torch.cuda.graph alone leaves it on."""
    import contextlib
    import gc

    from megatron_tlt.rollout import host

    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None):  # stands in for torch.cuda.graph (no CUDA here)
        seen.append((graph, pool))
        yield

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    with torch.cuda.graph("g0"):
        assert gc.isenabled()  # the control
    with host.graph_capture("g1", pool="p"):
        assert not gc.isenabled()
    assert gc.isenabled() and seen[-1] == ("g1", "p")
    with pytest.raises(ValueError):
        with host.graph_capture("g2"):
            raise ValueError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with host.graph_capture("g3"):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
