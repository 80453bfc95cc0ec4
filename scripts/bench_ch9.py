"""Record chapter 9 on a GPU: one-query decoding over a KV cache, ours against PyTorch SDPA.

    python scripts/bench_ch9.py [--out DIR] [--quick] [--sections decode,splits] [--dtypes float16,bfloat16]

Ours is ``fa_lab.kernels.decode.decode_forward`` (registered as ``triton_decode``) on a cache laid
out as flash-attn lays it, ``(B, Nk, Hkv, D)``, contiguous or paged (16- and 256-token pages at the
first shape, scattered over the pool at random, and 16-token pages in the order a block allocator
hands them out: ``PAGES``, ``placement`` in the records).  The peers are SDPA's flash and cuDNN
backends (``torch.nn.attention.sdpa_kernel``) on views of the same cache, with ``enable_gqa=True``;
a backend that refuses GQA gets K and V expanded to every query head beforehand (``gqa`` says which,
and its bytes read count the expansion); one that refuses the input is recorded as ``unsupported``.

For each problem, in one run and on the same inputs:

* ``gpu_us``: GPU time of one call from a CUDA graph of many calls (``triton.testing.do_bench_cudagraph``),
  the candidates interleaved in balanced orders (``fa_lab.bench.timer.balanced_orders``), the median
  of the rounds;
* ``bandwidth``: bytes of K and V read per second; ``copy`` is a device-to-device copy of a buffer of
  the same size timed the same way (its bandwidth counts the bytes read and written);
* ``host_us_per_call``: wall clock per eager call of many calls with one synchronisation at the end,
  measured separately (``fa_lab.bench.timer.back_to_back_ms``);
* ``splits``: the split count ours chose; ``pool_order``: whether it read the pages in pool order
  (``fa_lab.kernels.decode.pool_order``).  Where it did, ``triton_decode_key_order`` is ours made to read
  them in key order (``config=dict(POOL_ORDER=False)``), timed in the same rounds.

The ``loop`` section times ours while the sequences grow, one key per call, on scattered 16-token pages
(``decoding_loop``), in pool order and in key order.  The ``splits`` section times ours at fixed split
counts (``num_splits=``) beside the heuristic's.
Writes gpu_ch9.json (fa_lab.bench.records format) into DIR (default fa_lab/data).  ``--quick`` runs
fp16 only, with fewer rounds; ``--smoke`` runs tiny problems in any world (checks the script,
writes to DIR or a temporary folder).
"""
import argparse
import itertools
import math
import sys
import tempfile
import time

import fa_lab  # noqa: F401  (first: picks the world)
import torch  # noqa: E402

from fa_lab.bench import records as recorded  # noqa: E402
from fa_lab.bench.timer import back_to_back_ms, time_fn, time_interleaved  # noqa: E402
from fa_lab.core.world import ON_GPU  # noqa: E402
from fa_lab.kernels.decode import decode_forward  # noqa: E402
from fa_lab.kernels.decode.forward import decode_plan  # noqa: E402

#: (batch, heads, kv_heads, n_q, n_k, head_dim): the chapter's problems, and one long sequence (split-KV's case)
ROWS = [(8, 32, 8, 1, 8192, 128), (64, 32, 8, 1, 2048, 128), (1, 32, 8, 1, 65536, 128)]
#: the paged caches, at ROWS[0]: (page size, where the pages lie in the pool, ``PLACEMENTS``)
PAGES = ((16, "scattered"), (256, "scattered"), (16, "allocator order"))
#: where a sequence's pages lie in the pool: anywhere, a uniformly random permutation (a long-running
#: server's free list), or in the order a block allocator hands pages to sequences that all grow
#: together (round-robin: page i of sequence b is block i·B + b)
PLACEMENTS = ("scattered", "allocator order")
#: the ``loop`` section: calls whose lengths a graph cycles through, and how far apart the sequences' lengths start
LOOP_STEPS, LOOP_STAGGER = 256, 5
#: split counts of the ``splits`` section
SPLITS = (1, 2, 4, 8, 16, 32)
#: peer name -> SDPA backend name
SDPA = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}
#: (rounds, do_bench_cudagraph rep in ms, eager calls per host timing); 8 rounds balance 2, 4 or 8 candidates
FULL, QUICK, SMOKE = (8, 20, 200), (2, 10, 100), (1, 1, 3)


def gpu_us(fn, rep_ms: int) -> float:
    """GPU time of one call in µs: CUDA-graph replay on a GPU (no host in it), wall clock in the CPU world."""
    if ON_GPU:
        import triton.testing

        median = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, quantiles=[0.5])
        return (median[0] if isinstance(median, (list, tuple)) else median) * 1e3   # one quantile: a float
    return time_fn(fn, warmup=1, rep=2)["ms"] * 1e3


def interleaved(fns: dict, rounds: int, measure) -> tuple[dict, dict]:
    """``measure(fn)`` of every callable in ``rounds`` interleaved rounds (``time_interleaved``):
    ``(name -> median, name -> error)``; a callable that raises is measured no more."""
    errors = {}
    times = time_interleaved(fns, rounds=rounds, measure=measure, errors=errors)
    return {n: t["ms"] for n, t in times.items()}, errors


def head(section, impl, row, dtype, page_size=0, placement=None, **fields):
    B, H, Hkv, Nq, Nk, D = row
    return dict(section=section, impl=impl, batch=B, heads=H, kv_heads=Hkv, n_q=Nq, n_k=Nk, head_dim=D, dtype=dtype,
                page_size=page_size, placement=placement if page_size else None, **fields)


def make_cache(row, dtype, seed=1):
    """q (B, Nq, H, D) and a contiguous cache (B, Nk, Hkv, D), every sequence full."""
    B, H, Hkv, Nq, Nk, D = row
    g = torch.Generator(device=fa_lab.DEVICE).manual_seed(seed)
    dt = getattr(torch, dtype)
    q = torch.randn(B, Nq, H, D, device=fa_lab.DEVICE, dtype=dt, generator=g)
    k = torch.randn(B, Nk, Hkv, D, device=fa_lab.DEVICE, dtype=dt, generator=g)
    v = torch.randn(B, Nk, Hkv, D, device=fa_lab.DEVICE, dtype=dt, generator=g)
    return q, k, v


def paged(k, v, page_size, seed=2, placement="scattered"):
    """The same keys and values in a pool of pages placed as ``placement`` says (``PLACEMENTS``), and its table."""
    B, Nk, Hkv, D = k.shape
    per_seq = math.ceil(Nk / page_size)
    pad = per_seq * page_size - Nk
    if placement == "scattered":
        order = torch.randperm(B * per_seq, generator=torch.Generator().manual_seed(seed))
    elif placement == "allocator order":
        order = (torch.arange(per_seq) * B + torch.arange(B)[:, None]).reshape(-1)   # page i of b: block i·B + b
    else:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    order = order.to(k.device)
    table = order.view(B, per_seq).to(torch.int32)
    pools = []
    for t in (k, v):
        pages = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)).view(B * per_seq, page_size, Hkv, D)
        pool = torch.empty_like(pages)
        pool[order] = pages
        pools.append(pool)
    return pools[0], pools[1], table


def sdpa_call(name, q, k, v):
    """``(fn, gqa mode, bytes of K and V it reads)`` for an SDPA backend on views of the cache, or raises."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA[name])
    qh = q.transpose(1, 2)                       # (B, H, Nq, D) views: no copy
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)
    group = q.shape[2] // k.shape[2]
    why = []
    for mode in ("enable_gqa", "expanded"):
        if mode == "expanded":
            kh, vh = (t.repeat_interleave(group, dim=1) for t in (kh, vh))   # outside the timed call
        kw = dict(enable_gqa=True) if mode == "enable_gqa" else {}

        def run(kh=kh, vh=vh, kw=kw):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qh, kh, vh, **kw)
        try:
            out = run()
        except RuntimeError as exc:
            why.append(f"{mode}: {str(exc).splitlines()[0][:150]}")
            continue
        return run, out.transpose(1, 2), mode, 2 * kh.numel() * kh.element_size()
    raise RuntimeError("; ".join(why))


def measure_row(row, dtype, mode, page_size=0, placement="scattered"):
    """Ours, each SDPA backend and the copy on one problem: one record each."""
    rounds, rep_ms, calls = mode
    if ON_GPU:
        torch.cuda.empty_cache()   # the previous problem's buffers
    q, k, v = make_cache(row, dtype)
    B, H, Hkv, Nq, Nk, D = row
    kv_bytes = 2 * k.numel() * k.element_size()
    seqlens = torch.full((B,), Nk, dtype=torch.int32, device=q.device)
    recs, fns = {}, {}
    with torch.no_grad():
        o_ref, _ = decode_forward(q, k, v, cache_seqlens=seqlens, scale=None)
        if page_size:
            k_pages, v_pages, table = paged(k, v, page_size, placement=placement)
            fns["triton_decode"] = lambda: decode_forward(q, k_pages, v_pages, cache_seqlens=seqlens,
                                                          block_table=table, scale=None)
            o = fns["triton_decode"]()[0]
            recs["triton_decode"] = head("decode", "triton_decode", row, dtype, page_size, placement, status="ok",
                                         max_abs_diff_vs_contiguous=float((o.float() - o_ref.float()).abs().max()))
            plan = decode_plan(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table)
            if plan.order_rows:
                key_order = dict(POOL_ORDER=False)
                fns["triton_decode_key_order"] = lambda: decode_forward(q, k_pages, v_pages, cache_seqlens=seqlens,
                                                                        block_table=table, scale=None,
                                                                        config=key_order)
                recs["triton_decode_key_order"] = head("decode", "triton_decode_key_order", row, dtype, page_size,
                                                       placement, status="ok", kv_bytes_read=kv_bytes, gqa="packed",
                                                       splits=decode_plan(q, k_pages, v_pages, cache_seqlens=seqlens,
                                                                          block_table=table, config=key_order).splits)
        else:
            fns["triton_decode"] = lambda: decode_forward(q, k, v, cache_seqlens=seqlens, scale=None)
            recs["triton_decode"] = head("decode", "triton_decode", row, dtype, status="ok")
            plan = decode_plan(q, k, v, cache_seqlens=seqlens)
        recs["triton_decode"].update(splits=plan.splits, pool_order=bool(plan.order_rows), kv_bytes_read=kv_bytes,
                                     gqa="packed")
        for name in SDPA:
            rec = recs[name] = head("decode", name, row, dtype, page_size, placement)
            if page_size:
                rec["status"] = "unsupported: SDPA takes no paged KV cache (no block table)"
                continue
            try:
                fns[name], out, rec["gqa"], rec["kv_bytes_read"] = sdpa_call(name, q, k, v)
                rec["max_abs_diff_vs_ours"] = float((out.float() - o_ref.float()).abs().max())
                rec["status"] = "ok"
            except Exception as exc:   # a backend that refuses the input is a fact, not a crash
                rec["status"] = f"unsupported: {type(exc).__name__}: {str(exc)[:300]}"
        src = torch.empty(kv_bytes // 2, dtype=torch.float16, device=q.device)
        dst = torch.empty_like(src)
        fns["copy"] = lambda: dst.copy_(src)
        recs["copy"] = head("decode", "copy", row, dtype, page_size, placement, status="ok", kv_bytes_read=kv_bytes)

        times, errors = interleaved(fns, rounds, lambda fn: gpu_us(fn, rep_ms))
        hosts, _ = interleaved({n: f for n, f in fns.items() if n not in ("copy", "triton_decode_key_order")
                                and n not in errors}, rounds,
                               lambda fn: back_to_back_ms(fn, calls) * 1e3)
    for name, error in errors.items():
        recs[name]["status"] = error
        print(f"  {name}: {error}", flush=True)
    for name, us in times.items():
        recs[name]["gpu_us"] = us
    for name, rec in recs.items():
        rec["kv_bytes"] = kv_bytes
        if rec.get("gpu_us"):
            moved = 2 * kv_bytes if name == "copy" else rec["kv_bytes_read"]
            rec["bandwidth"] = moved / (rec["gpu_us"] * 1e-6)
        if name in hosts:
            rec["host_us_per_call"] = hosts[name]
        rec["timer"] = ("do_bench_cudagraph, " if ON_GPU else "wall clock (CPU world), ") + \
            f"median of interleaved rounds; host: {calls} eager calls, one sync"
    return list(recs.values())


def decoding_loop(row, dtype, mode, page_size=16, steps=LOOP_STEPS):
    """Ours over scattered pages while the sequences grow one key per call, in pool order and in key order.

    The lengths are staggered (sequence b starts ``LOOP_STAGGER · b`` keys past a multiple of the page size),
    so in most calls some sequence fills a page or starts one; each call reads its own row of lengths, the
    calls of a CUDA graph cycle through ``steps`` of them (a graph replayed again starts over: shorter
    sequences, sorted again).
    """
    rounds, rep_ms, _ = mode
    q, k, v = make_cache(row, dtype)
    B, H, Hkv, Nq, Nk, D = row
    k_pages, v_pages, table = paged(k, v, page_size)
    start = (Nk - steps - page_size) // page_size * page_size
    lengths = torch.tensor([[start + (LOOP_STAGGER * b) % page_size + t for b in range(B)] for t in range(steps)],
                           dtype=torch.int32, device=q.device)
    fns, recs = {}, {}
    for impl, config in (("triton_decode", None), ("triton_decode_key_order", dict(POOL_ORDER=False))):
        step = itertools.count()

        def call(config=config, step=step):
            return decode_forward(q, k_pages, v_pages, cache_seqlens=lengths[next(step) % steps], block_table=table,
                                  scale=None, config=config)
        fns[impl] = call
        plan = decode_plan(q, k_pages, v_pages, cache_seqlens=lengths[0], block_table=table, config=config)
        recs[impl] = head("loop", impl, row, dtype, page_size, "scattered", splits=plan.splits,
                          pool_order=bool(plan.order_rows), steps=steps, first_length=start)
    with torch.no_grad():
        times, errors = interleaved(fns, rounds, lambda fn: gpu_us(fn, rep_ms))
    for impl, rec in recs.items():
        rec.update(gpu_us=times.get(impl), status=errors.get(impl, "ok"))
    return list(recs.values())


def sweep_splits(row, dtype, mode, splits=SPLITS):
    """Ours at fixed split counts and at the heuristic's (``chosen``), interleaved."""
    rounds, rep_ms, _ = mode
    rounds = min(rounds, 4)   # many candidates: fewer rounds keep the run short
    q, k, v = make_cache(row, dtype)
    B, H, Hkv, Nq, Nk, D = row
    seqlens = torch.full((B,), Nk, dtype=torch.int32, device=q.device)
    chosen = decode_plan(q, k, v, cache_seqlens=seqlens).splits
    fns = {s: (lambda s=s: decode_forward(q, k, v, cache_seqlens=seqlens, scale=None, num_splits=s))
           for s in sorted({*splits, chosen})}
    with torch.no_grad():
        times, errors = interleaved(fns, rounds, lambda fn: gpu_us(fn, rep_ms))
    return [head("splits", "triton_decode", row, dtype, num_splits=s, chosen=s == chosen, gpu_us=times.get(s),
                 status=errors.get(s, "ok")) for s in fns]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="directory for gpu_ch9.json (default: fa_lab/data)")
    parser.add_argument("--sections", default="decode,loop,splits", help="decode,loop,splits")
    parser.add_argument("--dtypes", default=None, help="float16,bfloat16 (--quick: float16)")
    parser.add_argument("--quick", action="store_true", help="fp16 only, fewer rounds: a minute or less")
    parser.add_argument("--smoke", action="store_true", help="tiny problems, any world: checks the script")
    parser.add_argument("--name", default="gpu_ch9", help="recording name")
    args = parser.parse_args(argv)
    rows, pages, splits, mode = ROWS, PAGES, SPLITS, QUICK if args.quick else FULL
    if args.smoke:
        rows, pages, splits, mode = [(2, 4, 2, 1, 40, 16), (3, 4, 1, 2, 24, 24)], PAGES[::2], (1, 2), SMOKE
        args.out = args.out or tempfile.mkdtemp(prefix="bench_ch9_")
    elif not ON_GPU:
        sys.exit("bench_ch9 records GPU numbers: run it on a machine with a CUDA GPU (or try --smoke)")
    dtypes = (args.dtypes or ("float16" if args.quick or args.smoke else "float16,bfloat16")).split(",")
    sections = args.sections.split(",")
    records = []
    t_start = time.perf_counter()

    def flush():
        return recorded.save(args.name, records, command="python scripts/bench_ch9.py " + " ".join(
                             argv if argv is not None else sys.argv[1:]), directory=args.out,
                             rows=[list(r) for r in rows], pages=list(pages), splits=list(splits),
                             seconds=round(time.perf_counter() - t_start, 1))

    if "decode" in sections:
        for dtype in dtypes:
            for row in rows:
                recs = measure_row(row, dtype, mode)
                records += recs
                flush()
                print(f"{dtype} {row}: " + "  ".join(f"{r['impl']} {r['gpu_us']:.1f}us" if r.get("gpu_us")
                                                     else f"{r['impl']} {r['status'][:40]}" for r in recs), flush=True)
            for page, placement in pages:
                recs = measure_row(rows[0], dtype, mode, page_size=page, placement=placement)
                records += recs
                flush()
                ours = recs[0]
                print(f"{dtype} {rows[0]} pages of {page}, {placement}: ours {ours.get('gpu_us', 0):.1f}us", flush=True)
    if "loop" in sections:
        for dtype in dtypes:
            recs = decoding_loop(rows[0], dtype, mode, steps=LOOP_STEPS if not args.smoke else 4)
            records += recs
            flush()
            print(f"loop {dtype} {rows[0]}: " + "  ".join(f"{r['impl']} {r.get('gpu_us') or 0:.1f}us" for r in recs),
                  flush=True)
    if "splits" in sections:
        for row in rows:
            records += sweep_splits(row, dtypes[0], mode, splits)
            flush()
            print(f"splits {row}: " + "  ".join(f"{r['num_splits']}{'*' if r['chosen'] else ''} {r['gpu_us']:.1f}us"
                                                for r in records if r["section"] == "splits"
                                                and r["batch"] == row[0]), flush=True)
    path = flush()
    print(f"wrote {path} in {time.perf_counter() - t_start:.0f}s", flush=True)
    return path


if __name__ == "__main__":
    main()
