"""Tuning the Triton kernels' launch configurations on the real inputs.

Forward (chapter 4): ``choose_config`` picks what a call runs with — small fixed tiles in the
CPU world; on a GPU the cached winner of the problem's key, or, on a miss, what
``FA_LAB_TRITON_AUTOTUNE`` asks for (``autotune_mode``): by default a quick choice among the winners
of the nearest tuned keys (a few seconds, kept in ``CACHE``), the full search (tens of seconds; what
``fa-lab tune`` runs ahead of time), or no timing at all.  Backward (chapter 5): ``tune_backward``
times the dK/dV and dQ kernels alone for each candidate tile (``scripts/bench_ch5.py --sections tune``).
"""
from __future__ import annotations

import functools
import math
import os
import sys
import time
from typing import NamedTuple

import torch
import triton

from fa_lab.core.world import ON_GPU
from fa_lab.kernels.triton import bwd, configs
from fa_lab.kernels.triton.config_cache import CACHE
from fa_lab.kernels.triton.configs import CPU_CONFIG, FIXED_CONFIG, Variant
from fa_lab.kernels.triton.policy import device_facts, device_index, tuner_extras, ws_fits_problem

#: (key, config, median ms) of every candidate the tuner timed in this process
TUNING_LOG: list[dict] = []


class ResolvedKey(NamedTuple):
    """What a call's configuration depends on: ``choose_config`` resolves each once per process."""

    device_index: int
    dtype: torch.dtype
    head_dim: int
    q_bucket: int
    k_bucket: int
    mask: str
    space: str
    ws_fits: bool


#: ResolvedKey -> config resolved in this process: the per-call fast path
_RESOLVED: dict[ResolvedKey, dict] = {}


def resolved_configs() -> list[tuple[ResolvedKey, dict]]:
    """The configurations the forward resolved in this process, oldest first (for benchmark records)."""
    return list(_RESOLVED.items())


#: FA_LAB_TRITON_AUTOTUNE value -> what a cache miss does
AUTOTUNE_MODES = {"": "quick", "quick": "quick", "1": "full", "true": "full", "yes": "full", "full": "full",
                  "0": "off", "false": "off", "no": "off", "off": "off"}
#: a quick choice times at most this many winners of nearby keys (plus the default)
QUICK_NEIGHBOURS = 3


def autotune_mode() -> str:
    """What a call does on a cache miss, from ``FA_LAB_TRITON_AUTOTUNE``.

    ``quick`` (unset): time the winners of the nearest tuned keys and the default, a few seconds.
    ``full`` (1): time the whole candidate space, tens of seconds.  ``off`` (0): time nothing;
    the nearest tuned key's winner runs, or the default.
    """
    value = os.environ.get("FA_LAB_TRITON_AUTOTUNE", "").strip().lower()
    if value not in AUTOTUNE_MODES:
        raise ValueError(f"FA_LAB_TRITON_AUTOTUNE={value!r}: expected quick (the default), 1/full or 0/off")
    return AUTOTUNE_MODES[value]


def _key_fields(key: str):
    """(dtype, head dim, log2 of the query and key buckets, mask, space) of a config key."""
    dtype, d, q, k, mask, space = key.split("|")
    return dtype, d, math.log2(int(q[1:])), math.log2(int(k[1:])), mask, space


def neighbour_configs(device: str, key: str, limit: int = QUICK_NEIGHBOURS,
                      capability: tuple[int, int] | None = None) -> list[dict]:
    """The winners of the cached keys nearest ``key``, nearest first, each configuration once.

    Near means the same head dim, mask and variant space, and length buckets a few powers of two
    away (the other 16-bit type counts as half a power: fp16 and bf16 tiles behave alike).  The
    keys are those ``CACHE.tables(device, capability)`` holds.
    """
    dtype, d, q, k, mask, space = _key_fields(key)
    ranked = []
    for table in CACHE.tables(device, capability):
        for other in table:
            o_dtype, o_d, o_q, o_k, o_mask, o_space = _key_fields(other)
            if (o_d, o_mask, o_space) != (d, mask, space) or other == key:
                continue
            if o_dtype != dtype and "float32" in (dtype, o_dtype):
                continue
            ranked.append((abs(q - o_q) + abs(k - o_k) + 0.5 * (o_dtype != dtype), other))
    out = []
    for _, other in sorted(ranked):
        cfg = CACHE.get(device, other, capability)
        if cfg not in out:
            out.append(cfg)
    return out[:limit]


def _say(message: str) -> None:
    # a miss is rare and costs seconds: say so where a user looks, not through a logger they never set up
    print(f"fa_lab: {message}", file=sys.stderr, flush=True)


def precompile(launches) -> None:
    """Compile ``launch(warmup=True)`` for every launch side by side (most of a compile is ptxas,
    a separate process).

    Through Triton's ``AsyncCompileMode``: the launches (argument binding, cache keys) stay
    on this thread and only the compile jobs go to the pool.  Calling ``warmup`` from several
    threads at once is not something Triton's JIT supports.
    """
    from concurrent.futures import ThreadPoolExecutor

    if not hasattr(triton, "AsyncCompileMode"):  # older Triton: compile one by one when timed
        return
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool, \
            triton.AsyncCompileMode(pool, ignore_errors=True):
        for launch in launches:
            try:
                launch(warmup=True)
            except Exception:  # reported when the candidate is timed
                pass


def tune(launch, candidates: list[dict], key: str, *, refine: tuple = ()) -> dict:
    """Time every candidate on the real inputs and keep the fastest.

    Candidates that fail to compile (out of shared memory or registers) are skipped.  Each
    dict in ``refine`` is tried on top of the three fastest (e.g. ``{"paired": True}``).
    The three best are then timed again, longer, and the fastest of that run wins.
    """
    from fa_lab.bench.timer import time_fn, time_interleaved

    timed = []

    def time_all(cfgs):
        precompile([functools.partial(launch, cfg) for cfg in cfgs])
        for cfg in cfgs:
            try:
                launch(cfg)
                ms = time_fn(lambda: launch(cfg), gpu_ms=(5, 25))["ms"]
            except Exception as exc:
                TUNING_LOG.append(dict(key=key, **cfg, ms=None, error=f"{type(exc).__name__}: {str(exc)[:160]}"))
                continue
            TUNING_LOG.append(dict(key=key, **cfg, ms=ms))
            timed.append((ms, cfg))

    time_all(candidates)
    for extra in refine:
        # not on top of a warp-specialized config: Triton's pass fails on those combinations
        time_all([dict(cfg, **extra) for _, cfg in sorted(timed, key=lambda t: t[0])[:3] if not cfg.get("ws")])
    if not timed:
        raise RuntimeError(f"no launch configuration compiled for {key}")
    # The top three again, in interleaved rounds: a 25 ms sample of one candidate can be off
    # by 5%, and under sustained load the clock drifts down, which would favour whichever
    # finalist happened to be timed first.  The median of each one's rounds decides.
    finalists = [cfg for _, cfg in sorted(timed, key=lambda t: t[0])[:3]]
    rounds = time_interleaved({i: functools.partial(launch, cfg) for i, cfg in enumerate(finalists)},
                              rounds=6, gpu_ms=(5, 40))
    ms, best = min(((rounds[i]["ms"], cfg) for i, cfg in enumerate(finalists)), key=lambda t: t[0])
    TUNING_LOG.append(dict(key=key, **best, ms=ms, final=True))
    return dict(best, ms=ms)


def choose_config(launch, spec, work: torch.dtype, variant: Variant, precision: str = "ieee", *,
                  candidates: list[dict] | None = None, retune: bool = False) -> dict:
    """CPU world: small fixed tiles.  GPU: the cached winner for this key, else tune (or a default)."""
    if not ON_GPU:
        return CPU_CONFIG
    if variant.space == "fixed":
        return FIXED_CONFIG
    space = variant.space + ("-tf32" if work == torch.float32 and precision == "tf32" else "")
    index = device_index(spec)
    device, capability = device_facts(index)
    ws_fits = ws_fits_problem(spec, work, capability[0])
    memo = ResolvedKey(index, work, spec.head_dim, configs.length_bucket(spec.n_q), configs.length_bucket(spec.n_k),
                       spec.mask, space, ws_fits)
    cfg = None if retune else _RESOLVED.get(memo)
    if cfg is not None:
        return cfg
    key = configs.config_key(spec, work, space)
    mode = "full" if retune else autotune_mode()
    # a GPU without tuned entries of its own takes those of its architecture's GPUs (config_cache)
    cfg = None if retune else CACHE.get(device, key, capability)
    if cfg is not None and mode == "full" and CACHE.search(device, key, capability) == "quick":
        cfg = None   # the full search was asked for: a quick choice made earlier does not stand in for it
    if cfg is None:
        d_pad = configs.head_dim_pad(spec.head_dim)
        default = configs.default_config(variant.space, d_pad, spec.n_q, spec.mask)
        # exact fp32 products run on the CUDA cores, not the Tensor Cores this chapter tunes for
        # (and their compiles are slow): they get the default unless asked to retune
        tensor_cores = work != torch.float32 or precision == "tf32"
        if not (tensor_cores or retune):
            cfg = default
        elif mode == "full":
            cands = list(candidates or configs.candidate_configs(variant.space, d_pad, work.itemsize, spec.n_q))
            refine = ()
            if candidates is None and variant.space == "pipelined":
                extra, refine = tuner_extras(spec, work, capability[0])
                cands += extra
            started = time.perf_counter()
            _say(f"tuning the Triton forward for {key}: the full search, {len(cands)} configurations ...")
            cfg = tune(launch, cands, key, refine=refine)
            CACHE.put(device, key, cfg)
            _say(f"{key} tuned in {time.perf_counter() - started:.1f} s")
        else:
            # the winners of the nearest tuned keys: one of them is usually the winner here too,
            # and timing a handful costs seconds where the full search costs tens of seconds
            near = [c for c in neighbour_configs(device, key, capability=capability) if ws_fits or not c.get("ws")]
            if mode == "off" or not near:
                cfg = near[0] if near else default
            else:
                cands = near + ([default] if default not in near else [])
                started = time.perf_counter()
                _say(f"{key} is not tuned yet: timing {len(cands)} configurations, the winners of the nearest "
                     "tuned keys and the default (`fa-lab tune` runs the full search ahead of time) ...")
                cfg = dict(tune(launch, cands, key), search="quick")
                CACHE.put(device, key, cfg)
                _say(f"{key}: chosen in {time.perf_counter() - started:.1f} s")
    if cfg.get("ws") and not ws_fits:
        # a winner tuned on another problem of the same key (same length buckets) that this one
        # cannot run warp-specialized: the untuned default instead of a compile error
        cfg = configs.default_config(variant.space, configs.head_dim_pad(spec.head_dim), spec.n_q, spec.mask)
    _RESOLVED[memo] = cfg
    return cfg


# ---------------------------------------------------------------------------------------------
# The backward's tiles (chapter 5)

#: tile candidates per padded head dim: (BLOCK_M, BLOCK_N, warps, stages), spill-free for sm_90 (Triton 3.6);
#: a fifth entry, true, is a warp-specialized dK/dV tile (``bwd_ws``: 4 warps that Triton splits into a
#: producer and two consumer warpgroups; at 8 warps it does not split)
BWD_TUNE_CANDIDATES = {
    64: {"dkdv": [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 8, 3), (64, 64, 4, 2),
                  (16, 128, 4, 3), (32, 64, 4, 3)],
         "dq": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3),
                (64, 64, 8, 3), (128, 32, 4, 3)]},
    128: {"dkdv": [(64, 128, 8, 2), (32, 128, 8, 2), (32, 128, 8, 3), (64, 64, 8, 2), (32, 64, 4, 2),
                   (64, 64, 8, 3), (64, 128, 4, 2, True), (64, 128, 4, 3, True), (32, 128, 4, 2, True)],
          "dq": [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (128, 32, 8, 3), (64, 64, 8, 2),
                 (64, 64, 4, 2), (64, 32, 4, 3)]},
    256: {"dkdv": [(64, 64, 8, 2), (64, 64, 8, 2, True), (64, 32, 4, 2, True), (32, 64, 8, 3), (32, 64, 8, 2),
                   (64, 64, 8, 1), (128, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 1)],
          "dq": [(128, 32, 8, 3), (128, 64, 8, 1), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 1), (64, 32, 8, 2)]},
}


def tune_backward(q, k, v, o, lse, do, spec, candidates: dict | None = None, *, rep: int = 50) -> list[dict]:
    """Time the dK/dV and dQ kernels alone for every candidate tile; one record per (kernel, tile).

    ``o, lse`` come from any forward (an independent one keeps the two passes' tuning apart);
    ``candidates`` is ``{"dkdv": [...], "dq": [...]}`` of ``(BLOCK_M, BLOCK_N, warps, stages)``,
    by default ``BWD_TUNE_CANDIDATES`` of the padded head dim (or the tiles in use, for other head
    dims).  A record holds ``kernel``, ``config``, ``status`` and, when it ran, ``ms``.
    """
    from fa_lab.bench.timer import time_fn

    dq, dkdv, _ = bwd.make_launcher(q.detach(), k.detach(), v.detach(), o, lse, do, spec)
    dq(bwd.configs(spec, q.dtype)[1])   # the dQ pass writes D and the base-2 lse that the dK/dV pass reads
    cands = candidates or BWD_TUNE_CANDIDATES.get(bwd.block_d(spec.head_dim))
    if cands is None:  # a head dim without a search list: time the tiles it runs with now
        dkdv_tile, dq_tile = bwd.configs(spec, q.dtype)
        cands = {"dkdv": [dkdv_tile], "dq": [dq_tile]}
    jobs = [(dkdv, "dkdv", tuple(c)) for c in cands["dkdv"]] + [(dq, "dq", tuple(c)) for c in cands["dq"]]
    precompile([functools.partial(launch, cfg) for launch, _, cfg in jobs])
    records = []
    for launch, kernel, cfg in jobs:
        rec = dict(kernel=kernel, config=list(cfg))
        try:
            launch(cfg)
            rec["ms"] = time_fn(lambda: launch(cfg), gpu_ms=(10, rep))["ms"]
            rec["status"] = "ok"
        except Exception as exc:
            rec["status"] = f"error: {type(exc).__name__}: {str(exc)[:160]}"
        records.append(rec)
    return records


def _fastest_tiles(records, warp_specialized: bool) -> dict[tuple[int, str], tuple[float, tuple]]:
    """``{(head_dim, kernel): (summed ms, tile)}``: the least time summed over the tuned rows, among
    the tiles of one kind that ran on the most rows."""
    import collections

    totals = collections.defaultdict(float)
    counts = collections.Counter()
    for r in records:
        if r.get("status") == "ok" and (len(r["config"]) > 4 and bool(r["config"][4])) == warp_specialized:
            key = (r["head_dim"], r["kernel"], tuple(r["config"]))
            totals[key] += r["ms"]
            counts[key] += 1
    fastest = {}
    for d, kernel in {key[:2] for key in totals}:
        ran = {key[2]: t for key, t in totals.items() if key[:2] == (d, kernel)}
        most = max(counts[(d, kernel, tile)] for tile in ran)
        fastest[(d, kernel)] = min((t, tile) for tile, t in ran.items() if counts[(d, kernel, tile)] == most)
    return fastest


def best_backward_tiles(records, *, warp_specialized: bool = False) -> dict[int, tuple[tuple, tuple]]:
    """``{head_dim: (dkdv tile, dq tile)}``: per head dim and kernel, the tile with the least time
    summed over the tuned rows, among the tiles that ran on all of them; the plain tiles, or with
    ``warp_specialized`` the warp-specialized ones (a fifth entry, true).

    Records need ``head_dim``, ``kernel``, ``config``, ``status`` and ``ms`` (``tune_backward``'s
    records with the row's head dim added).
    """
    fastest = _fastest_tiles(records, warp_specialized)
    return {d: (fastest[(d, "dkdv")][1], fastest[(d, "dq")][1])
            for d in sorted({d for d, _ in fastest}) if (d, "dkdv") in fastest and (d, "dq") in fastest}


def backward_tables(records) -> dict[int, tuple[tuple, tuple]]:
    """``{head_dim: (plain tiles, split tiles)}`` for ``bwd.GPU_CONFIGS`` and ``bwd.WS_CONFIGS``: the
    fastest plain ``(dkdv, dq)`` pair, and per kernel the fastest warp-specialized tile where its summed
    time beat the plain tile's over the same rows (None elsewhere)."""
    plain, split = _fastest_tiles(records, False), _fastest_tiles(records, True)
    tables = {}
    for d, tiles in best_backward_tiles(records).items():
        ws = tuple(split[(d, kernel)][1] if (d, kernel) in split and split[(d, kernel)][0] < plain[(d, kernel)][0]
                   else None for kernel in ("dkdv", "dq"))
        tables[d] = (tiles, ws)
    return tables
