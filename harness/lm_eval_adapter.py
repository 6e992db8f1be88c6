"""lm-evaluation-harness model ``expertcast``: the harness's requests run through the offloading runtime
(docs/design.md, "Harnesses").

    lm_eval --model expertcast --model_args model=M,policy=lru,capacity=0.25 --tasks gsm8k

(with lm-eval 0.4.13, which discovers no external models: ``expertcast lm-eval`` with the same arguments,
:mod:`expertcast.commands.lm_eval`). The model is loaded straight to the host store
(:func:`~expertcast.inference.runtime.loading.load_offloaded`) under the cache policy and capacity, as
``expertcast eval`` loads it, and is checked the same way before it loads (policy and options, capacity
against the model's shape, artefacts made for another model).

* ``generate_until``: greedy decoding through :meth:`OffloadedModel.generate` in batches of ``batch_size``
  (contexts grouped by their generation settings, longest first); ``until`` stops a sequence (transformers'
  ``stop_strings``; the text is cut before the first stop sequence, as the harness expects), ``max_gen_toks``
  bounds it. A row that stopped is padded with EOS, so the runtime stops routing it at the next step, as
  after an EOS. Sampling (``do_sample=True`` or a temperature above 0) is refused.
* ``loglikelihood`` / ``loglikelihood_rolling``: teacher-forced through the runtime's prefill (the prompt's
  forward pass with every expert it routes to, resident or streamed), the full-sequence logits read from
  that one forward. Prefill is uncounted, so these requests add nothing to the cache metrics.
* the metrics of every decode step, as ``expertcast eval`` computes them
  (:func:`~expertcast.inference.runtime.eval_run.decode_metrics`: Hit = resident hits / accesses with ``cpu_exec``
  apart, AdjHit, MB/token, read MB/token, exposed misses per token, tokens without a miss, TTFT and TPOT at
  p50/p90/p99, stall per token; decode-only, over the ``generate_until`` calls) go into the harness's results JSON (``config.expertcast``, through
  :meth:`ExpertcastLM.get_model_info`) and are printed as a table when the evaluation ends.
* % of full speed (``pct_full``): when the evaluation ends, ``expertcast eval``'s paired speed measurement
  (:func:`~expertcast.inference.runtime.session.paired_speed_passes`) runs on the first ``speed_samples`` contexts of
  ``generate_until`` (default 2; 0 turns it off): baseline, then (offloaded, baseline) x ``speed_repeats``,
  a fresh policy and an empty cache each offloaded pass, each against the mean of its two neighbouring
  baseline passes. The baseline is ``baseline``, the same runtime (``auto``, as ``eval --baseline auto``: every
  expert resident in its slots when a slot for every expert fits, else every expert executed on the host;
  ``resident``, ``host`` or ``none``); a ratio whose passes disagree is flagged, not reported (``speed_flag``). The speed passes decode up to the first
  context's ``max_gen_toks`` new tokens and stop at EOS only (not at the task's stop sequences), so both
  sides decode the same tokens (``tokens_match``).

Model arguments: ``model`` (any ``--model`` of ``expertcast eval``; default ``tiny-default``), ``policy``
(``--policy``; options separated by ``;`` since the harness splits its arguments on commas, e.g.
``policy=lrfu:lam=0.1``), ``capacity`` (a fraction of all experts), ``slots`` or ``budget_gb`` (decimal GB of
expert weights), one of them, ``pool``, ``dtype``,
``decode_path``, ``link_gbps``, ``seed`` (a random-init preset), ``threads``, ``max_length`` and
``max_gen_toks`` (default 256, the harness's), ``speed_samples``, ``speed_repeats`` and ``baseline`` (the speed
measurement above), ``expert_dtype`` (``eval --expert-dtype``: ``bfloat16``, ``int8``, ``int4``, ...),
``allow_overlap`` and ``allow_model_mismatch`` (the guard below), plus the harness's ``batch_size`` and ``device``.

The guard (``expertcast eval``'s, :func:`~expertcast.inference.runtime.session.check_artefacts`): a policy's
forecaster or cue set fitted on another model's routing is refused at load unless ``allow_model_mismatch=true``;
before any request runs, its documents are named in the benchmark's problem-id form (:func:`problem_id`:
``gsm8k-test-00012`` as ``expertcast eval`` names them) and scoring problems the forecaster was fitted on is
refused unless ``allow_overlap=true``. The result is in the results JSON (``config.expertcast["guard"]``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from expertcast.inference.cache.expert_cache import Budget
from expertcast.inference.runtime.session import (
    BASELINES,  # ``baseline`` values (``expertcast eval --baseline``)
)
from expertcast.utils.errors import UsageError
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

MODEL_NAME = "expertcast"
"""The harness's name of this model (``--model expertcast``)."""
METRIC_COLUMNS = ("hit", "cpu_exec", "adj_hit", "mb_per_token", "read_mb_per_token", "exposed_misses_per_token",
                  "miss_free_token_frac", "stall_ms_per_token", "tokens_per_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
                  "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "decoded_tokens", "late_prefetches", "pct_full",
                  "pct_full_min", "pct_full_max", "speed_flag", "baseline")
"""The cache and speed columns of the printed table (decode-only counters)."""
GREEDY_KEYS = {"do_sample", "temperature", "until", "max_gen_toks"}
"""Generation settings the adapter reads; any other (top_p, ...) is refused."""


def _budget_arg(capacity: Any, slots: Any, budget_gb: Any) -> Budget:
    """The :class:`~expertcast.inference.cache.expert_cache.Budget` of ``capacity=F``, ``slots=N`` or
    ``budget_gb=G`` (exactly one)."""
    given = [k for k, v in (("capacity", capacity), ("slots", slots), ("budget_gb", budget_gb)) if v is not None]
    if len(given) != 1:
        raise UsageError("--model_args: give capacity=F (a fraction of all experts), slots=N or budget_gb=G, "
                         f"one of them (got {', '.join(given) or 'none'})")
    if capacity is not None:
        return Budget.fraction(float(capacity))
    if slots is not None:
        return Budget.slots(_int_arg("slots", slots))
    try:
        return Budget.gb(float(budget_gb))
    except ValueError:
        raise UsageError(f"--model_args budget_gb={budget_gb!r}: expected a positive number of GB") from None


def _int_arg(name: str, value: Any, minimum: int = 1) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"--model_args {name}={value!r}: expected an integer") from None
    if n < minimum or isinstance(value, float) and value != n:
        raise UsageError(f"--model_args {name}={value!r}: expected an integer >= {minimum}")
    return n


def _bool_arg(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise UsageError(f"--model_args {name}={value!r}: expected true or false")


TASK_BENCHMARKS = {"gsm8k": "gsm8k", "minerva_math500": "math500", "expertcast_arith": "arith"}
"""The local tasks (:mod:`expertcast.harness.local_tasks`, their ``test`` split) and the benchmark each scores."""


def problem_id(task: str, doc_id: Any, doc: Any) -> str | None:
    """The problem id ``expertcast eval`` gives the harness document ``doc_id`` of a local task (its test split;
    :func:`~expertcast.data.benchmarks.load_benchmark`'s naming: GSM8K by row, MATH-500 by ``unique_id``, arith by
    its own ``id``), or None for another task."""
    bench = TASK_BENCHMARKS.get(str(task))
    doc = doc if isinstance(doc, dict) else {}
    if bench == "arith" and doc.get("id") is not None:
        return str(doc["id"])
    if bench is None or doc_id is None:
        return None
    if bench == "math500" and doc.get("unique_id"):
        return str(doc["unique_id"])
    return f"{bench}-test-{int(doc_id):05d}"


@register_model(MODEL_NAME)
class ExpertcastLM(TemplateLM):
    """The harness's view of one offloaded model (see the module docstring for the arguments)."""

    def __init__(self, model: str = "tiny-default", policy: str = "lru", capacity: float | None = None,
                 slots: int | None = None, budget_gb: float | None = None, pool: str = "per-layer", device: str | None = None, dtype: str = "auto",
                 batch_size: int | str | None = 1, max_batch_size: int | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, seed: int = 0, link_gbps: float | None = None, decode_path: str = "eager",
                 threads: int | None = None, speed_samples: int = 2, speed_repeats: int = 3, baseline: str = "auto",
                 expert_dtype: str = "bfloat16", allow_overlap: Any = False, allow_model_mismatch: Any = False,
                 **unknown: Any):
        super().__init__()
        if unknown:
            raise UsageError(f"--model_args: unknown argument(s) {', '.join(sorted(unknown))} of model {MODEL_NAME} "
                             f"(model, policy, capacity, slots, budget_gb, pool, dtype, decode_path, link_gbps, seed, "
                             f"threads, max_length, max_gen_toks, speed_samples, speed_repeats, baseline, expert_dtype, "
                             f"allow_overlap, allow_model_mismatch)")
        if str(batch_size).startswith("auto"):
            raise UsageError(f"--batch_size {batch_size}: model {MODEL_NAME} takes a fixed batch size (an integer)")
        self._batch_size = _int_arg("batch_size", batch_size if batch_size is not None else 1)
        self._max_gen_toks = _int_arg("max_gen_toks", max_gen_toks)
        self._max_length_arg = None if max_length is None else _int_arg("max_length", max_length)
        self._speed_samples = _int_arg("speed_samples", speed_samples, minimum=0)
        self._speed_repeats = _int_arg("speed_repeats", speed_repeats)
        if baseline not in BASELINES:
            raise UsageError(f"--model_args baseline={baseline!r}: expected one of {', '.join(BASELINES)}")
        self._baseline = baseline
        self._allow_overlap = _bool_arg("allow_overlap", allow_overlap)
        self._allow_model_mismatch = _bool_arg("allow_model_mismatch", allow_model_mismatch)
        self._expert_dtype = str(expert_dtype)
        self._scored_ids: set[str] = set()
        self._unchecked_tasks: set[str] = set()
        self._speed_contexts: list[tuple[list[int], int]] = []
        """(prompt ids, max new tokens) of the first ``speed_samples`` generate_until contexts."""
        self._model_info: dict[str, Any] | None = None
        self._batches: list[dict[str, Any]] = []
        """:func:`~expertcast.inference.runtime.eval_run.batch_stats` of every generate_until batch."""
        if threads is not None:
            torch.set_num_threads(_int_arg("threads", threads))
        self.budget = _budget_arg(capacity, slots, budget_gb)
        self.settings = self._check(model, policy, self.budget, pool, device or "auto", dtype, seed, link_gbps,
                                    decode_path)
        self._load()

    # -- set-up -----------------------------------------------------------------------------------------
    def _check(self, model: str, policy: str, cap: Budget, pool: str, device: str, dtype: str,
               seed: Any, link_gbps: Any, decode_path: str) -> dict[str, Any]:
        """Every cheap check, before the model loads (:func:`~expertcast.inference.runtime.session.check_run`, as
        ``expertcast eval`` checks its flags); builds the session's settings."""
        from expertcast.inference.runtime.session import DTYPES, SessionSettings, check_run
        from expertcast.utils.devices import resolve_device

        if pool not in ("per-layer", "shared"):
            raise UsageError(f"--model_args pool={pool!r}: expected per-layer or shared")
        if dtype not in DTYPES:
            raise UsageError(f"--model_args dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
        if decode_path not in ("eager", "graph", "auto"):
            raise UsageError(f"--model_args decode_path={decode_path!r}: expected eager, graph or auto")
        spec = str(policy).replace(";", ",")
        self._policy_spec = spec
        checked = check_run(model, spec, cap, pool, allow_model_mismatch=self._allow_model_mismatch)
        self._checked = checked
        self.guard = self._check_guard(None)  # another model's routing: refused before the model loads
        self.policy, name, opts, files = checked.policy, checked.policy_name, checked.options, checked.files
        resolved, shape = checked.model_path, checked.shape
        self.session_settings = SessionSettings(
            model=str(model), model_path=resolved, device=resolve_device(device), dtype=dtype, pool=pool,
            link_gbps=None if link_gbps is None else float(link_gbps), decode_path=decode_path, seed=int(seed),
            expert_dtype=self._expert_dtype)
        ss = self.session_settings
        return {"model": ss.model, "model_path": resolved, "policy": spec, "policy_name": name,
                "policy_options": {k: v for k, v in sorted(opts.items()) if k not in files}, "artefacts": files,
                "capacity": cap.row(), "pool": pool, "shape": list(shape), "cache": checked.cache_config.describe(),
                "device": ss.device, "dtype": dtype, "seed": ss.seed, "link_gbps": ss.link_gbps,
                "decode_path": decode_path, "batch_size": self._batch_size, "greedy": True,
                "expert_dtype": ss.expert_dtype}

    def _check_guard(self, problem_ids: list[str] | None) -> dict[str, dict[str, Any]]:
        from expertcast.inference.runtime.session import check_artefacts

        try:
            return check_artefacts(self._checked, problem_ids, scored=f"the harness's documents on --model_args "
                                                                     f"model={self._checked.model_path}",
                                   allow_overlap=self._allow_overlap, allow_model_mismatch=self._allow_model_mismatch)
        except UsageError as e:  # name the harness's spelling of the flags
            text = str(e).replace("--allow-overlap", "--model_args allow_overlap=true")
            raise type(e)(text.replace("--allow-model-mismatch", "--model_args allow_model_mismatch=true")) from None

    def check_requests(self, requests: list[Any]) -> None:
        """The guard on the documents of ``requests`` (before any of them runs): their problem ids
        (:func:`problem_id`) with every id scored so far against the policy's forecaster; tasks whose documents
        have no problem id are listed as unchecked."""
        for req in requests:
            task = getattr(req, "task_name", None)
            if task is None:
                continue
            pid = problem_id(task, getattr(req, "doc_id", None), getattr(req, "doc", None))
            if pid is None:
                self._unchecked_tasks.add(str(task))
            else:
                self._scored_ids.add(pid)
        if self._scored_ids and "forecaster" in self._checked.files:
            self.guard = self._check_guard(sorted(self._scored_ids))

    def guard_record(self) -> dict[str, Any]:
        """``config.expertcast["guard"]``: every check's result, its one-line note, the scored problem ids."""
        from expertcast.utils.fitted_on import guard_note

        return {"checks": self.guard, "note": guard_note(self.guard), "scored_problems": len(self._scored_ids),
                "unchecked_tasks": sorted(self._unchecked_tasks),
                "allow_overlap": self._allow_overlap, "allow_model_mismatch": self._allow_model_mismatch}

    def _load(self) -> None:
        from expertcast.inference.runtime.eval_run import eos_ids
        from expertcast.inference.runtime.session import ModelSession

        s = self.settings
        self.session = ModelSession(self.session_settings)
        self.om = self.session.offload(self.policy, self.budget)
        self.tok, self.load_report = self.session.tok, self.session.load_report
        self.eos = eos_ids(self.om.model, self.tok)
        if not self.eos:
            raise UsageError(f"model {s['model']}: neither its generation config nor its tokenizer has an EOS token")
        self.tokenizer = self.tok

    # -- what the harness reads -------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_token_id if self.tok.eos_token_id is not None else self.eos[0]

    @property
    def max_length(self) -> int:
        if self._max_length_arg is not None:
            return self._max_length_arg
        n = getattr(self.om.model.config, "max_position_embeddings", None)
        return int(n) if n else 2048

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self.om.device

    @property
    def tokenizer_name(self) -> str:
        return str(self.tok.name_or_path or self.settings["model_path"]).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tok.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template, as ``expertcast eval`` builds its chat prompts."""
        if not self.tok.chat_template:
            raise UsageError(f"model {self.settings['model']} has no chat template: drop --apply_chat_template")
        return self.tok.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tok.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(tokens, skip_special_tokens=skip_special_tokens)

    # -- generation -------------------------------------------------------------------------------------
    def _gen_settings(self, gen_kwargs: dict[str, Any]) -> tuple[tuple[str, ...], int]:
        """(stop sequences, max new tokens) of one request; sampling and unknown settings are refused."""
        extra = sorted(set(gen_kwargs) - GREEDY_KEYS)
        if extra:
            raise UsageError(f"generation setting(s) {', '.join(extra)}: model {MODEL_NAME} decodes greedily and "
                             f"reads only until and max_gen_toks")
        if gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature") or 0.0) > 0.0:
            raise UsageError(f"model {MODEL_NAME} decodes greedily: do_sample=True / temperature > 0 is not supported")
        until = gen_kwargs.get("until")
        until = [until] if isinstance(until, str) else list(until or [])
        if not until:
            until = [self.tok.decode([self.eot_token_id])]
        return tuple(until), _int_arg("max_gen_toks", gen_kwargs.get("max_gen_toks", self.max_gen_toks))

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self.check_requests(requests)
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        self.check_requests(requests)
        groups: dict[tuple[str | None, tuple[str, ...], int], list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            # one task per batch: a batch's counters belong to one task (the per-task metrics)
            groups[(getattr(req, "task_name", None), *self._gen_settings(dict(req.args[1])))].append(i)
        out: list[str | None] = [None] * len(requests)
        bar = None
        if not disable_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc=f"{MODEL_NAME} generate_until ({self.settings['cache']})")
        for (task, until, max_new), idx in groups.items():
            idx = sorted(idx, key=lambda i: -len(self.tok_encode(requests[i].args[0])))  # longest first: less padding
            for b in range(0, len(idx), self.batch_size):
                batch = idx[b:b + self.batch_size]
                texts = self._generate([requests[i].args[0] for i in batch], until, max_new, batch, task)
                for i, text in zip(batch, texts, strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                if bar is not None:
                    bar.update(len(batch))
        if bar is not None:
            bar.close()
        return [t if t is not None else "" for t in out]

    def _generate(self, contexts: list[str], until: tuple[str, ...], max_new: int, ids: list[int],
                  task: str | None = None) -> list[str]:
        from expertcast.inference.runtime.eval_run import generated

        enc = self.tok(contexts, return_tensors="pt", padding=True, add_special_tokens=False)
        keep = max(self.max_length - max_new, 1)
        input_ids, mask = enc["input_ids"][:, -keep:], enc["attention_mask"][:, -keep:]  # left-padded: keep the end
        for row, m in zip(input_ids.tolist(), mask.tolist(), strict=True):
            if len(self._speed_contexts) < self._speed_samples:
                self._speed_contexts.append(([t for t, k in zip(row, m, strict=True) if k], max_new))
        from expertcast.inference.runtime.eval_run import StepClock, batch_stats, counters_now

        before = counters_now(self.om)
        with StepClock(self.om) as clock:
            res = self.om.generate(input_ids, mask, max_new_tokens=max_new, eos_token_id=self.eos,
                                   pad_token_id=self.eos[0], stop_strings=list(until), tokenizer=self.tok,
                                   seq_ids=[f"req{i}" for i in ids])
        self._batches.append({**batch_stats(self.om, before, res, res.seconds, clock), "task": task})
        texts = []
        for g in generated(res.sequences.cpu(), input_ids.shape[1], self.eos):
            text = self.tok.decode(g, skip_special_tokens=True)
            for stop in until:
                if stop:
                    text = text.split(stop, 1)[0]
            texts.append(text)
        return texts

    # -- log-likelihood (teacher-forced through the runtime's prefill) ------------------------------------
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        out: list[tuple[float, bool]] = []
        for b in range(0, len(requests), self.batch_size):
            batch = requests[b:b + self.batch_size]
            rows, conts = [], []
            for _, ctx, cont in batch:
                full = (ctx + cont)[-(self.max_length + 1):]  # the input is full[:-1]: at most max_length tokens
                rows.append(full[:-1])
                conts.append(cont[-(len(full) - 1):])  # the continuation tokens that have a position before them
            for (key, _, _), res in zip(batch, self._score(rows, conts), strict=True):
                out.append(res)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, res)
        return out

    def _score(self, rows: list[list[int]], conts: list[list[int]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation), continuation is greedy) per row: one prefill through the runtime, its
        logits kept for every position. The prefill adds no decode counts; its time is not decode time."""
        P = max(len(r) for r in rows)
        pad = self.eos[0]
        ids = torch.tensor([[pad] * (P - len(r)) + r for r in rows], dtype=torch.long)
        mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
        captured: list[torch.Tensor] = []
        hook = self.om.model.register_forward_hook(lambda _m, _a, o: captured.append(o.logits) if not captured else None)
        decode_before = self.om.stats.decode_seconds
        try:
            self.om.generate(ids, mask, max_new_tokens=1, eos_token_id=self.eos, pad_token_id=pad, logits_to_keep=0)
        finally:
            hook.remove()
        self.om.stats.decode_seconds = decode_before  # a 1-token generation has no decode step
        logp = torch.log_softmax(captured[0].float().cpu(), dim=-1)
        res = []
        for i, cont in enumerate(conts):
            n = len(cont)
            lp = logp[i, P - n:P]
            target = torch.tensor(cont, dtype=torch.long)
            res.append((float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())))
        return res

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        self.check_requests(requests)
        out = []
        for req in requests:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(req.args[0]), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(ll for ll, _ in self._loglikelihood_tokens([(None, c, t) for c, t in windows]))
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return out

    # -- cache metrics beside the harness's accuracy --------------------------------------------------------
    def cache_metrics(self) -> dict[str, Any]:
        """The decode-only metrics of every ``generate_until`` so far (``expertcast eval``'s:
        :func:`~expertcast.inference.runtime.eval_run.decode_metrics`), with the settings and the model's identity.
        ``tokens_per_s`` is the harness's own decode until the paired speed passes replace it."""
        from expertcast.inference.runtime.eval_run import decode_metrics
        from expertcast.models.backbone import model_identity

        m = decode_metrics(self._batches)
        tasks = sorted({b["task"] for b in self._batches if b["task"] is not None})
        per_task = {t: decode_metrics([b for b in self._batches if b["task"] == t]) for t in tasks}
        s = self.settings
        return {
            **m, "tokens_per_s": m["graded_tokens_per_s"], "per_task": per_task,
            "tokens_per_s_source": "the harness's generate_until requests",
            "expert_bytes": int(self.om.layout.expert_bytes),
            "accounting": "decode-only; prefill (and every loglikelihood request) uncounted",
            "settings": s, "model_identity": model_identity(s["model_path"], init_seed=s["seed"]),
            "memory": self.om.memory_report().to_dict(), "load": self.load_report,
            "expert_dtype": s["expert_dtype"], "guard": self.guard_record(),
        }

    def measure_speed(self) -> dict[str, Any] | None:
        """The paired speed measurement on the recorded contexts (see the module docstring), or None when
        it is off (``speed_samples=0``, ``baseline=none``) or no ``generate_until`` ran. The harness's
        OffloadedModel is given back to the session and a fresh one (fresh policy, empty cache) replaces it."""
        from expertcast.inference.runtime.session import (
            build_policy,
            choose_baseline,
            fit_stage_policy,
            paired_speed_passes,
        )

        if self._baseline == "none" or not self._speed_contexts:
            return None
        s = self.settings
        session = self.session
        session.give_back(self.om)
        baseline, choice = choose_baseline(self._baseline, session, who=MODEL_NAME)
        pad = self.tok.pad_token_id
        encs = []
        for b in range(0, len(self._speed_contexts), self.batch_size):
            rows = [ids for ids, _ in self._speed_contexts[b:b + self.batch_size]]
            P = max(len(r) for r in rows)
            encs.append({"input_ids": torch.tensor([[pad] * (P - len(r)) + r for r in rows], dtype=torch.long),
                         "attention_mask": torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows],
                                                        dtype=torch.long)})

        def make_policy() -> Any:
            policy = build_policy(self._policy_spec)[0]
            fit_stage_policy(policy, s["model_path"], self._allow_model_mismatch)
            return policy

        max_new = self._speed_contexts[0][1]
        speed = paired_speed_passes(session, encs, make_policy, self.budget, int(s["shape"][2]),
                                    baseline, self._speed_repeats, max_new_tokens=max_new, eos=self.eos)
        speed["baseline_choice"] = choice
        speed["speed_samples"] = len(self._speed_contexts)
        speed["max_new_tokens"] = max_new
        speed["stops"] = "EOS only (the task's stop sequences are not applied in the speed passes)"
        self.policy = make_policy()
        self.om = session.offload(self.policy, self.budget)
        return speed

    def get_model_info(self) -> dict[str, Any]:
        """Called by the harness once the evaluation is done (its results JSON's ``config``): the cache
        metrics of the harness's requests, then the paired speed measurement (% of full speed), printed as a
        table. Measured once; later calls return the same record."""
        from expertcast.inference.runtime.session import speed_line
        from expertcast.utils.io import print_table

        if self._model_info is not None:
            return self._model_info
        metrics = self.cache_metrics()
        speed = self.measure_speed()
        if speed is None:
            metrics.update(pct_full="n/a", pct_full_min="n/a", pct_full_max="n/a", speed_flag=None, baseline="none",
                           speed=None)
        else:  # one tokens/s: the paired offloaded passes', as expertcast eval reports it
            metrics.update(pct_full=None if speed["flag"] else speed["pct_full"], pct_full_measured=speed["pct_full"],
                           pct_full_min=speed["pct_full_min"], pct_full_max=speed["pct_full_max"],
                           speed_flag=speed["flag"], baseline=speed["baseline"], speed=speed,
                           tokens_per_s=speed["tokens_per_s"],
                           tokens_per_s_source="median of the paired offloaded passes")
        s = self.settings
        print_table([{"policy": s["policy"], **s["capacity"], **{k: metrics[k] for k in METRIC_COLUMNS}}],
                    title=f"expertcast cache metrics: {s['model']}, {s['cache']} ({metrics['accounting']})")
        if metrics["per_task"]:  # per task: its own batches' metrics (a batch holds one task's requests)
            cols = [k for k in METRIC_COLUMNS if k in next(iter(metrics["per_task"].values()))]
            print_table([{"task": t, **{k: m[k] for k in cols}} for t, m in metrics["per_task"].items()],
                        title="per task (generate_until batches of that task; speed: the aggregate row's)")
        if speed is not None:
            print(speed_line(speed, f"{speed['speed_samples']} contexts") + f"; tokens match: {speed['tokens_match']}")
        print(f"tokens_per_s: {metrics['tokens_per_s_source']}")
        if metrics["guard"]["note"]:
            print(f"guard: {metrics['guard']['note']}")
        self._model_info = {MODEL_NAME: metrics}
        return self._model_info
