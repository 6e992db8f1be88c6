"""Forecaster training loss under data parallelism: a mean over every rank's valid targets (partial windows
included), not a mean of per-rank means. Two real gloo processes against one process on the union batch."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from expertcast.models.forecaster import activation_vector
from expertcast.train.forecaster_module import ForecasterModule

L, E, K, W = 2, 8, 2, 10


def _module() -> ForecasterModule:
    torch.manual_seed(0)
    m = ForecasterModule(shape={"num_layers": L, "num_experts": E, "top_k": K, "trigger_layer": None}, hidden_size=32,
                         head_dim=16, state_size=8, num_blocks=1, chunk_size=8, direct_horizons=3,
                         online_half_lives=[0.0, 4.0])
    torch.nn.init.normal_(m.net.head.weight, std=0.1)
    return m


def _batch(rows: int, valid: list[int], seed: int) -> dict[str, torch.Tensor]:
    """``rows`` windows of W elements, row r holding ``valid[r]`` valid targets (partial windows)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(rows * (W + 1) * L)]).view(rows, W + 1, L, K)
    x = activation_vector(ids, torch.rand(rows, W + 1, L, K, generator=g), E)
    mask = torch.arange(W).view(1, W) < torch.tensor(valid).view(rows, 1)
    return {"inputs": x[:, :-1] * mask.view(rows, W, 1, 1), "target_ids": ids[:, 1:], "target_dist": x[:, 1:],
            "mask": mask, "decode": mask.clone()}


BATCHES = [_batch(2, [W, W], seed=1), _batch(2, [3, 1], seed=2)]  # rank 1 holds two partial windows


def _grads(module: ForecasterModule, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    module.zero_grad()
    out = module._losses(module.net(batch["inputs"], all_horizons=True), batch, batch["mask"], global_mean=True)
    out["loss"].backward()
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]


def _rank(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        grads = _grads(_module(), BATCHES[rank])
        for g in grads:  # what DDP does: average the gradients over ranks
            dist.all_reduce(g)
            g /= 2
        if rank == 0:
            torch.save(grads, out)
    finally:
        dist.destroy_process_group()


def test_ddp_gradient_equals_the_mean_over_all_ranks_targets(tmp_path: Path):
    torch.set_num_threads(1)
    union = {k: torch.cat([b[k] for b in BATCHES]) for k in BATCHES[0]}
    want = _grads(_module(), union)
    out = tmp_path / "grads.pt"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_rank, args=(f"file://{tmp_path / 'pg'}", str(out)), nprocs=2, join=True, start_method="fork")
    got = torch.load(out)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    # the check can fail: a mean of per-rank means (each rank normalising by its own count) differs here
    per_rank = [_grads_local(_module(), b) for b in BATCHES]
    naive = [(a + b) / 2 for a, b in zip(*per_rank, strict=True)]
    assert max(float((a - b).abs().max()) for a, b in zip(naive, want, strict=True)) > 1e-3


def _grads_local(module: ForecasterModule, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    module.zero_grad()
    out = module._losses(module.net(batch["inputs"], all_horizons=True), batch, batch["mask"], global_mean=False)
    out["loss"].backward()
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]
