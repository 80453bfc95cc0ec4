"""Record chapter 10 on a GPU: score modifications (soft cap, ALiBi) in ours, FlexAttention and SDPA.

    python scripts/bench_ch10.py [--out DIR] [--quick] [--mods none,softcap,alibi] [--masks none,causal]
                                 [--softcap 50] [--smoke]

One problem, ``(B, H, N, D) = (4, 16, 4096, 128)`` bf16, without and with the (bottom-right) causal mask,
under three score modifications: none, ``softcap`` (``cap·tanh(s/cap)``, cap 50 as Gemma 2's attention)
and ``alibi`` (Press et al.'s slopes for H heads).  For each, in one run, on the same values:

* ``triton_varlen`` — ours: ``fa_lab.flash_attn.flash_attn_varlen_func`` on the batch packed as
  ``(B·N, H, D)`` (a view of ``(B, N, H, D)``), the kernel that applies the modifications;
* ``flash_triton`` — chapter 4's tuned kernel (``fa_lab.flash_attention``), which has no modifications:
  the plain problem only;
* ``flex-attention`` — ``torch.nn.attention.flex_attention.flex_attention`` under ``torch.compile``, with the
  equivalent ``score_mod`` and, causal, a block mask from ``create_block_mask``; the first forward and the
  first backward compile, and their seconds are recorded apart (``compile_s``), never in the timings;
* ``sdpa`` — ``torch.nn.functional.scaled_dot_product_attention`` as PyTorch picks its backend
  (``sdpa_backend`` says which): plain (``is_causal``), and for ALiBi with the bias materialised as a dense
  ``(1, H, N, N)`` additive mask (the causal mask folded in as −inf), the "no fused modification" peer.  SDPA
  has no soft cap: ``unsupported``.

``mode`` ``fwd`` times a forward on inputs that require grad (as in training: every implementation also
keeps what its backward needs), ``fwd+bwd`` a forward and ``torch.autograd.grad`` of it.  Timing:
``fa_lab.bench.timer.time_interleaved`` (``triton.testing.do_bench``, L2 cleared, the candidates interleaved in
balanced orders, the median of the rounds).  TFLOP/s by DESIGN.md's convention (forward ``4·B·H·N²·D``,
halved causal; fwd+bwd 3.5×; the modifications and exponentials not counted).  Each record also has the
largest difference of its forward output from ours.  Writes gpu_ch10.json (fa_lab.bench.records format)
into DIR (default fa_lab/data).  ``--quick``: fewer, shorter rounds.  ``--smoke``: tiny problems in any
world, FlexAttention eager where there is no GPU (checks the script; writes to DIR or a temporary folder).
"""
import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("FA_LAB_TRITON_AUTOTUNE", "0")   # chapter 4's kernel runs its shipped configuration

import fa_lab  # noqa: E402  (first: picks the world)
import torch  # noqa: E402

from fa_lab.bench import records as recorded  # noqa: E402
from fa_lab.bench.timer import balanced_orders, time_interleaved  # noqa: E402
from fa_lab.core.flops import attention_flops  # noqa: E402
from fa_lab.core.world import ON_GPU  # noqa: E402
from fa_lab.exercises.ch10 import slopes_list  # noqa: E402
from fa_lab.flash_attn import flash_attn_varlen_func  # noqa: E402

#: (batch, heads, seq, head_dim): the chapter's problem
ROW = (4, 16, 4096, 128)
SMOKE_ROW = (1, 2, 48, 32)
MODS = ("none", "softcap", "alibi")
MASKS = ("none", "causal")
#: (rounds per balanced design, do_bench (warmup, rep) in ms)
FULL, QUICK, SMOKE = (2, (10, 40)), (1, (5, 20)), (1, None)


def make_inputs(row, dtype, seed=1):
    """q, k, v ``(B, N, H, D)`` (ours, packed views) and their ``(B, H, N, D)`` copies (the peers), dO of each."""
    B, H, N, D = row
    g = torch.Generator(device=fa_lab.DEVICE).manual_seed(seed)
    ours = [torch.randn(B, N, H, D, device=fa_lab.DEVICE, dtype=dtype, generator=g) for _ in range(4)]
    peers = [t.transpose(1, 2).contiguous() for t in ours]
    for t in ours[:3] + peers[:3]:
        t.requires_grad_(True)
    return ours, peers


def score_mods(mod, n_q, n_k, cap, slopes):
    """FlexAttention's ``score_mod`` for ``mod`` (None for none): the same formula as the reference."""
    if mod == "softcap":
        def softcap_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)
        return softcap_mod
    if mod == "alibi":
        def alibi_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx + (n_k - n_q) - kv_idx).abs()
        return alibi_mod
    return None


def alibi_bias(slopes, n_q, n_k, causal, dtype):
    """ALiBi as a dense additive mask ``(1, H, Nq, Nk)``; causal: −inf where a query does not see the key."""
    i = torch.arange(n_q, device=slopes.device)[:, None] + (n_k - n_q)
    j = torch.arange(n_k, device=slopes.device)[None, :]
    bias = -slopes[:, None, None] * (i - j).abs().to(torch.float32)
    if causal:
        bias = bias.masked_fill(j > i, float("-inf"))
    return bias.to(dtype)[None]


def sdpa_backend(q, k, v, bias, causal) -> str:
    """The backend SDPA picks for these inputs (PyTorch's own choice function), or 'unknown'."""
    try:
        from torch.nn.attention import SDPBackend

        return SDPBackend(torch._fused_sdp_choice(q, k, v, bias, 0.0, causal and bias is None)).name.lower()
    except Exception:   # a private function: its absence is no reason to stop
        return "unknown"


def candidates(mod, causal, ours, peers, cap, slopes):
    """``{impl: forward callable}`` for one problem, and ``{impl: facts}`` to record with it."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = ours[:3]
    B, N, H, D = q.shape
    cu = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device=q.device)
    qp, kp, vp = peers[:3]
    softcap = cap if mod == "softcap" else 0.0
    alibi = slopes if mod == "alibi" else None
    fns, facts = {}, {}
    fns["triton_varlen"] = lambda: flash_attn_varlen_func(
        q.view(B * N, H, D), k.view(B * N, H, D), v.view(B * N, H, D), cu, cu, N, N, causal=causal,
        softcap=softcap, alibi_slopes=alibi).view(B, N, H, D)
    if mod == "none":
        fns["flash_triton"] = lambda: fa_lab.flash_attention(qp, kp, vp, causal=causal).transpose(1, 2)
    mask = None
    if causal:
        def causal_mask(b, h, q_idx, kv_idx):   # bottom-right: j <= i + Nk - Nq (here Nq = Nk = N)
            return kv_idx <= q_idx + (N - N)
        mask = create_block_mask(causal_mask, B=None, H=None, Q_LEN=N, KV_LEN=N, device=q.device)
    flex = torch.compile(flex_attention, dynamic=False) if ON_GPU else flex_attention
    score_mod = score_mods(mod, N, N, cap, slopes)
    # on a CPU FlexAttention has a forward only (and refuses inputs that require grad)
    fq, fk, fv = (qp, kp, vp) if ON_GPU else (t.detach() for t in (qp, kp, vp))
    fns["flex-attention"] = lambda: flex(fq, fk, fv, score_mod=score_mod, block_mask=mask).transpose(1, 2)
    if mod == "softcap":
        facts["sdpa"] = dict(status="unsupported: SDPA has no soft cap (no hook between QKᵀ and the softmax)")
    else:
        bias = alibi_bias(slopes, N, N, causal, qp.dtype) if mod == "alibi" else None
        facts["sdpa"] = dict(sdpa_backend=sdpa_backend(qp, kp, vp, bias, causal),
                             bias_bytes=0 if bias is None else bias.numel() * bias.element_size())
        fns["sdpa"] = lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=bias,
                                                             is_causal=causal and bias is None).transpose(1, 2)
    return fns, facts


def with_backward(fn, grads_of, do):
    """A callable that runs ``fn`` forward and its backward to ``grads_of``, as training does."""
    return lambda: torch.autograd.grad(fn(), grads_of, do)


def once(fns):
    """The CPU world (``--smoke``): one wall-clock call each, only to exercise the script."""
    out = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        out[name] = dict(ms=ms, ms_p10=ms, ms_p90=ms, rounds=1, timer="wall clock (CPU world), one call")
    return out


def sync():
    if ON_GPU:
        torch.cuda.synchronize()


def grad_inputs(impl, ours, peers):
    """``(inputs to differentiate, dO)`` of an implementation: ours reads the packed layout, the peers theirs."""
    if impl == "triton_varlen":
        return ours[:3], ours[3]
    return peers[:3], peers[3].transpose(1, 2)   # every callable returns (B, N, H, D) views


def first_calls(fns, ours, peers):
    """Each candidate's first forward and backward, outside the timings (FlexAttention compiles here):
    ``(seconds {impl: (fwd, bwd)}, forward outputs, errors {(impl, mode): why})``."""
    seconds, outputs, failed = {}, {}, {}
    for impl, fn in fns.items():
        grads_of, do = grad_inputs(impl, ours, peers)
        try:
            sync()
            t0 = time.perf_counter()
            out = fn()
            sync()
            t1 = time.perf_counter()
        except Exception as exc:   # a peer that cannot run this problem is a fact, not a crash
            failed[(impl, "fwd")] = failed[(impl, "fwd+bwd")] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            continue
        outputs[impl] = out.detach()
        try:
            torch.autograd.grad(out, grads_of, do)
            sync()
            seconds[impl] = (t1 - t0, time.perf_counter() - t1)
        except Exception as exc:   # FlexAttention has no eager backward, for one
            failed[(impl, "fwd+bwd")] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            seconds[impl] = (t1 - t0, None)
    return seconds, outputs, failed


def measure(mod, causal, dtype, mode, row, cap):
    """Every candidate on one problem, forward and forward+backward: one record per (impl, mode)."""
    rounds, gpu_ms = mode
    B, H, N, D = row
    ours, peers = make_inputs(row, dtype)
    slopes = torch.tensor(slopes_list(H), dtype=torch.float32, device=fa_lab.DEVICE)
    fns, facts = candidates(mod, causal, ours, peers, cap, slopes)
    head = dict(section="peers", mod=mod, causal=causal, batch=B, heads=H, n_q=N, n_k=N, head_dim=D,
                dtype=str(dtype).replace("torch.", ""), softcap=cap if mod == "softcap" else 0.0)
    seconds, outputs, failed = first_calls(fns, ours, peers)
    records = []
    for m in ("fwd", "fwd+bwd"):
        group = {}
        for impl, fn in fns.items():
            if (impl, m) not in failed:
                grads_of, do = grad_inputs(impl, ours, peers)
                group[impl] = fn if m == "fwd" else with_backward(fn, grads_of, do)
        design = len(balanced_orders(len(group))) if group else 1
        times = time_interleaved(group, rounds=rounds * design, gpu_ms=gpu_ms) if ON_GPU else once(group)
        flops = attention_flops(B, H, N, N, D, causal=causal, mode=m)
        for impl in [*fns, *(i for i in facts if i not in fns)]:
            rec = dict(head, impl=impl, mode=m, **facts.get(impl, {}))
            records.append(rec)
            if impl not in fns:        # a peer that cannot express the problem: its status says why
                continue
            if (impl, m) in failed:
                rec["status"] = failed[(impl, m)]
                continue
            rec.update(times[impl], status="ok", tflops=flops / times[impl]["ms"] / 1e9)
            rec["max_abs_diff_vs_ours"] = float((outputs[impl].float() - outputs["triton_varlen"].float()).abs().max())
            if impl == "flex-attention":
                rec["compile_s"] = seconds[impl][0 if m == "fwd" else 1]
                rec["compiled"] = ON_GPU
    del ours, peers, fns
    if ON_GPU:
        torch.cuda.empty_cache()
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="directory for gpu_ch10.json (default: fa_lab/data)")
    parser.add_argument("--mods", default=",".join(MODS), help="none,softcap,alibi")
    parser.add_argument("--masks", default=",".join(MASKS), help="none,causal")
    parser.add_argument("--softcap", type=float, default=50.0, help="the cap (default 50, Gemma 2's attention)")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 or float16")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
    parser.add_argument("--smoke", action="store_true", help="tiny problems, any world: checks the script")
    parser.add_argument("--name", default="gpu_ch10", help="recording name")
    args = parser.parse_args(argv)
    row, mode = ROW, QUICK if args.quick else FULL
    if args.smoke:
        row, mode = SMOKE_ROW, SMOKE
        args.out = args.out or tempfile.mkdtemp(prefix="bench_ch10_")
    elif not ON_GPU:
        sys.exit("bench_ch10 records GPU numbers: run it on a machine with a CUDA GPU (or try --smoke)")
    if ON_GPU:
        import torch._dynamo as dynamo

        # one compiled flex_attention serves every (modification, mask): more recompilations than the default allows
        for knob in ("cache_size_limit", "recompile_limit"):
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, 64)
    dtype = getattr(torch, args.dtype)
    mods, masks = args.mods.split(","), args.masks.split(",")
    for name, given, known in (("mods", mods, MODS), ("masks", masks, MASKS)):
        if not set(given) <= set(known):
            parser.error(f"--{name} takes a comma-separated subset of {','.join(known)}, got {','.join(given)}")
    records = []
    t_start = time.perf_counter()

    def flush():
        return recorded.save(args.name, records, command="python scripts/bench_ch10.py " + " ".join(
                             argv if argv is not None else sys.argv[1:]), directory=args.out,
                             row=list(row), softcap=args.softcap, seconds=round(time.perf_counter() - t_start, 1))

    for mask in masks:
        for mod in mods:
            recs = measure(mod, mask == "causal", dtype, mode, row, args.softcap)
            records += recs
            flush()
            print(f"{mod:>7} causal={mask == 'causal'!s:5}: " + "  ".join(
                f"{r['impl']} {r['mode']} " + (f"{r['tflops']:.3g}" if r.get("status") == "ok" else r["status"][:30])
                for r in recs), flush=True)
    path = flush()
    print(f"wrote {path} in {time.perf_counter() - t_start:.0f}s", flush=True)
    return path


if __name__ == "__main__":
    main()
