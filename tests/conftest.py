"""Shared test setup.

- Tests under tests/gpu/ (and any test marked `gpu`) are skipped when CUDA is absent.
- torch uses a few intra-op threads and one inter-op thread: CI has 2 cores, and
  multi-process tests must not oversubscribe them.
- `free_port`: an unused TCP port on 127.0.0.1.
- MEGATRON_TLT_RECORD_KERNELS=FILE records every interpreted Triton launch for
  tools/triton_compile_check.py (compiles them for sm_90 without a GPU).
- `run_torchrun(script, nproc, args=(), timeout=300)`: run a script under
  `python -m torch.distributed.run` on this host; a non-zero exit (or a timeout) fails
  the test with the tail of the output.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
GPU_TESTS = REPO_ROOT / "tests" / "gpu"
OUTPUT_TAIL_CHARS = 6000

if os.environ.get("MEGATRON_TLT_RECORD_KERNELS"):  # tools/triton_compile_check.py, step 1
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from triton_compile_check import install_recorder

    install_recorder(os.environ["MEGATRON_TLT_RECORD_KERNELS"])

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
try:
    torch.set_num_interop_threads(1)
except RuntimeError:  # already set, or inter-op work already started
    pass


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if Path(str(item.path)).resolve().is_relative_to(GPU_TESTS):
            item.add_marker(pytest.mark.gpu)
        if not has_cuda and item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    return find_free_port()


def _tail(text: str) -> str:
    text = text or ""
    return text if len(text) <= OUTPUT_TAIL_CHARS else "...\n" + text[-OUTPUT_TAIL_CHARS:]


def _as_text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode("utf-8", "replace")
    return data or ""


def torchrun(
    script_path: str | os.PathLike,
    nproc: int,
    args: list[str] | tuple[str, ...] = (),
    timeout: float = 300,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run `script_path` on `nproc` local ranks (gloo on CPU); fail the test on a timeout,
    and with `check` on a non-zero exit.

    Each rank gets OMP_NUM_THREADS=1 and the repo on PYTHONPATH. The whole process
    group is killed on timeout, so no rank outlives the test.
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1",
        "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1",
        "--master_port", str(find_free_port()),
        str(script_path), *map(str, args),
    ]  # fmt: skip
    run_env = dict(os.environ)
    run_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    run_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), run_env.get("PYTHONPATH")) if p)
    if env:
        run_env.update(env)
    proc = subprocess.Popen(
        cmd, cwd=str(REPO_ROOT), env=run_env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun forwards it to its workers (some may sit in their own
        # sessions); then SIGKILL whatever is left in the group we started.
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            stdout = stderr = None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if stdout is None:
            stdout, stderr = proc.communicate()
        pytest.fail(
            f"torchrun {Path(script_path).name} (nproc={nproc}) timed out after {timeout}s\n"
            f"--- stdout (tail) ---\n{_tail(_as_text(stdout))}\n--- stderr (tail) ---\n{_tail(_as_text(stderr))}",
            pytrace=False,
        )
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if check and result.returncode != 0:
        pytest.fail(
            f"torchrun {Path(script_path).name} (nproc={nproc}) exited {result.returncode}\n"
            f"--- stdout (tail) ---\n{_tail(stdout)}\n--- stderr (tail) ---\n{_tail(stderr)}",
            pytrace=False,
        )
    return result


@pytest.fixture
def run_torchrun():
    """`run_torchrun(script_path, nproc, args=(), timeout=300, env=None, check=True) -> CompletedProcess`."""
    return torchrun
