"""Mode-Markov routing traces with a known Bayes-optimal forecaster (checks of the forecaster).

A hidden mode z_t follows a first-order Markov chain with transition matrix P [M, M]; mode m fixes a
top-K expert set S_l(m) and its weights for every layer l. The trace reveals z_t (the sets of distinct
modes differ), so the Bayes-optimal probability that expert e of layer l is active h steps ahead is
``(P^h[z_t] @ I_l)[e]`` with I_l [M, E] the mode-membership indicators, and the Bayes-optimal top-K
(maximizing expected recall) is the top-K of these marginals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from expertcast.data.trace_format import TraceMeta, TraceSequence


@dataclass
class ModeMarkovProcess:
    """Shapes: ``transition`` [M, M] (rows sum to 1); ``sets`` int [M, L, K]; ``weights`` float [M, L, K]."""

    transition: np.ndarray
    sets: np.ndarray
    weights: np.ndarray
    num_experts: int

    @classmethod
    def random(cls, num_modes: int, num_layers: int, num_experts: int, top_k: int, stickiness: float = 0.3,
               concentration: float = 0.3, seed: int = 0) -> ModeMarkovProcess:
        """A random process: Dirichlet(``concentration``) rows mixed with ``stickiness`` on the diagonal."""
        rng = np.random.default_rng(seed)
        P = rng.dirichlet(np.full(num_modes, concentration), size=num_modes)
        P = (1 - stickiness) * P + stickiness * np.eye(num_modes)
        seen: set[bytes] = set()
        sets = np.zeros((num_modes, num_layers, top_k), dtype=np.int64)
        for m in range(num_modes):
            while True:
                s = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_layers)])
                key = np.sort(s, axis=-1).tobytes()
                if key not in seen:
                    seen.add(key)
                    sets[m] = s
                    break
        w = -np.sort(-rng.dirichlet(np.ones(top_k), size=(num_modes, num_layers)), axis=-1)
        return cls(P, sets, w.astype(np.float32), num_experts)

    @property
    def num_layers(self) -> int:
        return self.sets.shape[1]

    @property
    def top_k(self) -> int:
        return self.sets.shape[2]

    def meta(self) -> TraceMeta:
        return TraceMeta(model_id="synthetic/mode-markov", num_layers=self.num_layers, num_experts=self.num_experts,
                         top_k=self.top_k, expert_bytes=1 << 20, dataset="synthetic")

    def sample(self, num_sequences: int, length: int, prompt_len: int = 0, seed: int = 1
               ) -> tuple[list[TraceSequence], list[np.ndarray]]:
        """Sequences and their mode paths (int [T] each)."""
        rng = np.random.default_rng(seed)
        M = self.transition.shape[0]
        cum = np.cumsum(self.transition, axis=1)
        seqs, modes = [], []
        for i in range(num_sequences):
            z = np.empty(length, dtype=np.int64)
            z[0] = rng.integers(M)
            u = rng.random(length)
            for t in range(1, length):
                z[t] = min(int(np.searchsorted(cum[z[t - 1]], u[t])), M - 1)
            seqs.append(TraceSequence(
                seq_id=f"mm-{seed}-{i}", token_ids=np.zeros(length, dtype=np.int32), prompt_len=prompt_len,
                expert_ids=self.sets[z].astype(np.int16), expert_weights=self.weights[z].astype(np.float16)))
            modes.append(z)
        return seqs, modes

    def membership(self) -> np.ndarray:
        """I [M, L, E]: 1 where expert e is in mode m's set at layer l."""
        M, L, K = self.sets.shape
        ind = np.zeros((M, L, self.num_experts))
        for m in range(M):
            for layer in range(L):
                ind[m, layer, self.sets[m, layer]] = 1.0
        return ind

    def bayes_marginals(self, mode: int, horizon: int) -> np.ndarray:
        """[L, E]: P(e active at layer l, h steps after a step in ``mode``)."""
        ph = np.linalg.matrix_power(self.transition, horizon)[mode]
        return np.einsum("m,mle->le", ph, self.membership())

    def bayes_recall(self, modes: list[np.ndarray], horizon: int, k: int | None = None, start: int = 0) -> float:
        """Expected recall@k of the Bayes-optimal top-k over the targets t+h, t >= ``start`` of ``modes``."""
        k = k or self.top_k
        ind = self.membership()
        Ph = np.linalg.matrix_power(self.transition, horizon)
        marg = np.einsum("zm,mle->zle", Ph, ind)  # [M, L, E]
        top = np.argsort(-marg, axis=-1, kind="stable")[..., :k]  # [M, L, k]
        hits, n = 0.0, 0
        for z in modes:
            for t in range(start, len(z) - horizon):
                nxt = z[t + horizon]
                got = np.take_along_axis(ind[nxt], top[z[t]], axis=-1).sum(-1)  # [L]
                hits += float(got.sum()) / self.top_k
                n += self.num_layers
        return hits / max(n, 1)


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
    import lightning as pl
    from expertcast.train.forecaster_data import ForecasterDataModule
    from expertcast.train.forecaster_module import ForecasterModule

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
    from expertcast.train.forecaster_module import calibrate_on_loader

    held_out = bool(dm.splits["val"])
    calibrate_on_loader(module.net, dm.val_dataloader() if held_out else dm.train_dataloader(),
                        residual=held_out and module.hparams.fit_residual_scale)
    module.net.eval()
    return module, dm


@dataclass
class StickyRoutingProcess:
    """Routing that is near-uniform in aggregate yet locally sticky, like real MoE routing (issue 17: normalised
    entropy of expert use ~0.99, step overlap |S_t ∩ S_t+1| / K ~0.27 for top-6 of 64, random K/E = 0.09).

    Per layer l: a global popularity ``popularity`` [L, E] (mildly skewed); per sequence a preference
    rho_l ~ Dirichlet(``concentration`` · E · popularity_l) (each sequence favours some experts, the favourites
    differ between sequences, so the aggregate stays near-uniform); per step a persistence shared by all
    layers (``stay`` · 2 · u, u ~ Beta(2, 2), so some tokens change their experts more than others): each
    expert of S_t stays in S_t+1 with that probability and the rest of S_t+1 is drawn from rho_l without
    replacement. Router weights are sorted Dirichlet(1) draws. There is no hidden Bayes-optimal forecast in
    closed form; the online baselines (repeat-last, recent frequency) are strong here by construction.
    """

    popularity: np.ndarray
    top_k: int
    stay: float = 0.13
    concentration: float = 1.0

    @classmethod
    def realistic(cls, num_layers: int = 4, num_experts: int = 64, top_k: int = 6, skew: float = 0.25,
                  stay: float = 0.13, concentration: float = 1.0, seed: int = 0) -> StickyRoutingProcess:
        """Defaults give entropy ~0.99 and overlap ~0.27 at top-6 of 64 (tested)."""
        rng = np.random.default_rng(seed)
        logits = skew * rng.standard_normal((num_layers, num_experts))
        pop = np.exp(logits)
        return cls(pop / pop.sum(-1, keepdims=True), top_k, stay, concentration)

    @property
    def num_layers(self) -> int:
        return self.popularity.shape[0]

    @property
    def num_experts(self) -> int:
        return self.popularity.shape[1]

    def meta(self) -> TraceMeta:
        return TraceMeta(model_id="synthetic/sticky-routing", num_layers=self.num_layers,
                         num_experts=self.num_experts, top_k=self.top_k, expert_bytes=1 << 20, dataset="synthetic")

    def sample(self, num_sequences: int, length: int, prompt_len: int = 0, seed: int = 1,
               prefix: str = "sticky") -> list[TraceSequence]:
        """``num_sequences`` sequences of ``length`` steps (ids ``{prefix}-{seed}-{i}``).

        Draws without replacement use the Gumbel-top-k trick, all sequences and layers at once: S_t+1 is the
        top-K of (+inf for the experts that stay, log rho + Gumbel noise for the others)."""
        rng = np.random.default_rng(seed)
        N, L, E, K = num_sequences, self.num_layers, self.num_experts, self.top_k
        alpha = self.concentration * E * self.popularity  # [L, E]
        rho = np.stack([[rng.dirichlet(alpha[li]) for li in range(L)] for _ in range(N)]) + 1e-9  # [N, L, E]
        log_rho = np.log(rho)

        def draw(stays: np.ndarray) -> np.ndarray:
            score = log_rho + rng.gumbel(size=log_rho.shape)
            score[stays] = np.inf
            return np.argpartition(-score, K - 1, axis=-1)[..., :K]

        ids = np.zeros((N, length, L, K), dtype=np.int64)
        ids[:, 0] = draw(np.zeros((N, L, E), dtype=bool))
        stay = np.clip(self.stay * 2 * rng.beta(2, 2, size=(N, length)), 0, 1)
        for t in range(1, length):
            kept = rng.random((N, L, K)) < stay[:, t, None, None]
            stays = np.zeros((N, L, E), dtype=bool)
            n_i, l_i, k_i = np.nonzero(kept)
            stays[n_i, l_i, ids[n_i, t - 1, l_i, k_i]] = True
            ids[:, t] = draw(stays)
        w = -np.sort(-rng.dirichlet(np.ones(K), size=(N, length, L)), axis=-1)
        return [TraceSequence(seq_id=f"{prefix}-{seed}-{i}", token_ids=np.zeros(length, dtype=np.int32),
                              prompt_len=prompt_len, expert_ids=ids[i].astype(np.int16),
                              expert_weights=w[i].astype(np.float16)) for i in range(N)]
