"""The descriptor dK/dV pass (``fa_lab.kernels.triton.bwd_ws``) against the plain kernels and cuDNN.

    python scripts/bench_bwd_ws.py [--tiles split|descriptor] [--out DIR] [--rounds 6] [--rows 0,2]
                                   [--no-reference]

For each bf16 row of the chapter-5 table: every candidate dK/dV tile timed alone (``tuner.tune_backward``:
``bwd.GPU_CONFIGS``' plain tiles first; the dQ pass runs its plain tile), each descriptor tile's gradients
against the plain kernels' (max |difference|), then the whole backward with the plain tiles, the shipped
ones (``bwd.configs``), the row's fastest, and cuDNN's (SDPA, ``torch.autograd.grad`` of its output)
in interleaved rounds, and the fastest tiles' gradients over repeated calls (bit-identical or not).
``--tiles split`` times the 4-warp tiles with Triton's warp specialization on (which the library leaves
off, ``bwd.WARP_SPECIALIZE_DKDV``); ``--tiles descriptor`` the unsplit descriptor tiles.  A small GQA
problem is checked against the float64 reference first.  Writes ``bwd_ws.json`` (or ``bwd_desc.json``)
into DIR.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fa_lab  # noqa: E402  (first: picks the world)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from fa_lab.bench import time_interleaved  # noqa: E402
from fa_lab.bench.peers import sdpa_kwargs  # noqa: E402
from fa_lab.core.reference import reference_attention  # noqa: E402
from fa_lab.core.testing import random_qkv  # noqa: E402
from fa_lab.kernels.triton import bwd, tuner  # noqa: E402

#: (B, H, Hkv, N, D, causal): chapter 5's table (the rows of the fwd+bwd comparison with cuDNN)
ROWS = [(4, 16, 16, 4096, 128, False), (1, 16, 16, 16384, 128, False), (4, 16, 16, 4096, 128, True),
        (4, 32, 32, 4096, 64, True), (4, 32, 8, 4096, 128, True), (16, 16, 16, 1024, 128, False),
        (2, 16, 16, 8192, 256, True)]
#: dK/dV tiles by head dim, (BLOCK_M, BLOCK_N, warps, stages, through descriptors): the tiles Triton 3.6
#: splits and that fit in shared memory (at D = 128, 128 x 128 with 3 stages needs 296,760 bytes, more than a
#: block may have).  The dQ pass runs its plain tile: through descriptors it lost on every row
#: (docs/decisions/backward-descriptor-copies.md)
WS_TILES = {128: [(64, 128, 4, 2, True), (64, 128, 4, 3, True), (32, 128, 4, 2, True), (32, 128, 4, 3, True),
                  (128, 128, 4, 2, True)],
            64: [(64, 128, 4, 2, True), (64, 128, 4, 3, True), (128, 128, 4, 2, True), (32, 128, 4, 3, True)]}
#: unsplit descriptor dK/dV tiles (8 warps, or 4 without the split), within shared memory
DESC_TILES = {128: [(64, 128, 8, 3, True), (64, 128, 8, 2, True)],
              64: [(64, 128, 8, 3, True), (64, 128, 4, 3, True), (64, 64, 4, 3, True), (128, 128, 8, 2, True)],
              256: [(64, 64, 8, 2, True)]}
TILE_SETS = {"split": WS_TILES, "descriptor": DESC_TILES}


def reference_check(tiles) -> dict:
    """A small GQA problem, bf16, against the float64 gradients."""
    B, H, Hkv, N, D = 1, 4, 2, 512, 128   # GQA: the reference repeats each K/V head for its group
    q, k, v = random_qkv(B, H, N, N, D, kv_heads=Hkv, dtype=torch.bfloat16, seed=11)
    spec = fa_lab.make_spec(q, k, v)
    o, lse = fa_lab.attention(q, k, v, impl="triton", return_lse=True)
    do = torch.randn_like(o)
    x64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention(*x64, fa_lab.make_spec(*x64))
    ref.backward(do.double())
    out = {}
    plain = bwd.GPU_CONFIGS[(bwd.block_d(D), 2)]
    for name, cfg in (("plain", plain), ("descriptor", (tiles[D][0], plain[1]))):
        grads = bwd.triton_backward(q, k, v, o, lse, do, spec, config=cfg)
        out[name] = [float((g.double() - x.grad).abs().max()) for g, x in zip(grads, x64)]
    return out


def row(B, H, Hkv, N, D, causal, rounds, tile_set) -> dict:
    q, k, v = random_qkv(B, H, N, N, D, kv_heads=Hkv, dtype=torch.bfloat16, seed=N + D)
    spec = fa_lab.make_spec(q, k, v, causal=causal)
    o, lse = fa_lab.attention(q, k, v, impl="triton", return_lse=True, causal=causal)
    do = torch.randn_like(o)
    plain = bwd.GPU_CONFIGS[(bwd.block_d(D), 2)]
    shipped = bwd.configs(spec, torch.bfloat16, (q, k, v, do))
    cands = dict(dkdv=[plain[0], *tile_set[D]], dq=[plain[1]])
    t0 = time.time()
    tiles = tuner.tune_backward(q, k, v, o, lse, do, spec, cands)
    base = bwd.triton_backward(q, k, v, o, lse, do, spec, config=plain)
    for rec in tiles:
        if rec["status"] != "ok" or len(rec["config"]) < 5:
            continue
        cfg = tuple(rec["config"])
        pair = (cfg, plain[1]) if rec["kernel"] == "dkdv" else (plain[0], cfg)
        grads = bwd.triton_backward(q, k, v, o, lse, do, spec, config=pair)
        rec["max_diff_vs_plain"] = [float((a.float() - b.float()).abs().max()) for a, b in zip(grads, base)]

    def best(kernel):
        ok = [r for r in tiles if r["kernel"] == kernel and r["status"] == "ok"
              and max(r.get("max_diff_vs_plain", [0.0])) < 0.05]
        return tuple(min(ok, key=lambda r: r["ms"])["config"])

    chosen = (best("dkdv"), best("dq"))
    qc, kc, vc = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):   # the backward node it records is cuDNN's
        oc = F.scaled_dot_product_attention(qc, kc, vc, **sdpa_kwargs("sdpa-cudnn", spec))
    fns = {"plain": lambda: bwd.triton_backward(q, k, v, o, lse, do, spec, config=plain),
           "shipped": lambda: bwd.triton_backward(q, k, v, o, lse, do, spec),
           "chosen": lambda: bwd.triton_backward(q, k, v, o, lse, do, spec, config=chosen),
           "cudnn": lambda: torch.autograd.grad(oc, (qc, kc, vc), do, retain_graph=True)}
    timed = time_interleaved(fns, rounds=rounds)
    first = fns["chosen"]()
    repeats = sum(all(torch.equal(a, b) for a, b in zip(first, fns["chosen"]())) for _ in range(20))
    flops = 2.5 * fa_lab.attention_flops(B, H, N, N, D, causal=causal)     # a backward counts 2.5 forwards
    whole = {name: dict(ms=t["ms"], ms_p10=t["ms_p10"], ms_p90=t["ms_p90"], tflops=flops / t["ms"] / 1e9)
             for name, t in timed.items()}
    rates = ", ".join(f"{n} {w['tflops']:.0f}" for n, w in whole.items())
    print(f"({B},{H},{Hkv},{N},{D}{', causal' if causal else ''}) chosen {chosen}: {rates} TFLOP/s "
          f"({time.time() - t0:.0f} s)", flush=True)
    return dict(shape=[B, H, Hkv, N, D], causal=causal, plain=[list(c) for c in plain],
                shipped=[list(c) for c in shipped], chosen=[list(c) for c in chosen], tiles=tiles, backward=whole,
                chosen_bit_identical_calls=f"{repeats}/20")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiles", choices=sorted(TILE_SETS), default="split")
    parser.add_argument("--out", default=".", help="directory for the JSON")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--rows", default=None, help="indices into ROWS, comma-separated (default: all)")
    parser.add_argument("--no-reference", action="store_true", help="skip the float64 check")
    args = parser.parse_args()
    # the split tiles measure the split itself, which the library leaves off (bwd.WARP_SPECIALIZE_DKDV)
    bwd.WARP_SPECIALIZE_DKDV = args.tiles == "split"
    tile_set = TILE_SETS[args.tiles]
    rows = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
               date=time.strftime("%Y-%m-%dT%H:%M:%S"), command=f"python scripts/bench_bwd_ws.py --tiles {args.tiles}")
    if not args.no_reference:
        out["reference"] = reference_check(tile_set)
        print("float64 check, max |error| (dq, dk, dv):", out["reference"], flush=True)
    out["rows"] = []
    for shape in rows:
        if shape[4] not in tile_set:   # the split tiles were never drawn up for D = 256
            out["rows"].append(dict(shape=list(shape), status=f"skipped: no {args.tiles} tiles at D = {shape[4]}"))
            print(shape, out["rows"][-1]["status"], flush=True)
            continue
        try:
            out["rows"].append(row(*shape, args.rounds, tile_set))
        except Exception as exc:
            out["rows"].append(dict(shape=list(shape), status=f"error: {type(exc).__name__}: {str(exc)[:300]}"))
            print(shape, out["rows"][-1]["status"], flush=True)
        path = Path(args.out) / ("bwd_ws.json" if args.tiles == "split" else "bwd_desc.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
