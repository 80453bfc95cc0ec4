"""Record chapter 8 on a GPU: a training step on a packed variable-length batch against padding.

    python scripts/bench_ch8.py [--out DIR] [--quick] [--smoke]

The batch is the chapter's: 16 sequences with lengths drawn log-uniformly from 128..8192 with a
fixed seed (``fa_lab.figures.varlen.chapter_lengths``; recorded in the meta), H = 16 heads,
D = 128, bf16, with and without the causal mask.  In one run, interleaved in balanced orders
(``fa_lab.bench.timer.balanced_orders``), each timed with ``triton.testing.do_bench`` (CUDA events,
L2 cleared between calls, median; ``fa_lab.bench.timer.time_fn``):

* ``varlen``: ours, ``fa_lab.flash_attn.flash_attn_varlen_func`` on the packed ``(total, H, D)``
  batch with ``cu_seqlens``;
* ``sdpa-flash-padded``: PyTorch SDPA's FlashAttention-2 backend on the zero-padded
  ``(B, H, max L, D)`` batch.  The flash backend takes no key-padding mask, so the padded queries
  compute like real ones; under the causal mask the real rows still get the right answer
  (padding sits after every real key), without it they attend to zero keys too (a speed
  baseline, not a correct answer: ``correct`` says which);
* ``sdpa-nested``: SDPA on nested tensors with ``layout=torch.jagged`` (whatever backend PyTorch
  picks); a call it refuses is recorded as ``unsupported`` with PyTorch's reason;
* ``flash_triton-fixed`` and ``varlen-fixed``: our fixed-length kernel (``fa_lab.flash_attention``)
  and our varlen kernel on 4 sequences of 4096 tokens, ``(4, 16, 4096, 128)``: the TFLOP/s the
  packed batch is compared with.

Modes ``fwd`` (forward alone) and ``fwd+bwd`` (forward and backward: a training step's attention).
TFLOP/s count the real FLOPs (DESIGN.md's convention, summed per sequence: ``4·H·L²·D``, halved
when causal, ×3.5 for fwd+bwd); ``tflops_computed`` counts what a padded batch computes.
Writes gpu_ch8.json (fa_lab.bench.records format) into DIR (default fa_lab/data).  ``--quick``
takes fewer rounds; ``--smoke`` runs tiny problems in any world (checks the script, writes to DIR
or a temporary folder).
"""
import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("FA_LAB_TRITON_AUTOTUNE", "0")   # the shipped configurations of chapter 4's kernel

import fa_lab  # noqa: E402  (first: picks the world)
import torch  # noqa: E402

from fa_lab.bench import records as recorded  # noqa: E402
from fa_lab.bench.timer import time_fn, time_interleaved  # noqa: E402
from fa_lab.core.flops import attention_flops  # noqa: E402
from fa_lab.core.world import ON_GPU  # noqa: E402
from fa_lab.figures.varlen import chapter_lengths, padding_ratios  # noqa: E402
from fa_lab.flash_attn import flash_attn_varlen_func  # noqa: E402

#: (heads, head_dim, dtype) of the chapter's batch, and the fixed shape (B, H, N, D) it is compared with
FULL = dict(heads=16, head_dim=128, dtype="bfloat16", fixed=(4, 16, 4096, 128))
SMOKE_PROBLEM = dict(heads=2, head_dim=16, dtype="float32", fixed=(2, 2, 24, 16), lengths=[9, 0, 21, 4])
#: (rounds, do_bench warmup and rep in ms): 6 rounds balance 2, 3 or 6 candidates (5 candidates: 10)
FULL_MODE, QUICK_MODE, SMOKE_MODE = (10, (10, 40)), (4, (5, 20)), (1, None)
MODES = ("fwd", "fwd+bwd")


def measure(fn, gpu_ms):
    """Milliseconds of one call: do_bench's median on a GPU, one wall-clock call in the CPU world."""
    if ON_GPU:
        return time_fn(fn, gpu_ms=gpu_ms)["ms"]
    return time_fn(fn, warmup=0, rep=1)["ms"]


def interleaved(fns: dict, rounds: int, gpu_ms) -> tuple[dict, dict]:
    """``(name -> timing, name -> error)``: ``time_interleaved`` with this script's ``measure``; a
    callable that raises is measured no more."""
    errors = {}
    times = time_interleaved(fns, rounds=rounds, measure=lambda fn: measure(fn, gpu_ms), errors=errors)
    return times, errors


def packed_inputs(lengths, heads, head_dim, dtype, seed=1):
    """q, k, v ``(total, H, D)`` leaves that require grad, dO, and cu_seqlens."""
    g = torch.Generator(device=fa_lab.DEVICE).manual_seed(seed)
    total = sum(lengths)
    q, k, v, do = (torch.randn(total, heads, head_dim, device=fa_lab.DEVICE, dtype=dtype, generator=g)
                   for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=fa_lab.DEVICE)
    return q, k, v, do, cu


def padded(t, lengths):
    """``(total, H, D)`` -> ``(B, H, max L, D)`` with zeros after each sequence (a new leaf)."""
    B, longest = len(lengths), max(lengths)
    out = t.new_zeros(B, longest, *t.shape[1:])
    start = 0
    for b, n in enumerate(lengths):
        out[b, :n] = t[start:start + n]
        start += n
    return out.transpose(1, 2).contiguous().detach().requires_grad_(t.requires_grad)


def unpadded(t, lengths):
    """``(B, H, max L, D)`` -> the real rows, ``(total, H, D)``."""
    return torch.cat([t[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])


def step(run, inputs, do):
    """``mode -> callable``: the forward alone, and the forward with the backward."""
    def fwd():
        with torch.no_grad():
            return run()

    def fwd_bwd():
        return torch.autograd.grad(run(), inputs, do)
    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def candidates(lengths, problem, causal):
    """``impl -> (mode -> callable, record fields)`` for every implementation, and the reference output."""
    dtype = getattr(torch, problem["dtype"])
    H, D = problem["heads"], problem["head_dim"]
    q, k, v, do, cu = packed_inputs(lengths, H, D, dtype)
    longest = max(lengths)
    out = {}

    def ours():
        return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)
    with torch.no_grad():
        reference = ours().float()
    real = dict(flops={m: sum(attention_flops(1, H, n, n, D, causal=causal, mode=m) for n in lengths) for m in MODES},
                n_tokens=sum(lengths), n_seqs=len(lengths), max_len=longest)
    out["varlen"] = (step(ours, (q, k, v), do), dict(real, correct=True))

    # SDPA flash on the zero-padded batch: padded queries compute too
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qp, kp, vp, dop = (padded(t, lengths) for t in (q, k, v, do))

    def flash_padded():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qp, kp, vp, is_causal=causal)
    fields = dict(real, computed={m: attention_flops(len(lengths), H, longest, longest, D, causal=causal, mode=m)
                                  for m in MODES}, correct=causal)
    try:
        with torch.no_grad():
            diff = unpadded(flash_padded(), lengths).float() - reference
            fields["max_abs_diff_vs_varlen"] = float(diff.abs().max())
        out["sdpa-flash-padded"] = (step(flash_padded, (qp, kp, vp), dop), fields)
    except Exception as exc:   # no flash backend here (the CPU world), or it refuses the input
        out["sdpa-flash-padded"] = (None, dict(fields, status=f"unsupported: {type(exc).__name__}: {str(exc)[:300]}"))

    # SDPA on nested (jagged) tensors, whatever backend PyTorch picks
    offsets = cu.to(torch.int64)
    qv, kv, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def nested():
        # min and max length given: PyTorch need not read them from the device (no synchronisation)
        qn, kn, vn = (torch.nested.nested_tensor_from_jagged(t, offsets, min_seqlen=min(lengths), max_seqlen=longest)
                      .transpose(1, 2) for t in (qv, kv, vv))
        return F.scaled_dot_product_attention(qn, kn, vn, is_causal=causal).transpose(1, 2).values()
    fields = dict(real, correct=True)
    try:
        with torch.no_grad():
            fields["max_abs_diff_vs_varlen"] = float((nested().float() - reference).abs().max())
        out["sdpa-nested"] = (step(nested, (qv, kv, vv), do), fields)
    except Exception as exc:
        why = " ".join(str(exc).split())[:300]
        out["sdpa-nested"] = (None, dict(fields, status=f"unsupported: {type(exc).__name__}: {why}"))

    # the comparable fixed shape: chapter 4/5's kernel and ours on equal lengths
    B, Hf, N, Df = problem["fixed"]
    g = torch.Generator(device=fa_lab.DEVICE).manual_seed(2)
    qf, kf, vf, dof = (torch.randn(B, Hf, N, Df, device=fa_lab.DEVICE, dtype=dtype, generator=g) for _ in range(4))
    qf, kf, vf = (t.requires_grad_() for t in (qf, kf, vf))
    fixed = dict(flops={m: attention_flops(B, Hf, N, N, Df, causal=causal, mode=m) for m in MODES}, n_tokens=B * N,
                 n_seqs=B, max_len=N, correct=True, shape=f"({B}, {Hf}, {N}, {Df})")
    out["flash_triton-fixed"] = (step(lambda: fa_lab.flash_attention(qf, kf, vf, causal=causal), (qf, kf, vf), dof),
                                 fixed)
    qs, ks, vs, dos = (t.detach().transpose(1, 2).reshape(B * N, Hf, Df).contiguous() for t in (qf, kf, vf, dof))
    qs, ks, vs = (t.requires_grad_() for t in (qs, ks, vs))
    cuf = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device=fa_lab.DEVICE)
    out["varlen-fixed"] = (step(lambda: flash_attn_varlen_func(qs, ks, vs, cuf, cuf, N, N, causal=causal),
                                (qs, ks, vs), dos), fixed)
    return out


def run(lengths, problem, mode, causal):
    rounds, gpu_ms = mode
    cands = candidates(lengths, problem, causal)
    ratios = padding_ratios(lengths)
    records = []
    for m in MODES:
        fns, failed = {}, {}
        for name, (fn, _) in cands.items():   # compile, and fail here rather than while timed
            if fn is None:
                continue
            try:
                fn[m]()
                fns[name] = fn[m]
            except Exception as exc:
                failed[name] = f"error: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        times, errors = interleaved(fns, rounds, gpu_ms)
        errors.update(failed)
        for name, (_, fields) in cands.items():
            rec = dict(section="step", impl=name, mode=m, causal=causal, dtype=problem["dtype"],
                       heads=problem["heads"], head_dim=problem["head_dim"],
                       **{k: v for k, v in fields.items() if k not in ("flops", "computed")})
            rec["flops"] = fields["flops"][m]
            if "computed" in fields:
                rec["flops_computed"] = fields["computed"][m]
            if not name.endswith("-fixed"):
                rec.update(padding_ratio_tokens=ratios["tokens"], padding_ratio_attention=ratios["attention"])
            rec.setdefault("status", errors.get(name, "ok"))
            if name in times and rec["status"] == "ok":
                rec.update(times[name])
                rec["tflops"] = rec["flops"] / (rec["ms"] * 1e-3) / 1e12
                if "flops_computed" in rec:
                    rec["tflops_computed"] = rec["flops_computed"] / (rec["ms"] * 1e-3) / 1e12
            rec["timer"] = ("do_bench (CUDA events), " if ON_GPU else "wall clock (CPU world), ") + \
                f"median of {rounds} interleaved rounds"
            records.append(rec)
    del cands
    if ON_GPU:
        torch.cuda.empty_cache()
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="directory for gpu_ch8.json (default: fa_lab/data)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds: a minute or two")
    parser.add_argument("--smoke", action="store_true", help="tiny problems, any world: checks the script")
    parser.add_argument("--name", default="gpu_ch8", help="recording name")
    args = parser.parse_args(argv)
    problem, mode, lengths = FULL, QUICK_MODE if args.quick else FULL_MODE, chapter_lengths()
    if args.smoke:
        problem, mode, lengths = SMOKE_PROBLEM, SMOKE_MODE, SMOKE_PROBLEM["lengths"]
        args.out = args.out or tempfile.mkdtemp(prefix="bench_ch8_")
    elif not ON_GPU:
        sys.exit("bench_ch8 records GPU numbers: run it on a machine with a CUDA GPU (or try --smoke)")
    records = []
    t_start = time.perf_counter()

    def flush():
        return recorded.save(args.name, records, command="python scripts/bench_ch8.py " + " ".join(
                             argv if argv is not None else sys.argv[1:]), directory=args.out, lengths=list(lengths),
                             heads=problem["heads"], head_dim=problem["head_dim"], dtype=problem["dtype"],
                             fixed=list(problem["fixed"]), seconds=round(time.perf_counter() - t_start, 1))

    for causal in (False, True):
        recs = run(lengths, problem, mode, causal)
        records += recs
        flush()
        for r in recs:
            shown = f"{r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s" if r.get("ms") else r["status"][:60]
            print(f"causal={causal} {r['mode']:8s} {r['impl']:20s} {shown}", flush=True)
    path = flush()
    print(f"wrote {path} in {time.perf_counter() - t_start:.0f}s", flush=True)
    return path


if __name__ == "__main__":
    main()
