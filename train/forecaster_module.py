"""LightningModule training the SeqMoE forecaster (SeqMoE 5.4; docs/design.md "Forecaster").

Loss = ``rank_weight`` · ranking loss around the top-K boundary + ``kl_weight`` · KL(target ‖ model).
Scheduled sampling (SeqMoE 5.4; docs/design.md "Forecaster"): training starts with teacher forcing;
after ``teacher_forcing_fraction`` of the optimizer steps the probability ``rate`` that a rollout
segment is replaced rises linearly to ``max_sampling_rate`` (:func:`sampling_schedule`). Each window is
cut into segments of ``sampling_rollout`` elements; in a replaced (row, segment) every input after the
segment's first is the model's own recursive rollout: its next-element forecast turned into an
activation vector (:func:`~expertcast.models.forecaster.predictions_to_input`) and fed back through the
recurrent state, step after step, from the state that consumed the (mixed) inputs before it
(:func:`rollout_inputs`, no grad). The trained pass then runs the parallel scan over the mixed inputs
against the true targets, so training sees the compounding errors of multi-step rollout.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.models.forecaster import (
    ExpertForecaster,
    ForecasterConfig,
    ForecasterState,
    check_backbone,
    predictions_to_input,
    scaled_width,
)
from expertcast.models.forecaster_export import save_forecaster
from expertcast.train.forecaster_calibration import (
    SELECT_CONFIDENCE,
    SELECT_MARGIN,
    ResidualScaleFit,
    calibrate_on_loader,
    fit_temperature,
    recall_at,
    select_components,
)


def ranking_loss(logits: torch.Tensor, target_ids: torch.Tensor, num_negatives: int) -> torch.Tensor:
    """Pairwise logistic loss between every true expert and the hardest non-selected ones.

    Args:
        logits: [N, L, E]; target_ids: long [N, L, K]; num_negatives: m hardest negatives per layer.
    Returns:
        [N] loss per element (mean over layers and pairs) of softplus(s_neg - s_pos).
    """
    E = logits.shape[-1]
    pos_mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, target_ids, True)
    pos = logits.gather(-1, target_ids)  # [N, L, K]
    m = min(num_negatives, E - target_ids.shape[-1])
    neg = logits.masked_fill(pos_mask, float("-inf")).topk(m, dim=-1).values  # [N, L, m]
    return F.softplus(neg.unsqueeze(-2) - pos.unsqueeze(-1)).mean(dim=(-1, -2, -3))


def kl_loss(logits: torch.Tensor, target_dist: torch.Tensor) -> torch.Tensor:
    """KL(target ‖ softmax(logits)) per element: logits / target_dist [N, L, E] -> [N] (mean over layers)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    q = target_dist.float()
    return (torch.xlogy(q, q) - q * logp).sum(-1).mean(-1)


def sampling_schedule(progress: float, teacher_forcing_fraction: float, ramp_fraction: float,
                      max_rate: float) -> float:
    """Scheduled-sampling rate at training ``progress`` in [0, 1]: 0 up to ``teacher_forcing_fraction``, then
    rising linearly to ``max_rate`` over the next ``ramp_fraction`` of training, then ``max_rate``."""
    if max_rate <= 0:
        return 0.0
    ramp = max(ramp_fraction, 1e-9)
    return float(max_rate * min(1.0, max(0.0, (progress - teacher_forcing_fraction) / ramp)))


def sample_replacements(mask: torch.Tensor, rate: float, segment: int,
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """Which inputs scheduled sampling replaces: mask bool [B, W] (valid inputs) -> bool [B, W].

    Each (row, segment of ``segment`` elements) is chosen with probability ``rate``; in a chosen one every
    valid input after the segment's first is replaced (the first stays true: the rollout starts there).
    """
    B, W = mask.shape
    n_seg = -(-W // segment)
    chosen = torch.rand(B, n_seg, generator=generator, device=mask.device) < rate
    pos = torch.arange(W, device=mask.device)
    return chosen.repeat_interleave(segment, dim=1)[:, :W] & (pos % segment != 0) & mask


@torch.no_grad()
def rollout_inputs(net: ExpertForecaster, x: torch.Tensor, replaced: torch.Tensor, segment: int) -> torch.Tensor:
    """The model's own multi-step rollout in place of the true inputs at ``replaced``.

    Args:
        net: the forecaster; x: float [B, W, L, E] true inputs of a window (from a zero state);
        replaced: bool [B, W], only at positions p with p % segment != 0 (:func:`sample_replacements`);
        segment: the segment length R.
    Returns:
        [B, W, L, E]: x where not replaced. In the segment starting at s, the recurrent state consumes the
        true inputs 0..s (as at inference, where a rollout starts from the true history), then its
        next-element forecast, turned into an activation vector (``predictions_to_input``), is fed back
        step after step: position s+k holds the k-th fed-back vector. All segments roll out as one batch,
        so this costs W/R parallel scans plus R-1 recurrent steps.
    """
    B, W = x.shape[:2]
    if bool(replaced[:, ::segment].any()):
        raise ValueError("the first input of a segment cannot be replaced (the rollout starts from it)")
    out = x.clone()
    state = net.init_state(B, x.device)
    K = net.config.top_k
    rows, starts, states, logits = [], [], [], []
    done = 0
    for s in range(0, W - 1, segment):
        lg = net(x[:, done:s + 1], state)[:, -1]  # the state has consumed the true inputs 0..s
        done = s + 1
        r = replaced[:, s + 1:s + segment].any(1).nonzero().flatten()
        if r.numel():
            rows.append(r)
            starts.append(torch.full_like(r, s))
            states.append(state.select(r))
            logits.append(lg[r])
    if not rows:
        return out
    row, start = torch.cat(rows), torch.cat(starts)
    roll_state, cur = ForecasterState.cat(states), torch.cat(logits)
    for k in range(1, segment):
        pos = start + k
        inp = predictions_to_input(cur, K).to(out.dtype)
        ok = pos < W
        hit = torch.zeros_like(ok)
        hit[ok] = replaced[row[ok], pos[ok]]
        out[row[hit], pos[hit]] = inp[hit]
        if k < segment - 1:
            cur, _ = net.step(inp, roll_state)
    return out


class ForecasterModule(pl.LightningModule):
    """Trains an :class:`ExpertForecaster`. L, E, K and the trigger layer (``shape``: num_layers, num_experts,
    top_k, trigger_layer) come from the data module when not given; they are then stored in the
    hyper-parameters, so checkpoints rebuild the same network.

    Args:
        backbone / hidden_size / num_blocks / state_size / head_dim / expand / conv_kernel / n_groups /
        chunk_size: :class:`ForecasterConfig` fields.
        lr / weight_decay / warmup_fraction / min_lr_ratio: AdamW with linear warm-up then cosine decay to
            ``min_lr_ratio``·lr over the run's optimizer steps.
        rank_weight / kl_weight / rank_negatives: loss mix; hardest negatives in the ranking loss.
        teacher_forcing_fraction / sampling_ramp_fraction / max_sampling_rate: scheduled sampling starts
            after this share of steps and rises linearly to ``max_sampling_rate`` over the next share
            (the probability that a rollout segment is replaced by the model's own rollout).
        sampling_rollout: elements per scheduled-sampling segment (its first input stays true; the others
            are a rollout of ``sampling_rollout - 1`` steps).
        online_half_lives: half-lives of the online statistics the forecaster reads
            (:class:`~expertcast.models.forecaster.OnlinePrior`; 0 = the last selection; [] = none).
        loss_on_prefill: also train on targets inside the prompt (the routing there is a sequence too).
        export_dir: where ``expertcast fit`` writes the export once training finished normally (default:
            ``export/`` in the run directory); never written from a hook mid-run.
        calibration_elements: held-out elements whose one-step logits fit the probability temperature after
            each validation (:func:`fit_temperature`; stored in the export's config).
        direct_horizons: H_d output heads, head j trained on element i+j of the same window (multi-horizon
            sequence-to-sequence training; 1 = next element only, longer horizons by recursive rollout).
        ahead_weight: weight of the mean loss of heads 2..H_d relative to the next-element head.
        prior_lr: learning rate of the online prior's mixture and gates (``net.online``; None: ``lr``). They are
            a few hundred scalars that must move by several units within a short fit (which statistic to trust
            at which horizon), so they get a larger rate than the network.
        fit_residual_scale: after training, choose per head the factor on the learned logits on the held-out
            (validation) targets (:class:`ResidualScaleFit`): the forecaster then falls back to its online prior
            at the horizons where its learned part does not help. Needs online statistics and a validation split.
        prior_start: half-life (one of ``online_half_lives``) of the statistic the online prior starts on (0.9 of
            every head's mixture; :meth:`~expertcast.models.forecaster.OnlinePrior.start_on`), e.g. the recent-freq
            baseline's 16; None: equal shares. Training moves the mixture from there only as far as the fit
            set asks.
        learned_gate_rate / learned_gate_half_life: per-sequence gate on the learned logits (kappa and the
            discount of :attr:`~expertcast.models.forecaster.ForecasterConfig.learned_gate_rate`; 0 = off).
        online_hedge_rate / online_hedge_half_life: per-sequence weighting of the online sources by their recall
            on the sequence so far (:class:`~expertcast.models.forecaster.OnlinePrior`; 0 = off).
        component_half_lives: the online baselines as exact components, recent-freq at these half-lives (None:
            none); at the end of the fit :func:`select_components` picks per head and layer the learned part or a
            component on the validation split (margin ``select_margin``); a layer leaves its head's default component
            for another only where its gain passes a one-sided test at ``select_confidence`` with runs of 64
            consecutive validation targets as clusters (0: no test, each layer's best component).
        component_cross_layer: with components, also the cross-layer component (the trigger layer's experts
            through the fit set's map to every layer of the next element;
            :attr:`~expertcast.models.forecaster.ForecasterConfig.component_cross_layer`).
        component_cross_recent: with the cross-layer component, also cross-x-recent (its scores times the sequence's
            recent-freq at half-life 16 over the fit set's frequency;
            :attr:`~expertcast.models.forecaster.ForecasterConfig.component_cross_recent`).
        within_token_table: with components, also fit and export the within-token table (layer l - 1's experts to
            layer l's of the same token) that seqmoe's ``replan`` reads
            (:attr:`~expertcast.models.forecaster.ForecasterConfig.within_token_table`).
        switch_half_life: per sequence, each head and layer issues the selected forecast or a component, whichever
            has the best discounted recall (this half-life) on the sequence so far
            (:attr:`~expertcast.models.forecaster.ForecasterConfig.switch_half_life`; 0 = off).
        head_rank: factored per-layer output heads of this rank (0: one dense head).
        skip_hidden: width of the per-element branch added to the head's logits
            (:attr:`~expertcast.models.forecaster.ForecasterConfig.skip_hidden`; 0: none).
        hidden_size: 0 scales the width with L x E (:func:`~expertcast.models.forecaster.scaled_width`).

    Loss normalisation: every loss term is a mean over the valid targets of all data-parallel ranks (the
    per-rank sums divided by the all-reduced count over the world size, which DDP's gradient averaging turns
    into sum / total count), not a mean of per-rank means, so ranks holding partial windows weigh what they hold.
    """

    task_name = "forecaster"
    export_kind = "export-forecaster"

    def __init__(self, backbone: str = "mamba2", hidden_size: int = 128, num_blocks: int = 2, state_size: int = 32,
                 head_dim: int = 32, expand: int = 2, conv_kernel: int = 4, n_groups: int = 1, chunk_size: int = 64,
                 lr: float = 2e-3, weight_decay: float = 0.01, warmup_fraction: float = 0.05, min_lr_ratio: float = 0.05,
                 rank_weight: float = 1.0, kl_weight: float = 1.0, rank_negatives: int = 8,
                 teacher_forcing_fraction: float = 0.4, sampling_ramp_fraction: float = 0.4,
                 max_sampling_rate: float = 0.5, loss_on_prefill: bool = True, export_dir: str | None = None,
                 shape: dict[str, Any] | None = None, source: dict[str, Any] | None = None,
                 split_info: dict[str, Any] | None = None, calibration_elements: int = 4096,
                 direct_horizons: int = 1, ahead_weight: float = 1.0, sampling_rollout: int = 8,
                 online_half_lives: list[float] | None = None, prior_lr: float | None = 0.05,
                 fit_residual_scale: bool = True, online_hedge_rate: float = 0.0,
                 online_hedge_half_life: float = 64.0, prior_start: float | None = None,
                 learned_gate_rate: float = 0.0, learned_gate_half_life: float = 8.0,
                 component_half_lives: list[float] | None = None, head_rank: int = 0,
                 select_margin: float = SELECT_MARGIN, switch_half_life: float = 0.0, skip_hidden: int = 0,
                 component_cross_layer: bool = False, component_cross_recent: bool = False,
                 within_token_table: bool = False, select_confidence: float = SELECT_CONFIDENCE):
        super().__init__()
        check_backbone(backbone)  # before any trace is read
        if not (select_confidence == 0 or 0.5 <= select_confidence < 1):
            raise ValueError(f"select_confidence must be 0 (no test) or in [0.5, 1), got {select_confidence}")
        if sampling_rollout < 2:
            raise ValueError(f"sampling_rollout must be >= 2 (one true input, then the rollout), got {sampling_rollout}")
        self.save_hyperparameters()
        self.net: ExpertForecaster | None = None
        self._calib: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._residual_fit: ResidualScaleFit | None = None
        self._residual_scale: list[float] | None = None
        """The residual scale chosen at the last validation; written into the network's config when fitting ends."""
        self.selection_report: dict[str, Any] | None = None
        """What :func:`select_components` measured at the end of the fit (written into the export)."""
        self._total_steps: int | None = None
        """The fit's optimizer steps, planned once by :meth:`plan_steps` when the optimizer is configured."""
        if shape:
            self._build(shape["num_layers"], shape["num_experts"], shape["top_k"], shape.get("trigger_layer"))

    # --- construction ---
    def _build(self, L: int, E: int, K: int, trigger_layer: int | None) -> None:
        h = self.hparams
        comp = h.get("component_half_lives")
        cfg = ForecasterConfig(num_layers=L, num_experts=E, top_k=K, trigger_layer=trigger_layer, backbone=h.backbone,
                               hidden_size=h.hidden_size or scaled_width(L, E), head_rank=int(h.get("head_rank", 0)),
                               component_half_lives=None if comp is None else [float(v) for v in comp], num_blocks=h.num_blocks, state_size=h.state_size,
                               head_dim=h.head_dim, expand=h.expand, conv_kernel=h.conv_kernel, n_groups=h.n_groups,
                               chunk_size=h.chunk_size, direct_horizons=h.direct_horizons,
                               online_half_lives=[float(v) for v in h.online_half_lives or []],
                               online_hedge_rate=float(h.get("online_hedge_rate", 0.0)),
                               online_hedge_half_life=float(h.get("online_hedge_half_life", 64.0)),
                               learned_gate_rate=float(h.get("learned_gate_rate", 0.0)),
                               learned_gate_half_life=float(h.get("learned_gate_half_life", 8.0)),
                               switch_half_life=float(h.get("switch_half_life", 0.0)),
                               skip_hidden=int(h.get("skip_hidden", 0)),
                               component_cross_layer=bool(h.get("component_cross_layer", False)),
                               component_cross_recent=bool(h.get("component_cross_recent", False)),
                               within_token_table=bool(h.get("within_token_table", False)))
        self.net = ExpertForecaster(cfg)
        start = h.get("prior_start")
        if start is not None:
            if float(start) not in cfg.online_half_lives:
                raise ValueError(f"prior_start {start} is not one of online_half_lives {cfg.online_half_lives}")
            self.net.online.start_on(cfg.online_half_lives.index(float(start)))
        self.hparams.update(shape={"num_layers": L, "num_experts": E, "top_k": K, "trigger_layer": trigger_layer})

    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None and hasattr(dm, "prepare"):
            meta = dm.prepare()
            p = getattr(dm, "trigger_layer", None)
            if self.net is None:
                self._build(meta.num_layers, meta.num_experts, meta.top_k, p)
            else:
                c = self.net.config
                meta.check_compatible(c.num_layers, c.num_experts, c.top_k, what="forecaster")
                if c.trigger_layer != p:
                    raise ValueError(f"forecaster trigger layer {c.trigger_layer} != data module trigger layer {p}")
            self.hparams.update(source={"model_id": meta.model_id, "num_layers": meta.num_layers,
                                        "num_experts": meta.num_experts, "top_k": meta.top_k,
                                        "expert_bytes": meta.expert_bytes, "dataset": meta.dataset},
                                split_info=getattr(dm, "split_info", None))
        if self.net is None:
            raise ValueError("ForecasterModule needs shape={num_layers, num_experts, top_k} or a ForecasterDataModule")

    # --- schedule ---
    def planned_steps(self) -> int:
        """Optimizer steps this fit makes, the total the LR schedule and the sampling ramp are fractions of: planned
        once (:meth:`plan_steps`) when the optimizer is configured; reading it changes nothing."""
        if self._total_steps is None:
            raise RuntimeError("the fit's steps are planned when its optimizer is configured (trainer.fit)")
        return self._total_steps

    def plan_steps(self) -> int:
        """Plan the fit's optimizer steps (the setup step of :meth:`configure_optimizers`; returns them).

        ``trainer.min_steps`` is a floor on it that does not depend on the trace set's size: Lightning stops
        at ``max_epochs`` even below ``min_steps``, so where ``max_epochs`` whole epochs make fewer steps,
        ``max_epochs`` is raised to the fewest whole epochs that reach the floor (``max_steps`` still caps).
        Validation keeps its epoch cadence, stretched with the epochs (``check_val_every_n_epoch`` grows so
        that the fit validates as often as its recipe's epochs planned, the epochs rounded up to a multiple of
        it): the last validation at the last epoch, not one per epoch of a one-batch set. On big trace sets the
        epochs reach the floor: nothing changes there (docs/results.md, "Forecaster training length: a steps
        floor")."""
        t = self.trainer
        floor = int(t.fit_loop.min_steps or 0)
        total = t.estimated_stepping_batches
        epochs = t.max_epochs
        if (floor > 0 and epochs is not None and epochs > 0 and total != float("inf") and total < floor
                and (t.max_steps == -1 or total < t.max_steps)):
            per_epoch = math.ceil(t.num_training_batches / t.accumulate_grad_batches)
            if per_epoch > 0:
                grown = math.ceil(floor / per_epoch)
                every = t.check_val_every_n_epoch
                if every:
                    checks = max(1, epochs // every)
                    every = max(every, math.ceil(grown / checks))
                    t.check_val_every_n_epoch = every
                    grown = math.ceil(grown / every) * every
                t.fit_loop.max_epochs = grown
                total = t.estimated_stepping_batches
        self._total_steps = max(1, int(total))
        return self._total_steps

    def sampling_rate(self) -> float:
        """Current scheduled-sampling replacement rate (0 while teacher forcing)."""
        h = self.hparams
        if h.max_sampling_rate <= 0 or self._trainer is None:
            return 0.0
        total = self.planned_steps()
        return sampling_schedule(self.global_step / total, h.teacher_forcing_fraction, h.sampling_ramp_fraction,
                                 h.max_sampling_rate)

    # --- steps ---
    def _losses(self, logits: torch.Tensor, batch: dict[str, torch.Tensor], use: torch.Tensor,
                global_mean: bool = False) -> dict[str, torch.Tensor]:
        """Losses of next-element logits [B, W, L, E] (or all heads [B, W, H_d, L, E]) on the targets selected by
        ``use`` [B, W]. Head j (0-based) at position i is scored against the target of position i+j, i.e.
        element i+1+j of the window; positions whose element i+1+j lies outside the window are skipped.

        Each term is sum / count over the selected targets; with ``global_mean`` the count is the all-ranks total
        over the world size (:meth:`_global_counts`), so DDP's gradient average is the mean over every rank's
        targets. Heads without a target on any rank are left out of ``ahead``."""
        if logits.dim() == 4:
            logits = logits.unsqueeze(2)
        h = self.hparams
        B, W, H = logits.shape[:3]
        # every head's scored rows in one gather (per-head slices each cost a full-size zero gradient in backward)
        rows, tgt, counts = [], [], []
        for j in range(H):
            b, i = use[:, j:].nonzero(as_tuple=True)  # position i of head j is scored against element i + 1 + j
            rows.append((b * W + i) * H + j)
            tgt.append(b * W + i + j)
            counts.append(len(b))
        rows_t, tgt_t = torch.cat(rows), torch.cat(tgt)
        lg = logits.reshape(B * W * H, *logits.shape[3:]).index_select(0, rows_t)
        rank_e = ranking_loss(lg.float(), batch["target_ids"].flatten(0, 1).index_select(0, tgt_t), h.rank_negatives)
        kl_e = kl_loss(lg, batch["target_dist"].flatten(0, 1).index_select(0, tgt_t))
        rank_s = [part.sum() for part in rank_e.split(counts)]
        kl_s = [part.sum() for part in kl_e.split(counts)]
        n = torch.tensor(counts, device=logits.device, dtype=torch.float32)
        denom = self._global_counts(n) if global_mean else n
        rank = torch.stack(rank_s) / denom.clamp_min(1e-9)
        kl = torch.stack(kl_s) / denom.clamp_min(1e-9)
        part = h.rank_weight * rank + h.kl_weight * kl  # [H]
        out: dict[str, torch.Tensor] = {"loss": part[0], "rank": rank[0], "kl": kl[0]}
        has = denom[1:] > 0
        if bool(has.any()):
            out["ahead"] = part[1:][has].mean()
            out["loss"] = out["loss"] + h.ahead_weight * out["ahead"]
        return out

    def _global_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """counts [H] (this rank's targets per head) -> [H] all ranks' total / world size (the same tensor on one
        process). One all-reduce per call, made by every rank (no rank skips it), so ranks never fall out of step."""
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() <= 1:
            return counts
        total = counts.detach().clone()
        dist.all_reduce(total)
        return total / dist.get_world_size()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.net is not None
        x = batch["inputs"]
        rate = self.sampling_rate()
        if rate > 0:
            replaced = sample_replacements(batch["mask"], rate, self.hparams.sampling_rollout)
            if bool(replaced.any()):
                x = rollout_inputs(self.net, x, replaced, self.hparams.sampling_rollout)
        logits = self.net(x, all_horizons=self.net.config.direct_horizons > 1)
        use = batch["mask"] if self.hparams.loss_on_prefill else batch["mask"] & batch["decode"]
        if not bool(use.any()):
            use = batch["mask"]
        out = self._losses(logits, batch, use, global_mean=True)
        bs = x.shape[0]
        self.log("train/loss", out["loss"], prog_bar=True, batch_size=bs)
        self.log("train/rank", out["rank"], batch_size=bs)
        self.log("train/kl", out["kl"], batch_size=bs)
        if "ahead" in out:
            self.log("train/ahead", out["ahead"], batch_size=bs)
        self.log("train/sampling_rate", rate, batch_size=bs)
        return out["loss"]

    def _eval_step(self, batch: dict[str, torch.Tensor], prefix: str) -> None:
        assert self.net is not None
        H = self.net.config.direct_horizons
        all_logits = self.net(batch["inputs"], all_horizons=H > 1)
        use = batch["mask"]
        out = self._losses(all_logits, batch, use)
        logits = all_logits[:, :, 0] if H > 1 else all_logits
        bs = batch["inputs"].shape[0]
        self.log(f"{prefix}/loss", out["loss"], prog_bar=True, batch_size=bs, sync_dist=True)
        self.log(f"{prefix}/kl", out["kl"], batch_size=bs, sync_dist=True)
        dec = batch["mask"] & batch["decode"]
        sel = dec if bool(dec.any()) else use
        K = self.net.config.top_k
        n = int(sel.sum())
        r_k = recall_at(logits[sel].float(), batch["target_ids"][sel], K).mean()
        r_k3 = recall_at(logits[sel].float(), batch["target_ids"][sel], K + 3).mean()
        if prefix == "val" and sum(x.shape[0] for x in self._calib[0]) < self.hparams.calibration_elements:
            self._calib[0].append(logits[sel].detach().float().cpu())
            self._calib[1].append(batch["target_ids"][sel].cpu())
            if self._residual_fit is not None:
                learned, prior = self.net.forward_parts(batch["inputs"], all_horizons=True)
                self._residual_fit.add(learned.cpu(), prior.cpu(), batch["target_ids"].cpu(), sel.cpu())
        self.log(f"{prefix}/recall@K", r_k, prog_bar=True, batch_size=n, sync_dist=True)
        self.log(f"{prefix}/recall@K+3", r_k3, batch_size=n, sync_dist=True)
        if H > 1:  # the farthest direct head, scored on the targets H-1 positions later
            sel_h = sel[:, H - 1:]
            if bool(sel_h.any()):
                W = all_logits.shape[1]
                r_h = recall_at(all_logits[:, : W - H + 1, H - 1][sel_h].float(),
                                batch["target_ids"][:, H - 1:][sel_h], K).mean()
                self.log(f"{prefix}/recall@K_h{H}", r_h, batch_size=int(sel_h.sum()), sync_dist=True)

    def on_validation_epoch_start(self) -> None:
        self._calib = ([], [])
        c = self.net.config if self.net is not None else None
        self._residual_fit = ResidualScaleFit(c.direct_horizons, c.top_k) \
            if c is not None and self.hparams.get("fit_residual_scale", True) and self.net.online is not None else None

    def calibrate(self) -> float | None:
        """Fit the probability temperature on the logits kept from the last validation epoch."""
        if self.net is None or not getattr(self, "_calib", None) or not self._calib[0]:
            return None
        T, bce = fit_temperature(torch.cat(self._calib[0]), torch.cat(self._calib[1]), self.net.config.top_k)
        self.net.config.temperature = T
        self.log("val/temperature", T, sync_dist=True)
        self.log("val/bce", bce, sync_dist=True)
        if self._residual_fit is not None and self._residual_fit.result() is not None:
            # kept aside: applying it now would stop the gradient of heads with alpha 0 for the rest of training
            self._residual_scale = self._residual_fit.result()
            self.log("val/residual_scale_mean", sum(self._residual_scale) / len(self._residual_scale), sync_dist=True)
        return T

    def on_fit_end(self) -> None:
        """The residual scale chosen at the last validation goes into the network's config (and the export); with
        exact components, :func:`select_components` then chooses it and the selection on the validation split
        (the tables refitted on train + val), or, without one, fits the tables on the training split."""
        if self.net is not None and self._residual_scale is not None:
            self.net.config.residual_scale = list(self._residual_scale)
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if self.net is None or self.net.components is None or getattr(dm, "splits", None) is None:
            return
        train, val = dm.splits["train"], dm.splits.get("val") or []
        if val:
            self.selection_report = select_components(self.net, train, val, dm.meta, refit=train + val,
                                                      margin=self.hparams.select_margin,
                                                      confidence=self.hparams.get("select_confidence", SELECT_CONFIDENCE))
        else:
            self.net.components.fit(train, self.net.config.p)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    # --- optimizer ---
    def configure_optimizers(self) -> dict[str, Any]:
        assert self.net is not None
        h = self.hparams
        decay, no_decay, prior = [], [], []
        for n, p in self.net.named_parameters():
            if n.startswith("online.") and h.get("prior_lr") is not None:
                prior.append(p)
            else:
                (no_decay if p.ndim < 2 or n.endswith(("A_log", "D", "dt_bias")) else decay).append(p)
        groups = [{"params": decay, "weight_decay": h.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if prior:  # the online prior's mixture and gates: no decay, their own rate (same schedule)
            groups.append({"params": prior, "weight_decay": 0.0, "lr": float(h.prior_lr)})
        opt = torch.optim.AdamW(groups, lr=h.lr)
        total = self.plan_steps()
        warm = max(1, int(h.warmup_fraction * total))

        def lr_lambda(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            prog = min(1.0, (step - warm) / max(1, total - warm))
            return h.min_lr_ratio + (1 - h.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # --- checkpoints ---
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # the calibrated temperature lives in the network's config, not in its state dict
        if self.net is not None:
            checkpoint["forecaster_temperature"] = float(self.net.config.temperature)
            checkpoint["forecaster_residual_scale"] = self._residual_scale

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        t = checkpoint.get("forecaster_temperature")
        if t is not None and self.net is not None:
            self.net.config.temperature = float(t)
        self._residual_scale = checkpoint.get("forecaster_residual_scale")

    # --- export ---
    def export(self, path: str | Path, extra: dict[str, Any] | None = None,
               training: dict[str, Any] | None = None) -> Path:
        """Write the forecaster export (safetensors + JSON + manifest) to ``path``; ``training`` is the
        provenance block (:func:`expertcast.models.forecaster_export.save_forecaster`)."""
        assert self.net is not None
        info = {"split": self.hparams.split_info, "global_step": int(self.global_step) if self._trainer else None}
        if self._trainer is not None:
            info["val_metrics"] = {k: float(v) for k, v in self.trainer.callback_metrics.items()
                                   if k.startswith("val/")}
        if self.selection_report is not None:
            info["selection"] = self.selection_report
        info.update(extra or {})
        return save_forecaster(self.net, path, source=self.hparams.source, extra=info, training=training)

    def on_validation_epoch_end(self) -> None:
        if self._trainer is not None and not self.trainer.sanity_checking:
            self.calibrate()


# ------------------------------------------------------------------------------------------------ in memory
def fit_forecaster(meta: TraceMeta, seqs: list[TraceSequence], *, epochs: int = 10, batch_size: int = 16,
                   window: int | None = None, val_fraction: float = 0.2, seed: int = 0, trigger_layer: int | None = None,
                   max_steps: int = -1, val_sequences: list[TraceSequence] | None = None, **module_kwargs):
    """Train a small forecaster on in-memory sequences with Lightning on CPU (tests, benchmarks).

    ``max_steps`` > 0 stops after that many optimizer steps (else after ``epochs``); ``val_fraction`` 0 trains
    on every sequence and calibrates on them. ``val_sequences``: the held-out sequences (instead of a
    ``val_fraction`` split of ``seqs``). The probability temperature and, with online statistics and a held-out
    split, the residual scale (unless ``fit_residual_scale=False``) are fitted on the held-out windows.
    Returns (ForecasterModule, ForecasterDataModule); the network is ``module.net`` (eval mode).
    """
    from expertcast.train.forecaster_data import ForecasterDataModule

    pl.seed_everything(seed, verbose=False)
    T = max(s.num_tokens for s in list(seqs) + list(val_sequences or []))
    dm = ForecasterDataModule.from_sequences(meta, seqs, window=window or T, batch_size=batch_size,
                                             val_fraction=0.0 if val_sequences else val_fraction, split_seed=seed,
                                             trigger_layer=trigger_layer)
    if val_sequences:
        from expertcast.train.forecaster_data import check_sequences
        from expertcast.utils.provenance import check_overlap

        check_sequences(meta, val_sequences)
        check_overlap([s.seq_id for s in val_sequences], [s.seq_id for s in seqs], what="the training sequences")
        assert dm.splits is not None
        dm.splits["val"] = list(val_sequences)
    kw = dict(hidden_size=32, head_dim=16, state_size=16, num_blocks=1, chunk_size=32, lr=1e-2, kl_weight=0.1)
    kw.update(module_kwargs)
    module = ForecasterModule(**kw)
    trainer = pl.Trainer(max_epochs=epochs if max_steps <= 0 else -1, max_steps=max_steps, accelerator="cpu",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, gradient_clip_val=1.0, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, dm)
    held_out = bool(dm.splits["val"])
    calibrate_on_loader(module.net, dm.val_dataloader() if held_out else dm.train_dataloader(),
                        residual=held_out and module.hparams.fit_residual_scale and module.net.components is None)
    module.net.eval()
    return module, dm
