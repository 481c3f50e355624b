import os

import pytest
import torch

from fededge.clients.device import resolve_device
from fededge.clients.train import BatchSampler, local_sgd
from fededge.models.zoo import build_model

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here (CI never has one); "
                                "this test runs wherever torch.cuda.is_available()")


def test_auto_picks_cuda_exactly_when_available():
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(HAS_CUDA, reason="checks the error on a machine without CUDA")
def test_cuda_requested_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"device='cuda' was asked for but torch.cuda.is_available\(\) is False.*device=auto"):
        resolve_device("cuda")


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")


@needs_cuda
def test_local_sgd_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 1, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g)
    results = {}
    for dev in ("cpu", "cuda"):
        m = build_model("cnn", input_shape=(1, 8, 8), num_classes=10, seed=0).to(dev)
        local_sgd(m, x.to(dev), y.to(dev), steps=5, lr=0.05, momentum=0.9,
                  sampler=BatchSampler(64, 16, seed=0))
        results[dev] = {k: v.cpu() for k, v in m.state_dict().items()}
    for k in results["cpu"]:
        torch.testing.assert_close(results["cuda"][k], results["cpu"][k], rtol=1e-3, atol=1e-4)


@needs_cuda
def test_inprocess_run_on_cuda(tmp_path):
    import json

    from fededge.server.inprocess import run_inprocess

    run_dir = run_inprocess({"num-rounds": 2, "local-steps": 5, "device": "cuda",
                             "results-dir": str(tmp_path), "progress": "off"}, num_clients=3)
    assert json.loads((run_dir / "config.json").read_text())["device"].startswith("cuda")


def test_cuda_determinism_flags_and_cpu_untouched(monkeypatch):
    from fededge.clients.device import set_cuda_determinism

    before = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
              torch.are_deterministic_algorithms_enabled())
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    set_cuda_determinism(torch.device("cpu"), True)  # the CPU repeats anyway: nothing set
    assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
            torch.are_deterministic_algorithms_enabled()) == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    try:
        # The flags are plain settings: they can be set (and read back) without a GPU.
        set_cuda_determinism(torch.device("cuda"), True)
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        set_cuda_determinism(torch.device("cuda"), False)
        assert not torch.backends.cudnn.deterministic and torch.backends.cudnn.benchmark
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[:2]
        # warn_only too: a CUDA run earlier in this process left deterministic mode on with
        # warn_only, and restoring it without made later tests' CNN backward passes raise
        # (adaptive_avg_pool2d has no deterministic CUDA kernel; seen on an H100).
        torch.use_deterministic_algorithms(before[2], warn_only=warn_only)


def test_deterministic_key_reaches_the_config():
    from fededge.config import RunConfig

    assert RunConfig.from_mapping({}).deterministic is True
    assert RunConfig.from_mapping({"deterministic": False}).deterministic is False


@pytest.mark.parametrize("inductor_first", [False, True])
def test_deterministic_kernels_without_importing_inductor(inductor_first):
    """torch.use_deterministic_algorithms imports torch._inductor (and torch._dynamo:
    seconds of a CUDA client's start-up, in every flwr-clientapp process); fededge sets
    the same flags without it, and inductor's own flag where inductor is already there."""
    import subprocess
    import sys

    code = f"""
import sys, torch
if {inductor_first}:
    import torch._inductor.config as cfg
from fededge.clients.device import set_cuda_determinism
set_cuda_determinism(torch.device("cuda"), True)  # the flags need no GPU
assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
if {inductor_first}:
    assert cfg.deterministic is True
else:
    assert "torch._inductor" not in sys.modules and "torch._dynamo" not in sys.modules, "imported"
    import os
    assert os.environ["TORCHINDUCTOR_DETERMINISTIC"] == "1"  # what inductor will read if imported
set_cuda_determinism(torch.device("cuda"), False)
assert not torch.are_deterministic_algorithms_enabled()
if {inductor_first}:
    assert cfg.deterministic is False
else:
    assert "torch._inductor" not in sys.modules and "torch._dynamo" not in sys.modules, "imported"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
