"""LightningModule for cache-aware joint router adaptation: L = L_LM + sw * L_cov.

Modes (docs/design.md, "Cache-aware router adaptation (restated)"; paper section 4):

- ``lm_only``: no auxiliary routers, sw = 0 (the LM-only reference).
- ``aux_only``: backbone and native router frozen; only the added routers (``aux_routers``:
  ``temporal``, ``full`` or ``spatio_only``) learn, on fixed representations.
- ``temporal`` / ``spatio_only`` / ``full``: joint training of the backbone (fully, or through LoRA)
  and the routers; the native distributions stay in the graph, so the coverage loss also shapes
  expert demand.

LoRA (peft) targets the attention projections (``target_modules``) and, through
``target_parameters`` (peft >= 0.17), the fused expert weights of transformers 5
(``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) and the native router weight
(``mlp.gate.weight``), so the native distribution can adapt under LoRA too. The auxiliary routers are
always trained in full.

Backbones: ``model="default"`` (the embedded default model), a tiny preset name
(``qwen3_moe-tiny``: random init with the byte-level tokenizer), or a local HF directory / Hub id
(``trust_remote_code`` off).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as pl
import torch
from expertcast.models.cache_routers import (
    ROUTER_MODES,
    CacheRouters,
    RouterTap,
    cache_coverage_loss,
    resolve_budget,
    soft_topb_membership,
    spatio_temporal_priority,
    temporal_priority,
)
from expertcast.models.routing import find_routers
from lightning.pytorch.strategies import ModelParallelStrategy

TRAIN_MODES = ("lm_only", "aux_only", "temporal", "spatio_only", "full")
EXPORT_FORMAT = "expertcast-router-adaptation"
EXPORT_FORMAT_VERSION = 1


@dataclass
class LoraSettings:
    """LoRA of the backbone (peft)."""

    r: int = 8
    """Rank (per expert for the fused expert parameters)."""
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """nn.Linear modules (attention projections)."""
    target_parameters: list[str] = field(
        default_factory=lambda: ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
    )
    """nn.Parameters: the fused expert weights and the native router weight (names of the family)."""
    merge_on_export: bool = True
    """Export a merged HF model (True) or the base id plus the peft adapter (False)."""


def load_backbone(name: str, dtype: str = "float32", seed: int = 0):
    """(model, tokenizer, base identity) for ``name``: ``default``/``tiny-default``, a tiny preset, an HF
    directory or a Hub id (:func:`expertcast.models.names.resolve_model`: the shipped default when named, then
    :func:`expertcast.models.backbone.load_moe_model`); the identity is what an adapter export records
    (``name`` as given plus :func:`expertcast.models.backbone.model_identity`)."""
    from expertcast.models.backbone import load_moe_model, model_identity
    from expertcast.models.names import resolve_model

    resolved = resolve_model(name)
    model, tok = load_moe_model(resolved, dtype=dtype, seed=seed)
    return model, tok, {"name": str(name), **model_identity(resolved, init_seed=seed, model=model)}


class RouterAdaptationModule(pl.LightningModule):
    """Joint (or auxiliary-only) training of the cache-aware routers with the backbone.

    Batches come from :class:`expertcast.train.router_data.RouterLMDataModule`. Logged: ``train/lm``,
    ``train/cov`` (L_cov in [-1, 0]), ``train/loss``, and on the held-out split ``val/lm`` (token-mean
    LM loss), ``val/cov`` and ``val/cover`` (target top-K coverage of the hard top-B of the mode's
    priority, the training-time hit proxy). ``export_dir``: where ``expertcast fit`` writes the export
    once training finished (default: ``export/`` in the run directory).
    """

    def __init__(self, model: str = "default", mode: str = "temporal", sw: float = 0.1, budget: float = 0.25,
                 tau: float = 0.02, aux_routers: str = "temporal", lr: float = 2e-4, router_lr: float = 2e-3,
                 weight_decay: float = 0.0, warmup_steps: int = 0, lora: LoraSettings | None = None,
                 init: str = "copy", dtype: str = "float32", gradient_checkpointing: bool = False,
                 export_dir: str | None = None, seed: int = 0):
        super().__init__()
        if mode not in TRAIN_MODES:
            raise ValueError(f"unknown training mode {mode!r}; expected one of {TRAIN_MODES}")
        if mode == "aux_only" and aux_routers not in ROUTER_MODES:
            raise ValueError(f"aux_routers must be one of {ROUTER_MODES}, got {aux_routers!r}")
        if sw < 0:
            raise ValueError(f"sw must be >= 0, got {sw}")
        if isinstance(lora, dict):  # from YAML / LightningCLI
            lora = LoraSettings(**lora)
        self.save_hyperparameters()
        self.lora = lora
        self.mode = mode
        self.router_mode = None if mode == "lm_only" else (aux_routers if mode == "aux_only" else mode)
        self.sw = 0.0 if mode == "lm_only" else float(sw)
        torch.manual_seed(seed)
        backbone, self.tokenizer, self.base_identity = load_backbone(model, dtype)
        sites = find_routers(backbone)
        self.num_layers, self.num_experts, self.top_k = len(sites), sites[0].num_experts, sites[0].top_k
        self.budget = resolve_budget(budget, self.num_experts, self.top_k)
        self.tau = float(tau)
        # copy-initialise from the native routers before any adaptation (paper 3.4)
        self.routers = (CacheRouters.for_model(backbone, mode=self.router_mode, init=init, seed=seed)
                        if self.router_mode else None)
        if mode == "aux_only":
            backbone.requires_grad_(False)
        elif lora is not None:
            backbone = self._apply_lora(backbone, lora)
        if gradient_checkpointing and mode != "aux_only":
            backbone.gradient_checkpointing_enable()
        backbone.train(mode != "aux_only")  # a frozen backbone stays in eval mode
        self.backbone = backbone
        # hooked now, before a strategy wraps or shards the model: RouterTap checks the routers against the
        # native router weights, which FSDP flattens into shards; the hooks stay on the same modules
        self.tap = RouterTap(backbone, self.routers)

    @staticmethod
    def _apply_lora(backbone, lora: LoraSettings):
        from peft import LoraConfig, get_peft_model

        names = {n for n, _ in backbone.named_parameters()}
        tp = [t for t in lora.target_parameters if any(n.endswith(t) for n in names)]
        missing = sorted(set(lora.target_parameters) - set(tp))
        if missing:
            raise ValueError(f"LoRA target_parameters {missing} match no parameter of {type(backbone).__name__}")
        cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                         target_modules=list(lora.target_modules), target_parameters=tp or None, bias="none")
        return get_peft_model(backbone, cfg)

    # ------------------------------------------------------------------ hooks
    def _forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        ids, am, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        B, T = ids.shape
        tap = self.tap
        if self.mode == "aux_only":
            with torch.no_grad():
                out = self.backbone(input_ids=ids, attention_mask=am, labels=labels, use_cache=False)
        else:
            out = self.backbone(input_ids=ids, attention_mask=am, labels=labels, use_cache=False)
        lm = out.loss
        if self.routers is None:
            return lm, None, None
        ro = tap.outputs(B, T)
        cov = cache_coverage_loss(ro, self.router_mode, self.budget, self.tau, am)
        return lm, cov, ro

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        lm, cov, _ = self._forward(batch)
        if cov is None:
            loss = lm
        elif self.mode == "aux_only":
            loss = cov  # nothing else has gradients; sw only rescales
        else:
            loss = lm + self.sw * cov
        bs = batch["input_ids"].shape[0]
        self.log("train/lm", lm.detach(), prog_bar=True, batch_size=bs)
        if cov is not None:
            self.log("train/cov", cov.detach(), prog_bar=True, batch_size=bs)
        self.log("train/loss", loss.detach(), batch_size=bs)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        lm, cov, ro = self._forward(batch)
        n = int((batch["labels"][:, 1:] != -100).sum())
        self.log("val/lm", lm, prog_bar=True, batch_size=max(n, 1), sync_dist=True)
        if cov is not None:
            self.log("val/cov", cov, batch_size=batch["input_ids"].shape[0], sync_dist=True)
            self.log("val/cover", self.hard_cover(ro, batch["attention_mask"]), prog_bar=True,
                     batch_size=batch["input_ids"].shape[0], sync_dist=True)

    @torch.no_grad()
    def hard_cover(self, ro, attention_mask: torch.Tensor) -> torch.Tensor:
        """Fraction of the target token's native top-K inside the hard top-B of the priority."""
        if self.router_mode == "temporal":
            s = temporal_priority(ro.p_R[:, :-1], ro.p_T[:, :-1])
        else:
            s = spatio_temporal_priority(ro.p_R, ro.p_T if self.router_mode == "full" else None, ro.p_S)
        topb = soft_topb_membership(s, self.budget, 1e-6) > 0.25  # hard Top-B (ties count)
        sel = torch.zeros_like(topb).scatter_(-1, ro.p_R[:, 1:].topk(self.top_k, -1).indices, True)
        am = attention_mask.bool()
        valid = (am[:, :-1] & am[:, 1:])[:, :, None].float()
        hit = (topb & sel).sum(-1).float() / self.top_k
        return (hit * valid).sum() / (valid.sum() * hit.shape[-1]).clamp_min(1)

    def configure_optimizers(self):
        groups = []
        bb = [p for p in self.backbone.parameters() if p.requires_grad]
        if bb:
            groups.append({"params": bb, "lr": self.hparams.lr, "weight_decay": self.hparams.weight_decay})
        if self.routers is not None:
            groups.append({"params": list(self.routers.parameters()), "lr": self.hparams.router_lr,
                           "weight_decay": 0.0})
        opt = torch.optim.AdamW(groups)
        w = int(self.hparams.warmup_steps)
        if w <= 0:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / w))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def configure_model(self) -> None:
        """Under :class:`DecoderLayerFSDP2Strategy` shard the model (:meth:`DecoderLayerFSDP2Strategy.shard`);
        nothing under any other strategy. Lightning calls it once the processes exist, before the optimizer."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, DecoderLayerFSDP2Strategy) and not _is_sharded(self):
            strategy.shard(self)

    # ------------------------------------------------------------------ export
    # `expertcast fit` writes the export once training finished normally (never from a hook mid-run):
    # into ``export_dir`` when set, else into the run directory (expertcast.train.fit_run)
    task_name = "router"
    export_kind = "export-router"
    collective_export = True
    """`expertcast fit` calls :meth:`export` on every rank (FSDP gathers the shards; rank 0 writes)."""

    def export(self, directory: str | Path, training: dict[str, Any] | None = None) -> Path | None:
        """Write the export into ``directory``; returns it (None on ranks > 0 of a multi-process fit).

        ``model/``: a plain Hugging Face folder, LoRA merged (``lora.merge_on_export``, the default), or
        ``adapter/``: the peft adapter, loaded over the base model that ``export.json`` records (``base``,
        :func:`expertcast.models.backbone.model_identity`) by :func:`~expertcast.models.backbone.load_moe_model`;
        ``routers/`` (safetensors + JSON, :mod:`expertcast.models.router_export`), ``export.json`` (with the
        provenance block ``training`` when given) and a manifest over every file of the export.

        In a multi-process fit every rank must call it: under FSDP the full state dict is gathered to rank 0
        (a collective, :func:`gathered_state_dict`); under DDP every rank already holds the whole model. All
        ranks meet at a barrier, then rank 0 alone writes.
        """
        state = gathered_state_dict(self)
        if _sync_ranks(self) != 0:
            return None
        source = self if state is None else self._unsharded_copy(state)
        return source._write_export(Path(directory), training)

    def _unsharded_copy(self, state: dict[str, torch.Tensor]) -> RouterAdaptationModule:
        """A new module of the same settings (backbone loaded again, LoRA applied) holding ``state``."""
        import inspect

        names = set(inspect.signature(type(self).__init__).parameters) - {"self", "export_dir"}
        twin = type(self)(**{k: v for k, v in self.hparams.items() if k in names})  # not LightningCLI's _class_path
        twin.load_state_dict(state, strict=True)
        return twin

    def _write_export(self, d: Path, training: dict[str, Any] | None) -> Path:
        from expertcast.models.router_export import ADAPTATION_FILE, save_routers
        from expertcast.utils.io import atomic_write_json
        from expertcast.utils.provenance import EXPORT_MANIFEST, write_export_manifest

        d.mkdir(parents=True, exist_ok=True)
        info: dict[str, Any] = {"format": EXPORT_FORMAT, "format_version": EXPORT_FORMAT_VERSION,
                                "mode": self.mode, "router_mode": self.router_mode, "sw": self.sw,
                                "budget": self.budget, "tau": self.tau, "base_model": self.hparams.model,
                                "base": self.base_identity}
        plain = self._save_backbone(d, info)
        if self.routers is not None:
            save_routers(d / "routers", self.routers, plain,
                         extra={"budget": self.budget, "tau": self.tau, "sw": self.sw, "train_mode": self.mode})
            info["routers_dir"] = "routers"
        if self._trainer is not None and self.trainer.global_step:
            info["steps"] = int(self.trainer.global_step)
            val = self.trainer.callback_metrics.get("val/lm")
            if val is not None and math.isfinite(float(val)):
                info["val_lm"] = float(val)
        if training is not None:
            info["training"] = training
        atomic_write_json(d / ADAPTATION_FILE, info)
        files = [str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p != d / EXPORT_MANIFEST
                 and not any(part.startswith(".") for part in p.relative_to(d).parts)]
        write_export_manifest(d, files)
        return d

    def _save_backbone(self, d: Path, info: dict[str, Any]) -> Any:
        """Save ``model/`` (merged) or ``adapter/`` with the tokenizer; returns a plain model of the routers'
        backbone (for their signature). Records the folder in ``info``."""
        bb = self.backbone
        if hasattr(bb, "peft_config") and self.lora is not None and not self.lora.merge_on_export:
            info["adapter_dir"] = "adapter"
            bb.save_pretrained(d / "adapter")
            plain = bb
        else:
            info["model_dir"] = "model"
            plain = bb
            if hasattr(bb, "peft_config"):
                self.tap.remove()  # the copy must not carry the training hooks
                try:
                    plain = copy.deepcopy(bb).merge_and_unload()
                finally:
                    self.tap = RouterTap(self.backbone, self.routers)
            plain.save_pretrained(d / "model")
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(d / info.get("model_dir", info.get("adapter_dir")))
        return plain


def _is_sharded(module: torch.nn.Module) -> bool:
    """True when FSDP (FullyShardedDataParallel submodules, or FSDP2's DTensor parameters) shards ``module``."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    return (any(isinstance(m, FullyShardedDataParallel) for m in module.modules())
            or any(isinstance(p, DTensor) for p in module.parameters()))


def _sync_ranks(module: pl.LightningModule) -> int:
    """Wait for every rank of a multi-process run (a barrier) and return this process's rank (0 when alone):
    the trainer's, or torch.distributed's for a module sharded outside a trainer."""
    if module._trainer is not None:
        module.trainer.strategy.barrier("expertcast-export")
        return module.trainer.global_rank
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        return torch.distributed.get_rank()
    return 0


def gathered_state_dict(module: pl.LightningModule) -> dict[str, torch.Tensor] | None:
    """The full state dict of a module that FSDP shards, gathered to rank 0's CPU (keys as in the unwrapped
    module's ``state_dict()``; empty on the other ranks). A collective: every rank must call it. None when
    nothing is sharded (one process, or DDP, where every rank holds the whole model)."""
    if not _is_sharded(module):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    root = module.trainer.strategy.model if module._trainer is not None else module
    return get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class DecoderLayerFSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over every process of the fit: Lightning's ModelParallelStrategy with one data-parallel mesh
    dimension of all ranks (no tensor parallelism), and a module whose ``configure_model`` calls :meth:`shard`
    (:class:`RouterAdaptationModule` does). Each decoder layer of ``layer_class`` (a dotted class path, e.g.
    ``transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeDecoderLayer``) is one ``fully_shard`` unit, with
    activation checkpointing around it when asked. Runs on CPU under gloo as on GPUs under NCCL
    (``tests/train/test_distributed_fit.py``). Selectable from YAML as the trainer's strategy."""

    def __init__(self, layer_class: str = "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeDecoderLayer",
                 reshard_after_forward: bool = True, activation_checkpointing: bool = True,
                 save_distributed_checkpoint: bool = True, process_group_backend: str | None = None):
        import importlib

        mod, _, name = layer_class.rpartition(".")
        try:
            self.layer_cls = getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"decoder layer class {layer_class!r} not found: {e}") from None
        self.reshard_after_forward = bool(reshard_after_forward)
        self.activation_checkpointing = bool(activation_checkpointing)
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every rank shards; tensor_parallel_size 1
        super().setup_environment()

    def shard(self, module: RouterAdaptationModule) -> int:
        """``fully_shard`` every decoder layer of ``module.backbone``, then the backbone (embeddings, norm, head)
        and each cache router (their gradients are reduced like the backbone's); returns the number of
        decoder layers. Called from ``configure_model``, before the optimizer exists."""
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        layers = [m for m in module.backbone.modules() if isinstance(m, self.layer_cls)]
        if not layers:
            from expertcast.utils.errors import UsageError

            raise UsageError(f"{type(module.backbone).__name__} has no decoder layer of class "
                             f"{self.layer_cls.__name__} (the strategy's layer_class)")
        if self.activation_checkpointing:  # wraps the same layer objects; they stay the fully_shard units
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                apply_activation_checkpointing,
            )

            apply_activation_checkpointing(module.backbone, check_fn=lambda m: isinstance(m, self.layer_cls))
        kw = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward}
        for layer in layers:
            fully_shard(layer, **kw)
        fully_shard(module.backbone, **kw)
        if module.routers is not None:  # called per layer (CacheRouters.distributions): one unit each
            for lin in module.routers.modules():
                if isinstance(lin, torch.nn.Linear):
                    fully_shard(lin, **kw)
        if self.global_rank == 0:
            print(f"FSDP2: {len(layers)} {self.layer_cls.__name__} units sharded over {mesh.size()} processes",
                  flush=True)
        return len(layers)
