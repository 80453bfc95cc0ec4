"""Memory traffic of a Numba CUDA kernel in the simulator, thread by thread (as GPU-Puzzles shows it).

``MemoryCounter`` watches simulated launches: every scalar a thread reads from (or writes to) a
kernel argument is a global-memory access, and every element it reads or writes in a
``cuda.shared.array`` a shared-memory access, each counted for the (block, thread) that made it.

``KVLoads`` is the structure check of chapter 3's kernel exercises: the K and V elements a kernel
loads from global memory, against what a tiled kernel needs —

- ``skip=False``  each K/V tile once per query block (BLOCK_M rows share one load), not once per row;
- ``skip=True``   and only the tiles some row of the block can see under the causal mask.

Its message shows the counts per thread of the busiest block and, for the skip, the tiles each
query block loaded against the tiles it needs.  ``memory_report`` prints the same tables for a
learner's function on an exercise's case, passing or not.  Only in the CPU world (the simulator);
on a GPU nothing is counted and the check does not apply.
"""
from __future__ import annotations

import sys
import threading

import numpy as np

from fa_lab.exercises.structure import StructureCheck

#: the inputs of a kernel exercise ``fn(q, k, v, causal)``, by position
QKV = {0: "Q", 1: "K", 2: "V"}


class _Thread:
    """What one simulated CUDA thread read and wrote."""

    __slots__ = ("block", "thread", "grid", "block_dim", "glob_r", "glob_w", "shared_r", "shared_w")

    def __init__(self, t):
        self.block, self.thread = tuple(t.blockIdx), tuple(t.threadIdx)
        self.grid = tuple(getattr(t._manager, "_grid_dim", ()))
        self.block_dim = tuple(getattr(t._manager, "_block_dim", ()))
        self.glob_r: dict = {}     # id(root array) -> scalar loads
        self.glob_w: dict = {}
        self.shared_r = 0
        self.shared_w = 0


def _root(arr):
    """The device array behind a simulated kernel argument (views lead back to it)."""
    root = arr._item._ary
    while getattr(root, "base", None) is not None and hasattr(root.base, "shape"):
        root = root.base
    return root


class MemoryCounter:
    """Count global and shared-memory accesses per simulated thread while active (a context manager)."""

    def __init__(self):
        self.records: list[_Thread] = []
        self.roots: dict = {}       # id -> root array (kept alive, matched to the inputs afterwards)
        self._restore = []

    # --------------------------------------------------------------- recording
    def _me(self) -> _Thread | None:
        t = threading.current_thread()
        if not hasattr(t, "blockIdx"):        # not a simulated CUDA thread (host code indexing an array)
            return None
        mine = getattr(t, "_fa_lab_memory", None)
        if mine is None or mine[0] is not self:
            rec = _Thread(t)
            t._fa_lab_memory = (self, rec)
            self.records.append(rec)          # list.append is atomic: threads register without a lock
            return rec
        return mine[1]

    def start(self) -> "MemoryCounter":
        from numba.cuda.simulator import kernelapi
        from numba.cuda.simulator.cudadrv.devicearray import FakeWithinKernelCUDAArray

        counter = self
        cls = FakeWithinKernelCUDAArray
        get, put = cls.__getitem__, cls.__setitem__

        def counting_get(arr, idx):
            out = get(arr, idx)
            if not isinstance(out, cls):      # a scalar is a load; taking a view loads nothing
                rec = counter._me()
                if rec is not None:
                    root = _root(arr)
                    key = id(root)
                    counter.roots.setdefault(key, root)
                    rec.glob_r[key] = rec.glob_r.get(key, 0) + 1   # only this thread writes its record
            return out

        def counting_put(arr, idx, val):
            put(arr, idx, val)
            rec = counter._me()
            if rec is not None:
                root = _root(arr)
                key = id(root)
                counter.roots.setdefault(key, root)
                rec.glob_w[key] = rec.glob_w.get(key, 0) + 1

        module = kernelapi.FakeCUDAModule
        shared_prop = module.__dict__["shared"]

        def shared(mod):
            wrapper = mod.__dict__.get("_fa_lab_shared")
            if wrapper is None:
                wrapper = mod.__dict__.setdefault("_fa_lab_shared", _CountingShared(mod._shared, counter))
            return wrapper

        cls.__getitem__, cls.__setitem__ = counting_get, counting_put
        module.shared = property(shared)
        self._restore = [(cls, "__getitem__", get), (cls, "__setitem__", put), (module, "shared", shared_prop)]
        return self

    def stop(self) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # --------------------------------------------------------------- reading the counts
    def match(self, host: np.ndarray) -> set:
        """The ids of the device arrays that hold ``host``'s values (copies made by the launch, any dtype)."""
        flat = np.asarray(host, dtype=np.float64).ravel()
        found = set()
        for key, root in self.roots.items():
            if root.size == flat.size and np.array_equal(np.asarray(root, dtype=np.float64).ravel(), flat,
                                                         equal_nan=True):
                found.add(key)
        return found

    def per_thread(self, names: dict) -> dict:
        """``{(block, thread): {"Q": loads, ..., "global writes": n, "shared reads": n, "shared writes": n}}``.

        ``names`` maps a name to the set of device-array ids that are that input (``match``).
        """
        out: dict = {}
        for rec in self.records:
            row = out.setdefault((rec.block, rec.thread), dict.fromkeys([*names, "other global reads",
                                                                         "global writes", "shared reads",
                                                                         "shared writes"], 0))
            for key, n in rec.glob_r.items():
                name = next((nm for nm, ids in names.items() if key in ids), "other global reads")
                row[name] += n
            row["global writes"] += sum(rec.glob_w.values())
            row["shared reads"] += rec.shared_r
            row["shared writes"] += rec.shared_w
        return out

    def launch_shape(self):
        """``(grid, block)`` of the first launch seen (empty tuples if no thread touched memory)."""
        return (self.records[0].grid, self.records[0].block_dim) if self.records else ((), ())


class _CountingShared:
    """``cuda.shared`` for one launch: the simulator's arrays, seen through a view that counts accesses."""

    def __init__(self, shared, counter: MemoryCounter):
        self._shared, self._counter = shared, counter

    def array(self, shape, dtype, *args, **kwargs):
        if shape == 0 or args or kwargs:      # dynamic shared memory, alignment: the simulator's own
            arr = self._shared.array(shape, dtype, *args, **kwargs)
        else:
            # One array per source line, as the simulator keys them; setdefault is one atomic step, so
            # two threads of a block can never end up holding two different "shared" arrays.
            from numba.core import types
            from numba.np import numpy_support

            np_dtype = numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else np.dtype(dtype)
            caller = sys._getframe(1)
            line = (caller.f_code.co_filename, caller.f_lineno)
            arr = self._shared._allocations.setdefault(line, np.empty(shape, np_dtype))
        view = arr.view(_SharedView)
        view._counter = self._counter
        return view


class _SharedView(np.ndarray):
    """A shared-memory array that counts the elements each simulated thread reads and writes."""

    _counter: MemoryCounter | None = None

    def __array_finalize__(self, obj):
        self._counter = getattr(obj, "_counter", None)

    def __getitem__(self, idx):
        out = super().__getitem__(idx)
        counter = self._counter
        if counter is not None and not isinstance(out, np.ndarray):
            rec = counter._me()
            if rec is not None:
                rec.shared_r += 1
        return out

    def __setitem__(self, idx, val):
        super().__setitem__(idx, val)
        counter = self._counter
        if counter is not None:
            rec = counter._me()
            if rec is not None:
                rec.shared_w += 1


# --------------------------------------------------------------------------- the budget of a tiled kernel

def tiles_needed(n_q: int, n_k: int, causal: bool, block_m: int, block_n: int, skip: bool) -> list[int]:
    """Key tiles each query block must load: all of them, or (``skip``) those some row of the block sees."""
    n_tiles = -(-n_k // block_n)
    out = []
    for m_start in range(0, n_q, block_m):
        if not (skip and causal):
            out.append(n_tiles)
            continue
        last_row = min(m_start + block_m, n_q) - 1
        stop = min(n_k, last_row + n_k - n_q + 1)          # bottom-right: row i sees keys j <= i + n_k - n_q
        out.append(-(-stop // block_n) if stop > 0 else 0)
    return out


def _rows(x: int, block_m: int, n_q: int) -> str:
    lo, hi = x * block_m, min(n_q, (x + 1) * block_m) - 1
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def thread_table(counts: dict, block: tuple, *, block_m: int, n_q: int) -> str:
    """The per-thread counts of one block as a text table."""
    rows = sorted((th, c) for (b, th), c in counts.items() if b == block)
    if not rows:
        return ""
    names = [n for n in next(iter(counts.values())) if n != "other global reads"
             or any(c[n] for _, c in rows)]
    head = ["thread", "query row"] + names
    body = []
    for th, c in rows:
        row = block[0] * block_m + th[0]
        body.append([str(th[0]), f"{row}" + (" (past Nq)" if row >= n_q else "")] + [str(c[n]) for n in names])
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in body]
    return "\n".join("    " + line for line in lines)


def report(counter: MemoryCounter, q, k, v, case_meta: dict, *, skip: bool) -> tuple[str, dict]:
    """(the tables in words, the numbers): loads of Q/K/V per element, per block and per thread."""
    ids = {name: counter.match(t.detach().cpu().numpy()) for name, t in (("Q", q), ("K", k), ("V", v))}
    counts = counter.per_thread(ids)
    heads, n_q, d = q.shape
    n_k = k.shape[1]
    bm, bn, causal = case_meta["block_m"], case_meta["block_n"], bool(case_meta.get("causal"))
    loads = {name: sum(c[name] for c in counts.values()) for name in ids}
    per_block_k: dict = {}
    for (b, _), c in counts.items():
        per_block_k[b] = per_block_k.get(b, 0) + c["K"]
    need = tiles_needed(n_q, n_k, causal, bm, bn, skip)
    allowed = heads * sum(need) * bn * d               # whole tiles: a padded tail tile may be loaded in full
    grid, block_dim = counter.launch_shape()
    numbers = dict(loads=loads, allowed=allowed, numel={"Q": q.numel(), "K": k.numel(), "V": v.numel()},
                   grid=grid, block_dim=block_dim, need=need, per_block_k=per_block_k, counts=counts)
    lines = []
    if grid:
        lines.append(f"  your launch: grid={grid[:2] if len(grid) > 2 and grid[2] == 1 else grid}, "
                     f"block={block_dim[0] if len(block_dim) > 2 and block_dim[1:] == (1, 1) else block_dim} thread(s)")
    lines.append("  global loads per element: " + ", ".join(
        f"{name} {loads[name] / max(numbers['numel'][name], 1):.3g}×" for name in ("Q", "K", "V")))
    if per_block_k:
        busiest = max(per_block_k, key=lambda b: (per_block_k[b], -b[1], -b[0]))
        lines.append(f"  reads and writes per thread in block {busiest[:2]} (blockIdx.x, blockIdx.y), the one that "
                     "loaded the most of K:")
        lines.append(thread_table(counts, busiest, block_m=bm, n_q=n_q))
    if skip and causal:
        lines.append("  K tiles loaded by each query block of head 0 (K elements loaded / (BLOCK_N·D)), and the "
                     "tiles its rows can see:")
        lines.append("    block  query rows  loaded  needed")
        for x, needed in enumerate(need):
            got = per_block_k.get((x, 0, 0), 0) / (bn * d)
            flag = "   <- more than needed" if got > needed + 1e-9 else ""
            lines.append(f"    {x:>5}  {_rows(x, bm, n_q):>10}  {got:>6.3g}  {needed:>6}{flag}")
    return "\n".join(lines), numbers


class KVLoads(StructureCheck):
    """K and V loaded from global memory once per query block (and, with ``skip``, only visible tiles).

    Needs ``case.meta``: ``block_m``, ``block_n``, ``causal``; the case's first three arguments are
    q ``(H, Nq, D)``, k and v ``(Hkv, Nk, D)``.  Applies in the CPU world to cases with
    ``meta['structure']``.
    """

    def __init__(self, skip: bool = False):
        self.skip = skip
        self.label = ("K/V loads: only the key tiles the block's rows can see (simulator)" if skip
                      else "K/V loads: each tile once per query block, not once per row (simulator)")

    def applies(self, case) -> bool:
        from fa_lab.core.world import ON_GPU

        return not ON_GPU and super().applies(case)

    def start(self, case, args, kwargs):
        self.case = case
        self.q, self.k, self.v = (args[i].detach().clone() for i in range(3))
        self.counter = MemoryCounter().start()

    def finish(self):
        counter = getattr(self, "counter", None)
        if counter is not None:
            counter.stop()

    def verdict(self):
        self.finish()
        meta = self.case.meta
        text, n = report(self.counter, self.q, self.k, self.v, meta, skip=self.skip)
        bm, bn = meta["block_m"], meta["block_n"]
        if n["allowed"] > 0 and (n["loads"]["K"] == 0 or n["loads"]["V"] == 0):
            return ("could not see your kernel read K and V: pass k and v to the kernel as they are (their "
                    "NumPy arrays, or cuda.as_cuda_array), not a padded, transposed or reshaped copy.\n" + text)
        over = {name: n["loads"][name] for name in ("K", "V") if n["loads"][name] > n["allowed"]}
        if not over:
            return None
        numel = n["numel"]["K"]
        heads, kv_heads = self.q.shape[0], self.k.shape[0]
        share = f", and {heads // kv_heads} query heads share each K/V head" if heads > kv_heads else ""
        said = ", ".join(f"{name} {loads / numel:.3g}×" for name, loads in over.items())
        if self.skip:
            tiles = sum(n["need"])
            full = len(n["need"]) * -(-self.k.shape[1] // bn)
            why = (f"too many K/V loads from global memory ({said} per element; the key tiles some row of each "
                   f"block can see allow {n['allowed'] / numel:.3g}×: {tiles} of the {full} (block, tile) pairs "
                   f"per head{share}). Under the causal mask a block's last row sees the furthest; the tiles past "
                   "it are masked for every row of the block: stop the tile loop there, the same stop for every "
                   "thread of the block.")
        else:
            blocks = len(n["need"])
            why = (f"K and V are loaded from global memory too often ({said} per element; once per query block "
                   f"is {n['allowed'] / numel:.3g}×: {blocks} block(s) of BLOCK_M={bm} rows per head{share}, with "
                   f"the tail tile of BLOCK_N={bn} counted whole). The threads of a block should copy each K/V "
                   "tile into cuda.shared.array together (a few elements each), cuda.syncthreads(), and then all "
                   "read it from there — not each fetch the keys for its own row from global memory.")
        return why + "\n" + text


def memory_report(name: str, fn, *, case: int | None = None) -> str:
    """What ``fn`` loads, per thread and per block, on exercise ``name``'s first structure case (the simulator).

    Never raises: an error in ``fn`` is reported in the text.
    """
    from fa_lab.core.world import ON_GPU
    from fa_lab.exercises.guard import call_with_timeout, describe_exception
    from fa_lab.exercises.judge import prepare_args
    from fa_lab.exercises.registry import get

    if ON_GPU:
        return "memory counts are taken in the Numba CUDA simulator: run this in the CPU world"
    ex = get(name)
    check = next((c for c in ex.structure if isinstance(c, KVLoads)), None)
    cases = [c for c in ex.make_cases(0) if c.meta.get("structure")]
    if check is None or not cases:
        return f"{name}: no memory counts for this exercise"
    chosen = cases[case if case is not None else 0]
    args, kwargs = prepare_args(ex, chosen)
    counter = MemoryCounter()
    try:
        with counter:
            call_with_timeout(fn, args, kwargs, 60.0)
    except Exception as exc:  # noqa: BLE001 — the learner's code failed: say so, never raise into the notebook
        return f"{chosen.label}: {describe_exception(exc)}"
    text, _ = report(counter, *args[:3], chosen.meta, skip=check.skip)
    return f"{chosen.label}\n{text}"


__all__ = ["MemoryCounter", "KVLoads", "memory_report", "report", "thread_table", "tiles_needed"]
