"""SAEM cue sets: candidate cues, stage segmentation, TCseq, calibration, versioned JSON (SAEM IV-1).

A *cue set* is the model-specific list of transition cues T_model (paper IV-1) plus what calibration
measured for each candidate. Calibration runs the streaming detector once per calibration trace with
all candidates (``all_matches`` mode), then scores every candidate alone and every greedy cue subset
from those matches (:func:`select_boundaries` reproduces the detector's output for any subset).

Definitions used throughout (docs/design.md "SAEM"; the paper does not spell out TCseq, we follow its
wording "similarity of per-layer expert-frequency vectors of adjacent stages"):

- stages of a sequence: its decode positions cut at the start token of every detected cue; stage k
  covers positions [s_k, s_{k+1}); the first stage starts at the first decode position.
- per-stage frequencies: counts [S, L, E] of how often each expert of each MoE layer is selected
  (top-K) by the tokens of the stage.
- TCseq_l(k) = cosine(counts[k, l], counts[k+1, l]) for adjacent stages; TCseq per layer is the mean
  over all adjacent pairs of all sequences, overall TCseq the mean over layers.
- segmentation noise: share of stages shorter than ``min_stage_tokens``.
- control: the same sequences cut into the same number of equal-length stages ("uniform"), and into
  stages of the same lengths in a random order ("shuffled").
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.inference.saem.stages import BoundaryEvent, StageDetector, TokenDecoder
from expertcast.utils.errors import UsageError
from expertcast.utils.io import atomic_write_json
from expertcast.utils.jsonfields import check_format, is_str_list

CUESET_FORMAT = "expertcast.saem.cueset"
CUESET_FORMAT_VERSION = 1
CUESET_FILENAME = "cues.json"
"""Name of a model's cue set inside its directory (``<model dir>/cues.json``): where
:func:`resolve_cue_set` and :class:`~expertcast.inference.policies.stage_aware.StageAwarePolicy` look when
no cue set is given."""

DEFAULT_CANDIDATES: tuple[str, ...] = (
    "Alternatively", "Instead", "Another way", "Another approach", "Wait", "But wait", "On second thought",
    "Therefore", "Let me check", "Let me verify", "Let me double-check", "Let me think", "Let me try",
    "Let me see", "Let me compute", "Let me consider", "Let me recall", "Hmm", "But", "So", "Actually",
    "Now", "First", "Next", "Then", "Thus", "Similarly", "Maybe", "Okay", "Yes", "I think",
)
"""Candidate transition cues scored by calibration (extend with ``--cues FILE``)."""


def load_candidates(path: str | os.PathLike | None, base: Iterable[str] = DEFAULT_CANDIDATES) -> list[str]:
    """``base`` plus the cues of a text file (one per line, ``#`` comments), duplicates dropped."""
    out = list(dict.fromkeys(base))
    if path is None:
        return out
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"cue candidate file {p} does not exist")
    for line in p.read_text(encoding="utf-8").splitlines():
        cue = line.split("#", 1)[0].strip()
        if cue and cue not in out:
            out.append(cue)
    return out


# ---------------------------------------------------------------------------------------------
# segmentation and coherence
# ---------------------------------------------------------------------------------------------
def select_boundaries(raw: Sequence[BoundaryEvent], allowed: set[int] | frozenset[int]) -> list[BoundaryEvent]:
    """The events a detector built with only the cues ``allowed`` (indices into the candidate list)
    would emit, from the events of an ``all_matches`` detector over all candidates.

    Matches confirmed together share ``char_end`` and come longest first; the detector emits the first
    of them that does not start before the end of the previously emitted match.
    """
    out: list[BoundaryEvent] = []
    last_end = 0
    i, n = 0, len(raw)
    while i < n:
        j = i
        while j < n and raw[j].char_end == raw[i].char_end and raw[j].token_index == raw[i].token_index:
            j += 1
        for ev in raw[i:j]:
            if ev.cue in allowed and ev.char_start >= last_end:
                out.append(ev)
                last_end = ev.char_end
                break
        i = j
    return out


def stage_starts(events: Sequence[BoundaryEvent], n_tokens: int) -> np.ndarray:
    """Start positions [S] of the stages (0 first, strictly increasing, all < ``n_tokens``)."""
    starts = sorted({0, *(e.start_token for e in events if 0 < e.start_token < n_tokens)})
    return np.asarray(starts, dtype=np.int64)


def stage_lengths(starts: np.ndarray, n_tokens: int) -> np.ndarray:
    """Lengths [S] of the stages starting at ``starts`` in a sequence of ``n_tokens``."""
    return np.diff(np.append(starts, n_tokens))


def stage_counts(expert_ids: np.ndarray, starts: np.ndarray, num_experts: int) -> np.ndarray:
    """Per-stage expert selection counts.

    Args:
        expert_ids: int [T, L, K] routing of the positions (decode only).
        starts: int [S] stage starts (see :func:`stage_starts`).
        num_experts: E.
    Returns:
        int64 [S, L, E].
    """
    T, L, K = expert_ids.shape
    stage_of = np.zeros(T, dtype=np.int64)
    if len(starts) > 1:
        stage_of[starts[1:]] = 1
        stage_of = np.cumsum(stage_of)
    S = len(starts)
    e = expert_ids.astype(np.int64)
    if e.size and (e.min() < 0 or e.max() >= num_experts):
        raise UsageError(f"expert ids outside [0, {num_experts}): the trace does not match E={num_experts}")
    flat = (stage_of[:, None, None] * L + np.arange(L)[None, :, None]) * num_experts + e
    return np.bincount(flat.ravel(), minlength=S * L * num_experts).reshape(S, L, num_experts)


def adjacent_cosine(counts: np.ndarray) -> np.ndarray:
    """TCseq of adjacent stages: cosine similarity [S-1, L] of ``counts`` [S, L, E] rows k and k+1."""
    c = counts.astype(np.float64)
    a, b = c[:-1], c[1:]
    num = (a * b).sum(-1)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def uniform_starts(n_tokens: int, n_stages: int) -> np.ndarray:
    """Starts of ``n_stages`` equal-length stages over ``n_tokens`` positions (the control)."""
    n_stages = max(1, min(n_stages, n_tokens))
    return np.unique((np.arange(n_stages) * n_tokens) // n_stages).astype(np.int64)


def shuffled_starts(lengths: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Starts of stages with the given ``lengths`` in a random order (the second control)."""
    perm = rng.permutation(lengths)
    return np.concatenate([[0], np.cumsum(perm)[:-1]]).astype(np.int64)


@dataclass
class SegmentationStats:
    """Summary of a segmentation of many sequences (and its controls)."""

    n_sequences: int
    n_tokens: int
    stages_per_seq: list[int]
    lengths: np.ndarray
    """int [total stages] stage lengths in tokens."""
    tcseq_layer: np.ndarray
    """float [L] mean TCseq per layer (NaN when no sequence has two stages)."""
    tcseq_uniform_layer: np.ndarray
    tcseq_shuffled_layer: np.ndarray
    n_pairs: int
    min_stage_tokens: int

    @property
    def tcseq(self) -> float:
        return float(np.mean(self.tcseq_layer)) if self.n_pairs else float("nan")

    @property
    def tcseq_uniform(self) -> float:
        return float(np.mean(self.tcseq_uniform_layer)) if self.n_pairs else float("nan")

    @property
    def tcseq_shuffled(self) -> float:
        return float(np.mean(self.tcseq_shuffled_layer)) if self.n_pairs else float("nan")

    @property
    def noise(self) -> float:
        return float(np.mean(self.lengths < self.min_stage_tokens)) if len(self.lengths) else 0.0

    def summary(self) -> dict[str, Any]:
        L = self.lengths
        sp = np.asarray(self.stages_per_seq)
        return {
            "sequences": self.n_sequences,
            "decode_tokens": self.n_tokens,
            "stages": int(sp.sum()),
            "stages_per_seq_median": float(np.median(sp)) if len(sp) else 0.0,
            "stages_per_seq_mean": float(sp.mean()) if len(sp) else 0.0,
            "stages_per_seq_min": int(sp.min()) if len(sp) else 0,
            "stages_per_seq_max": int(sp.max()) if len(sp) else 0,
            "stage_len_median": float(np.median(L)) if len(L) else 0.0,
            "stage_len_mean": float(L.mean()) if len(L) else 0.0,
            "stage_len_min": int(L.min()) if len(L) else 0,
            "stage_len_max": int(L.max()) if len(L) else 0,
            "noise": self.noise,
            "adjacent_pairs": self.n_pairs,
            "tcseq": self.tcseq,
            "tcseq_uniform": self.tcseq_uniform,
            "tcseq_shuffled": self.tcseq_shuffled,
        }


def segmentation_stats(routings: Sequence[np.ndarray], starts: Sequence[np.ndarray], num_experts: int,
                       min_stage_tokens: int = 32, seed: int = 0) -> SegmentationStats:
    """Stage statistics and TCseq of a segmentation, with the uniform and shuffled controls.

    Args:
        routings: per sequence, int [T_i, L, K] decode routing.
        starts: per sequence, its stage starts (:func:`stage_starts`).
    """
    if len(routings) != len(starts):
        raise ValueError(f"{len(routings)} routings but {len(starts)} segmentations")
    if not routings:
        raise ValueError("no sequences to segment")
    L = routings[0].shape[1]
    rng = np.random.default_rng(seed)
    sums = np.zeros((3, L))
    n_pairs = 0
    lengths, per_seq, n_tok = [], [], 0
    for r, s in zip(routings, starts, strict=True):
        T = r.shape[0]
        n_tok += T
        if T == 0:
            continue
        lens = stage_lengths(s, T)
        lengths.append(lens)
        per_seq.append(len(s))
        if len(s) < 2:
            continue
        for row, st in enumerate((s, uniform_starts(T, len(s)), shuffled_starts(lens, rng))):
            sums[row] += adjacent_cosine(stage_counts(r, st, num_experts)).sum(0)
        n_pairs += len(s) - 1
    means = sums / n_pairs if n_pairs else np.full((3, L), np.nan)
    return SegmentationStats(
        n_sequences=len(per_seq), n_tokens=n_tok, stages_per_seq=per_seq,
        lengths=np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64),
        tcseq_layer=means[0], tcseq_uniform_layer=means[1], tcseq_shuffled_layer=means[2],
        n_pairs=n_pairs, min_stage_tokens=min_stage_tokens,
    )


# ---------------------------------------------------------------------------------------------
# cue sets
# ---------------------------------------------------------------------------------------------
@dataclass
class CalibrationConfig:
    """Thresholds of cue pruning (SAEM IV-1: frequency, segmentation noise, adjacent-stage coherence)."""

    min_stage_tokens: int = 32
    """Stages shorter than this many tokens count as segmentation noise."""
    min_rate_per_1k: float = 0.3
    """A cue must occur at least this often per 1000 decode tokens of the calibration traces."""
    max_noise: float = 0.35
    """Largest share of too-short stages, for a cue alone and for the growing cue set."""
    tcseq_tolerance: float = 0.01
    """TCseq of the cue's (and the set's) stages may fall below the control by at most this."""
    control: str = "uniform"
    """Segmentation a cue's TCseq is compared with: ``uniform`` (the same number of equal-length stages)
    or ``shuffled`` (stages of the same lengths in a random order). TCseq grows with stage length (longer
    stages give smoother frequency vectors), so the uniform control also penalizes a cue for the spread of
    its stage lengths; the shuffled control compares only where the boundaries fall."""
    max_cues: int = 12
    """Upper bound on the size of the calibrated set."""
    ignore_case: bool = False
    """Match cues case-insensitively."""
    seed: int = 0
    """Seed of the shuffled control."""


@dataclass
class CueSet:
    """A model's calibrated transition cues, saved as versioned JSON beside the model's artifacts."""

    cues: list[str]
    model_id: str | None = None
    tokenizer: str | None = None
    ignore_case: bool = False
    candidates: list[str] = field(default_factory=list)
    scores: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per candidate: count, rate_per_1k, trace_share, noise, tcseq, tcseq_uniform, tcseq_shuffled, kept,
    reason."""
    calibration: dict[str, Any] = field(default_factory=dict)
    """Config, source traces and set-level statistics of the calibration run."""
    expert_frequency: list[list[float]] | None = None
    """[L][E] selection frequency over the calibration decode tokens (static placement, ablations)."""
    format_version: int = CUESET_FORMAT_VERSION

    def __post_init__(self) -> None:
        if not self.cues:
            raise ValueError("a cue set needs at least one cue")

    def detector(self, decoder: Callable[[int], bytes] | None = None, batch_size: int = 1) -> StageDetector:
        return StageDetector(self.cues, decoder, batch_size=batch_size, ignore_case=self.ignore_case)

    def to_dict(self) -> dict[str, Any]:
        return {"format": CUESET_FORMAT, **asdict(self)}

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> CueSet:
        """Read and validate a cue-set JSON; one-line errors (FileNotFoundError, UsageError) name the file."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"cue set {p} does not exist (create it with `expertcast stages calibrate`)")
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"cue set {p} is not valid JSON: {e}") from None
        return cls.from_dict(d, source=str(p))

    @classmethod
    def from_dict(cls, d: Any, source: str = "cue set") -> CueSet:
        check_format(d, CUESET_FORMAT, CUESET_FORMAT_VERSION, UsageError,
                     wrong_format=lambda _: f"{source} is not an expertcast cue set (missing \"format\": "
                                            f"\"{CUESET_FORMAT}\")",
                     bad_version=lambda ver: f"{source} has cue-set format_version {ver!r}; this expertcast reads "
                                             f"versions 1..{CUESET_FORMAT_VERSION}")
        if not is_str_list(d.get("cues")):
            raise UsageError(f"{source}: \"cues\" must be a non-empty list of strings")
        freq = d.get("expert_frequency")
        if freq is not None:
            try:
                arr = np.asarray(freq, dtype=np.float64)
            except (TypeError, ValueError):
                raise UsageError(f"{source}: expert_frequency must be a [L][E] list of numbers") from None
            if arr.ndim != 2:
                raise UsageError(f"{source}: expert_frequency must be [L][E], got shape {arr.shape}")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    def check_compatible(self, num_layers: int, num_experts: int, what: str = "trace") -> None:
        """Raise when the stored expert frequencies were measured on a model of another shape."""
        if self.expert_frequency is None:
            return
        L, E = np.asarray(self.expert_frequency).shape
        if (L, E) != (num_layers, num_experts):
            raise UsageError(f"cue set of {self.model_id!r} holds expert frequencies for L={L}, E={E} but the {what} "
                             f"has L={num_layers}, E={num_experts}: calibrated on another model")

    def fitted_on(self, source: str = "cue set") -> Any:
        """What the cue set was calibrated on (:class:`~expertcast.utils.fitted_on.FittedOn`): the calibration
        sequence ids (None: a cue set written before they were recorded) and the model identity."""
        from expertcast.utils.fitted_on import FittedOn, model_of

        ids = self.calibration.get("sequence_ids")
        return FittedOn(source, frozenset(ids) if isinstance(ids, list) else None,
                        model_of(self.calibration.get("model"), self.model_id), verb="calibrated")

    def check_model(self, model_id: str | None, source: str = "cue set", what: str = "the traces",
                    model: dict[str, Any] | None = None, allow_mismatch: bool = False) -> dict[str, Any]:
        """Refuse (:class:`~expertcast.utils.fitted_on.ModelMismatchError`, naming both models) a cue set
        calibrated on a model other than ``model`` (an identity) or ``model_id`` (the same string, or two paths of
        one folder, count as the same model), unless ``allow_mismatch``; the guard's result for the output."""
        from expertcast.utils.fitted_on import check_fitted_on, model_of

        return check_fitted_on(self.fitted_on(source), None, model or model_of(None, model_id), scored=what,
                               allow_model_mismatch=allow_mismatch,
                               mismatch_hint="calibrate a cue set on this model's traces (expertcast stages calibrate)")


@dataclass
class CalibSequence:
    """One calibration sequence: decode token ids [T] and decode routing int [T, L, K]."""

    seq_id: str
    token_ids: np.ndarray
    expert_ids: np.ndarray


def sequences_from_traces(seqs: Iterable[Any]) -> list[CalibSequence]:
    """Decode parts of :class:`~expertcast.data.trace_format.TraceSequence` objects."""
    out = []
    for s in seqs:
        p = s.prompt_len
        out.append(CalibSequence(str(s.seq_id), np.asarray(s.token_ids[p:]), np.asarray(s.expert_ids[p:])))
    return out


def raw_matches(seqs: Sequence[CalibSequence], decoder: Callable[[int], bytes], candidates: Sequence[str],
                ignore_case: bool = False, progress: bool = False) -> list[list[BoundaryEvent]]:
    """All candidate occurrences of every sequence (one detector pass each, ``all_matches`` mode)."""
    det = StageDetector(candidates, decoder, batch_size=1, ignore_case=ignore_case, all_matches=True)
    out = []
    it: Iterable[CalibSequence] = seqs
    if progress:
        from tqdm import tqdm

        it = tqdm(seqs, desc="detecting cues", unit="seq")
    for s in it:
        det.reset(1)
        ev: list[BoundaryEvent] = []
        for tid in s.token_ids.tolist():
            ev += det.feed_token(0, tid)
        ev += det.flush(0)
        out.append(ev)
    return out


def _stats_for(seqs: Sequence[CalibSequence], raw: Sequence[Sequence[BoundaryEvent]], allowed: set[int],
               num_experts: int, cfg: CalibrationConfig) -> tuple[SegmentationStats, int, int]:
    starts, n_events, n_with = [], 0, 0
    for s, r in zip(seqs, raw, strict=True):
        ev = select_boundaries(r, allowed)
        n_events += len(ev)
        n_with += bool(ev)
        starts.append(stage_starts(ev, len(s.token_ids)))
    st = segmentation_stats([s.expert_ids for s in seqs], starts, num_experts, cfg.min_stage_tokens, cfg.seed)
    return st, n_events, n_with


def expert_frequency(seqs: Sequence[CalibSequence], num_experts: int) -> np.ndarray:
    """float [L, E]: share of the tokens that select each expert, over all decode tokens."""
    L = seqs[0].expert_ids.shape[1]
    tot = np.zeros((L, num_experts))
    n = 0
    for s in seqs:
        tot += stage_counts(s.expert_ids, np.zeros(1, dtype=np.int64), num_experts)[0]
        n += s.expert_ids.shape[0]
    return tot / max(n, 1)


def calibrate(seqs: Sequence[CalibSequence], decoder: Callable[[int], bytes], num_experts: int,
              candidates: Sequence[str] = DEFAULT_CANDIDATES, config: CalibrationConfig | None = None,
              model_id: str | None = None, tokenizer_id: str | None = None,
              progress: bool = False, model: dict[str, Any] | None = None) -> CueSet:
    """Score every candidate alone, prune, and grow the cue set greedily (best TCseq margin first)
    while the set's noise and TCseq stay within the thresholds. The cue set records the calibration sequence
    ids and ``model`` (the traces' model identity) for :meth:`CueSet.fitted_on`."""
    cfg = config or CalibrationConfig()
    if cfg.control not in ("uniform", "shuffled"):
        raise UsageError(f"calibration control must be 'uniform' or 'shuffled', got {cfg.control!r}")

    def ctrl(st: SegmentationStats) -> float:
        return st.tcseq_shuffled if cfg.control == "shuffled" else st.tcseq_uniform

    seqs = [s for s in seqs if len(s.token_ids)]
    if not seqs:
        raise UsageError("no calibration sequence has decode tokens")
    if isinstance(decoder, TokenDecoder):
        decoder.check_ids(np.concatenate([s.token_ids for s in seqs]), "the calibration traces")
    raw = raw_matches(seqs, decoder, candidates, cfg.ignore_case, progress=progress)
    n_tok = sum(len(s.token_ids) for s in seqs)
    scores: dict[str, dict[str, Any]] = {}
    eligible: list[tuple[float, int]] = []
    for i, cue in enumerate(candidates):
        st, n_ev, n_with = _stats_for(seqs, raw, {i}, num_experts, cfg)
        rate = 1000.0 * n_ev / n_tok
        sc = {"count": n_ev, "rate_per_1k": rate, "trace_share": n_with / len(seqs), "noise": st.noise,
              "tcseq": st.tcseq, "tcseq_uniform": st.tcseq_uniform, "tcseq_shuffled": st.tcseq_shuffled,
              "kept": False}
        margin = st.tcseq - ctrl(st) if st.n_pairs else float("nan")
        if rate < cfg.min_rate_per_1k:
            sc["reason"] = f"rare ({rate:.3f}/1k < {cfg.min_rate_per_1k})"
        elif st.noise > cfg.max_noise:
            sc["reason"] = f"noisy ({st.noise:.2f} of stages < {cfg.min_stage_tokens} tokens)"
        elif not margin >= -cfg.tcseq_tolerance:
            sc["reason"] = f"incoherent (TCseq {st.tcseq:.4f} < {cfg.control} {ctrl(st):.4f} - {cfg.tcseq_tolerance})"
        else:
            sc["reason"] = "eligible"
            eligible.append((margin, i))
        scores[cue] = sc
    eligible.sort(key=lambda x: (-x[0], -scores[candidates[x[1]]]["rate_per_1k"]))
    chosen: set[int] = set()
    history = []
    for _margin, i in eligible:
        if len(chosen) >= cfg.max_cues:
            scores[candidates[i]]["reason"] = f"set full ({cfg.max_cues} cues)"
            continue
        trial = chosen | {i}
        st, n_ev, _ = _stats_for(seqs, raw, trial, num_experts, cfg)
        set_margin = st.tcseq - ctrl(st)
        if st.noise > cfg.max_noise:
            scores[candidates[i]]["reason"] = f"set would be noisy ({st.noise:.2f})"
            continue
        if not set_margin >= -cfg.tcseq_tolerance:
            scores[candidates[i]]["reason"] = f"set would lose coherence (margin {set_margin:.4f})"
            continue
        chosen = trial
        scores[candidates[i]]["kept"] = True
        scores[candidates[i]]["reason"] = "kept"
        history.append({"added": candidates[i], "noise": st.noise, "tcseq": st.tcseq,
                        "tcseq_uniform": st.tcseq_uniform, "tcseq_shuffled": st.tcseq_shuffled, "boundaries": n_ev})
    if not chosen:
        # keep the single most frequent candidate so the set stays usable, and say so
        best = max(range(len(candidates)), key=lambda i: scores[candidates[i]]["count"])
        chosen = {best}
        scores[candidates[best]]["kept"] = True
        scores[candidates[best]]["reason"] = "fallback: no candidate passed the thresholds; most frequent kept"
    cues = [candidates[i] for i in sorted(chosen)]
    final, _, _ = _stats_for(seqs, raw, chosen, num_experts, cfg)
    full, _, _ = _stats_for(seqs, raw, set(range(len(candidates))), num_experts, cfg)
    return CueSet(
        cues=cues, model_id=model_id, tokenizer=tokenizer_id, ignore_case=cfg.ignore_case,
        candidates=list(candidates), scores=scores,
        calibration={"config": asdict(cfg), "sequences": len(seqs), "sequence_ids": [s.seq_id for s in seqs],
                     **({"model": dict(model)} if model else {}), "decode_tokens": n_tok,
                     "selected": final.summary(), "all_candidates": full.summary(), "greedy": history},
        expert_frequency=expert_frequency(seqs, num_experts).tolist(),
    )


def resolve_cue_set(cue_set: str | os.PathLike | None, model: str | os.PathLike | None = None) -> Path:
    """The cue-set file to use: ``cue_set`` when given, else ``<model>/cues.json`` (the model's artifacts,
    written by ``expertcast stages calibrate --out <model>/cues.json``). Raises FileNotFoundError naming
    both places when neither exists."""
    if cue_set is not None:
        p = Path(cue_set)
        if not p.is_file():
            raise FileNotFoundError(f"cue set {p} does not exist (create it with `expertcast stages calibrate`)")
        return p
    if model is not None and Path(model).is_dir():
        p = Path(model) / CUESET_FILENAME
        if p.is_file():
            return p
        raise FileNotFoundError(f"no cue set given and the model directory {model} has no {CUESET_FILENAME}: run "
                                f"`expertcast stages calibrate --model {model} --out {p}` or pass --cues")
    raise FileNotFoundError("no cue set given (--cues) and no local model directory to find "
                            f"{CUESET_FILENAME} in")


def decoder_for(name_or_path: str) -> TokenDecoder:
    from expertcast.models.tokenizer import load_tokenizer

    return TokenDecoder(load_tokenizer(name_or_path))


def counts_from_frequency(freq: np.ndarray, tokens: int) -> np.ndarray:
    """int64 [L, E] selection counts from per-token selection frequencies [L, E] over ``tokens`` tokens."""
    return np.rint(np.asarray(freq, np.float64) * max(int(tokens), 1)).astype(np.int64)


def cue_set_calibration(cue_set: Any) -> tuple[np.ndarray, np.ndarray]:
    """(frequency float [L, E], selection counts int64 [L, E]) of a cue set's calibration traces (the
    stage policies' seed placement and the ``static`` baseline)."""
    if cue_set.expert_frequency is None:
        raise UsageError("the cue set has no expert_frequency (recalibrate it with `expertcast stages calibrate`)")
    freq = np.asarray(cue_set.expert_frequency, np.float64)
    return freq, counts_from_frequency(freq, cue_set.calibration.get("decode_tokens", 1))
