"""Book-keeping of one :meth:`OffloadedModel.generate` / :meth:`OffloadedModel.replay` call: the batch's
lockstep schedule (:class:`~expertcast.inference.cache.schedule.BatchSchedule`, ends learned from EOS), the
phase of each forward, the token rows to compute, the tokens fed at each step and the recorded
routing. It only observes; :class:`~expertcast.inference.runtime.engine.OffloadedModel` acts on what
it reports."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
from expertcast.data.trace_format import TraceSequence
from expertcast.inference.cache.schedule import BatchSchedule, StepInfo


@dataclass
class LivePrompt:
    """What ``Policy.begin_batch`` receives for one sequence of a live generation: its id and prompt (the
    completion is not known yet, so unlike a :class:`TraceSequence` it has no ``token_ids``/``expert_ids``)."""

    seq_id: str
    prompt_ids: np.ndarray
    """int32 [P] prompt token ids."""
    prompt_len: int


@dataclass
class GenerationResult:
    sequences: torch.Tensor
    """[B, P + new] token ids (left-padded prompts followed by the generated tokens)."""
    traces: list[TraceSequence] | None
    """Routing of every processed position per sequence (``record=True``)."""
    ttft_seconds: float
    seconds: float
    landings: list[tuple[int, int, int]] | None = None
    """``(x, layer, expert)`` of every proactive load that landed (``record=True``): with the traces, what
    :class:`~expertcast.inference.cache.driver.RecordedTransport` needs to replay this run in the simulator."""


class Phase(Enum):
    """What a forward of the wrapped model computes."""

    PREFILL = 0
    """The prompts, in one pass."""
    FIRST_DECODE = 1
    """The first decode step (it consumes the prefill's token): the prefill is closed first."""
    DECODE = 2


class RunState:
    """Phases, steps, active rows, fed tokens and routing logs of one call.

    Args:
        prompts: int32 [P_i] prompt of each member; seq_ids: their ids; eos: token ids ending a member.
        record: keep the routing of every processed position (:meth:`traces`).
        device: where the active-row index tensors live; num_layers, top_k: L and K of the model.
        forced: recorded (expert_ids [T, L, K], weights [T, L, K]) substituted for the router's (batch 1).
    """

    def __init__(self, prompts: list[np.ndarray], seq_ids: list[str], eos: set[int], record: bool,
                 device: torch.device, num_layers: int, top_k: int,
                 forced: tuple[np.ndarray, np.ndarray] | None = None):
        self.prompts = prompts
        self.B = len(prompts)
        self.seq_ids = seq_ids
        self.eos = eos
        self.record = record
        self.forced = forced
        self.device = device
        self.L, self.K = num_layers, top_k
        self.schedule = BatchSchedule([len(p) for p in prompts])
        self.prefill = True
        self.prefill_done = False
        self.n_forward = 0
        self.decode_step = -1
        self.active_rows: torch.Tensor | None = None
        self.active: list[int] = list(range(self.B))
        self.positions = np.zeros(self.B, np.int64)
        """Position of each member at the current decode step (-1 = idle), from the driver's schedule."""
        self.warmup = 0.0
        self.ttft = 0.0
        self._t_start = time.perf_counter()
        self._toks = np.zeros(self.B, np.int64)
        """Tokens fed by the current forward (the last column of its input ids)."""
        self._step_toks = self._toks
        """Tokens fed at the current decode step."""
        self._prefill_log: list[list[np.ndarray]] = [[] for _ in range(num_layers)]  # per layer [Ntok, K]
        self._prefill_wlog: list[list[np.ndarray]] = [[] for _ in range(num_layers)]
        self._pcat: list[np.ndarray] | None = None
        self._pwcat: list[np.ndarray] | None = None
        self._decode_log: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(self.B)]
        self._dec_ids = np.zeros((self.B, num_layers, top_k), np.int64)
        self._dec_w = np.zeros((self.B, num_layers, top_k), np.float32)
        self._dec_tokens: list[list[int]] = [[] for _ in range(self.B)]

    def members(self) -> list[LivePrompt]:
        return [LivePrompt(s, p.copy(), len(p)) for s, p in zip(self.seq_ids, self.prompts, strict=True)]

    # -- phases ------------------------------------------------------------------------------------
    def begin_forward(self, ids: torch.Tensor) -> Phase:
        """A forward of the wrapped model starts with input ``ids``; members that emitted EOS end."""
        self.n_forward += 1
        if self.n_forward == 1:
            B, P = ids.shape
            if B != self.B:
                raise ValueError(f"forward got a batch of {B}, expected {self.B}")
            rows = [r for i, p in enumerate(self.prompts) for r in range(i * P + P - len(p), i * P + P)]
            self.active_rows = None if len(rows) == B * P else torch.as_tensor(rows, device=self.device)
            return Phase.PREFILL
        self._toks = ids.reshape(self.B, -1)[:, -1].cpu().numpy().astype(np.int64)
        d = self.decode_step + 1  # the decode step this forward runs
        ending = range(self.B) if not self.prefill_done else self.active
        for i in ending:
            if int(self._toks[i]) in self.eos:  # emitted EOS: no position after its last one
                self.schedule.end_member(i, len(self.prompts[i]) + d)
        self.prefill = False
        if not self.prefill_done:
            self.ttft = time.perf_counter() - self._t_start
            return Phase.FIRST_DECODE
        return Phase.DECODE

    def close_prefill(self, no_decode: bool = False) -> None:
        """The prefill is closed (``no_decode``: the call ends without a decode step)."""
        if no_decode:
            self.ttft = time.perf_counter() - self._t_start
            for i, p in enumerate(self.prompts):
                self.schedule.end_member(i, len(p))
        self.prefill_done = True

    def start_step(self, info: StepInfo) -> None:
        """Decode step ``info`` starts: the rows of the members still going."""
        self.decode_step += 1
        self._step_toks = self._toks.copy()
        self.positions = info.positions
        self.active = info.active.tolist()
        self.active_rows = None if len(self.active) == self.B else torch.as_tensor(self.active, device=self.device)

    def fed_tokens(self, info: StepInfo) -> list[int | None]:
        """The token each member feeds to its next position after step ``info`` (None: it has none):
        the next prompt token, else the token of the current forward."""
        nxt = info.schedule.has_next(info.local)
        out: list[int | None] = []
        for i, (pos, ok) in enumerate(zip(info.positions.tolist(), nxt.tolist(), strict=True)):
            if not ok:
                out.append(None)
            elif pos + 1 < len(self.prompts[i]):
                out.append(int(self.prompts[i][pos + 1]))
            else:
                out.append(int(self._toks[i]))
        return out

    # -- routing ----------------------------------------------------------------------------------
    def forced_routing(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The recorded routing of the current forward (batch 1)."""
        assert self.forced is not None
        ids, w = self.forced
        pos = int(self.positions[0])  # the decode step's position (the prefill computes the whole prompt)
        sl = slice(0, len(self.prompts[0])) if self.prefill else slice(pos, pos + 1)
        dev = hidden.device
        return (torch.as_tensor(ids[sl, layer], device=dev),
                torch.as_tensor(w[sl, layer], device=dev).to(hidden.dtype))

    def log_routing(self, layer: int, idx: torch.Tensor, w: torch.Tensor) -> None:
        """Keep the routing of the rows computed at ``layer`` (prefill: every prompt token)."""
        ids = idx.cpu().numpy().astype(np.int64)
        ww = _as_recorded(w)
        if self.prefill:
            self._prefill_log[layer].append(ids)
            self._prefill_wlog[layer].append(ww)
            return
        for r, i in enumerate(self.active):
            self._dec_ids[i, layer] = ids[r]
            self._dec_w[i, layer] = ww[r]

    def flush_decode_log(self) -> None:
        """The current decode step ended: append its routing and input token to each active member's log."""
        if self.decode_step < 0:
            return
        for i in self.active:
            self._decode_log[i].append((self._dec_ids[i].copy(), self._dec_w[i].copy()))
            self._dec_tokens[i].append(int(self._step_toks[i]))

    def prefill_routing(self, layer: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64 [B, K], weights float32 [B, K]) of the prompt positions ``positions`` [B] at
        ``layer`` (zeros where the position is -1)."""
        if self._pcat is None:
            self._pcat = [np.concatenate(x) for x in self._prefill_log]
            self._pwcat = [np.concatenate(x) for x in self._prefill_wlog]
        assert self._pwcat is not None
        offs = np.concatenate([[0], np.cumsum([len(p) for p in self.prompts])[:-1]])
        ids = np.zeros((self.B, self.K), np.int64)
        w = np.zeros((self.B, self.K), np.float32)
        act = np.flatnonzero(positions >= 0)
        ids[act] = self._pcat[layer][offs[act] + positions[act]]
        w[act] = self._pwcat[layer][offs[act] + positions[act]]
        return ids, w

    def member_routing(self, idx: torch.Tensor, w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(ids int [B, K], weights float [B, K]) of this decode step, zeros for idle members; the weights
        at the precision traces record them (float16), so a replay of the recorded run sees the same."""
        ids_b = np.zeros((self.B, self.K), np.int64)
        w_b = np.zeros((self.B, self.K), np.float32)
        ids_b[self.active] = idx.cpu().numpy()
        w_b[self.active] = _as_recorded(w)
        return ids_b, w_b

    def traces(self) -> list[TraceSequence]:
        """The recorded routing of every processed position, one :class:`TraceSequence` per sequence."""
        out = []
        L, K = self.L, self.K
        pids = [np.concatenate(x) for x in self._prefill_log]
        pw = [np.concatenate(x) for x in self._prefill_wlog]
        off = 0
        for i, p in enumerate(self.prompts):
            n = len(p)
            ids = np.stack([pids[layer][off:off + n] for layer in range(L)], axis=1)
            ws = np.stack([pw[layer][off:off + n] for layer in range(L)], axis=1)
            off += n
            dec = self._decode_log[i]
            if dec:
                ids = np.concatenate([ids, np.stack([d[0] for d in dec])])
                ws = np.concatenate([ws, np.stack([d[1] for d in dec])])
            toks = np.concatenate([p, np.asarray(self._dec_tokens[i], np.int32)]).astype(np.int32)
            out.append(TraceSequence(self.seq_ids[i], toks, n, ids.reshape(-1, L, K).astype(np.int16),
                                     ws.reshape(-1, L, K).astype(np.float16)))
        return out


def _as_recorded(w: torch.Tensor) -> np.ndarray:
    """float32 values of routing weights ``w`` rounded to float16, the precision of recorded traces."""
    return w.float().cpu().numpy().astype(np.float16).astype(np.float32)


def left_padded_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[np.ndarray]:
    """The prompts (int32 [P_i] each) of a left-padded batch ``input_ids`` [B, P]; ValueError on a bad shape,
    an empty prompt or right padding."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, P], got {tuple(input_ids.shape)}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    B, P = input_ids.shape
    am = attention_mask.bool().cpu()
    lens = am.sum(1)
    if (lens == 0).any():
        raise ValueError("a prompt of the batch is empty")
    for i in range(B):  # left padding only: real tokens are the last lens[i] positions
        if not bool(am[i, P - int(lens[i]):].all()):
            raise ValueError("prompts must be left-padded (decoder-only generation)")
    ids = input_ids.cpu()
    return [ids[i, P - int(lens[i]):].numpy().astype(np.int32) for i in range(B)]


def check_replayable(s: TraceSequence, num_layers: int, num_experts: int, top_k: int) -> None:
    """ValueError naming the problem when ``s`` cannot be replayed on a model of shape (L, E, K)."""
    if s.expert_ids.shape[1:] != (num_layers, top_k):
        raise ValueError(f"sequence {s.seq_id}: routing {tuple(s.expert_ids.shape[1:])} does not match the "
                         f"model's [L={num_layers}, K={top_k}]: trace/model mismatch")
    if int(s.expert_ids.max()) >= num_experts or int(s.expert_ids.min()) < 0:
        raise ValueError(f"sequence {s.seq_id}: expert id outside [0, E={num_experts}): trace/model mismatch")
    if s.prompt_len < 1:
        raise ValueError(f"sequence {s.seq_id}: replay needs at least one prompt position")
