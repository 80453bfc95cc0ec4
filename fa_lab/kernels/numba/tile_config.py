"""Chapter 3: the compile-time shape of the tiled kernel (``TileConfig``) and the shapes it uses.

A ``TileConfig`` fixes what ``fa_lab.kernels.numba.tiled`` compiles: the tile of queries and
keys a block owns, how its threads split that tile, the head dim it is padded to, and how K
and V go through shared memory.  ``check`` refuses a shape the kernel cannot run, with the
rule it breaks; ``GPU_CONFIGS`` and ``CPU_CONFIGS`` are the shapes each world uses per head dim.
"""
from __future__ import annotations

from dataclasses import dataclass

from fa_lab.core.world import ON_GPU

#: Head dims are padded up to one of these; each has its own compiled kernel.
HEAD_DIM_BUCKETS = (16, 32, 64, 128)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]

#: Floats per shared-memory load in the inner loops: runs of 4 are one 128-bit load.
VEC = 4

#: Shared memory a block gets without asking (48 KiB).  A kernel that needs more must opt in
#: before its launch (``bridge.allow_shared_bytes``), and only dynamic shared memory can grow.
STATIC_SHARED_LIMIT = 48 * 1024
#: The most shared memory one block can opt in to on an H100 (227 KiB; other GPUs allow less,
#: which the launch checks).
SHARED_LIMIT = 227 * 1024


@dataclass(frozen=True)
class TileConfig:
    """The compile-time shape of one tiled kernel."""

    block_m: int     # BLOCK_M: query rows per block
    block_n: int     # BLOCK_N: keys per K/V tile
    threads_m: int   # threads along the rows of the block
    threads_n: int   # threads along the keys (and along D in the P·V product)
    d_pad: int       # head dim the kernel is compiled for (inputs are zero-padded up to it)
    share_kv: bool = False  # K and V tiles take turns in one shared buffer (saves shared memory)
    max_registers: int | None = None  # cap per thread, so that more blocks fit on a multiprocessor

    @property
    def threads(self) -> int:
        return self.threads_m * self.threads_n

    @property
    def rows(self) -> int:   # query rows per thread
        return self.block_m // self.threads_m

    @property
    def keys(self) -> int:   # keys per thread in the S tile
        return self.block_n // self.threads_n

    @property
    def dims(self) -> int:   # output features per thread
        return self.d_pad // self.threads_n

    # Row strides of the shared tiles, in floats.  Q and K rows are padded by VEC floats, and so
    # are P rows: rows stay 16-byte aligned, and threads reading one column of different rows hit
    # different banks.  V rows need no padding (a thread reads runs along a row, never a column).
    @property
    def q_stride(self) -> int:
        return self.d_pad + VEC

    @property
    def k_stride(self) -> int:
        return self.d_pad + VEC

    @property
    def p_stride(self) -> int:
        return self.block_n + VEC

    @property
    def red_stride(self) -> int:   # a row's partial results, one per thread of the row, +1 against bank conflicts
        return self.threads_n + 1

    @property
    def v_at(self) -> int:
        """Where V starts in the K/V tile: after K, or in K's place when they take turns."""
        return 0 if self.share_kv else self.block_n * self.k_stride

    def shared_floats(self) -> dict[str, int]:
        """Floats of each shared tile: Q, K/V, P and the row scratch ``red``."""
        k, v = self.block_n * self.k_stride, self.block_n * self.d_pad
        return dict(q=self.block_m * self.q_stride,
                    kv=max(k, v) if self.share_kv else k + v,
                    p=self.block_m * self.p_stride,
                    red=self.block_m * self.red_stride)

    def shared_bytes(self) -> int:
        return 4 * sum(self.shared_floats().values())

    def dynamic_bytes(self) -> int:
        """The K/V tile, the one shared array sized at launch (only dynamic shared memory can pass 48 KiB)."""
        return 4 * self.shared_floats()["kv"]

    def static_bytes(self) -> int:
        """Q, P and the row scratch: static arrays, sized when the kernel is compiled."""
        return self.shared_bytes() - self.dynamic_bytes()

    def check(self) -> "TileConfig":
        for what, big, small in (("block_m", self.block_m, self.threads_m), ("block_n", self.block_n, self.threads_n),
                                 ("block_n", self.block_n, VEC),                  # P rows read in runs of VEC keys
                                 ("d_pad", self.d_pad, VEC * self.threads_n),     # V rows in runs of VEC features
                                 # and no K/V tile element left unloaded:
                                 ("block_n*d_pad", self.block_n * self.d_pad, self.threads)):
            if big % small:
                raise ValueError(f"{what}={big} must be a multiple of {small}: {self}")
        if 32 % self.threads_n:
            raise ValueError(f"threads_n={self.threads_n} must divide 32 (a row's threads are lanes of one warp): "
                             f"{self}")
        if self.shared_bytes() > SHARED_LIMIT:
            raise ValueError(f"{self} needs {self.shared_bytes()} bytes of shared memory, over {SHARED_LIMIT}")
        return self


# On the GPU (chosen by `scripts/bench_ch3.py --tune` on an H100): 128 threads per block up to
# D = 64, 64 keys a tile.  At D = 64 each thread owns a 4 x 8 register tile of S; the block needs
# 69 KiB of shared memory, more than the 48 KiB it gets without opting in, and 168 registers a
# thread, so 3 blocks share a multiprocessor.  Against 32-key tiles, half as many tiles means half
# as many barriers and rescalings of acc per key.  At D = 16 a thread's output features must still
# be runs of four (VEC), so only 4 threads share a row.  At D = 128 the 64 x 16 tile with K and V
# taking turns in one buffer, 64 threads each owning a 4 x 32 slice of the output, is as fast as
# any larger tile tried (docs/decisions/numba-vector-loads.md).
GPU_CONFIGS = {
    16: TileConfig(64, 64, 16, 4, 16, max_registers=168),
    32: TileConfig(64, 64, 16, 8, 32, max_registers=128),
    64: TileConfig(64, 64, 16, 8, 64, max_registers=168),
    128: TileConfig(64, 16, 16, 4, 128, share_kv=True),
}
# For a GPU that cannot give a block a GPU_CONFIGS shape's shared memory (Turing allows 64 KiB):
# 32-key tiles, under the 48 KiB every GPU gives.  The shape shipped before 64-key tiles.
SMALL_SHARED_CONFIGS = {
    64: TileConfig(64, 32, 16, 8, 64, max_registers=128),
}
# In the simulator every CUDA thread is a Python thread: 4 per block.
CPU_CONFIGS = {d: TileConfig(4, 4, 2, 2, d) for d in HEAD_DIM_BUCKETS}


def head_dim_bucket(head_dim: int) -> int:
    """The padded head dim a kernel is compiled for; ValueError above ``MAX_HEAD_DIM``."""
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"numba_tiled keeps a {MAX_HEAD_DIM}-wide accumulator per row on chip and supports "
                     f"head dims 1..{MAX_HEAD_DIM}; got head_dim={head_dim}")


def gpu_config(bucket: int, shared_limit: int) -> TileConfig:
    """The GPU shape for head-dim ``bucket`` on a GPU that lets one block take ``shared_limit`` bytes of
    shared memory: the tuned one, or its ``SMALL_SHARED_CONFIGS`` stand-in where it does not fit."""
    for cfg in (GPU_CONFIGS[bucket], SMALL_SHARED_CONFIGS.get(bucket)):
        if cfg is not None and cfg.shared_bytes() <= shared_limit:
            return cfg
    raise ValueError(f"numba_tiled at head dim {bucket} needs {GPU_CONFIGS[bucket].shared_bytes()} bytes of "
                     f"shared memory per block; this GPU allows {shared_limit}")


def config_for(head_dim: int) -> TileConfig:
    """The tile configuration used for ``head_dim`` in this world (on a GPU: one that fits it)."""
    bucket = head_dim_bucket(head_dim)
    if not ON_GPU:
        return CPU_CONFIGS[bucket]
    from fa_lab.kernels.numba.bridge import shared_bytes_optin

    return gpu_config(bucket, shared_bytes_optin())


__all__ = ["TileConfig", "HEAD_DIM_BUCKETS", "MAX_HEAD_DIM", "VEC", "STATIC_SHARED_LIMIT", "SHARED_LIMIT",
           "GPU_CONFIGS", "SMALL_SHARED_CONFIGS", "CPU_CONFIGS", "head_dim_bucket", "gpu_config", "config_for"]
