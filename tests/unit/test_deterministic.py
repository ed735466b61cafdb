"""``debug.deterministic``: PyTorch's deterministic kernels, usable on CUDA (cuBLAS needs a
workspace configuration for them), so float ``index_add_`` sums repeat bit for bit."""

import os

import pytest
import torch

from torchtitan_rl.recipes.base import use_deterministic_algorithms


@pytest.fixture
def deterministic(monkeypatch):
    """Deterministic mode with no cuBLAS workspace configuration in the environment before;
    both restored afterwards."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # recorded, so the teardown restores the original
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    was_on = torch.are_deterministic_algorithms_enabled()
    use_deterministic_algorithms()
    yield
    torch.use_deterministic_algorithms(was_on)


def test_deterministic_mode_sets_the_cublas_workspace_it_needs(deterministic, monkeypatch):
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    # A configuration the environment chose is kept.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    use_deterministic_algorithms()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float_index_add_and_matmul_repeat_bitwise_on_cuda(deterministic):
    gen = torch.Generator().manual_seed(0)
    # Many float additions into few slots: atomics would add them in a varying order.
    values = torch.randn(1 << 20, generator=gen).cuda()
    slots = torch.randint(0, 7, (1 << 20,), generator=gen).cuda()
    sums = [torch.zeros(7, device="cuda").index_add_(0, slots, values) for _ in range(5)]
    assert all(torch.equal(s, sums[0]) for s in sums)
    matrix = torch.randn(256, 256, generator=gen).cuda()
    assert torch.equal(matrix @ matrix, matrix @ matrix)  # cuBLAS runs under deterministic mode
