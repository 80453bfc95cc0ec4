"""FLOPs, HBM bytes and a roofline time for three ways of computing attention.

* ``naive`` — the formula as written (chapter 1): ``S = Q Kᵀ`` is written to HBM, read back by a
  softmax that writes ``P``, which ``P V`` reads again.  Three kernels, ``N²`` traffic.
* ``flash_fwd`` — FlashAttention-2's forward (chapters 3–4): one program per ``BLOCK_M`` query rows
  keeps ``Q_m``, ``m_i``, ``l_i`` and ``acc`` on chip and streams ``BLOCK_N``-key tiles of K and V.
  Tiles that the mask hides completely are skipped (``fa_lab.core.masks.block_key_range``).
* ``flash_bwd`` — FlashAttention-2's backward (chapter 5): one program per ``BLOCK_N`` keys streams
  the query tiles that see them, recomputes ``P`` from ``lse``, accumulates ``dK, dV`` on chip and
  adds into an FP32 ``dQ`` in HBM (atomics); a pre-pass computes ``delta = rowsum(dO ∘ O)``.

Three FLOP counts, labelled everywhere:

* ``flops`` — the book's convention (DESIGN.md, ``fa_lab.core.flops``): ``2·Nq·Nk·(D + Dv)`` per head
  (``4·Nq·Nk·D`` when ``Dv = D``), halved for causal when ``Nq = Nk``, ×2.5 for the backward.
  A sliding window does *not* reduce it.  Every TFLOP/s in the book uses this one.
* ``flops_visible`` — the exact matmul FLOPs of the (query, key) pairs the mask lets through.
* ``flops_executed`` — what the Tensor Cores actually do: every computed tile is a full
  ``BLOCK_M × BLOCK_N`` MMA, including masked entries on the diagonal and padding at the edges.
  The time prediction uses this one.

Bytes are HBM (DRAM) bytes.  ``hbm_bytes`` assumes no cache: every tile a program loads comes
from DRAM.  ``compulsory_bytes`` reads every input once and writes every output once (what a
perfect cache would leave).  Which one DRAM really sees depends on whether the K/V tiles that
concurrent programs share still sit in L2 — ``fa_lab.perf.roofline.predict`` estimates that from
the L2 size, and turns the counts into a time.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from fa_lab.core.flops import attention_flops
from fa_lab.perf.devices import DTYPE_BYTES, canonical_dtype

#: the package's mask vocabulary (``fa_lab.core.registry.ALL_MASKS``)
MASKS = ("none", "causal", "window")
#: older words for the same masks, still accepted (recordings made before the vocabulary was one)
MASK_ALIASES = {"full": "none", "sliding_window": "window"}
ALGORITHMS = ("naive", "flash_fwd", "flash_bwd")
LSE_BYTES = 4        # lse / delta are float32
DQ_ACCUM_BYTES = 4   # the backward's dQ accumulator is float32


@dataclass(frozen=True)
class Problem:
    """One attention call, as the model sees it.

    ``mask='window'`` takes ``window=(left, right)`` (query ``i`` sees keys
    ``[i + Nk - Nq - left, i + Nk - Nq + right]``, bottom-right aligned as in DESIGN.md); an int
    ``W`` means ``(W, 0)``: the query itself and the ``W`` keys before it.
    """

    batch: int
    heads: int
    n_q: int
    n_k: int | None = None
    head_dim: int = 128
    head_dim_v: int | None = None
    kv_heads: int | None = None
    mask: str = "none"
    window: tuple | int | None = None
    dtype: str = "fp16"

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if self.n_k is None:
            set_("n_k", self.n_q)
        if self.head_dim_v is None:
            set_("head_dim_v", self.head_dim)
        if self.kv_heads is None:
            set_("kv_heads", self.heads)
        set_("dtype", canonical_dtype(self.dtype))
        set_("mask", MASK_ALIASES.get(self.mask, self.mask))
        for name in ("batch", "heads", "n_q", "n_k", "head_dim", "head_dim_v", "kv_heads"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}")
        if self.mask == "window":
            w = self.window
            if w is None:
                raise ValueError("mask='window' needs window=W or window=(left, right)")
            w = (int(w), 0) if isinstance(w, (int, np.integer)) else tuple(int(x) for x in w)
            if len(w) != 2 or min(w) < -1:
                raise ValueError(f"window must be W >= 0 or (left, right) with -1 for unbounded, got {self.window!r}")
            set_("window", w)
        elif self.window is not None:
            raise ValueError(f"window is only for mask='window' (mask is {self.mask!r})")

    @property
    def left_right(self) -> tuple[int, int]:
        """The mask as the (left, right) window of ``fa_lab.core.masks`` (-1 = unbounded)."""
        return {"none": (-1, -1), "causal": (-1, 0)}.get(self.mask, self.window)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bh(self) -> int:
        return self.batch * self.heads


# ------------------------------------------------------------------------------------------
# Counting the mask: rows, pairs, tiles
# ------------------------------------------------------------------------------------------
def key_ranges(n_q: int, n_k: int, left: int, right: int) -> tuple[np.ndarray, np.ndarray]:
    """``lo, hi`` per query row: row ``i`` sees keys ``[lo[i], hi[i])``.

    ``fa_lab.core.masks.key_range``, vectorised.
    """
    diag = np.arange(n_q, dtype=np.int64) + (n_k - n_q)
    lo = np.zeros(n_q, np.int64) if left < 0 else np.maximum(0, diag - left)
    hi = np.full(n_q, n_k, np.int64) if right < 0 else np.minimum(n_k, diag + right + 1)
    return lo, np.maximum(lo, hi)


def visible_pairs(n_q: int, n_k: int, left: int, right: int) -> int:
    """How many (query, key) pairs the mask lets through."""
    lo, hi = key_ranges(n_q, n_k, left, right)
    return int((hi - lo).sum())


@dataclass(frozen=True)
class Tiles:
    """The tiles a FlashAttention program loop visits, for one (batch, head).

    ``outer`` blocks of ``block_outer`` rows (queries in the forward, keys in the backward); for
    each, the inner tiles ``[first, first + count)`` of ``block_inner`` columns it computes.
    """

    block_outer: int
    block_inner: int
    rows: np.ndarray       # rows actually in each outer block (the last may be partial)
    count: np.ndarray      # inner tiles computed per outer block
    cols_read: np.ndarray  # inner columns loaded per outer block (tiles clipped at the edge)

    @property
    def programs(self) -> int:
        return len(self.rows)

    @property
    def tiles(self) -> int:
        return int(self.count.sum())

    @property
    def executed_pairs(self) -> int:
        """Score entries computed, padding and masked entries included: ``block_outer × block_inner`` per tile."""
        return self.tiles * self.block_outer * self.block_inner


def tiles(n_outer: int, n_inner: int, left: int, right: int, block_outer: int, block_inner: int) -> Tiles:
    """Tiles visited when each program owns ``block_outer`` consecutive outer rows.

    Row ``i`` sees inner columns ``key_ranges(n_outer, n_inner, left, right)``; ranges are monotone
    in ``i``, so a block needs the columns from its first row's ``lo`` to its last row's ``hi``
    (``fa_lab.core.masks.block_key_range``), in whole tiles aligned to ``block_inner``.
    """
    if block_outer < 1 or block_inner < 1:
        raise ValueError(f"block sizes must be >= 1, got {block_outer}, {block_inner}")
    lo, hi = key_ranges(n_outer, n_inner, left, right)
    starts = np.arange(0, n_outer, block_outer)
    ends = np.minimum(starts + block_outer, n_outer)
    b_lo, b_hi = lo[starts], hi[ends - 1]
    # a block whose rows all see nothing: lo of the first row can exceed hi of the last
    empty = b_hi <= b_lo
    first = b_lo // block_inner
    last = -(-b_hi // block_inner)                     # ceil
    count = np.where(empty, 0, last - first)
    cols_read = np.where(empty, 0, np.minimum(last * block_inner, n_inner) - first * block_inner)
    return Tiles(block_outer, block_inner, ends - starts, count, cols_read)


# ------------------------------------------------------------------------------------------
# Counts
# ------------------------------------------------------------------------------------------
@dataclass
class Phase:
    """One kernel (or one pass) of an algorithm: its work and its DRAM traffic, all (batch, heads)."""

    name: str
    flops: float            # executed matmul FLOPs
    exps: float             # exponentials (special-function unit)
    hbm_bytes: float        # no cache: every load from DRAM
    compulsory_bytes: float  # each input once, each output once
    l2_working_set: float = 0.0   # bytes the programs of one head share (its K/V), for the L2 estimate
    programs: int = 0             # CTAs launched
    programs_per_head: int = 1    # CTAs that share one head's working set
    tiles: int = 0                # tiles computed (for the per-program overhead of `predict`)


@dataclass
class Counts:
    """Everything the model counts for one algorithm on one problem."""

    algorithm: str
    problem: Problem
    flops: float                 # the book's convention (fa_lab.core.flops)
    flops_visible: float         # exact: pairs the mask lets through
    flops_executed: float        # what the hardware computes (tiles incl. masked/padded entries)
    exps: float
    hbm_bytes: float
    compulsory_bytes: float
    bytes_breakdown: dict
    phases: list = field(default_factory=list)
    blocks: dict = field(default_factory=dict)
    visible_pairs: int = 0
    tiles: int = 0
    programs: int = 0

    @property
    def intensity(self) -> float:
        """Executed FLOPs per HBM byte with no cache (the algorithm's own arithmetic intensity)."""
        return self.flops_executed / self.hbm_bytes

    @property
    def intensity_compulsory(self) -> float:
        """Executed FLOPs per compulsory byte (the best any cache could make it)."""
        return self.flops_executed / self.compulsory_bytes

    def as_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("problem", "phases")}
        d["problem"] = asdict(self.problem)
        d["phases"] = [asdict(p) for p in self.phases]
        d["intensity"] = self.intensity
        d["intensity_compulsory"] = self.intensity_compulsory
        return d


def _convention_flops(p: Problem, mode: str) -> float:
    """``fa_lab.core.flops.attention_flops`` with Dv allowed to differ: 2·Nq·Nk·(D + Dv) per head."""
    f = attention_flops(p.batch, p.heads, p.n_q, p.n_k, p.head_dim, causal=p.mask == "causal", mode=mode)
    return f * (p.head_dim + p.head_dim_v) / (2 * p.head_dim)


def _needed_keys(p: Problem) -> int:
    """Keys some query sees (K/V rows that must be read at least once)."""
    lo, hi = key_ranges(p.n_q, p.n_k, *p.left_right)
    seen = hi > lo
    return int(hi[seen].max() - lo[seen].min()) if seen.any() else 0


def _compulsory_fwd(p: Problem, s: int) -> dict:
    return dict(q=s * p.bh * p.n_q * p.head_dim,
                kv=s * p.batch * p.kv_heads * _needed_keys(p) * (p.head_dim + p.head_dim_v),
                o=s * p.bh * p.n_q * p.head_dim_v)


def naive_counts(p: Problem, *, score_bytes: int | None = None) -> Counts:
    """Standard attention: S and P go through HBM (four N² passes: write S, read S, write P, read P).

    ``score_bytes`` is the element size of S and P (default the input dtype's, as in the
    FlashAttention paper's Algorithm 0; chapter 1's ``naive_torch`` keeps scores in fp32: 4).
    Masked entries are computed and then overwritten, so executed FLOPs are the full ``Nq × Nk``.
    K and V are read once per *query* head (no sharing across a GQA group).
    """
    s = p.itemsize
    ss = s if score_bytes is None else int(score_bytes)
    D, Dv, NN = p.head_dim, p.head_dim_v, p.n_q * p.n_k
    qk = Phase("S = Q Kᵀ", 2 * p.bh * NN * D, 0,
               s * p.bh * (p.n_q + p.n_k) * D + ss * p.bh * NN, 0, programs=p.bh)
    sm = Phase("P = softmax(S)", 0, p.bh * NN, 2 * ss * p.bh * NN, 0, programs=p.bh)
    pv = Phase("O = P V", 2 * p.bh * NN * Dv, 0,
               ss * p.bh * NN + s * p.bh * (p.n_k + p.n_q) * Dv, 0, programs=p.bh)
    for ph in (qk, sm, pv):      # S and P are the algorithm's own traffic: no cache removes them
        ph.compulsory_bytes = ph.hbm_bytes
    breakdown = dict(q=s * p.bh * p.n_q * D, k=s * p.bh * p.n_k * D, v=s * p.bh * p.n_k * Dv,
                     o=s * p.bh * p.n_q * Dv, s_write=ss * p.bh * NN, s_read=ss * p.bh * NN,
                     p_write=ss * p.bh * NN, p_read=ss * p.bh * NN)
    total = sum(breakdown.values())
    return Counts("naive", p, _convention_flops(p, "fwd"),
                  2 * (D + Dv) * p.bh * visible_pairs(p.n_q, p.n_k, *p.left_right),
                  qk.flops + pv.flops, sm.exps, total, total, breakdown, [qk, sm, pv],
                  dict(score_bytes=ss), visible_pairs(p.n_q, p.n_k, *p.left_right), 0, 3 * p.bh)


def flash_forward_counts(p: Problem, *, block_m: int = 128, block_n: int = 64, skip_masked: bool = True,
                         mask_bytes: int = 0) -> Counts:
    """FlashAttention-2 forward: Q_m read once, K/V tiles streamed per query block, O and lse written once.

    ``skip_masked=False`` is a kernel that does not know the mask's shape — it computes every tile
    and masks elementwise — such as SDPA given an explicit ``attn_mask`` tensor, whose
    ``mask_bytes`` per (query, key) it also reads.
    """
    s, D, Dv = p.itemsize, p.head_dim, p.head_dim_v
    left, right = p.left_right
    t = tiles(p.n_q, p.n_k, left, right, block_m, block_n) if skip_masked else \
        tiles(p.n_q, p.n_k, -1, -1, block_m, block_n)
    pairs = visible_pairs(p.n_q, p.n_k, left, right)
    breakdown = dict(q=s * p.bh * p.n_q * D,
                     k=s * p.bh * int(t.cols_read.sum()) * D,
                     v=s * p.bh * int(t.cols_read.sum()) * Dv,
                     o=s * p.bh * p.n_q * Dv,
                     lse=LSE_BYTES * p.bh * p.n_q)
    comp = sum(_compulsory_fwd(p, s).values()) + breakdown["lse"]
    if mask_bytes:
        breakdown["mask"] = mask_bytes * p.bh * p.n_q * p.n_k
        comp += mask_bytes * p.n_q * p.n_k                 # one (Nq, Nk) mask, broadcast over batch and heads
    total = sum(breakdown.values())
    executed = 2 * (D + Dv) * p.bh * t.executed_pairs
    # concurrent programs of one head share its K/V: that is what L2 can catch
    kv_head = s * _needed_keys(p) * (D + Dv)
    phase = Phase("flash forward", executed, p.bh * t.executed_pairs, total, comp,
                  l2_working_set=kv_head, programs=p.bh * t.programs, programs_per_head=t.programs,
                  tiles=p.bh * t.tiles)
    return Counts("flash_fwd", p, _convention_flops(p, "fwd"), 2 * (D + Dv) * p.bh * pairs, executed,
                  phase.exps, total, comp, breakdown, [phase],
                  dict(block_m=block_m, block_n=block_n, skip_masked=skip_masked, mask_bytes=mask_bytes),
                  pairs, p.bh * t.tiles, phase.programs)


def flash_backward_counts(p: Problem, *, block_m: int = 64, block_n: int = 128) -> Counts:
    """FlashAttention-2 backward: delta pre-pass, a KV-block-outer main loop, dQ converted from FP32.

    Per computed tile: recompute ``S = Q Kᵀ`` and ``P = exp(S - lse)`` (2·D per pair),
    ``dV += Pᵀ dO`` (2·Dv), ``dP = dO Vᵀ`` (2·Dv), ``dK += dSᵀ Q`` (2·D), ``dQ += dS K`` (2·D):
    ``2·(3D + 2Dv)`` FLOPs per pair — 2.5× the forward when ``Dv = D``.  Each key block loads its
    K, V once and writes dK, dV once; per query tile it loads Q, dO, lse, delta and adds into dQ
    (FP32 read + write).  GQA's reduction of dK/dV over the group is not modelled.
    """
    s, D, Dv = p.itemsize, p.head_dim, p.head_dim_v
    left, right = p.left_right
    # the key-block view of the same mask: key j is seen by queries i with the roles swapped
    t = tiles(p.n_k, p.n_q, right, left, block_n, block_m)
    pairs = visible_pairs(p.n_q, p.n_k, left, right)
    q_rows = int(t.cols_read.sum())          # query rows loaded, summed over key blocks
    keys = p.n_k
    pre = dict(o=s * p.bh * p.n_q * Dv, do=s * p.bh * p.n_q * Dv, delta_write=LSE_BYTES * p.bh * p.n_q)
    main = dict(k=s * p.bh * keys * D, v=s * p.bh * keys * Dv,
                dk=s * p.bh * keys * D, dv=s * p.bh * keys * Dv,
                q=s * p.bh * q_rows * D, do_main=s * p.bh * q_rows * Dv,
                lse=LSE_BYTES * p.bh * q_rows, delta=LSE_BYTES * p.bh * q_rows,
                dq_accum=2 * DQ_ACCUM_BYTES * p.bh * q_rows * D)
    post = dict(dq_zero=DQ_ACCUM_BYTES * p.bh * p.n_q * D, dq_read=DQ_ACCUM_BYTES * p.bh * p.n_q * D,
                dq_write=s * p.bh * p.n_q * D)
    executed = 2 * (3 * D + 2 * Dv) * p.bh * t.executed_pairs
    comp_main = (s * p.bh * p.n_q * (D + Dv) + LSE_BYTES * 2 * p.bh * p.n_q      # q, do, lse, delta
                 + 2 * s * p.bh * keys * (D + Dv)                                 # k, v in; dk, dv out
                 + 2 * DQ_ACCUM_BYTES * p.bh * p.n_q * D)                         # dq accumulator
    phases = [Phase("delta = rowsum(dO∘O)", 0, 0, sum(pre.values()), sum(pre.values()), programs=p.bh),
              Phase("flash backward", executed, p.bh * t.executed_pairs, sum(main.values()), comp_main,
                    l2_working_set=(s * (D + Dv) + LSE_BYTES * 2 + DQ_ACCUM_BYTES * 2 * D) * p.n_q,
                    programs=p.bh * t.programs, programs_per_head=t.programs, tiles=p.bh * t.tiles),
              Phase("dQ fp32 → dtype", 0, 0, sum(post.values()), sum(post.values()), programs=p.bh)]
    breakdown = {**pre, **main, **post}
    return Counts("flash_bwd", p, _convention_flops(p, "bwd"), 2 * (3 * D + 2 * Dv) * p.bh * pairs, executed,
                  phases[1].exps, sum(breakdown.values()), sum(ph.compulsory_bytes for ph in phases), breakdown,
                  phases, dict(block_m=block_m, block_n=block_n), pairs, p.bh * t.tiles, phases[1].programs)


def count(algorithm: str, problem: Problem, **blocks) -> Counts:
    """``naive``, ``flash_fwd`` or ``flash_bwd`` counts; ``blocks`` are block_m/block_n (or score_bytes)."""
    fns = {"naive": naive_counts, "flash_fwd": flash_forward_counts, "flash_bwd": flash_backward_counts}
    if algorithm not in fns:
        raise ValueError(f"algorithm must be one of {list(fns)}, got {algorithm!r}")
    return fns[algorithm](problem, **{k: v for k, v in blocks.items() if v is not None})


__all__ = ["Problem", "Counts", "Phase", "Tiles", "MASKS", "MASK_ALIASES", "ALGORITHMS", "count", "naive_counts",
           "flash_forward_counts", "flash_backward_counts", "visible_pairs", "key_ranges", "tiles"]
