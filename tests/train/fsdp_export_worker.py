"""Worker of ``test_distributed_fit.py::test_fsdp_sharded_router_module_taps_gathers_and_exports``, run by
``torchrun --nproc_per_node 2`` on CPU (gloo): FSDP2 shards a LoRA router-adaptation module on a tiny
preset, its loss through RouterTap is compared with the unsharded one, then it is exported (full state
gathered to rank 0, written by rank 0 only).

    torchrun --nproc_per_node 2 tests/train/fsdp_export_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def make_module():
    """The module both this worker and the test build: tiny preset, full routers, LoRA with a non-zero B."""
    from expertcast.train.router_module import LoraSettings, RouterAdaptationModule

    torch.manual_seed(0)
    m = RouterAdaptationModule(model="qwen3_moe-tiny", mode="full", budget=6, lora=LoraSettings(r=4, alpha=8))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.backbone.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return m


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(4, 500, (2, 12), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def main(out: Path) -> None:
    from expertcast.train.router_module import _is_sharded
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    m = make_module()
    lm0, cov0, _ = m._forward(batch())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in m.backbone.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(m.backbone, mesh=mesh)  # the routers (4 small linears) stay whole on every rank
    gate = m.backbone.base_model.model.model.layers[0].mlp.gate
    local_rows = int(gate.weight.to_local().shape[0]) if hasattr(gate.weight, "to_local") else None
    lm, cov, _ = m._forward(batch())  # RouterTap reads the hooked routers of the sharded model
    (lm + 0.1 * cov).backward()
    written = m.export(out / "export")
    report = {"rank": dist.get_rank(), "sharded": _is_sharded(m), "gate_local_rows": local_rows,
              "lm": [float(lm0), float(lm)], "cov": [float(cov0), float(cov)], "wrote": written is not None}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
