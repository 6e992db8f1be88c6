"""Compiled (numba) fast paths of the simulator: classic policies and oracles over a flattened stream,
the demand-only ceiling of ``belady_fraction`` (:func:`ceiling_kernel`) and the stream builder.

The generic Python engine (:mod:`expertcast.inference.sim.simulator`) drives any
:class:`~expertcast.inference.cache.policy.Policy` through its hooks; the kernels here replay the same
stream for the demand-only classic policies and the oracles and return the same counts (the tests
compare both engines access by access). Both engines follow one set of rules:

* stream: ``experts`` int [A] lists each layer-execution's selection (the union over a batch, in first
  appearance order); ``exec_ptr`` int64 [X+1] delimits layer-execution ``x = step * L + layer``;
* protect rule: at a layer-execution the resident selected experts are hits and are touched first (in
  selection order); then the misses are inserted in selection order, each taking an Empty slot of its
  pool or evicting the minimum-key resident of the pool that is not in the selection; when every slot
  holds a selected expert (a batch union larger than the pool) the miss is served from a temporary
  slot (a demand transfer, not retained);
* one access clock, incremented once per accessed expert in that order (hits then misses), is the
  "time" of LRU, FIFO, LFU ties and LRFU;
* eviction keys (smallest evicted first), all unique so the victim never depends on heap order:
  LRU (last access, 0), FIFO (insertion time, 0), LFU (count, last access), LRFU
  (log2 CRF + lambda * last, last), Belady (-next use, id), Belady-k (-inf, last access) while the next
  use lies beyond the horizon, else (-next use, id).

Per pool, a lazy binary min-heap of (key1, key2, id, version) entries finds the victim in O(log n);
stale entries (older version, or no longer resident) are skipped and the heap is rebuilt from the
pool's slots when it fills.
"""

from __future__ import annotations

import numpy as np
from numba import njit

KIND_LRU = 0
KIND_FIFO = 1
KIND_LFU = 2
KIND_LRFU = 3
KIND_BELADY = 4
"""Belady under the protect rule; with a finite horizon it is Belady-k."""
KIND_BELADY_SEQ = 5
"""Sequential Belady: requests one by one, no protection (libcachesim's Belady on the flat stream)."""

NEVER = np.int64(1) << np.int64(62)
"""Next-use value of an access that is never repeated."""


@njit(cache=True, inline="always")
def _less(a1, a2, b1, b2):
    return a1 < b1 or (a1 == b1 and a2 < b2)


@njit(cache=True)
def _push(hk1, hk2, hid, hver, hsize, p, k1, k2, item, ver):
    i = hsize[p]
    hsize[p] = i + 1
    while i > 0:
        parent = (i - 1) >> 1
        if _less(k1, k2, hk1[p, parent], hk2[p, parent]):
            hk1[p, i] = hk1[p, parent]
            hk2[p, i] = hk2[p, parent]
            hid[p, i] = hid[p, parent]
            hver[p, i] = hver[p, parent]
            i = parent
        else:
            break
    hk1[p, i] = k1
    hk2[p, i] = k2
    hid[p, i] = item
    hver[p, i] = ver


@njit(cache=True)
def _pop(hk1, hk2, hid, hver, hsize, p):
    """Remove the top entry of heap ``p``; return (id, version)."""
    top_id = hid[p, 0]
    top_ver = hver[p, 0]
    n = hsize[p] - 1
    hsize[p] = n
    if n > 0:
        k1 = hk1[p, n]
        k2 = hk2[p, n]
        it = hid[p, n]
        vr = hver[p, n]
        i = 0
        while True:
            c = 2 * i + 1
            if c >= n:
                break
            if c + 1 < n and _less(hk1[p, c + 1], hk2[p, c + 1], hk1[p, c], hk2[p, c]):
                c += 1
            if _less(hk1[p, c], hk2[p, c], k1, k2):
                hk1[p, i] = hk1[p, c]
                hk2[p, i] = hk2[p, c]
                hid[p, i] = hid[p, c]
                hver[p, i] = hver[p, c]
                i = c
            else:
                break
        hk1[p, i] = k1
        hk2[p, i] = k2
        hid[p, i] = it
        hver[p, i] = vr
    return top_id, top_ver


@njit(cache=True)
def lrfu_log_crf(log_crf_old, last_old, now, lam, has_history):
    """log2 of LRFU's combined recency-frequency after an access at ``now``.

    CRF(now) = 1 + CRF(last) * 2^(-lam * (now - last)) with F(x) = (1/2)^(lam x) (Lee et al., 2001);
    kept in the log2 domain so that long replays never underflow. ``lam`` = 0 counts accesses (LFU),
    ``lam`` = 1 makes the last access dominate (LRU). Shared by both engines so their keys are bitwise
    equal.
    """
    if not has_history:
        return 0.0
    x = log_crf_old - lam * (now - last_old)
    # log2(1 + 2^x), stable for large |x|
    if x > 50.0:
        return x + np.log2(1.0 + np.exp2(-x))
    return np.log2(1.0 + np.exp2(x))


@njit(cache=True)
def replay_kernel(experts, exec_ptr, step_counted, num_layers, num_experts, pool_of_layer, pool_cap,
                  kind, lam, horizon, perfect_history, next_use,
                  out_acc, out_hit, out_miss, out_temp, out_resident, out_evict, out_step_miss):
    """Replay the stream with one classic policy or oracle; fill per-layer counters.

    Args:
        experts: int [A] selected experts, layer-execution after layer-execution.
        exec_ptr: int64 [X+1] (X = steps * L) start of each layer-execution in ``experts``.
        step_counted: bool [X // L] steps whose accesses are counted (decode); others only warm the cache.
        pool_of_layer: int32 [L] pool index of each layer; pool_cap: int32 [P] slots per pool.
        kind: KIND_*; lam: LRFU lambda; horizon: Belady-k look-ahead in layer-executions
            (k * L; a negative value means the full future); perfect_history: LFU/LRFU keep counts of
            evicted experts.
        next_use: int64 [A] next layer-execution accessing the same (layer, expert) (NEVER if none);
            for KIND_BELADY_SEQ the next *access index* instead.
        out_acc, out_hit, out_miss, out_temp: int64 [L] counted accesses, hits, demand misses (incl.
            temporary-slot loads), temporary-slot loads.
        out_resident: int8 [L*E] final residency (1 = resident).
        out_evict: int64 [L] counted evictions (on the layer of the miss that took the slot).
        out_step_miss: int64 [X // L] demand misses of each step (counted or not).
    """
    L = num_layers
    E = num_experts
    n_items = L * E
    P = pool_cap.shape[0]
    cap_max = 0
    for p in range(P):
        if pool_cap[p] > cap_max:
            cap_max = pool_cap[p]
    H = 2 * cap_max + 16
    hk1 = np.empty((P, H), np.float64)
    hk2 = np.empty((P, H), np.float64)
    hid = np.empty((P, H), np.int32)
    hver = np.empty((P, H), np.int32)
    hsize = np.zeros(P, np.int64)
    slot_item = np.full((P, cap_max), -1, np.int32)
    occ = np.zeros(P, np.int64)

    res = np.zeros(n_items, np.int8)
    slot = np.full(n_items, -1, np.int64)
    k1 = np.zeros(n_items, np.float64)
    k2 = np.zeros(n_items, np.float64)
    ver = np.zeros(n_items, np.int32)
    last = np.zeros(n_items, np.float64)
    count = np.zeros(n_items, np.float64)
    logc = np.zeros(n_items, np.float64)
    hist = np.zeros(n_items, np.int8)
    nxt = np.full(n_items, NEVER, np.int64)
    stamp = np.full(n_items, -1, np.int64)
    stash = np.empty(E, np.int64)

    X = exec_ptr.shape[0] - 1
    clock = 0.0
    neg_inf = -np.inf
    sequential = kind == KIND_BELADY_SEQ
    is_belady = kind == KIND_BELADY or sequential

    for x in range(X):
        layer = x % L
        p = pool_of_layer[layer]
        counted = step_counted[x // L]
        a0 = exec_ptr[x]
        a1 = exec_ptr[x + 1]
        base = layer * E
        # Belady-k: experts whose next use enters the horizon now become visible.
        if kind == KIND_BELADY and horizon >= 0:
            y = x + horizon
            if y < X:
                for a in range(exec_ptr[y], exec_ptr[y + 1]):
                    it = base + experts[a]
                    if res[it] == 1 and nxt[it] == y:
                        k1[it] = -float(y)
                        k2[it] = float(it)
                        ver[it] += 1
                        if hsize[p] >= H:
                            _rebuild(hk1, hk2, hid, hver, hsize, p, slot_item, occ, k1, k2, ver)
                        _push(hk1, hk2, hid, hver, hsize, p, k1[it], k2[it], it, ver[it])
        if not sequential:
            for a in range(a0, a1):
                stamp[base + experts[a]] = x
        for phase in range(2):
            for a in range(a0, a1):
                it = base + experts[a]
                resident = res[it] == 1
                if not sequential:
                    # phase 0: hits, phase 1: misses
                    if phase == 0 and not resident:
                        continue
                    if phase == 1 and resident:
                        continue
                elif phase == 1:
                    break
                clock += 1.0
                if counted:
                    out_acc[layer] += 1
                if resident:
                    if counted:
                        out_hit[layer] += 1
                    if kind == KIND_FIFO:
                        continue
                else:
                    if counted:
                        out_miss[layer] += 1
                    out_step_miss[x // L] += 1
                    if occ[p] < pool_cap[p]:
                        s = occ[p]
                        occ[p] = s + 1
                    else:
                        victim = -1
                        ns = 0
                        while hsize[p] > 0:
                            v, vv = _pop(hk1, hk2, hid, hver, hsize, p)
                            if res[v] == 0 or vv != ver[v]:
                                continue
                            if stamp[v] == x:
                                stash[ns] = v
                                ns += 1
                                continue
                            victim = v
                            break
                        for i in range(ns):
                            v = stash[i]
                            _push(hk1, hk2, hid, hver, hsize, p, k1[v], k2[v], v, ver[v])
                        if victim < 0:
                            # every slot holds a selected expert: temporary slot, not retained
                            if counted:
                                out_temp[layer] += 1
                            if (kind == KIND_LFU or kind == KIND_LRFU) and perfect_history:
                                _touch_history(kind, it, clock, lam, count, logc, last, hist)
                            continue
                        s = slot[victim]
                        if counted:
                            out_evict[layer] += 1
                        res[victim] = 0
                        slot[victim] = -1
                        if not perfect_history:
                            count[victim] = 0.0
                            logc[victim] = 0.0
                            hist[victim] = 0
                    slot_item[p, s] = it
                    slot[it] = s
                    res[it] = 1
                # update the key of `it` (resident now)
                if kind == KIND_LRU or kind == KIND_FIFO:
                    k1[it] = clock
                    k2[it] = 0.0
                elif kind == KIND_LFU or kind == KIND_LRFU:
                    _touch_history(kind, it, clock, lam, count, logc, last, hist)
                    if kind == KIND_LFU:
                        k1[it] = count[it]
                    else:
                        k1[it] = logc[it] + lam * clock
                    k2[it] = clock
                else:  # Belady family
                    n = next_use[a]
                    nxt[it] = n
                    last[it] = clock
                    if is_belady and (horizon < 0 or n <= x + horizon):
                        k1[it] = -float(n)
                        k2[it] = float(it)
                    else:
                        k1[it] = neg_inf
                        k2[it] = clock
                ver[it] += 1
                if hsize[p] >= H:
                    _rebuild(hk1, hk2, hid, hver, hsize, p, slot_item, occ, k1, k2, ver)
                _push(hk1, hk2, hid, hver, hsize, p, k1[it], k2[it], it, ver[it])
    for i in range(n_items):
        out_resident[i] = res[i]


@njit(cache=True)
def _touch_history(kind, it, clock, lam, count, logc, last, hist):
    if kind == KIND_LFU:
        count[it] += 1.0
    else:
        logc[it] = lrfu_log_crf(logc[it], last[it], clock, lam, hist[it] == 1)
    last[it] = clock
    hist[it] = 1


@njit(cache=True)
def _rebuild(hk1, hk2, hid, hver, hsize, p, slot_item, occ, k1, k2, ver):
    hsize[p] = 0
    for s in range(occ[p]):
        it = slot_item[p, s]
        if it >= 0:
            _push(hk1, hk2, hid, hver, hsize, p, k1[it], k2[it], it, ver[it])


@njit(cache=True)
def next_use_kernel(experts, exec_ptr, num_layers, num_experts, by_access):
    """int64 [A]: for each access, the next layer-execution (or access index when ``by_access``) that
    selects the same (layer, expert), NEVER when there is none. One backward pass."""
    A = experts.shape[0]
    out = np.empty(A, np.int64)
    seen = np.full(num_layers * num_experts, NEVER, np.int64)
    X = exec_ptr.shape[0] - 1
    for x in range(X - 1, -1, -1):
        base = (x % num_layers) * num_experts
        for a in range(exec_ptr[x + 1] - 1, exec_ptr[x] - 1, -1):
            it = base + experts[a]
            out[a] = seen[it]
            seen[it] = a if by_access else x
    return out


@njit(cache=True)
def build_batch_stream(flat_ids, seq_off, step_seq, step_pos, L, K, E):
    """Flatten scheduled steps into the access stream.

    The schedule (which member processes which position at each step) comes from
    :func:`expertcast.inference.cache.schedule.stream_schedule`, the one definition of the lockstep batch
    schedule; this kernel only gathers the routing.

    Args:
        flat_ids: int16 [sum T * L * K] all sequences' expert ids, concatenated.
        seq_off: int64 [N] offset of each sequence in ``flat_ids``.
        step_seq: int64 [S, Bmax] sequence index of each member slot at each step (-1 = idle).
        step_pos: int64 [S, Bmax] position that member processes.

    Each layer-execution accesses the union of the active members' top-K in first-appearance order
    (members in batch order, each in router order), with the number of tokens routed to each expert.

    Returns (experts int16 [A], counts int32 [A], exec_ptr int64 [S*L+1], step_tokens int32 [S]).
    """
    n_steps = step_seq.shape[0]
    bmax = step_seq.shape[1]
    cap = 0
    for st in range(n_steps):
        for i in range(bmax):
            if step_seq[st, i] >= 0:
                cap += L * K
    experts = np.empty(cap, np.int16)
    counts = np.empty(cap, np.int32)
    exec_ptr = np.zeros(n_steps * L + 1, np.int64)
    step_tokens = np.zeros(n_steps, np.int32)
    where = np.full(E, -1, np.int64)
    a = 0
    for st in range(n_steps):
        for i in range(bmax):
            if step_seq[st, i] >= 0:
                step_tokens[st] += 1
        for layer in range(L):
            start = a
            for i in range(bmax):
                s = step_seq[st, i]
                if s < 0:
                    continue
                off = seq_off[s] + (step_pos[st, i] * L + layer) * K
                for k in range(K):
                    e = flat_ids[off + k]
                    w = where[e]
                    if w >= start:
                        counts[w] += 1
                    else:
                        where[e] = a
                        experts[a] = e
                        counts[a] = 1
                        a += 1
            exec_ptr[st * L + layer + 1] = a
    return experts[:a].copy(), counts[:a].copy(), exec_ptr, step_tokens


@njit(cache=True)
def ceiling_kernel(experts, exec_ptr, step_counted, num_layers, num_experts, pool_of_layer, pool_cap, next_use,
                   out_acc, out_hit):
    """Hits of the offline optimum of every demand-only policy on the counted steps (the ceiling of
    ``belady_fraction``).

    A demand-only policy (no proactive loads, every miss a transfer) starts each counted segment (the
    decode steps after uncounted prefill steps, or the start of the stream) from a cache it shaped
    for free (warm start, uncounted prefill loads), and after a layer-execution keeps a subset of what
    it held plus what was just selected (a miss is inserted or, from a temporary slot, not). The
    relaxation computed here allows every such choice, so its hits bound every demand-only policy:

    * at the start of each counted segment each pool is refilled for free with the experts whose
      first use in the segment comes soonest;
    * after each counted layer-execution, each pool keeps the ``cap`` experts with the nearest next use
      among its residents and the selection (furthest-next-use eviction, bypass allowed; the
      protect rule is relaxed too).

    Keeping the nearest next uses is optimal for this relaxation (Belady's exchange argument; experts
    next used at the same layer-execution are interchangeable). Uncounted steps are skipped.

    Args:
        experts, exec_ptr, step_counted, pool_of_layer, pool_cap: as :func:`replay_kernel`.
        next_use: int64 [A] next layer-execution selecting the same (layer, expert), NEVER if none.
        out_acc, out_hit: int64 [L] counted accesses and hits (misses = accesses - hits).
    """
    L = num_layers
    E = num_experts
    n_items = L * E
    P = pool_cap.shape[0]
    cap_max = 0
    for p in range(P):
        if pool_cap[p] > cap_max:
            cap_max = pool_cap[p]
    H = 2 * cap_max + 16
    hk1 = np.empty((P, H), np.float64)
    hk2 = np.empty((P, H), np.float64)
    hid = np.empty((P, H), np.int32)
    hver = np.empty((P, H), np.int32)
    hsize = np.zeros(P, np.int64)
    slot_item = np.full((P, cap_max), -1, np.int32)
    occ = np.zeros(P, np.int64)
    res = np.zeros(n_items, np.int8)
    slot = np.full(n_items, -1, np.int64)
    k1 = np.zeros(n_items, np.float64)
    k2 = np.arange(n_items).astype(np.float64)  # ties: the lower id is evicted first
    ver = np.zeros(n_items, np.int32)
    hit_at = np.full(n_items, -1, np.int64)
    X = exec_ptr.shape[0] - 1
    for x in range(X):
        st = x // L
        layer = x % L
        if not step_counted[st]:
            continue
        if layer == 0 and (st == 0 or not step_counted[st - 1]):
            # a counted segment starts: every pool refilled for free, soonest first use first
            for it in range(n_items):
                if res[it] == 1:
                    res[it] = 0
                    slot[it] = -1
                    ver[it] += 1
            for p in range(P):
                occ[p] = 0
                hsize[p] = 0
                for s in range(cap_max):
                    slot_item[p, s] = -1
            full = 0
            for p in range(P):
                if pool_cap[p] == 0:
                    full += 1
            y = x
            while y < X and step_counted[y // L] and full < P:
                base_y = (y % L) * E
                py = pool_of_layer[y % L]
                for a in range(exec_ptr[y], exec_ptr[y + 1]):
                    it = base_y + experts[a]
                    if res[it] == 1 or occ[py] >= pool_cap[py]:
                        continue
                    s = occ[py]
                    occ[py] = s + 1
                    if occ[py] == pool_cap[py]:
                        full += 1
                    _ceiling_place(it, s, py, float(y), res, slot, slot_item, k1, k2, ver,
                                   hk1, hk2, hid, hver, hsize, H, occ)
                y += 1
        p = pool_of_layer[layer]
        base = layer * E
        a0 = exec_ptr[x]
        a1 = exec_ptr[x + 1]
        for a in range(a0, a1):  # hits first (their keys move on to their next use)
            it = base + experts[a]
            out_acc[layer] += 1
            if res[it] == 1:
                out_hit[layer] += 1
                hit_at[it] = x
                k1[it] = -float(next_use[a])
                ver[it] += 1
                if hsize[p] >= H:
                    _rebuild(hk1, hk2, hid, hver, hsize, p, slot_item, occ, k1, k2, ver)
                _push(hk1, hk2, hid, hver, hsize, p, k1[it], k2[it], it, ver[it])
        for a in range(a0, a1):  # then the misses: kept when needed sooner than the pool's furthest
            it = base + experts[a]
            if hit_at[it] == x:
                continue
            nxt = float(next_use[a])
            if occ[p] < pool_cap[p]:
                s = occ[p]
                occ[p] = s + 1
                _ceiling_place(it, s, p, nxt, res, slot, slot_item, k1, k2, ver, hk1, hk2, hid, hver, hsize, H, occ)
                continue
            victim = -1
            while hsize[p] > 0:
                v, vv = _pop(hk1, hk2, hid, hver, hsize, p)
                if res[v] == 1 and vv == ver[v]:
                    victim = v
                    break
            if victim >= 0 and -k1[victim] > nxt:  # the victim is needed later than the newcomer: swap
                s = slot[victim]
                res[victim] = 0
                slot[victim] = -1
                ver[victim] += 1
                _ceiling_place(it, s, p, nxt, res, slot, slot_item, k1, k2, ver, hk1, hk2, hid, hver, hsize, H, occ)
            elif victim >= 0:  # bypass: the newcomer is served from a temporary slot
                _push(hk1, hk2, hid, hver, hsize, p, k1[victim], k2[victim], victim, ver[victim])


@njit(cache=True)
def _ceiling_place(it, s, p, nxt, res, slot, slot_item, k1, k2, ver, hk1, hk2, hid, hver, hsize, H, occ):
    """Put ``it`` into slot ``s`` of pool ``p`` with next use ``nxt``."""
    slot_item[p, s] = it
    slot[it] = s
    res[it] = 1
    k1[it] = -nxt
    ver[it] += 1
    if hsize[p] >= H:
        _rebuild(hk1, hk2, hid, hver, hsize, p, slot_item, occ, k1, k2, ver)
    _push(hk1, hk2, hid, hver, hsize, p, k1[it], k2[it], it, ver[it])
