"""Post-fit calibration of the SeqMoE forecaster (docs/design.md "Forecaster", "Exact components"): the temperature of
the learned logits, the residual scales against the online prior, the per-(head, layer) component selection on
held-out sequences and the per-head temperatures after it. :class:`~expertcast.train.forecaster_module.ForecasterModule`
runs them at the end of a fit."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.models.forecaster import (
    ExpertForecaster,
    activation_probs,
)


def recall_at(logits: torch.Tensor, target_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Share of the true top-K found in the predicted top-``k``: logits [N, L, E], target_ids [N, L, K] -> [N, L]."""
    pred = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
    hit = (target_ids.unsqueeze(-1) == pred.unsqueeze(-2)).any(-1)
    return hit.float().mean(-1)


def scored_targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """bool [B, W]: the decode targets of a batch (all valid targets when it holds none), as recall is scored."""
    dec = batch["mask"] & batch["decode"]
    return dec if bool(dec.any()) else batch["mask"]


TEMPERATURE_GRID_POINTS = 49
"""Log-spaced candidates in [0.05, 20] that :func:`fit_temperature` chooses the temperature among."""
COARSE_STRIDE = 8
"""Grid points between the candidates of :func:`grid_argmin`'s first pass."""


def grid_argmin(f: Any, n: int, stride: int = COARSE_STRIDE) -> tuple[int, float]:
    """(i, f(i)): the first index of the smallest ``f`` over 0 .. n-1, coarse to fine: every ``stride``-th index and
    the last, then around the best so far at stride/2, stride/4, .., 1 (each index evaluated once). Where f is
    unimodal over the grid this is the exhaustive search's answer (its first minimum) in about stride's log2 x 2 +
    n / stride evaluations instead of n; :func:`fit_temperature`'s calibration loss is (tested against the
    exhaustive search, and the fits' temperatures checked in docs/results.md, "Post-fit calibration, coarse to
    fine; the wide recipe on 500 short cross-layer sequences")."""
    if n < 1:
        raise ValueError("an empty grid has no minimum")
    seen: dict[int, float] = {}

    def best() -> int:
        return min(seen, key=lambda i: (seen[i], i))

    for i in sorted(set(range(0, n, max(1, stride))) | {n - 1}):
        seen[i] = f(i)
    step = max(1, stride) // 2
    while step >= 1:
        b = best()
        for i in (b - step, b + step):
            if 0 <= i < n and i not in seen:
                seen[i] = f(i)
        step //= 2
    b = best()
    return b, seen[b]


def fit_temperature(logits: torch.Tensor, target_ids: torch.Tensor, top_k: int,
                    grid: torch.Tensor | None = None, exhaustive: bool = False) -> tuple[float, float]:
    """Temperature T minimizing the binary cross-entropy of :func:`activation_probs` against the true selections,
    among ``grid`` (default: :data:`TEMPERATURE_GRID_POINTS` log-spaced in [0.05, 20]), searched coarse to fine
    (:func:`grid_argmin`: 13 of the 49 default candidates solved instead of all), or over every candidate with
    ``exhaustive`` (the reference the tests hold it to).

    Args:
        logits: [N, L, E] one-step logits of held-out elements; target_ids: long [N, L, K] their true experts.
    Returns:
        (T, BCE at T).
    """
    member = torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, target_ids, 1.0)
    grid = grid if grid is not None else torch.exp(torch.linspace(math.log(0.05), math.log(20.0),
                                                                  TEMPERATURE_GRID_POINTS))
    temps = grid.tolist()

    def bce(i: int) -> float:
        p = activation_probs(logits, top_k, temps[i]).clamp(1e-6, 1 - 1e-6)
        return float(F.binary_cross_entropy(p, member))

    i, loss = grid_argmin(bce, len(temps), stride=1 if exhaustive else COARSE_STRIDE)
    return float(temps[i]), loss


RESIDUAL_GRID: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
"""Candidate factors alpha_j on the learned logits of each head (:class:`ResidualScaleFit`)."""


class ResidualScaleFit:
    """Held-out choice of ``ForecasterConfig.residual_scale``: for each direct head j, the alpha in ``grid`` whose
    logits alpha · learned + online prior reach the highest recall@K on the held-out targets of head j (the
    smallest such alpha on ties, so a head whose learned part adds nothing there reduces to the online prior).

    Accumulates hits [H_d, len(grid)] and targets [H_d] batch by batch (no logits kept)."""

    def __init__(self, heads: int, top_k: int, grid: tuple[float, ...] = RESIDUAL_GRID):
        if not grid or any(not 0 <= a <= 1 for a in grid):
            raise ValueError(f"residual grid values must be in [0, 1], got {grid}")
        self.grid = tuple(sorted(grid))
        self.top_k = top_k
        self.hits = torch.zeros(heads, len(self.grid), dtype=torch.float64)
        self.count = torch.zeros(heads, dtype=torch.float64)

    @torch.no_grad()
    def add(self, learned: torch.Tensor, prior: torch.Tensor, target_ids: torch.Tensor, use: torch.Tensor) -> None:
        """learned / prior [B, W, H, L, E] (:meth:`ExpertForecaster.forward_parts`), target_ids long [B, W, L, K]
        (target of position i = element i+1), use bool [B, W] (targets to score). Head j at position i is scored
        against the target of position i+j."""
        W, H = learned.shape[1], min(learned.shape[2], self.hits.shape[0])
        for j in range(H):
            sel = use[:, j:]
            n = int(sel.sum())
            if not n:
                continue
            lg, pr = learned[:, : W - j, j][sel].float(), prior[:, : W - j, j][sel].float()
            tid = target_ids[:, j:][sel]
            for a_i, a in enumerate(self.grid):
                self.hits[j, a_i] += float(recall_at(a * lg + pr, tid, self.top_k).mean(-1).sum())
            self.count[j] += n

    def result(self) -> list[float] | None:
        """alpha per head (None until every head has held-out targets)."""
        if not bool((self.count > 0).all()):
            return None
        best = (self.hits / self.count.unsqueeze(1)).argmax(1)  # first maximum: the smallest alpha
        return [float(self.grid[int(i)]) for i in best]

    def recall(self) -> torch.Tensor:
        """Held-out recall@K [H_d, len(grid)] (NaN where a head had no targets)."""
        return self.hits / self.count.unsqueeze(1)


SELECT_MARGIN = 0.002
"""A (head, layer) issues the learned part only when it beats the chosen component's held-out recall@K there by more
than this, and leaves its head's default component for another only by more than this plus the test's bound
(:func:`select_components`)."""
SELECT_CONFIDENCE = 0.975
"""One-sided confidence of the test by which a (head, layer) leaves its head's default component for another
(:func:`choose_selection`); 0: no test (each layer's best component on the held-out split, the rule before)."""


T_EXACT_DOF = 200
"""Up to this many degrees of freedom :func:`t_quantile` inverts the exact distribution function; above, the
Cornish-Fisher expansion (closer than 1e-6 relative there)."""


def t_cdf(t: float, dof: int) -> float:
    """Distribution function of Student's t at ``t`` for an integer ``dof`` >= 1: the finite series of Abramowitz &
    Stegun 26.7.3 (odd dof) / 26.7.4 (even) in theta = atan(t / sqrt(dof))."""
    th = math.atan(abs(t) / math.sqrt(dof))
    c2, term, acc = math.cos(th) ** 2, 1.0, 1.0
    if dof % 2:
        for k in range(1, (dof - 1) // 2):  # 1 + 2/3 c^2 + 2.4/(3.5) c^4 ... up to c^(dof-3)
            term *= c2 * (2 * k) / (2 * k + 1)
            acc += term
        a = 2 / math.pi * (th + (math.sin(th) * math.cos(th) * acc if dof > 1 else 0.0))
    else:
        for k in range(1, dof // 2):  # 1 + 1/2 c^2 + 1.3/(2.4) c^4 ... up to c^(dof-2)
            term *= c2 * (2 * k - 1) / (2 * k)
            acc += term
        a = math.sin(th) * acc
    return 0.5 + math.copysign(a / 2, t)


def t_quantile(q: float, dof: int) -> float:
    """Quantile ``q`` (0.5 <= q < 1) of Student's t with an integer ``dof`` >= 1: bisection on :func:`t_cdf` up to
    ``T_EXACT_DOF`` degrees of freedom (to 1e-12), the Cornish-Fisher expansion in 1 / dof (Abramowitz & Stegun
    26.7.5, four terms) above."""
    if not 0.5 <= q < 1 or dof < 1:
        raise ValueError(f"t_quantile needs 0.5 <= q < 1 and dof >= 1, got q={q}, dof={dof}")
    if dof <= T_EXACT_DOF:
        lo, hi = 0.0, 1.0
        while t_cdf(hi, dof) < q:
            hi *= 2
        while hi - lo > 1e-12 * max(1.0, hi):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if t_cdf(mid, dof) < q else (lo, mid)
        return (lo + hi) / 2
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(q, dtype=torch.float64)).item()
    n = float(dof)
    return (z + (z ** 3 + z) / (4 * n) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * n ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * n ** 3)
            + (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / (92160 * n ** 4))


class PairedRecall:
    """Held-out recall@K of N candidates per (head, layer), with what the standard error of the difference of any two
    needs, over clusters of targets (:func:`select_components`: runs of consecutive targets of one sequence, which
    are not independent of each other).

    Per head j: the targets' recall sums S [N, L], and over the clusters s the sums Q_s [N, L] of their targets'
    recall and n_s their target count, kept as sum_s Q_s Q_s^T [N, N, L], sum_s n_s Q_s [N, L] and sum_s n_s^2.
    For candidates a, b the mean difference is d = (S_a - S_b) / n and the cluster-robust variance of d is
    G / (G - 1) * sum_s (D_s - n_s d)^2 / n^2 with D_s = Q_s,a - Q_s,b, G the clusters with targets."""

    def __init__(self, heads: int, candidates: int, layers: int):
        H, N, L = heads, candidates, layers
        self.S = torch.zeros(H, N, L, dtype=torch.float64)
        self.QQ = torch.zeros(H, N, N, L, dtype=torch.float64)
        self.nQ = torch.zeros(H, N, L, dtype=torch.float64)
        self.nn = torch.zeros(H, dtype=torch.float64)
        self.n = torch.zeros(H, dtype=torch.float64)
        self.clusters = torch.zeros(H, dtype=torch.long)

    def add(self, j: int, per_seq: torch.Tensor, counts: torch.Tensor) -> None:
        """Head j: per_seq [B, N, L] each cluster's summed recall per candidate, counts [B] its targets."""
        q, c = per_seq.double(), counts.double()
        self.S[j] += q.sum(0)
        self.QQ[j] += torch.einsum("bnl,bml->nml", q, q)
        self.nQ[j] += (c.view(-1, 1, 1) * q).sum(0)
        self.nn[j] += float((c * c).sum())
        self.n[j] += float(c.sum())
        self.clusters[j] += int((c > 0).sum())

    def recall(self) -> torch.Tensor:
        """Mean recall [H, N, L]."""
        return self.S / self.n.view(-1, 1, 1)

    def stderr(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Standard error [H, L] of recall(a) - recall(b), a / b long [H, L] candidate indices (inf with fewer than
        2 clusters; 0 where a == b)."""
        H, L = a.shape
        hi, li = torch.arange(H).view(H, 1).expand(H, L), torch.arange(L).view(1, L).expand(H, L)
        n = self.n.view(H, 1)
        d = (self.S[hi, a, li] - self.S[hi, b, li]) / n
        dd = self.QQ[hi, a, a, li] + self.QQ[hi, b, b, li] - 2 * self.QQ[hi, a, b, li]  # sum_s D_s^2
        nd = self.nQ[hi, a, li] - self.nQ[hi, b, li]  # sum_s n_s D_s
        ss = (dd - 2 * d * nd + d * d * self.nn.view(H, 1)).clamp_min(0)
        G = self.clusters.view(H, 1).double()
        var = torch.where(G > 1, ss / (n * n) * G / (G - 1).clamp_min(1), torch.full_like(ss, math.inf))
        return torch.where(a == b, torch.zeros_like(var), var.sqrt())


SELECT_BLOCK = 64
"""Consecutive targets of one held-out sequence that form one cluster of :class:`PairedRecall` in
:func:`select_components` (a sequence of up to this many targets is one)."""


def block_sums(r: torch.Tensor, use: torch.Tensor, block: int = SELECT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """r [B, W, N, L] recall per position (0 where not scored), use bool [B, W] -> the clusters' sums [B x blocks, N,
    L] and target counts [B x blocks]: each row's positions in blocks of ``block`` consecutive positions."""
    B, W = use.shape
    pad = (-W) % block
    if pad:
        r = torch.cat([r, r.new_zeros(B, pad, *r.shape[2:])], 1)
        use = torch.cat([use, use.new_zeros(B, pad)], 1)
    n = (W + pad) // block
    return r.reshape(B * n, block, *r.shape[2:]).sum(1), use.reshape(B * n, block).sum(1)  # slices: not views


def choose_selection(stats: PairedRecall, alphas: int, margin: float = SELECT_MARGIN,
                     confidence: float = SELECT_CONFIDENCE) -> dict[str, torch.Tensor]:
    """The selection rule of :func:`select_components` on the held-out recall of ``alphas`` learned candidates (the
    residual scales, in order) then the components.

    Per head j: alpha_j is the best learned candidate over all layers (the smallest on ties); the head's default is
    the component with the best recall over all layers (the first on ties). Layer l issues its own best component
    instead of the default only where that beats the default there by more than ``margin`` + t x its standard error
    (:class:`PairedRecall`; t Student's quantile at G - 1 degrees of freedom, G the clusters of held-out targets: with
    one, no layer leaves the default; at 1 - (1 - ``confidence``) / (C - 1), Bonferroni's bound for the best of the C - 1
    other components: a layer's best of C - 1 is chosen because it scored high, so its held-out gain is biased up). The
    learned part, one alternative fixed in advance (its gain unbiased), is issued where it beats the component so
    chosen by more than ``margin``, untested: a test rejected real gains of the learned part on two validation
    sequences (docs/results.md, "A tested selection"). ``confidence`` 0: no test (each layer its best component).
    Returns ``a_idx`` [H], ``component`` [H, L] (into the components), ``keep`` bool [H, L] (learned), ``learned`` /
    ``chosen`` recall [H, L] and ``default`` [H]."""
    rec = stats.recall()
    H, N, L = rec.shape
    G = alphas
    a_idx = rec[:, :G].mean(-1).argmax(1)  # first maximum: the smallest alpha
    learned = rec[torch.arange(H), a_idx]  # [H, L]
    comp = rec[:, G:]
    best_c = comp.argmax(1)  # [H, L], first maximum
    default = comp.mean(-1).argmax(1)  # [H]
    dflt = default.view(H, 1).expand(H, L)
    hi, li = torch.arange(H).view(H, 1).expand(H, L), torch.arange(L).view(1, L).expand(H, L)
    if confidence > 0:
        q = 1 - (1 - confidence) / max(1, comp.shape[1] - 1)  # the layer's best of C - 1 alternatives: Bonferroni
        t_c = torch.tensor([t_quantile(q, int(g) - 1) if g > 1 else math.inf for g in stats.clusters.tolist()],
                           dtype=torch.float64).view(H, 1)  # at each head's clusters
        gain = comp[hi, best_c, li] - comp[hi, dflt, li]
        bound = t_c * stats.stderr(best_c + G, dflt + G)
        component = torch.where(gain > margin + torch.nan_to_num(bound, nan=math.inf), best_c, dflt)
    else:
        component = best_c
    chosen = comp[hi, component, li]
    keep = learned > chosen + margin
    return {"a_idx": a_idx, "component": component, "keep": keep, "learned": learned, "chosen": chosen,
            "default": default}


@torch.no_grad()
def select_components(net: ExpertForecaster, fit: Sequence[TraceSequence], held_out: Sequence[TraceSequence],
                      meta: TraceMeta, refit: Sequence[TraceSequence] | None = None, margin: float = SELECT_MARGIN,
                      grid: tuple[float, ...] = RESIDUAL_GRID, budget: int = 1 << 24,
                      confidence: float = SELECT_CONFIDENCE) -> dict[str, Any]:
    """Choose ``residual_scale`` and ``selection`` on held-out sequences (docs/design.md "Exact components").

    The components' tables are fitted on ``fit``. Each held-out sequence is run from a zero state as a whole (as
    forecast-eval runs it; batched with sequences of similar length, so that this costs about one pass over the
    held-out elements: :func:`~expertcast.train.forecaster_data.whole_sequence_batches`), scored on its decode
    targets per direct head j and layer l, for: the forecaster's own logits (learned part x alpha + online prior,
    learned gate included) at every alpha of ``grid`` (1 alone without online statistics), and every exact component.
    :func:`choose_selection` then picks per head alpha_j and a default component; a layer leaves that default for its
    own best component only where the held-out gain passes a test with runs of ``SELECT_BLOCK`` consecutive targets of
    a sequence as clusters (``confidence``), so that a small held-out split (one prompt, a few dozen targets) does not
    pick per layer among a dozen components by noise; it issues the learned part where that beats the component so
    chosen by more than ``margin``. A head left with no learned layer gets alpha 0. Then the tables are refitted on
    ``refit`` (e.g. train + val: the sequences forecast-eval fits its baselines on), so the components stay the
    baselines exactly.
    Returns a report (held-out recall per head of the chosen logits, the learned part and each component)."""
    from expertcast.train.forecaster_data import whole_sequence_batches

    comps = net.components
    if comps is None:
        raise ValueError("select_components needs a forecaster with exact components (component_half_lives)")
    c = net.config
    was = net.training
    net.eval()
    dev = next(net.parameters()).device
    H, L, K = c.direct_horizons, c.num_layers, c.top_k
    comps.fit(fit, c.p)
    alphas = tuple(sorted(grid)) if net.online is not None else (1.0,)
    C = comps.num_components
    G = len(alphas)
    stats = PairedRecall(H, G + C, L)
    saved = (c.residual_scale, c.selection)
    row = H * c.input_size  # logits floats per padded element

    def batches(by_length: bool = True):
        return whole_sequence_batches(held_out, meta, c.trigger_layer, row, budget, by_length)

    try:
        for batch in batches():
            x, tid, use = batch["inputs"].to(dev), batch["target_ids"], scored_targets(batch)
            cands = []
            c.selection = None
            learned, prior = net.forward_parts(x, all_horizons=True)  # one backbone pass for every alpha
            for alpha in alphas:
                c.residual_scale = [alpha] * H
                cands.append(net.forward_from_parts(x, learned, prior, all_horizons=True).float().cpu())
            comp = comps.scores(x.float(), H, list(range(C)))
            cands += [comp[k].cpu() for k in range(C)]
            W = x.shape[1]
            for j in range(H):
                sel = use[:, j:]  # [B, W - j]: one row per held-out sequence
                if not bool(sel.any()):
                    continue
                m = sel.unsqueeze(-1).double()
                r = torch.stack([recall_at(lg[:, : W - j, j], tid[:, j:], K).double() * m for lg in cands], 2)
                stats.add(j, *block_sums(r, sel))
    finally:
        c.residual_scale, c.selection = saved
        net.train(was)
    if not bool((stats.n > 0).all()):
        raise ValueError("the held-out sequences hold no decode targets for every direct head")
    pick = choose_selection(stats, G, margin, confidence)
    keep, a_idx = pick["keep"], pick["a_idx"]
    selection = torch.where(keep, torch.full_like(pick["component"], -1), pick["component"])
    scale = [float(alphas[int(a_idx[j])]) if bool(keep[j].any()) else 0.0 for j in range(H)]
    c.residual_scale = scale if net.online is not None else None
    c.selection = selection.tolist()  # with switch_half_life > 0 the per-sequence leader now starts from it; the
    # temperatures below are fitted on the logits issued with it
    chosen = torch.where(keep, pick["learned"], pick["chosen"]).mean(-1)
    # the probabilities must match the logits now issued (a selected component's are scaled scores): per-head
    # temperatures on the same held-out targets, the tables still fitted on ``fit`` only
    temps = fit_head_temperatures(net, batches(by_length=False), dev)  # the held-out order: its first elements
    c.head_temperatures = temps
    if refit is not None:
        comps.fit(refit, c.p)
    rec = stats.recall()
    return {"held_out_sequences": len(held_out), "margin": margin, "confidence": confidence,
            "residual_scale": scale, "head_temperatures": temps,
            "learned_layers": [int(k) for k in keep.sum(1)],
            "default_component": [comps.names[int(d)] for d in pick["default"]],
            "layers_off_default": [int(k) for k in ((pick["component"] != pick["default"].view(H, 1)) & ~keep).sum(1)],
            "recall": {"chosen": chosen.tolist(), "learned": pick["learned"].mean(-1).tolist(),
                       **{n: rec[:, G + k].mean(-1).tolist() for k, n in enumerate(comps.names)}}}


HEAD_CALIBRATION_ELEMENTS = 2048
"""Held-out decode targets per direct head that :func:`fit_head_temperatures` fits each temperature on."""


@torch.no_grad()
def fit_head_temperatures(net: ExpertForecaster, batches: Any, dev: Any,
                          max_elements: int = HEAD_CALIBRATION_ELEMENTS) -> list[float]:
    """Per direct head j, the temperature of :func:`fit_temperature` for the logits the network issues now (its
    selection and residual scale applied) against the targets j elements later, on up to ``max_elements`` decode
    targets of the held-out ``batches`` (an iterable of :class:`~expertcast.train.forecaster_data.ForecastWindows`
    batches, read only as far as needed)."""
    c = net.config
    H = c.direct_horizons
    was = net.training
    net.eval()
    logits: list[list[torch.Tensor]] = [[] for _ in range(H)]
    ids: list[list[torch.Tensor]] = [[] for _ in range(H)]
    n = [0] * H
    try:
        for batch in batches:
            if min(n) >= max_elements:
                break
            x, tid, use = batch["inputs"].to(dev), batch["target_ids"], scored_targets(batch)
            lg = net(x, all_horizons=True).float().cpu()  # [B, T, H, L, E]
            W = x.shape[1]
            for j in range(H):
                sel = use[:, j:]
                if n[j] >= max_elements or not bool(sel.any()):
                    continue
                logits[j].append(lg[:, : W - j, j][sel])
                ids[j].append(tid[:, j:][sel])
                n[j] += int(sel.sum())
    finally:
        net.train(was)
    out = []
    for j in range(H):
        if not logits[j]:
            out.append(float(c.temperature))
            continue
        T, _ = fit_temperature(torch.cat(logits[j])[:max_elements], torch.cat(ids[j])[:max_elements], c.top_k)
        out.append(T)
    return out


@torch.no_grad()
def calibrate_on_loader(net: ExpertForecaster, loader: Any, max_elements: int = 4096, residual: bool = False
                        ) -> float:
    """Fit ``net.config.temperature`` on the one-step logits of a loader's windows (held-out data). Returns T.

    ``residual``: first fit ``net.config.residual_scale`` on the same windows (:class:`ResidualScaleFit`; only
    with online statistics; pass held-out windows: on the training windows the learned part always wins)."""
    was = net.training
    net.eval()
    dev = next(net.parameters()).device
    c = net.config
    if residual and net.online is not None:
        fit = ResidualScaleFit(c.direct_horizons, c.top_k)
        n = 0
        for batch in loader:
            learned, prior = net.forward_parts(batch["inputs"].to(dev), all_horizons=True)
            fit.add(learned.cpu(), prior.cpu(), batch["target_ids"], scored_targets(batch))
            n += int(batch["mask"].sum())
            if n >= max_elements:
                break
        c.residual_scale = fit.result()
    logits, ids = [], []
    n = 0
    for batch in loader:
        lg = net(batch["inputs"].to(dev)).float().cpu()
        m = batch["mask"]
        logits.append(lg[m])
        ids.append(batch["target_ids"][m])
        n += int(m.sum())
        if n >= max_elements:
            break
    net.train(was)
    if not logits:
        return net.config.temperature
    T, _ = fit_temperature(torch.cat(logits), torch.cat(ids), net.config.top_k)
    net.config.temperature = T
    return T
