"""rollout/pdl.py: the launch-keyword switch the decode forward's Triton kernels read."""

import pytest
import torch

from megatron_tlt.rollout import pdl


def test_launch_keywords_follow_the_innermost_context(monkeypatch):
    """Off outside any context; `launches(True)` hands out USE_PDL and launch_pdl, a nested
    `launches(False)` turns them off for its body only, and every exit restores the outer
    setting, an exception's included."""
    assert pdl.kwargs() == {"USE_PDL": False} and not pdl.active()
    with pdl.launches(True):
        assert pdl.kwargs() == {"USE_PDL": True, "launch_pdl": True}
        with pdl.launches(False):
            assert pdl.kwargs() == {"USE_PDL": False}
        assert pdl.active()
        try:
            with pdl.launches(False):
                raise KeyError("x")
        except KeyError:
            pass
        assert pdl.active()
    assert pdl.kwargs() == {"USE_PDL": False}


def test_requested_by_default_off_by_the_environment_and_never_on_a_cpu(monkeypatch):
    """On unless MEGATRON_TLT_PDL=0 (the default since session 25), and never where the
    device cannot (a CPU: DecodeModel.pdl is requested() and supported())."""
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    assert pdl.requested()
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    assert pdl.requested()
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    assert not pdl.requested()
    assert not pdl.supported("cpu") and not pdl.supported(torch.device("cpu"))


def test_prefetch_limit_from_the_environment(monkeypatch):
    """MEGATRON_TLT_PDL_PREFETCH_MB: off (0) unless set, megabytes otherwise, fractions
    allowed, anything else a clear error naming the variable."""
    monkeypatch.delenv(pdl.PREFETCH_ENV, raising=False)
    assert pdl.prefetch_bytes() == 0
    monkeypatch.setenv(pdl.PREFETCH_ENV, "32")
    assert pdl.prefetch_bytes() == 32 * 2 ** 20
    monkeypatch.setenv(pdl.PREFETCH_ENV, "0.5")
    assert pdl.prefetch_bytes() == 2 ** 19
    monkeypatch.setenv(pdl.PREFETCH_ENV, "lots")
    with pytest.raises(ValueError, match=pdl.PREFETCH_ENV):
        pdl.prefetch_bytes()


def test_preload_limit_from_the_environment_and_only_inside_pdl(monkeypatch):
    """MEGATRON_TLT_PDL_PRELOAD_KB: off (0) unless set, kilobytes otherwise, anything else a
    clear error; a `launches` context hands the limit to the kernels only with PDL on, and
    restores the outer one on exit."""
    monkeypatch.delenv(pdl.PRELOAD_ENV, raising=False)
    assert pdl.preload_bytes() == 0
    monkeypatch.setenv(pdl.PRELOAD_ENV, "64")
    assert pdl.preload_bytes() == 64 * 1024
    monkeypatch.setenv(pdl.PRELOAD_ENV, "many")
    with pytest.raises(ValueError, match=pdl.PRELOAD_ENV):
        pdl.preload_bytes()
    assert pdl.preload_limit() == 0
    with pdl.launches(True, 0, 4096):
        assert pdl.preload_limit() == 4096
        with pdl.launches(False, 0, 4096):
            assert pdl.preload_limit() == 0
        assert pdl.preload_limit() == 4096
    assert pdl.preload_limit() == 0


def test_plain_launch_after_cublas_only_when_asked(monkeypatch):
    """pdl.plain_launch() (called by a cuBLAS projection): with PLAIN_AFTER_CUBLAS (the
    default since session 37) the next launch of a PDL context takes the same USE_PDL code
    without launch_pdl, the one after it PDL again; with the knob off, outside PDL, or
    across a context's entry and exit it changes nothing."""
    on = {"USE_PDL": True, "launch_pdl": True}
    assert pdl.PLAIN_AFTER_CUBLAS is True
    monkeypatch.setattr(pdl, "PLAIN_AFTER_CUBLAS", False)
    with pdl.launches(True):
        pdl.plain_launch()
        assert pdl.kwargs() == on
    monkeypatch.setattr(pdl, "PLAIN_AFTER_CUBLAS", True)
    pdl.plain_launch()
    assert pdl.kwargs() == {"USE_PDL": False}
    with pdl.launches(True):
        assert pdl.kwargs() == on
        pdl.plain_launch()
        assert pdl.kwargs() == {"USE_PDL": True}
        assert pdl.kwargs() == on
        pdl.plain_launch()
        with pdl.launches(True):  # a nested context starts afresh, and restores on exit
            assert pdl.kwargs() == on
        assert pdl.kwargs() == {"USE_PDL": True}
        with pdl.launches(False):
            pdl.plain_launch()
            assert pdl.kwargs() == {"USE_PDL": False}
        assert pdl.kwargs() == on
        pdl.plain_launch()
    with pdl.launches(True):
        assert pdl.kwargs() == on


def test_cublas_projection_marks_the_next_launch_plain(monkeypatch):
    """triton_linear's cuBLAS paths (linear_partials, linear_into: F.linear) call
    plain_launch once each (a spy counts the calls; no interpreter needed on this path).
    Skipped without triton (CI: triton_linear imports it)."""
    pytest.importorskip("triton")
    from megatron_tlt.rollout import triton_linear as tlin
    calls = []
    monkeypatch.setattr(pdl, "plain_launch", lambda: calls.append(1))
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    tlin.linear_partials(x, w, tlin.CUBLAS)
    tlin.linear_into(x, w, torch.empty(2, 4), tlin.CUBLAS)
    assert len(calls) == 2
