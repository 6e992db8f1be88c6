"""Recall of the forecaster by horizon vs the online baselines (docs/design.md, "Online statistics"): the
predictors and the recall tables behind ``expertcast forecast-eval`` (:mod:`expertcast.commands.forecast_eval`,
which chooses the evaluated sequences, writes and plots the tables) and the generalisation protocol
(:mod:`expertcast.train.generalisation`).

For every held-out sequence and every element i whose next element is a decode element, each predictor
forecasts elements i+1..i+H (the forecaster by recursive rollout from its recurrent state). Recall@K
is the share of the true top-K found in the predicted top-K; recall@K+3 uses the predicted top-(K+3).
Reported per horizon, per layer and overall, for:

- ``forecaster``: the export under test;
- ``repeat-last``: element i's experts for every horizon (ties broken by training frequency);
- ``frequency``: per-layer expert frequency of the training sequences;
- ``transition``: first-order per-layer transition counts from the training sequences, propagated
  h steps as a Markov chain over the current element's weights;
- ``recent-freq``: per-layer expert frequency of this sequence so far (an exponential moving average of
  the elements seen, half-life ``RecentFrequencyBaseline.half_life`` elements, training frequency as the
  prior): the stronger baseline at long horizons, where the next steps' experts are mostly the ones the
  sequence has been using;
- ``cross-layer``: the trigger layer's experts through the training sequences' per-layer map to the next
  element's experts (for the layers after the trigger layer: the same token's), then the transition table
  (:func:`~expertcast.models.forecaster_components.cross_layer_scores`).

``--horizons`` forecasts come from the forecaster's direct heads where it has them and from recursive
rollout beyond (:meth:`~expertcast.models.forecaster.ExpertForecaster.rollout`).

The caller fits the baselines (:func:`fit_baselines`) on sequences the evaluated ones are disjoint from
(``expertcast forecast-eval``: the export's training sequences or ``--fit-traces``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.models.forecaster import (
    ExpertForecaster,
    activation_vector,
    ema_scan,
    trigger_offset,
    trigger_sequence,
)
from expertcast.models.forecaster_components import (
    CROSS_LAYER,
    CROSS_RECENT,
    CROSS_RECENT_HALF_LIFE,
    TRANSITION_ALPHA,
    count_name,
    cross_layer_scores,
    cross_recent_scores,
    decay_of,
    fit_cross_layer,
    fit_frequency,
    fit_transition,
    fit_within_token,
    recent_name,
    recent_scores,
    recent_update,
    repeat_last_scores,
    transition_scores,
)

# ----------------------------------------------------------------------------------------------
# element tensors


def element_arrays(seqs: Sequence[TraceSequence], num_layers: int, p: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                       torch.Tensor, torch.Tensor]:
    """Pad a batch of sequences into forecaster-element arrays.

    Returns ``ids`` long [B, T', L, K], ``weights`` float [B, T', L, K], ``lengths`` long [B] (elements
    per row) and ``prompt`` long [B] (prompt length; element e is a decode element iff e >= prompt).
    """
    s = trigger_offset(num_layers, p)
    ids_l, w_l, lens, prompts = [], [], [], []
    for sq in seqs:
        ids = torch.from_numpy(np.asarray(sq.expert_ids, dtype=np.int64))
        w = torch.from_numpy(np.asarray(sq.expert_weights, dtype=np.float32))
        ids_l.append(trigger_sequence(ids, p))
        w_l.append(trigger_sequence(w, p))
        lens.append(sq.num_tokens - s)
        prompts.append(sq.prompt_len)
    T = max(lens)
    B = len(seqs)
    L, K = ids_l[0].shape[1:]
    ids = torch.zeros(B, T, L, K, dtype=torch.long)
    w = torch.zeros(B, T, L, K)
    for b in range(B):
        ids[b, : lens[b]] = ids_l[b]
        w[b, : lens[b]] = w_l[b]
    return ids, w, torch.tensor(lens), torch.tensor(prompts)


# ----------------------------------------------------------------------------------------------
# predictors


class Baseline:
    """A predictor of elements i+1..i+H from element i (stateless unless it overrides :meth:`reset`)."""

    name = "baseline"

    def reset(self, batch_size: int) -> None:
        """A new batch of sequences starts (stateful baselines clear their per-sequence state)."""

    def observe(self, x: torch.Tensor) -> None:
        """Element x [B, L, E] was seen without a forecast being scored (prompt warm-up)."""

    def predict(self, x: torch.Tensor, horizons: int) -> torch.Tensor:
        """x float [B, L, E] (element i) -> scores [B, H, L, E]."""
        raise NotImplementedError


def _frequency(train: Sequence[TraceSequence], L: int, E: int, p: int) -> torch.Tensor:
    return fit_frequency(train, L, E)


class FrequencyBaseline(Baseline):
    """Per-layer expert frequency of the training sequences, the same for every step and horizon."""

    name = "frequency"

    def __init__(self, freq: torch.Tensor):
        self.freq = freq  # [L, E]

    def predict(self, x: torch.Tensor, horizons: int) -> torch.Tensor:
        return self.freq.expand(x.shape[0], horizons, *self.freq.shape)


class RepeatLastBaseline(Baseline):
    """The current element's experts (weights) at every horizon; ties broken by training frequency."""

    name = "repeat-last"

    def __init__(self, freq: torch.Tensor):
        self.freq = freq

    def predict(self, x: torch.Tensor, horizons: int) -> torch.Tensor:
        return repeat_last_scores(x, self.freq).unsqueeze(1).expand(-1, horizons, -1, -1)


class TransitionBaseline(Baseline):
    """First-order per-layer transition counts: T_l[e, e'] = #(e in element i, e' in element i+1), row-normalized
    with add-``alpha`` smoothing; horizon h applies T_l h times to the current weights."""

    name = "transition"

    def __init__(self, train: Sequence[TraceSequence], L: int, E: int, p: int, freq: torch.Tensor,
                 alpha: float = TRANSITION_ALPHA):
        self.T = fit_transition(train, L, E, p, alpha)  # [L, E, E]
        self.freq = freq

    def predict(self, x: torch.Tensor, horizons: int) -> torch.Tensor:
        return transition_scores(x, self.T, self.freq, horizons)


class CrossLayerBaseline(Baseline):
    """The trigger layer ``p``'s weights of the current element through the cross-layer table C_l[e, e'] =
    #(e at layer p in element i, e' at layer l in element i+1), row-normalized with add-``alpha`` smoothing
    (horizon 1), then h - 1 steps through the transition table ``trans``."""

    name = CROSS_LAYER

    def __init__(self, train: Sequence[TraceSequence], L: int, E: int, p: int, freq: torch.Tensor,
                 trans: torch.Tensor, alpha: float = TRANSITION_ALPHA):
        self.C = fit_cross_layer(train, L, E, p, alpha)  # [L, E, E]
        self.T, self.freq, self.p = trans, freq, p

    def predict(self, x: torch.Tensor, horizons: int) -> torch.Tensor:
        return cross_layer_scores(x, self.C, self.T, self.freq, self.p, horizons)


class CrossRecentBaseline(Baseline):
    """cross-x-recent: the cross-layer baseline's scores times the sequence's recent-freq (half-life 16) over the
    training frequency (:func:`~expertcast.models.forecaster_components.cross_recent_scores`), the product of the
    two signals the MLP reference reads."""

    name = CROSS_RECENT

    def __init__(self, cross: CrossLayerBaseline, freq: torch.Tensor):
        self.cross = cross
        self.recent = RecentFrequencyBaseline(freq, CROSS_RECENT_HALF_LIFE)
        self.freq = freq

    def reset(self, batch_size: int) -> None:
        self.recent.reset(batch_size)

    def observe(self, x: torch.Tensor) -> None:
        self.recent.observe(x)

    def predict(self, x: torch.Tensor, horizons: int) -> torch.Tensor:
        recent = self.recent.predict(x, 1)[:, 0]
        return cross_recent_scores(self.cross.predict(x, horizons), recent, self.freq)


class RecentFrequencyBaseline(Baseline):
    """Per-layer expert frequency of the current sequence: an exponential moving average of its elements
    (half-life ``half_life`` elements) plus ``0.05 · (1 - d)`` x the training frequency, the same for every
    horizon (:func:`~expertcast.models.forecaster_components.recent_scores`). ``count``: the average of the
    elements' membership (recent-count: each selected expert 1/K, weights ignored) instead of their weights."""

    def __init__(self, freq: torch.Tensor, half_life: float = 16.0, count: bool = False):
        self.freq = freq
        self.name = count_name(half_life) if count else recent_name(half_life)
        self.decay = decay_of(half_life)
        self.counts = torch.tensor([True]) if count else None
        self.ema: torch.Tensor | None = None

    def reset(self, batch_size: int) -> None:
        self.ema = torch.zeros(batch_size, 1, *self.freq.shape)

    def observe(self, x: torch.Tensor) -> None:
        if self.ema is None or self.ema.shape[0] != x.shape[0]:
            self.reset(x.shape[0])
        recent_update(self.ema, x, self.decay, self.counts)

    def predict(self, x: torch.Tensor, horizons: int) -> torch.Tensor:
        self.observe(x)
        assert self.ema is not None
        return recent_scores(self.ema, self.freq, self.decay)[:, 0].unsqueeze(1).expand(-1, horizons, -1, -1)


def baseline_half_lives(component_half_lives: Sequence[float] | None) -> list[float]:
    """The half-lives the recent baselines are listed at beside a forecaster: 16 and its components' (so that
    every component it can select has its baseline in the table)."""
    return sorted({16.0, *(component_half_lives or [])})


def fit_baselines(train: Sequence[TraceSequence], meta: TraceMeta, p: int,
                  half_lives: Sequence[float] = (16.0,)) -> list[Baseline]:
    """The three baselines of docs/design.md "Forecaster" plus the sequence's recent frequency (weights) and
    recent count (membership) at each of ``half_lives``, then the cross-layer baseline and its product with the
    recent frequency (cross-x-recent), fitted on ``train`` (the order of
    :func:`~expertcast.models.forecaster_components.component_names`)."""
    if not train:
        raise ValueError("no training sequences to fit the baselines on")
    L, E = meta.num_layers, meta.num_experts
    freq = fit_frequency(train, L, E)
    trans = TransitionBaseline(train, L, E, p, freq)
    out = [RepeatLastBaseline(freq), FrequencyBaseline(freq), trans] + \
        [RecentFrequencyBaseline(freq, h) for h in half_lives] + \
        [RecentFrequencyBaseline(freq, h, count=True) for h in half_lives]
    cross = CrossLayerBaseline(train, L, E, p, freq, trans.T)
    return out + [cross, CrossRecentBaseline(cross, freq)]


class MLPReference(Baseline):
    """The reference MLP predictor (docs/design.md "Exact components", MLP reference): one hidden layer (ReLU) over the current
    element and the sequence's recent frequency (half-life 16, :func:`recent_update`), [x_t ; e_t] (2·L·E) ->
    H·L·E logits, one block per horizon 1..H (longer horizons repeat the last). Trained by
    :func:`fit_mlp_reference`; no recurrence beyond the moving average, so it shows what width alone buys."""

    name = "mlp-reference"

    def __init__(self, net: torch.nn.Sequential, num_layers: int, num_experts: int, horizons: int):
        self.net = net.eval()
        self.L, self.E, self.H = num_layers, num_experts, horizons
        self.decay = decay_of(16.0)
        self.ema: torch.Tensor | None = None

    def reset(self, batch_size: int) -> None:
        self.ema = torch.zeros(batch_size, 1, self.L, self.E)

    def observe(self, x: torch.Tensor) -> None:
        if self.ema is None or self.ema.shape[0] != x.shape[0]:
            self.reset(x.shape[0])
        recent_update(self.ema, x, self.decay)

    @torch.no_grad()
    def predict(self, x: torch.Tensor, horizons: int) -> torch.Tensor:
        self.observe(x)
        assert self.ema is not None
        B = x.shape[0]
        out = self.net(torch.cat([x.reshape(B, -1), self.ema.reshape(B, -1)], dim=-1)).view(B, self.H, self.L, self.E)
        idx = torch.arange(horizons).clamp(max=self.H - 1)
        return out[:, idx]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.net.parameters())

    def step_flops(self) -> int:
        """FLOPs of one prediction at batch 1 (2 per multiply-add)."""
        return 2 * sum(m.in_features * m.out_features for m in self.net if isinstance(m, torch.nn.Linear))


def _mlp_examples(seqs: Sequence[TraceSequence], L: int, E: int, p: int, horizons: int, max_examples: int,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Up to ``max_examples`` elements drawn evenly at random from the sequences: inputs [N, 2·L·E], target ids
    [N, H, L, K] and a validity mask [N, H] (target inside the sequence)."""
    rng = np.random.default_rng(seed)
    total = sum(max(0, sq.num_tokens - trigger_offset(L, p) - 1) for sq in seqs)
    keep = min(1.0, max_examples / max(total, 1))
    xs, ts, vs = [], [], []
    decay = decay_of(16.0)
    for sq in seqs:
        ids, w, lens, _ = element_arrays([sq], L, p)
        n = int(lens[0])
        if n < 2:
            continue
        x = activation_vector(ids[0, :n], w[0, :n], E)  # [n, L, E]
        # the moving average after each element, as recent_update computes it one element at a time
        v = x / x.sum(-1, keepdim=True).clamp_min(1e-9)
        emas = ema_scan(v.reshape(1, n, L * E), decay.view(1))[0, :, 0].view(n, L, E)
        pos = np.flatnonzero(rng.random(n - 1) < keep)
        if not len(pos):
            continue
        pos_t = torch.from_numpy(pos)
        xs.append(torch.cat([x[pos_t].reshape(len(pos), -1), emas[pos_t].reshape(len(pos), -1)], -1))
        tgt = (pos_t.view(-1, 1) + torch.arange(1, horizons + 1).view(1, -1))
        vs.append(tgt < n)
        ts.append(ids[0, tgt.clamp(max=n - 1)])
    if not xs:
        raise ValueError("no sequence is long enough to train the MLP reference on")
    return torch.cat(xs), torch.cat(ts), torch.cat(vs)


def fit_mlp_reference(train: Sequence[TraceSequence], meta: TraceMeta, p: int, horizons: int = 8, hidden: int = 256,
                      steps: int = 300, batch_size: int = 128, lr: float = 2e-3, max_examples: int = 16384,
                      seed: int = 0) -> MLPReference:
    """Train the :class:`MLPReference` on up to ``max_examples`` elements of ``train`` (Adam, ``steps`` steps):
    per horizon and layer, the cross-entropy of softmax(logits) against the true top-K (each selected expert 1/K)."""
    L, E = meta.num_layers, meta.num_experts
    x, tid, valid = _mlp_examples(train, L, E, p, horizons, max_examples, seed)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(2 * L * E, hidden), torch.nn.ReLU(),
                              torch.nn.Linear(hidden, horizons * L * E))
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(steps):
        b = torch.randint(0, x.shape[0], (min(batch_size, x.shape[0]),), generator=g)
        logp = torch.log_softmax(net(x[b]).view(-1, horizons, L, E), dim=-1)
        nll = -logp.gather(-1, tid[b]).mean(dim=(-1, -2))  # [B, H]
        v = valid[b].float()
        loss = (nll * v).sum() / v.sum().clamp_min(1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return MLPReference(net, L, E, horizons)


# ----------------------------------------------------------------------------------------------
# evaluation


@dataclass
class RecallTable:
    """Accumulated hits: ``hits_k`` / ``hits_k3`` float [H, L] (sum of per-target recalls), ``count`` [H, L]."""

    horizons: int
    num_layers: int
    hits_k: np.ndarray = field(init=False)
    hits_k3: np.ndarray = field(init=False)
    count: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.hits_k = np.zeros((self.horizons, self.num_layers))
        self.hits_k3 = np.zeros((self.horizons, self.num_layers))
        self.count = np.zeros((self.horizons, self.num_layers))

    def recall(self, which: str = "k") -> np.ndarray:
        """[H] overall recall per horizon."""
        h = self.hits_k if which == "k" else self.hits_k3
        return h.sum(1) / np.maximum(self.count.sum(1), 1)

    def recall_per_layer(self, which: str = "k") -> np.ndarray:
        h = self.hits_k if which == "k" else self.hits_k3
        return h / np.maximum(self.count, 1)


def _accumulate(table: RecallTable, scores: torch.Tensor, tgt_ids: torch.Tensor, valid: torch.Tensor, K: int) -> None:
    """scores [B, H, L, E]; tgt_ids long [B, H, L, K]; valid bool [B, H]."""
    E = scores.shape[-1]
    top = scores.topk(min(K + 3, E), dim=-1).indices  # sorted descending
    hit = tgt_ids.unsqueeze(-1) == top.unsqueeze(-2)  # [B, H, L, K, K+3]
    r_k = hit[..., :K].any(-1).float().mean(-1)  # [B, H, L]
    r_k3 = hit.any(-1).float().mean(-1)
    v = valid.unsqueeze(-1).float()
    table.hits_k += (r_k * v).sum(0).double().numpy()
    table.hits_k3 += (r_k3 * v).sum(0).double().numpy()
    table.count += v.expand_as(r_k).sum(0).double().numpy()


@torch.no_grad()
def evaluate(model: ExpertForecaster | None, seqs: Sequence[TraceSequence], meta: TraceMeta,
             baselines: Sequence[Baseline] = (), horizons: int = 8, batch_size: int = 32,
             trigger_layer: int | None = None, progress: bool = True, device: str | torch.device = "cpu"
             ) -> dict[str, RecallTable]:
    """Recall tables of the forecaster (when given) and the baselines over ``seqs`` (decode targets only)."""
    L, E, K = meta.num_layers, meta.num_experts, meta.top_k
    if model is not None:
        c = model.config
        meta.check_compatible(c.num_layers, c.num_experts, c.top_k, what="forecaster")
        p = c.p
        model.eval()
    else:
        p = L - 1 if trigger_layer is None else trigger_layer
    names = (["forecaster"] if model is not None else []) + [b.name for b in baselines]
    tables = {n: RecallTable(horizons, L) for n in names}
    seqs = sorted(seqs, key=lambda s: s.num_tokens)
    batches = [seqs[i:i + batch_size] for i in range(0, len(seqs), batch_size)]
    total = sum(max(s.num_tokens for s in b) for b in batches)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="forecast-eval", unit="step", leave=False, disable=None)
    for batch in batches:
        ids, w, lens, prompts = element_arrays(batch, L, p)
        B, T = ids.shape[:2]
        state = model.init_state(B, device) if model is not None else None
        # elements before the first evaluated one only warm the state up (one parallel window)
        warm = max(0, int(prompts.min()) - 1)
        warm = min(warm, T - 1)
        x_warm = activation_vector(ids[:, :warm], w[:, :warm], E)  # [B, warm, L, E]
        if model is not None and warm > 0:
            model(x_warm.to(device), state)
        for b in baselines:
            b.reset(B)
            for i in range(warm):
                b.observe(x_warm[:, i])
        if bar is not None:
            bar.update(warm)
        hidx = torch.arange(1, horizons + 1)
        for i in range(warm, T - 1):
            x = activation_vector(ids[:, i], w[:, i], E)  # [B, L, E]
            tgt = (i + hidx).clamp(max=T - 1)
            # forecasts issued at decode time only: the first target i+1 is a decode element
            valid = ((i + hidx).unsqueeze(0) < lens.unsqueeze(1)) & (i + 1 >= prompts).unsqueeze(1)
            tgt_ids = ids[:, tgt]  # [B, H, L, K]
            if model is not None:
                logits, _ = model.step(x.to(device), state, all_horizons=True)
                if bool(valid.any()):
                    scores = model.rollout(logits, state, horizons).float().cpu()
                    _accumulate(tables["forecaster"], scores, tgt_ids, valid, K)
            for b in baselines:  # every element is predicted (stateful baselines see it), scored when valid
                pred = b.predict(x, horizons)
                if bool(valid.any()):
                    _accumulate(tables[b.name], pred, tgt_ids, valid, K)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.update(max(s.num_tokens for s in batch) - (T - 1))
    if bar is not None:
        bar.close()
    return tables


# ----------------------------------------------------------------------------------------------
# within-token reach

REACH_DISTANCES = (1, 2, 4, 8)
"""Source distances (layers back, same token) of :func:`within_token_reach`."""


@torch.no_grad()
def within_token_reach(train: Sequence[TraceSequence], seqs: Sequence[TraceSequence], meta: TraceMeta, p: int,
                       distances: Sequence[int] = REACH_DISTANCES) -> dict:
    """How much of a layer's routing the same token's earlier layers tell, by distance: the question behind
    re-planning prefetch at more layers than the trigger layer ``p`` (docs/design.md, "Generalisation protocol").

    Targets: layer l's top-K at every decode position of ``seqs``, for the layers ``first .. L-1`` where every
    source exists (``first`` = the largest distance kept, at least p + 1), so that every predictor is scored on the
    same targets. Predictors, each table fitted on ``train`` only (:func:`fit_within_token`, add-0.01): ``layer p``
    (layer p's weights of the same token through W_l: the cross-layer component's within-token part), ``d back``
    (layer l - d's), each also times the sequence's recent-freq (half-life 16, through the previous position) over
    the fit set's frequency (the cross-x-recent product), and the online baselines ``repeat-last`` (the previous
    position's layer l) and ``recent-freq``. Returns ``{"layers": [first, L - 1], "targets": n, "rows": [...]}``,
    a row per predictor with ``R@K`` and ``R@K+3``."""
    L, E, K = meta.num_layers, meta.num_experts, meta.top_k
    ds = sorted({int(d) for d in distances if 1 <= int(d) < L})
    first = max(ds + [p + 1])
    if first > L - 1 or not seqs:
        return {"layers": [], "targets": 0, "rows": []}
    freq = fit_frequency(train, L, E)
    sources = {f"layer {p} (trigger)": [p] * L}
    for d in ds:
        sources[f"{d} back"] = [layer - d for layer in range(L)]
    tables = {name: fit_within_token(train, L, E, src) for name, src in sources.items()}
    decay = decay_of(CROSS_RECENT_HALF_LIFE)
    tl = torch.arange(first, L)
    names = ["repeat-last", "recent-freq"] + [n for name in sources for n in (name, f"{name} x recent")]
    scored = {n: RecallTable(1, L - first) for n in names}  # one horizon, the scored layers
    for sq in seqs:
        ids = torch.from_numpy(np.asarray(sq.expert_ids, dtype=np.int64))  # [T, L, K]
        w = torch.from_numpy(np.asarray(sq.expert_weights, dtype=np.float32))
        T = ids.shape[0]
        start = max(int(sq.prompt_len), 1)
        if T <= start:
            continue
        x = activation_vector(ids, w, E)  # [T, L, E]
        ema = torch.zeros(1, 1, L, E)
        recent = torch.empty(T, L, E)  # recent-freq through the position before
        for t in range(T):
            recent[t] = recent_scores(ema, freq, decay)[0, 0]
            recent_update(ema, x[t:t + 1], decay)
        pos = torch.arange(start, T)
        tgt = ids[pos][:, tl].unsqueeze(1)  # [N, 1, Lt, K]
        valid = torch.ones(len(pos), 1, dtype=torch.bool)
        rec = recent[pos][:, tl]  # [N, Lt, E]
        tie = 1e-6 * freq[tl]
        preds = {"repeat-last": repeat_last_scores(x[pos - 1], freq)[:, tl], "recent-freq": rec}
        for name, src in sources.items():
            sl = torch.tensor([src[layer] for layer in tl.tolist()])
            v = x[pos][:, sl]
            v = v / v.sum(-1, keepdim=True).clamp_min(1e-9)
            sc = torch.einsum("nle,lef->nlf", v, tables[name][tl]) + tie
            preds[name] = sc
            preds[f"{name} x recent"] = cross_recent_scores(sc.unsqueeze(1), rec, freq[tl]).squeeze(1)
        for n in names:
            _accumulate(scored[n], preds[n].unsqueeze(1), tgt, valid, K)
    n_tgt = int(scored[names[0]].count.sum())
    rows = [{"predictor": n, "R@K": float(t.recall("k")[0]), "R@K+3": float(t.recall("k3")[0]), "targets": n_tgt}
            for n, t in scored.items()]
    return {"layers": [first, L - 1], "targets": n_tgt, "rows": rows}
