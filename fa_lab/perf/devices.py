"""GPU presets for the performance model: the datasheet numbers, and how to replace them by measurements.

Every figure is a *dense* peak (no 2:4 sparsity) at the boost clock, from the vendor's datasheet
or architecture whitepaper (cited next to each preset).  Two kinds of FLOP/s matter for attention:

* ``tensor`` — matrix-multiply-accumulate on the Tensor Cores, with an FP32 accumulator, which is
  what ``Q Kᵀ`` and ``P V`` use in every FlashAttention kernel.  GeForce cards (RTX 3090/4090/5080)
  run FP16/BF16 with an FP32 accumulator at *half* their advertised FP16-accumulate rate.
* ``cuda`` — ordinary FMA instructions on the CUDA cores (an FP32 FMA counts as 2 FLOPs), which is
  what a tiled kernel without Tensor Cores (chapter 3's Numba kernel) can reach.

``sfu_per_clk_per_sm`` is the special-function-unit throughput (``exp2``, ``rcp`` …): 16 results per
clock per SM on compute capability 8.x–12.0 (CUDA C++ Programming Guide, "Arithmetic
Instructions" throughput table).  It is the ceiling for the softmax's exponentials.

A *name* such as ``H100_80GB_fp16`` selects a device and a dtype; see :func:`select`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

TERA = 1e12
GB = 1e9

#: element size in bytes of each dtype the model knows: the torch dtypes of ``fa_lab.core.dtypes``
#: (fp64 aside: no GPU here has a float64 matmul peak worth modelling) and two that exist only in hardware
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "tf32": 4, "fp8": 1}
#: dtypes of the model only (Tensor Core formats without a torch dtype of their own here)
_MODEL_ONLY = {"tf32": "tf32", "fp8": "fp8", "float8": "fp8", "fp8_e4m3": "fp8"}


def canonical_dtype(dtype) -> str:
    """'fp16' for 'fp16', 'float16' or torch.float16 (``fa_lab.core.dtypes``), plus 'tf32' and 'fp8';
    raises ValueError for anything else."""
    from fa_lab.core.dtypes import short_name

    if isinstance(dtype, str) and dtype.strip().lower() in _MODEL_ONLY:
        return _MODEL_ONLY[dtype.strip().lower()]
    name = short_name(dtype)
    if name not in DTYPE_BYTES:
        raise ValueError(f"the performance model has no {name}; expected one of {list(DTYPE_BYTES)}")
    return name


@dataclass(frozen=True)
class Device:
    """What the roofline needs to know about one GPU."""

    name: str
    sm_count: int
    boost_clock_mhz: float
    hbm_bandwidth: float          # bytes/s (DRAM: HBM or GDDR)
    smem_per_sm: int              # bytes of shared memory per SM (the configurable maximum)
    l2_bytes: int
    memory_bytes: int
    tensor_flops: dict            # dtype → dense Tensor Core FLOP/s (FP32 accumulate)
    cuda_flops: dict              # dtype → CUDA-core FLOP/s (FMA = 2)
    sfu_per_clk_per_sm: int = 16  # exp2 / rcp results per clock per SM
    source: str = ""
    measured: dict = field(default_factory=dict)   # what was replaced by a measurement, and from where
    short: str = ""               # how prose names it: 'H100'

    @property
    def exp_rate(self) -> float:
        """Exponentials per second the special function units can produce."""
        return self.sfu_per_clk_per_sm * self.sm_count * self.boost_clock_mhz * 1e6

    def peak_flops(self, dtype: str, unit: str = "auto") -> float:
        """Peak matmul FLOP/s for ``dtype`` on ``unit`` ('tensor', 'cuda', or 'auto').

        'auto' is the Tensor Cores for 16-bit, TF32 and FP8, and the CUDA cores for 'fp32'
        (an FP32 kernel that does not opt into TF32, like chapter 3's Numba kernel).
        """
        dtype = canonical_dtype(dtype)
        if unit == "auto":
            unit = "cuda" if dtype == "fp32" else "tensor"
        table = {"tensor": self.tensor_flops, "cuda": self.cuda_flops}.get(unit)
        if table is None:
            raise ValueError(f"unit must be 'tensor', 'cuda' or 'auto', got {unit!r}")
        if dtype not in table:
            raise ValueError(f"{self.name} has no {unit} peak for {dtype}; known: {sorted(table)}")
        return table[dtype]

    @property
    def ridge(self) -> float:
        """FLOP per byte where the 16-bit Tensor Core roof meets the memory roof."""
        return self.tensor_flops["fp16"] / self.hbm_bandwidth

    def with_ceilings(self, ceilings: dict, source: str = "measured") -> "Device":
        """A copy whose peaks are replaced by measured ceilings.

        ``ceilings`` maps ``'copy_bytes_per_s'`` (a device-to-device copy, bytes read + written),
        ``'tensor_<dtype>'`` (a large matmul on the Tensor Cores, FLOP/s), ``'cuda_<dtype>'``
        (FP32 matmul with TF32 off) and ``'exp_per_s'`` (exponentials per second).  Unnamed
        figures keep their datasheet values; ``measured`` records what changed.
        """
        tensor, cuda = dict(self.tensor_flops), dict(self.cuda_flops)
        changes = {}
        bw, sfu = self.hbm_bandwidth, self.sfu_per_clk_per_sm
        for key, value in ceilings.items():
            if value is None:
                continue
            if key == "copy_bytes_per_s":
                bw = float(value)
            elif key.startswith("tensor_"):
                tensor[canonical_dtype(key[7:])] = float(value)
            elif key.startswith("cuda_"):
                cuda[canonical_dtype(key[5:])] = float(value)
            elif key == "exp_per_s":
                sfu = float(value) / (self.sm_count * self.boost_clock_mhz * 1e6)
            else:
                continue
            changes[key] = float(value)
        if not changes:
            raise ValueError(f"no known ceiling in {sorted(ceilings)}; expected copy_bytes_per_s, "
                             "tensor_<dtype>, cuda_<dtype> or exp_per_s")
        return dataclasses.replace(self, hbm_bandwidth=bw, tensor_flops=tensor, cuda_flops=cuda,
                                   sfu_per_clk_per_sm=sfu, measured={"source": source, **changes})

    def with_ceilings_file(self, path) -> "Device":
        """:meth:`with_ceilings` from a JSON file written by ``scripts/correlate_gpu.py``."""
        blob = json.loads(Path(path).read_text())
        return self.with_ceilings(ceilings_from_blob(blob), source=str(path))

    def summary(self) -> dict:
        return dict(name=self.name, sm_count=self.sm_count, boost_clock_mhz=self.boost_clock_mhz,
                    hbm_bandwidth=self.hbm_bandwidth, smem_per_sm=self.smem_per_sm, l2_bytes=self.l2_bytes,
                    tensor_flops=self.tensor_flops, cuda_flops=self.cuda_flops, exp_rate=self.exp_rate,
                    measured=self.measured)


def ceilings_from_blob(blob: dict) -> dict:
    """The ceilings dict out of a recording ({'meta':…, 'records':[{'name':…, 'value':…}]}) or a plain dict."""
    if "records" in blob:
        return {r["name"]: r["value"] for r in blob["records"] if r.get("value") is not None}
    return dict(blob.get("ceilings", blob))


# ---------------------------------------------------------------------------------------------
# Presets.  T = TFLOP/s dense.  Sources are the public datasheets / whitepapers named per entry.
# ---------------------------------------------------------------------------------------------
DEVICES: dict[str, Device] = {}


def _add(key, *aliases, **kw):
    dev = Device(**kw)
    for k in (key, *aliases):
        DEVICES[k.upper()] = dev
    return dev


# NVIDIA H100 Tensor Core GPU datasheet (SXM5 column) and the H100 architecture whitepaper:
# 132 SMs, max boost 1980 MHz; FP16/BF16 Tensor 989.4 T dense (1979 with sparsity), TF32 494.7 T,
# FP8 1978.9 T; FP32 66.9 T; FP16/BF16 non-Tensor 133.8 T; HBM3 3.35 TB/s, 80 GB; 50 MB L2;
# 228 KB shared memory per SM (up to 227 KB per block).
_add("H100_80GB", "H100", "H100_SXM", "H100_SXM_80GB",
     name="NVIDIA H100 SXM5 80GB", short="H100", sm_count=132, boost_clock_mhz=1980, hbm_bandwidth=3.35e12,
     smem_per_sm=228 * 1024, l2_bytes=50 * 2**20, memory_bytes=80 * GB,
     tensor_flops={"fp16": 989.4 * TERA, "bf16": 989.4 * TERA, "tf32": 494.7 * TERA, "fp8": 1978.9 * TERA},
     cuda_flops={"fp32": 66.9 * TERA, "fp16": 133.8 * TERA, "bf16": 133.8 * TERA},
     source="NVIDIA H100 datasheet (SXM5) + H100 whitepaper")

# NVIDIA H200 datasheet (SXM): the H100's compute (same GH100, 132 SMs, 1980 MHz: FP16/BF16 989 T
# dense, TF32 494.7 T, FP8 1979 T, FP32 67 T) with 141 GB of HBM3e at 4.8 TB/s; 50 MB L2.
_add("H200", "H200_141GB", "H200_SXM",
     name="NVIDIA H200 SXM 141GB", short="H200", sm_count=132, boost_clock_mhz=1980, hbm_bandwidth=4.8e12,
     smem_per_sm=228 * 1024, l2_bytes=50 * 2**20, memory_bytes=141 * GB,
     tensor_flops={"fp16": 989.4 * TERA, "bf16": 989.4 * TERA, "tf32": 494.7 * TERA, "fp8": 1978.9 * TERA},
     cuda_flops={"fp32": 66.9 * TERA, "fp16": 133.8 * TERA, "bf16": 133.8 * TERA},
     source="NVIDIA H200 datasheet (SXM)")

# NVIDIA A100 datasheet (SXM4 80GB) and the A100 (GA100) whitepaper: 108 SMs, boost 1410 MHz;
# FP16/BF16 Tensor 312 T dense, TF32 156 T; FP32 19.5 T; FP16 non-Tensor 78 T, BF16 non-Tensor 39 T;
# HBM2e 2039 GB/s; 40 MB L2; 164 KB shared memory per SM (of 192 KB L1/shared).
_add("A100_80GB", "A100", "A100_SXM_80GB",
     name="NVIDIA A100 SXM4 80GB", short="A100", sm_count=108, boost_clock_mhz=1410, hbm_bandwidth=2.039e12,
     smem_per_sm=164 * 1024, l2_bytes=40 * 2**20, memory_bytes=80 * GB,
     tensor_flops={"fp16": 312 * TERA, "bf16": 312 * TERA, "tf32": 156 * TERA},
     cuda_flops={"fp32": 19.5 * TERA, "fp16": 78 * TERA, "bf16": 39 * TERA},
     source="NVIDIA A100 80GB datasheet (SXM) + GA100 whitepaper")

# NVIDIA L4 datasheet (AD104, 58 SMs, boost 2040 MHz): FP16/BF16 Tensor 242 T *with sparsity* →
# 121 T dense, TF32 120 T sparse → 60 T dense, FP8 485 T sparse → 242.5 T dense; FP32 30.3 T;
# GDDR6 300 GB/s, 24 GB; 48 MB L2; 100 KB shared memory per SM (compute capability 8.9).
_add("L4", "L4_24GB",
     name="NVIDIA L4 24GB", short="L4", sm_count=58, boost_clock_mhz=2040, hbm_bandwidth=300 * GB,
     smem_per_sm=100 * 1024, l2_bytes=48 * 2**20, memory_bytes=24 * GB,
     tensor_flops={"fp16": 121 * TERA, "bf16": 121 * TERA, "tf32": 60 * TERA, "fp8": 242.5 * TERA},
     cuda_flops={"fp32": 30.3 * TERA, "fp16": 30.3 * TERA, "bf16": 30.3 * TERA},
     source="NVIDIA L4 datasheet")

# NVIDIA Ampere GA102 whitepaper (RTX 3090 column): 82 SMs, boost 1695 MHz; FP16 Tensor with FP16
# accumulate 142 T dense, with FP32 accumulate 71 T; BF16 (FP32 acc) 71 T; TF32 35.6 T; FP32 35.6 T;
# GDDR6X 936 GB/s, 24 GB; 6 MB L2; 100 KB shared memory per SM (compute capability 8.6).
_add("RTX3090", "RTX_3090", "RTX3090_24GB",
     name="NVIDIA GeForce RTX 3090", short="RTX 3090", sm_count=82, boost_clock_mhz=1695, hbm_bandwidth=936 * GB,
     smem_per_sm=100 * 1024, l2_bytes=6 * 2**20, memory_bytes=24 * GB,
     tensor_flops={"fp16": 71 * TERA, "bf16": 71 * TERA, "tf32": 35.6 * TERA},
     cuda_flops={"fp32": 35.6 * TERA, "fp16": 35.6 * TERA, "bf16": 35.6 * TERA},
     source="NVIDIA Ampere GA102 whitepaper (FP32-accumulate Tensor rates)")

# NVIDIA Ada Lovelace (AD102) whitepaper, RTX 4090 column: 128 SMs, boost 2520 MHz; FP16 Tensor with
# FP16 accumulate 330.3 T dense, with FP32 accumulate 165.2 T; BF16 165.2 T; TF32 82.6 T;
# FP8 (FP32 acc) 330.3 T; FP32 82.6 T; GDDR6X 1008 GB/s, 24 GB; 72 MB L2; 100 KB shared memory per SM.
_add("RTX4090", "RTX_4090", "RTX4090_24GB",
     name="NVIDIA GeForce RTX 4090", short="RTX 4090", sm_count=128, boost_clock_mhz=2520, hbm_bandwidth=1008 * GB,
     smem_per_sm=100 * 1024, l2_bytes=72 * 2**20, memory_bytes=24 * GB,
     tensor_flops={"fp16": 165.2 * TERA, "bf16": 165.2 * TERA, "tf32": 82.6 * TERA, "fp8": 330.3 * TERA},
     cuda_flops={"fp32": 82.6 * TERA, "fp16": 82.6 * TERA, "bf16": 82.6 * TERA},
     source="NVIDIA Ada Lovelace whitepaper (FP32-accumulate Tensor rates)")

# NVIDIA RTX Blackwell (GB203) whitepaper / RTX 5080 specifications: 84 SMs (10752 CUDA cores),
# boost 2617 MHz; FP16/BF16 Tensor with FP32 accumulate 112.6 T dense (225.1 T with FP16 accumulate),
# TF32 56.3 T, FP8 (FP32 acc) 225.1 T; FP32 56.3 T (84 × 128 × 2 × 2.617 GHz); GDDR7 30 Gbps × 256 bit
# = 960 GB/s, 16 GB; 64 MB L2; 100 KB shared memory per SM (compute capability 12.0).
_add("RTX5080", "RTX_5080", "RTX5080_16GB",
     name="NVIDIA GeForce RTX 5080", short="RTX 5080", sm_count=84, boost_clock_mhz=2617, hbm_bandwidth=960 * GB,
     smem_per_sm=100 * 1024, l2_bytes=64 * 2**20, memory_bytes=16 * GB,
     tensor_flops={"fp16": 112.6 * TERA, "bf16": 112.6 * TERA, "tf32": 56.3 * TERA, "fp8": 225.1 * TERA},
     cuda_flops={"fp32": 56.3 * TERA, "fp16": 56.3 * TERA, "bf16": 56.3 * TERA},
     source="NVIDIA RTX Blackwell whitepaper (FP32-accumulate Tensor rates)")


def device_names() -> list[str]:
    """The preset keys (each also reachable as ``<KEY>_<dtype>``, e.g. ``H100_80GB_fp16``)."""
    seen, names = set(), []
    for key, dev in DEVICES.items():
        if id(dev) not in seen:
            seen.add(id(dev))
            names.append(key)
    return names


def get_device(name) -> Device:
    """The preset called ``name`` (a :class:`Device` is returned as it is)."""
    if isinstance(name, Device):
        return name
    try:
        return DEVICES[name.upper().replace("-", "_")]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(device_names())}") from None


def select(name: str) -> tuple[Device, str]:
    """``'H100_80GB_fp16'`` → (the H100 preset, 'fp16'); a bare device name means fp16."""
    key = name.upper().replace("-", "_")
    head, _, tail = key.rpartition("_")
    if head:
        try:
            return get_device(head), canonical_dtype(tail.lower())
        except ValueError:   # not a dtype: the whole name is the device's ('H100_80GB')
            pass
    return get_device(key), "fp16"


def sim_device_names() -> list[str]:
    """Every ``<device>_<dtype>`` the presets give a peak for (what ``--sim-device`` lists)."""
    out = []
    for key in device_names():
        dev = DEVICES[key]
        for dt in DTYPE_BYTES:
            if dt in dev.tensor_flops or (dt == "fp32" and "fp32" in dev.cuda_flops):
                out.append(f"{key}_{dt}")
    return out


def preset_for(gpu_name: str) -> Device | None:
    """The preset for a GPU name as the driver reports it ('NVIDIA H100 80GB HBM3' → H100_80GB), or None."""
    name = str(gpu_name).upper().replace(" ", "")
    for key, probe in (("H100_80GB", "H100"), ("H200", "H200"), ("A100_80GB", "A100"), ("L4", "L4"),
                       ("RTX3090", "3090"), ("RTX4090", "4090"), ("RTX5080", "5080")):
        if probe in name:
            return DEVICES[key]
    return None


def current_device(measured_ceilings=None) -> Device | None:
    """The preset matching the GPU torch sees (None without a GPU or for an unknown GPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    dev = preset_for(torch.cuda.get_device_name(0))
    return dev.with_ceilings(measured_ceilings) if dev is not None and measured_ceilings else dev
