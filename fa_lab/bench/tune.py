"""Tune the Triton forward's launch configurations ahead of time, so that no call waits for it.

Examples::

    fa-lab tune                                  # D 64/128/256 x none/causal x fp16/bf16 x N 512/4096/16384
    fa-lab tune --head-dim 128 --mask causal --dtype bf16 --seq-len 8192
    fa-lab tune --ship                           # maintainers: also into the package's shipped table

A configuration is tuned per key: dtype, head dim (padded to a power of two), the query and key
lengths' power-of-two buckets and the mask (``fa_lab.kernels.triton.config_key``).  The first call
of a key that neither the shipped table nor this machine's cache holds times only the winners of the
nearest tuned keys (a few seconds); this command runs the full search (dozens of candidates, timed on
the real inputs) beforehand, on inputs of ``--batch`` x ``--heads``
(default: 16 heads and as many sequences as make 16k tokens), and keeps the winners in the user
cache (``$FA_LAB_CACHE_DIR`` or ``~/.cache/fa_lab``).  Keys already cached by a full search (shipped
or tuned here before) are listed, not tuned again; a key that a call only chose quickly, among the
winners of nearby keys, gets the full search; ``--ship`` adds the keys tuned now to the shipped table.
Needs a CUDA GPU.
"""
from __future__ import annotations

import itertools
import json
import time

#: the keys a first call most likely meets: the head dims of today's models, both masks, both 16-bit types
DEFAULT_HEAD_DIMS = (64, 128, 256)
DEFAULT_SEQ_LENS = (512, 4096, 16384)
#: tokens per tuning problem (batch x sequence length), as in the book's seed table
TOKENS = 16384


def configure(parser) -> None:
    from fa_lab.cli import positive_int

    parser.add_argument("--head-dim", nargs="+", type=positive_int, default=list(DEFAULT_HEAD_DIMS), metavar="D")
    parser.add_argument("--mask", nargs="+", choices=("none", "causal"), default=["none", "causal"])
    parser.add_argument("--dtype", nargs="+", choices=("fp16", "bf16"), default=["fp16", "bf16"])
    parser.add_argument("--seq-len", nargs="+", type=positive_int, default=list(DEFAULT_SEQ_LENS), metavar="N")
    parser.add_argument("--heads", type=positive_int, default=16)
    parser.add_argument("--batch", type=positive_int, help=f"sequences per problem (default {TOKENS} // N, >= 1)")
    parser.add_argument("--ship", action="store_true",
                        help="also merge the results into the package's shipped table (fa_lab/data)")


def problems(args) -> list[dict]:
    """One tuning problem per (head dim, mask, dtype, length): shape, dtype and mask."""
    from fa_lab.core.dtypes import as_dtype

    out = []
    for d, mask, dtype, n in itertools.product(args.head_dim, args.mask, args.dtype, args.seq_len):
        batch = args.batch or max(1, TOKENS // n)
        out.append(dict(shape=(batch, args.heads, n, d), dtype=as_dtype(dtype), causal=mask == "causal"))
    return out


def ship(device: str, tuned: dict, path=None, capability: tuple[int, int] | None = None) -> None:
    """Merge ``{key: config}`` tuned on ``device`` into the shipped table (its note kept), with the
    device's compute ``capability``, through which GPUs of the same architecture find the entries."""
    from fa_lab.kernels.triton.config_cache import ConfigCache

    path = path or ConfigCache.SHIPPED
    table = json.loads(path.read_text())
    table.setdefault("configs", {}).setdefault(device, {}).update(tuned)
    if capability is not None:
        table.setdefault("devices", {})[device] = list(capability)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def run(args) -> int:
    import os
    import sys

    import fa_lab

    if not fa_lab.ON_GPU:
        print("fa-lab tune: tuning times the kernels on a CUDA GPU; this is the CPU world "
              f"({fa_lab.DEVICE}). Run it on the machine that will run the kernels.", file=sys.stderr)
        return 2
    before = os.environ.get("FA_LAB_TRITON_AUTOTUNE")
    os.environ["FA_LAB_TRITON_AUTOTUNE"] = "1"   # this command's purpose: tune every miss
    try:
        tuned = tune_all(problems(args))
    finally:
        if before is None:
            os.environ.pop("FA_LAB_TRITON_AUTOTUNE")
        else:
            os.environ["FA_LAB_TRITON_AUTOTUNE"] = before
    if args.ship and tuned:
        import torch

        from fa_lab.kernels.triton import CACHE

        ship(torch.cuda.get_device_name(), tuned, capability=torch.cuda.get_device_capability())
        print(f"{len(tuned)} keys merged into {CACHE.SHIPPED}")
    return 0


def tune_all(todo: list[dict]) -> dict:
    """Tune each problem's key that is not cached yet (GPU): ``{key: config}`` of the keys tuned now."""
    import sys

    import torch

    import fa_lab
    from fa_lab.core.spec import make_spec
    from fa_lab.kernels.triton import CACHE, config_key

    device = torch.cuda.get_device_name()
    tuned = {}
    for i, p in enumerate(todo, 1):
        q = torch.randn(*p["shape"], device="cuda", dtype=p["dtype"])
        key = config_key(make_spec(q, q, q, causal=p["causal"]), p["dtype"], "pipelined")
        cached = CACHE.get(device, key)
        if cached is not None and CACHE.search(device, key) == "full":
            print(f"[{i}/{len(todo)}] {key}: cached, {cached}", flush=True)
            continue
        print(f"[{i}/{len(todo)}] {key}: tuning on {tuple(p['shape'])} ...", flush=True)
        t0 = time.perf_counter()
        with torch.no_grad():
            fa_lab.attention(q, q, q, impl="triton", causal=p["causal"])
        torch.cuda.synchronize()
        # the user file's entry keeps the winner's time beside it, as the shipped table does
        cfg = CACHE.user_entries().get(device, {}).get(key)
        if cfg is None:   # the tuner keeps every winner; none means the call took another path
            print(f"[{i}/{len(todo)}] {key}: no configuration was tuned", file=sys.stderr)
            continue
        tuned[key] = cfg
        print(f"[{i}/{len(todo)}] {key}: {cfg} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return tuned
