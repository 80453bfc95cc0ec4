"""Chapter 11: reading Nsight Compute's CSV pages and SASS, the capture script's plumbing, and the chapter.

The tests read the shipped recording, ``fa_lab/data/gpu_profile.json`` and ``fa_lab/data/ncu/`` (one run of
``scripts/profile_ncu.py`` on an H100), and check the readers against the same files read by hand with the
csv module, against chapter 6's model counted by hand, and against identities any ncu report keeps (the
stall reasons add up to the warp cycles per issued instruction, the two pages agree).  Format cases the
recording lacks (sampled stall counts, other SASS listings, ncu 2024's CSV rows with empty rule columns)
are small samples written here or in the script's ``--smoke``, none of them a GPU recording.
"""
import csv
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from script_loader import load_script

from fa_lab.core.data import DATA_DIR
from fa_lab.figures import profiling
from fa_lab.perf import ncu, sass
from fa_lab.perf.devices import get_device

ROOT = Path(__file__).resolve().parents[1]
NCU_DIR = DATA_DIR / ncu.SUBDIR
DETAILS = NCU_DIR / ncu.DETAILS
RAW = NCU_DIR / ncu.RAW
RECORDING = json.loads((DATA_DIR / f"{ncu.RECORDING}.json").read_text(encoding="utf-8"))
META, RECORDS = RECORDING["meta"], RECORDING["records"]
NOTEBOOK = ROOT / "book" / "11_profiling.ipynb"
SOL = "GPU Speed Of Light Throughput"
#: ncu's units, by hand: factor to bytes, seconds or hertz
UNITS = {"ns": 1e-9, "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6,
         "Gbyte": 1e9, "byte/s": 1.0, "hz": 1.0, "%": 1.0, "register/thread": 1.0, "cycle": 1.0}


def by_hand(path):
    """Header and rows of a recorded CSV page, with the csv module alone."""
    rows = list(csv.reader(path.read_text(encoding="utf-8").splitlines()))
    return rows[0], rows[1:]


def hand_number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return math.nan


def details_by_hand():
    """{(id, section, metric): (unit, value as text)} and the launches' kernel names, in launch order."""
    header, rows = by_hand(DETAILS)
    col = {name: header.index(name) for name in ("ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit",
                                                 "Metric Value")}
    metrics, kernels = {}, {}
    for r in rows:
        kernels.setdefault(int(r[col["ID"]]), r[col["Kernel Name"]])
        if r[col["Metric Name"]]:
            metrics[(int(r[col["ID"]]), r[col["Section Name"]], r[col["Metric Name"]])] = (r[col["Metric Unit"]],
                                                                                          r[col["Metric Value"]])
    return metrics, kernels


def raw_by_hand():
    """{id: {metric: value in base units}} from the raw page's units row and launch rows."""
    header, rows = by_hand(RAW)
    units, launches = rows[0], rows[1:]
    first = header.index("CC") + 1
    out = {}
    for r in launches:
        out[int(r[0])] = {name: hand_number(text) * UNITS.get(unit, 1.0)
                          for name, unit, text in zip(header[first:], units[first:], r[first:])}
    return out


@pytest.fixture(scope="module")
def profile():
    p = ncu.load()
    assert p is not None
    return p


@pytest.fixture(scope="module")
def launches(profile):
    return profile.launches()


def one(launches, case, kernel):
    hit = launches[(launches["case"] == case) & (launches["kernel"] == kernel)]
    assert len(hit) == 1, (case, kernel)
    return hit.iloc[0]


# ---------------------------------------------------------------------------- the shipped recording

def test_every_launch_has_its_duration_and_dram_bytes():
    metrics, kernels = details_by_hand()
    raw = raw_by_hand()
    assert META["statuses"] == {"ncu": "ok", "cases": "ok"}
    assert sorted(kernels) == sorted(r["id"] for r in RECORDS) == sorted(raw)
    for r in RECORDS:
        assert r["status"] == "ok"
        unit, text = metrics[(r["id"], SOL, "Duration")]
        assert hand_number(text) * UNITS[unit] > 0
        assert raw[r["id"]]["dram__bytes_read.sum"] > 0 and raw[r["id"]]["dram__bytes_write.sum"] > 0
        assert ncu.short_name(kernels[r["id"]]) == r["kernel"]


def test_load_labels_exactly_the_recorded_cases(profile, launches):
    cases = META["cases"]
    assert set(launches["case"]) == set(cases)
    for case, spec in cases.items():
        ran = launches[launches["case"] == case]["kernel"].tolist()
        assert ran == [k for k in spec["kernels"] if k in ran]          # in the plan's order
        optional = load_script("profile_ncu").OPTIONAL
        assert set(spec["kernels"]) - set(ran) <= optional    # only an optional kernel may be missing
    # the decoding case ran with one split: one program per (batch, KV head), so no merge kernel
    B, _, Hkv, _, _, _ = cases["decode"]["shape"]
    assert one(launches, "decode", "decode_split_kv")["blocks"] == B * Hkv
    assert "combine_kernel" not in set(launches["kernel"])
    assert launches["duration_s"].notna().all() and launches["dram_bytes"].notna().all()


# ---------------------------------------------------------------------------- ncu's CSV pages

def test_details_page_parses_every_number_to_base_units():
    header, _ = ncu.csv_table(DETAILS)
    assert header == by_hand(DETAILS)[0]
    metrics, kernels = details_by_hand()
    d = ncu.read_details(DETAILS)
    assert len(d) == len(metrics)
    assert d.drop_duplicates("id")["kernel"].tolist() == [ncu.short_name(kernels[i]) for i in sorted(kernels)]
    checked = 0
    for row in d.itertuples():
        unit, text = metrics[(row.id, row.section, row.metric)]
        value = hand_number(text)
        if math.isnan(value):       # a word ("PolicySpread"), kept as text
            assert math.isnan(row.value) and row.text == text
        elif unit in UNITS:
            assert row.value == pytest.approx(value * UNITS[unit], rel=1e-12), (row.metric, unit, text)
            checked += 1
    assert checked > len(d) / 2
    assert any("," in text for _, text in metrics.values())       # thousands separators were there to read


def test_rules_are_the_rows_without_a_metric():
    rules = ncu.read_rules(DETAILS)
    header, rows = by_hand(DETAILS)
    name, speedup = header.index("Rule Name"), header.index("Estimated Speedup")
    advice = [r for r in rows if len(r) > name and r[name]]
    assert len(rules) == len(advice) > 0
    assert set(rules["type"]) <= {"OPT", "WRN", "INF"}
    expected = [hand_number(r[speedup]) if r[speedup] else math.nan for r in advice]
    assert [x if x == x else None for x in rules["speedup"]] == [x if x == x else None for x in expected]


def test_cut_details_leaves_out_only_the_rules_descriptions():
    header, rows = by_hand(DETAILS)
    column = header.index("Rule Description")
    full = DETAILS.read_text(encoding="utf-8").splitlines()
    # a rule row with its description, as ncu writes one: the cut keeps every other field and every other line
    rule = list(next(r for r in rows if len(r) > column and r[header.index("Rule Name")]))
    rule[column] = "a paragraph of advice"
    sample = "\n".join([full[0], full[1], '"' + '","'.join(rule) + '"']) + "\n"
    cut = ncu.cut_details(sample)
    assert cut.splitlines()[:2] == full[:2] and ncu.cut_details(cut) == cut
    assert next(csv.reader([cut.splitlines()[2]]))[column] == ""
    assert ncu.read_rules(cut)["description"].tolist() == [""]
    assert all(len(r) <= column or r[column] == "" for r in rows)   # the shipped page is cut


def test_raw_page_units_row_and_values():
    raw = ncu.read_raw(RAW)
    by_hand_values = raw_by_hand()
    assert sorted(raw["id"].unique()) == sorted(by_hand_values)
    for row in raw.itertuples():
        expected = by_hand_values[row.id][row.metric]
        assert (math.isnan(row.value) and math.isnan(expected)) or row.value == pytest.approx(expected, rel=1e-12)
    time = raw[raw["metric"] == "gpu__time_duration.sum"]
    assert set(time["unit"]) == {"second"} and time["value"].between(1e-6, 1).all()


def test_headline_agrees_between_pages(profile, launches):
    head = launches.set_index("id")
    raw = profile.raw.pivot_table(index="id", columns="metric", values="value")
    assert (head["duration_s"] - raw["gpu__time_duration.sum"]).abs().max() < 1e-12
    assert (head["l2_hit_pct"] - raw["lts__t_sector_hit_rate.pct"]).abs().max() < 1e-9
    assert (head["registers"] == raw["launch__registers_per_thread"]).all()
    assert (head["dram_bytes"] == raw["dram__bytes_read.sum"] + raw["dram__bytes_write.sum"]).all()
    assert (head["limit_registers"] == raw["launch__occupancy_limit_registers"]).all()
    assert (head["limit_shared"] == raw["launch__occupancy_limit_shared_mem"]).all()
    assert (head["sm_pct"] - raw["sm__throughput.avg.pct_of_peak_sustained_elapsed"]).abs().max() < 1e-9


def test_occupancy_limits_follow_the_chapter_formulas(launches):
    head = launches.set_index("id")
    # registers are allocated per warp in units of 256: R rounded up to a multiple of 8
    per_block = (head["registers"] / 8).apply(math.ceil) * 8 * head["threads"]
    assert ((65536 // per_block).clip(upper=32) == head["limit_registers"]).all()
    smem = head["smem_dynamic"] + head["smem_static"] + head["smem_driver"]
    assert ((head["smem_config"] // smem).clip(upper=32) == head["limit_shared"]).all()
    assert (head["limit_warps"] == 64 // (head["threads"] / 32)).all()
    limits = head[list(ncu.LIMITS)]
    assert (head["blocks_per_sm"] == limits.min(axis=1)).all()
    for i, row in limits.iterrows():
        assert head.loc[i, "limiter"] == " and ".join(ncu.LIMITS[c] for c in ncu.LIMITS if row[c] == row.min())
    # theoretical occupancy is the limiting blocks' warps out of 64
    warps = head["threads"] / 32 * head["blocks_per_sm"]
    assert ((warps / 64 * 100).clip(upper=100) - head["theoretical_occupancy_pct"]).abs().max() < 0.01
    assert (head["achieved_occupancy_pct"] <= head["theoretical_occupancy_pct"] + 0.5).all()


def test_stall_reasons_add_up_to_the_cycles_per_issued_instruction(profile, launches):
    stalls = profile.stalls()
    head = launches.set_index("id")
    total = stalls.groupby("id")["cycles"].sum()
    # ncu prints each of the ~20 ratios to two decimals, so their sum may drift by up to 0.005 each; and the two
    # come from different replay passes, which with the clocks unlocked differ by about a percent
    drift = stalls.groupby("id").size() * 0.005 + 0.02 * head["warp_cycles_per_issue"]
    assert ((total - head["warp_cycles_per_issue"]).abs() <= drift).all()
    assert (stalls.groupby("id")["share"].sum() - 1).abs().max() < 1e-9
    assert not stalls["reason"].str.contains("not_issued").any()
    # the first row of each launch is its largest ratio on the raw page
    pattern = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
    for i, metrics in raw_by_hand().items():
        ratios = {pattern.match(m).group(1): v for m, v in metrics.items()
                  if pattern.match(m) and not m.endswith("not_issued_per_issue_active.ratio")}
        assert stalls[stalls["id"] == i].iloc[0]["reason"] == max(ratios, key=ratios.get)


def test_stall_reasons_from_samples_when_no_ratios():
    raw = pd.DataFrame([dict(id=0, kernel="k", metric=m, unit="", value=v) for m, v in (
        ("smsp__pcsamp_warps_issue_stalled_wait", 30.0), ("smsp__pcsamp_warps_issue_stalled_barrier", 10.0),
        ("smsp__pcsamp_warps_issue_stalled_barrier_not_issued", 99.0), ("dram__bytes_read.sum", 5.0))])
    s = ncu.stall_reasons(raw)
    assert s["reason"].tolist() == ["wait", "barrier"] and s["share"].tolist() == [0.75, 0.25]
    assert set(s["kind"]) == {"samples"}


@pytest.mark.parametrize("value,unit,expected", [
    (1.5, "usecond", (1.5e-6, "second")), (974176, "ns", (974176e-9, "second")), (2, "Kbyte", (2000, "byte")),
    (3, "Gbyte/s", (3e9, "byte/second")), (3, "byte/s", (3, "byte/second")),
    (48, "Kbyte/block", (48000, "byte/block")), (1.755, "cycle/nsecond", (1.755e9, "hz")), (1.5, "Ghz", (1.5e9, "hz")),
    (71.3, "%", (71.3, "%")), (156, "register/thread", (156, "register/thread"))])
def test_units_to_base(value, unit, expected):
    got = ncu.to_base(value, unit)
    assert got[1] == expected[1] and got[0] == pytest.approx(expected[0])


def test_numbers_and_kernel_names():
    assert ncu.number("1,052,160") == 1052160 and math.isnan(ncu.number("n/a")) and math.isnan(ncu.number("(1, 2)"))
    numba = ("cudapy::fa_lab::kernels::numba::tiled::build_kernel::_3clocals_3e::flash_attention_fwd"
             "[abi:v1,cw51cXTLSU]( Array<float, 1, C, mutable, aligned>, long long)")
    assert ncu.short_name(numba) == "flash_attention_fwd"
    assert ncu.short_name("attn_fwd") == "attn_fwd"
    assert ncu.short_name("void cutlass::Kernel<Params>(Params)") == "Kernel"


def test_bound():
    assert ncu.bound(78, 71) == "compute" and ncu.bound(12, 86) == "memory" and ncu.bound(55, 40) == "latency"


def test_csv_table_needs_a_header():
    with pytest.raises(ValueError, match="no ncu CSV"):
        ncu.csv_table("==PROF== Disconnected\n")


# ---------------------------------------------------------------------------- launches to cases

PLAN = [("fwd", "attn_fwd", False), ("bwd", "bwd_dkdv", False), ("bwd", "bwd_dq", False),
        ("decode", "decode_split_kv", False), ("decode", "combine_kernel", True)]


def test_assign_cases():
    launched = [(0, "attn_fwd"), (1, "bwd_dkdv"), (2, "bwd_dq"), (3, "decode_split_kv"), (4, "combine_kernel")]
    assert ncu.assign_cases(launched, PLAN) == {0: ("fwd", "attn_fwd"), 1: ("bwd", "bwd_dkdv"),
                                                2: ("bwd", "bwd_dq"), 3: ("decode", "decode_split_kv"),
                                                4: ("decode", "combine_kernel")}
    assert ncu.assign_cases(launched[:4], PLAN)[3] == ("decode", "decode_split_kv")   # the merge did not run: fine
    numba = [(0, "_ZN6cudapy6fa_lab7kernels5numba5tiled12build_kernel12_3clocals_3e19flash_attention_fwdB2v1"
                 "B6cw51cXE5ArrayIfLi1E1C7mutable7alignedE")]
    assert ncu.assign_cases(numba, [("numba_tiled", "flash_attention_fwd", False)]) == {
        0: ("numba_tiled", "flash_attention_fwd")}
    with pytest.raises(ValueError, match="does not follow"):
        ncu.assign_cases([(0, "attn_fwd"), (1, "bwd_dq")], PLAN)
    with pytest.raises(ValueError, match="no profiled launch"):
        ncu.assign_cases(launched[:2], PLAN)
    with pytest.raises(ValueError, match="does not follow"):
        ncu.assign_cases([*launched, (5, "attn_fwd")], PLAN)


def test_the_recorded_launches_follow_the_plan():
    _, kernels = details_by_hand()
    plan = load_script("profile_ncu").plan(list(META["cases"]))
    got = ncu.assign_cases([(i, kernels[i]) for i in sorted(kernels)], plan)
    assert got == {r["id"]: (r["case"], r["kernel"]) for r in RECORDS}


# ---------------------------------------------------------------------------- SASS

CUOBJDUMP = """
        code for sm_90a
                Function : attn_fwd
        .headerflags    @"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                      /* 0x00000a00ff017b82 */
                                                                               /* 0x000fe40000000800 */
        /*0010*/                   FFMA R2, R3, R4, R5 ;                       /* 0x0000000403027223 */
                                                                               /* 0x000fe20000000005 */
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0030*/                   MUFU.EX2 R3, R3 ;
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R88, R56, gdesc[UR12], R88 ;
        /*0050*/              @!P0 BRA 0x20 ;
        /*0060*/                   FFMA R2, R3, R4, R5 ;
        /*0070*/                   FFMA R2, R3, R4, R5 ;
        /*0080*/                   FFMA R2, R3, R4, R5 ;
        /*0090*/               @P1 BRA 0x60 ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   BRA 0xb0 ;
"""
TRITON = """Function:attn_fwd
--:-:-:Y:4\tLDC R1, c[0x0][0x28];
--:-:-:-:2\tFFMA R2, R3, R4, R5;
LBB0:
--:-:-:-:1\tHGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT;
--:-:0:-:1\tMUFU.EX2 R3, R3;
--:-:-:-:1\tHGMMA.64x128x16.F32.BF16 R88, R56, gdesc[UR12], R88;
--:-:-:-:5\t@!P0 BRA LBB0;
LBB1:
--:-:-:-:1\tFFMA R2, R3, R4, R5;
--:-:-:-:1\tFFMA R2, R3, R4, R5;
--:-:-:-:1\tFFMA R2, R3, R4, R5;
--:-:-:-:5\t@P1 BRA LBB1;
--:-:-:Y:5\tEXIT;
LBB2:
--:-:-:Y:0\tBRA LBB2;
"""
NVDISASM = """
        .text.attn_fwd:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   FFMA R2, R3, R4, R5 ;
.L_x_0:
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0030*/                   MUFU.EX2 R3, R3 ;
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R88, R56, gdesc[UR12], R88 ;
        /*0050*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0060*/                   FFMA R2, R3, R4, R5 ;
        /*0070*/                   FFMA R2, R3, R4, R5 ;
        /*0080*/                   FFMA R2, R3, R4, R5 ;
        /*0090*/               @P1 BRA `(.L_x_1) ;
        /*00a0*/                   EXIT ;
.L_x_2:
        /*00b0*/                   BRA `(.L_x_2) ;
"""


@pytest.mark.parametrize("text", [CUOBJDUMP, TRITON, NVDISASM], ids=["cuobjdump", "triton", "nvdisasm"])
def test_sass_formats_give_the_same_loops(text):
    instrs = sass.parse(text)
    assert [r["op"] for r in instrs][:3] == ["LDC", "FFMA", "HGMMA.64x128x16.F32.BF16"] and len(instrs) == 12
    found = sass.loops(instrs)
    assert [(lp["start"], lp["end"]) for lp in found] == [(0x20, 0x50), (0x60, 0x90)]   # not the BRA to itself
    main = sass.main_loop(instrs)                     # the Tensor Core loop, though the FFMA loop is as long
    assert main["start"] == 0x20 and main["counts"]["HGMMA"] == 2 and main["counts"]["MUFU.EX2"] == 1
    assert sass.mma_flops(main["body"]) == 2 * 2 * 64 * 128 * 16
    s = sass.summary(text)
    assert (s["loop_hgmma"], s["loop_mufu_ex2"], s["loop_instructions"], s["total_ffma"], s["loops"]) == (2, 1, 4, 4, 2)
    # an excerpt keeps no labels: its branch back names the loop's start by address, in every format
    assert sass.excerpt(instrs, main).splitlines()[-1] == "/*0050*/  @!P0 BRA 0x20 ;"
    assert sass.parse(sass.excerpt(instrs, main))[-1]["target"] == 0x20


def test_main_loop_is_the_innermost_of_equals_and_excerpt_keeps_the_branch():
    body = "\n".join(f"        /*{16 * i:04x}*/   {op} ;" for i, op in enumerate(
        ["MOV R1, R2", "HGMMA.64x64x16.F32.F16 R4, gdesc[UR4], R4", "FFMA R1, R1, R1, R1", "@P0 BRA 0x10",
         "@P1 BRA 0x0", "EXIT"]))
    instrs = sass.parse(body)
    main = sass.main_loop(instrs)
    assert (main["start"], main["end"]) == (0x10, 0x30)
    text = sass.excerpt(instrs, None, max_lines=4)
    assert "2 instructions left out" in text and text.rstrip().endswith("EXIT ;")
    assert sass.opcode("@!UP0 MUFU.EX2 R1, R2") == "MUFU.EX2" and sass.family("MUFU.RCP") == "MUFU.RCP"
    assert sass.main_loop(sass.parse("        /*0000*/   EXIT ;")) is None


def test_a_wait_retried_after_the_kernels_end_is_no_loop():
    # the layout of a Triton kernel with TMA copies: a barrier wait whose retry sits after EXIT and jumps back
    # into the loop; the address range from that jump's target to it holds the epilogue and EXIT
    ops = ["MOV R1, R2",                                               # 0x00
           "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], RZ",             # 0x10 the loop: wait for a copy
           "@!P0 BRA 0xa0",                                           # 0x20 not there yet: the retry
           "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT",       # 0x30
           "MUFU.EX2 R3, R3",                                          # 0x40
           "HGMMA.64x128x16.F32.BF16 R88, R56, gdesc[UR12], R88",      # 0x50
           "@P1 BRA 0x10",                                            # 0x60 the loop's branch back
           "FFMA R2, R3, R4, R5",                                      # 0x70 the epilogue
           "@P5 EXIT",                                                 # 0x80 a predicated EXIT: inside a span is fine
           "EXIT",                                                     # 0x90
           "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], RZ",             # 0xa0 the retry
           "@!P0 BRA 0xa0",                                           # 0xb0
           "BRA 0x30"]                                                 # 0xc0 back to after the wait
    instrs = sass.parse("\n".join(f"        /*{16 * i:04x}*/   {op} ;" for i, op in enumerate(ops)))
    assert [(lp["start"], lp["end"]) for lp in sass.loops(instrs)] == [(0xa0, 0xb0), (0x10, 0x60)]
    main = sass.main_loop(instrs)
    assert (main["start"], main["end"]) == (0x10, 0x60) and main["counts"]["FFMA"] == 0


def test_recorded_sass_counts_match_their_excerpts(profile):
    assert set(zip(profile.sass["case"], profile.sass["kernel"])) == {(r["case"], r["kernel"]) for r in RECORDS}
    for _, row in profile.sass.iterrows():
        text = profile.sass_text(row["case"], row["kernel"])
        kept = sass.parse(text)
        families = [sass.family(r["op"]) for r in kept]
        if "left out" not in text:
            assert len(kept) == row["loop_instructions"]
            assert families.count("HGMMA") == row["loop_hgmma"] and families.count("MUFU.EX2") == row["loop_mufu_ex2"]
        else:
            assert len(kept) < row["loop_instructions"] and families.count("HGMMA") <= row["loop_hgmma"]
        assert kept[0]["address"] == row["loop_start"] and kept[-1]["address"] == row["loop_end"]
        assert kept[-1]["op"] == "BRA"
        # the branch back, by address; an excerpt of an nvdisasm listing may name a label it no longer holds
        assert kept[-1]["target"] == row["loop_start"] or (kept[-1]["target"] is None and "`(" in kept[-1]["text"])
        for family in ("hgmma", "mufu_ex2", "ffma"):
            assert row[f"loop_{family}"] <= row[f"total_{family}"]


# ---------------------------------------------------------------------------- the chapter's reading

def test_model_traffic_matches_a_count_by_hand(launches):
    moved = profiling.traffic(launches, get_device("H100")).set_index("launch")
    B, H, _, N, _, D = META["cases"]["fwd"]["shape"]
    block_m = profiling.config(one(launches, "fwd", "attn_fwd"))["BLOCK_M"]
    compulsory = 4 * B * H * N * D * 2 + 4 * B * H * N          # q, k, v, o in bf16 and lse in fp32
    fwd = moved.loc["Triton forward"]
    assert fwd["compulsory_bytes"] == compulsory
    streamed = B * H * N * D * 2 * 2 + B * H * (N // block_m) * 2 * N * D * 2 + 4 * B * H * N   # K/V per query block
    assert fwd["streamed_bytes"] == streamed
    assert fwd["dram_vs_compulsory"] == pytest.approx(fwd["dram_bytes"] / compulsory)
    B, H, Hkv, Nq, Nk, D = META["cases"]["decode"]["shape"]
    decode = moved.loc["decode"]
    assert decode["compulsory_bytes"] == 2 * B * Hkv * Nk * D * 2 + 2 * B * H * Nq * D * 2 + 4 * B * H * Nq
    assert "backward dK/dV, causal" not in moved.index


def test_kernel_flops_and_roofline_points(launches):
    fwd, causal = one(launches, "fwd", "attn_fwd"), one(launches, "fwd_causal", "attn_fwd")
    B, H, _, N, _, D = META["cases"]["fwd"]["shape"]
    assert profiling.kernel_flops(fwd) == 4 * B * H * N ** 2 * D
    assert profiling.kernel_flops(causal) == 4 * B * H * N ** 2 * D / 2
    assert profiling.kernel_flops(one(launches, "bwd_causal", "bwd_dkdv_ws")) == 2 * profiling.kernel_flops(causal)
    assert profiling.scores(fwd) == B * H * N ** 2 and profiling.scores(causal) == B * H * N ** 2 / 2
    merge = pd.Series(dict(fwd.to_dict(), kernel="combine_kernel"))
    assert profiling.kernel_flops(merge) == 0
    points = profiling.roofline_points(launches).set_index("launch")
    assert len(points) == len(launches)
    p = points.loc["Triton forward"]
    assert p["intensity_dram"] == pytest.approx(p["flops"] / fwd["dram_bytes"])
    assert p["flop_rate"] == pytest.approx(p["flops"] / fwd["duration_s"])
    for _, r in launches.iterrows():
        q = points.loc[profiling.label(r["case"], r["kernel"])]
        assert q["bound"] == ncu.bound(r["sm_pct"], r["memory_pct"])
        assert q["unit"] == ("cuda" if r["dtype"] == "float32" else "tensor")


def test_sass_loops_against_the_algorithm(profile, launches):
    loops = profiling.sass_loops(profile, launches).set_index("launch")
    for case in ("fwd", "fwd_causal"):
        row, cfg = one(launches, case, "attn_fwd"), profiling.config(one(launches, case, "attn_fwd"))
        bm, bn, warps, d = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], int(row["head_dim"])
        got = loops.loc[profiling.label(case, "attn_fwd")]
        assert got["mma_flops_needed"] == 2 * 2 * bm / max(1, warps // 4) * bn * d
        assert got["scores_per_thread"] == bm * bn / (32 * warps) and got["emu"] == bool(cfg.get("emu"))
        ratio = got["mma_flops_issued"] / got["mma_flops_needed"]
        if ratio == round(ratio):
            assert got["iterations"] == ratio
            assert got["ex2_per_score"] == got["mufu_ex2"] / (ratio * bm * bn / (32 * warps))
        else:              # a span over more than one loop: nothing per iteration
            assert math.isnan(got["iterations"]) and math.isnan(got["ex2_per_score"])
    # the plain forward compiles one key loop: its hot loop is one iteration of it
    assert loops.loc["Triton forward", "iterations"] == 1


def test_recorded_values(profile, launches):
    none = profiling.recorded_values(None)
    model_facts = {"ridge", "kv_head", "l2_size"}
    assert all(v == ncu.NOT_RECORDED for k, v in none.items() if k not in model_facts)
    device = get_device("H100")
    assert none["l2_size"] == f"{device.l2_bytes / 2**20:.0f} MiB" and none["ridge"] == f"{device.ridge:.0f}"
    got = profiling.recorded_values(profile)
    assert set(got) == set(none) == set(profiling.VALUES) | model_facts
    missing = [k for k, v in got.items() if v == ncu.NOT_RECORDED]
    assert not missing, missing
    fwd = one(launches, "fwd", "attn_fwd")
    assert got["fwd_limiter"] == fwd["limiter"] and got["fwd_blocks"] == f"{fwd['blocks_per_sm']:.0f}"
    assert got["fwd_bound"] == ncu.bound(fwd["sm_pct"], fwd["memory_pct"])
    B, H, _, N, _, D = META["cases"]["fwd"]["shape"]
    assert got["fwd_dram_x"] == f"{fwd['dram_bytes'] / (4 * B * H * N * D * 2 + 4 * B * H * N):.2f}×"
    first = profile.stalls().groupby("case").head(1).set_index("case")
    assert got["fwd_top_reason"] == first.loc["fwd", "reason"].replace("_", " ")
    assert got["fwd_mem_unit"] == profiling.MEMORY_UNITS[max(("dram_pct", "l2_pct", "l1_pct"), key=lambda c: fwd[c])]
    assert got["fwd_xu_per_score"] == f"{fwd['xu_instructions'] * 32 / (B * H * N * N):.2f}"


def test_chapter_claims_hold_on_the_recording(profile, launches):
    """What the chapter says in words, checked on the numbers it says them of."""
    dev = profiling.device_of(profile)
    assert dev.short in profile.meta["device"]      # the roofs are the recording GPU's
    fwd, causal = one(launches, "fwd", "attn_fwd"), one(launches, "fwd_causal", "attn_fwd")
    numba, dec = one(launches, "numba_tiled", "flash_attention_fwd"), one(launches, "decode", "decode_split_kv")
    dkdv = one(launches, "bwd_causal", "bwd_dkdv_ws")
    moved = profiling.traffic(launches, dev).set_index("launch")
    points = profiling.roofline_points(launches).set_index("launch")
    stalls = profile.stalls()
    # speed of light: the forward's busiest memory unit is L2, DRAM far below; its SM busy on the Tensor Cores
    assert profiling.busiest_memory(fwd) == "L2" and fwd["dram_pct"] < fwd["l2_pct"] / 3
    assert abs(fwd["tensor_pipe_pct"] - fwd["sm_pct"]) < 5
    # the Numba kernel: its FMA pipe ahead of its memory pipes, L1/TEX (shared memory) the busiest memory unit
    assert profiling.busiest_memory(numba) == "L1/TEX" and numba["fma_pipe_pct"] > numba["mem_pipes_pct"]
    assert numba["dram_pct"] < 10
    # the backward's dK/dV kernel: the descriptor kernel unsplit, two warpgroups, one program per SM, latency-bound
    assert dkdv["threads"] == 2 * 128 and dkdv["blocks_per_sm"] == 1
    assert ncu.bound(dkdv["sm_pct"], dkdv["memory_pct"]) == "latency"
    # no register budgets of a split (setmaxnreg); a CTA-wide barrier before each TMA copy (after the copy
    # before it), the rows' lse and D as asynchronous pointer copies (LDGSTS), and barrier its largest stall
    dkdv_text = profile.sass_text("bwd_causal", "bwd_dkdv_ws")
    assert "left out" not in dkdv_text
    dkdv_ops = [r["op"] for r in sass.parse(dkdv_text)]
    assert not any(op.startswith("USETMAXREG") for op in dkdv_ops)
    copies = [i for i, op in enumerate(dkdv_ops) if op.startswith("UTMALDG")]
    assert len(copies) == 2 and any(op.startswith("LDGSTS") for op in dkdv_ops[copies[-1]:])
    assert all(any(op.startswith("BAR.SYNC") for op in dkdv_ops[before + 1:i])
               for before, i in zip([-1, *copies], copies))
    top = stalls[(stalls["case"] == "bwd_causal") & (stalls["kernel"] == "bwd_dkdv_ws")].iloc[0]
    assert top["reason"] == "barrier"
    # the roofline: the forward and the Numba kernel right of the ridge, the decoding kernel left at both levels
    assert points.loc["Triton forward", "intensity_dram"] > dev.ridge
    assert points.loc["Numba tiled (fp32)", "intensity_dram"] > dev.ridge
    assert points.loc["decode", ["intensity_dram", "intensity_l2"]].max() < dev.ridge / 10
    # memory: DRAM saw the forward's inputs and outputs about once, L2 many times that; decode reads once
    t = moved.loc["Triton forward"]
    assert 0.9 < t["dram_vs_compulsory"] < 1.1 and t["l2_bytes"] > 10 * t["dram_bytes"]
    assert 0.9 < moved.loc["decode", "dram_vs_compulsory"] < 1.1 and dec["l2_hit_pct"] < 10
    assert moved.loc["decode", "streamed_bytes"] > 2 * moved.loc["decode", "compulsory_bytes"]
    # warp states: the decoding kernel hardly waits on memory, its copies asynchronous (LDGSTS)
    share = stalls[stalls["case"] == "decode"].set_index("reason")["share"]
    assert share.get("long_scoreboard", 0) < 0.15 and "LDGSTS" in profile.sass_text("decode", "decode_split_kv")
    # the Numba kernel's warps are ready: its largest shares are not selected and selected
    assert set(stalls[stalls["case"] == "numba_tiled"].head(2)["reason"]) == {"not_selected", "selected"}
    # the forward's loop top: the first product's HGMMA, then its wait, then a copy, then the wait for it
    ops = [sass.family(r["op"]) for r in sass.parse(profile.sass_text("fwd", "attn_fwd"))]
    first = ops.index("HGMMA")
    assert ops[first:].index("WARPGROUP") < ops[first:].index("UTMALDG") < ops[first:].index("SYNCS", ops[first:].index(
        "UTMALDG"))
    # SASS: one MUFU.EX2 per score plus a few rescale factors; emu moves exponentials off the XU pipe
    loop = profiling.sass_loops(profile, launches).set_index("launch").loc["Triton forward"]
    assert 1 <= loop["ex2_per_score"] < 1.1
    fwd_xu, causal_xu = (r["xu_instructions"] * 32 / profiling.scores(r) for r in (fwd, causal))
    assert profiling.config(causal).get("emu") and causal_xu < 0.75 * fwd_xu and causal_xu > 0.5
    assert causal["fma_pipe_pct"] > fwd["fma_pipe_pct"]


def test_naive_vs_tiled_reads_chapter_3s_measurement():
    from fa_lab.bench import records as recorded

    _, measured = recorded.load("gpu_ch3_hbm")
    got = profiling.naive_vs_tiled(measured)
    full = measured[~measured["causal"]].set_index("impl")
    dram = full["dram__bytes_read.sum"] + full["dram__bytes_write.sum"]
    assert got["naive_x"] == f"{dram['numba_naive'] / dram['numba_tiled']:.0f}×"
    assert dram["numba_naive"] > 10 * dram["numba_tiled"]          # S and P through HBM, against none
    assert profiling.naive_vs_tiled(None) == dict.fromkeys(("naive_gb", "tiled_gb", "naive_x"), ncu.NOT_RECORDED)


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_figures_show_every_launch_legibly(profile, launches, theme):
    from matplotlib.text import Text

    spec = importlib.util.spec_from_file_location("figure_checks", ROOT / "tests" / "test_figures_partII_ch9.py")
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)        # the book's test of a figure: inside, apart, the palette's ink
    stalls = profile.stalls()
    figs = [profiling.roofline_figure(profiling.roofline_points(launches), theme=theme),
            profiling.stall_figure(stalls, theme=theme)]
    for fig in figs:
        checks.assert_legible(fig, theme)
        words = " ".join(t.get_text() for t in fig.findobj(Text))
        for case, kernel in zip(launches["case"], launches["kernel"]):
            assert profiling.label(case, kernel) in words
    top = stalls.groupby("reason")["share"].sum().idxmax().replace("_", " ")
    assert top in " ".join(t.get_text() for t in figs[1].findobj(Text))


# ---------------------------------------------------------------------------- the capture script

def test_smoke_runs_without_a_gpu(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_ncu.py"), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert {p.name for p in (tmp_path / "ncu").iterdir()} == {"details.csv", "raw.csv", "sass_counts.csv",
                                                              "sass_fwd_attn_fwd.txt"}
    meta, rows = json.loads((tmp_path / "gpu_profile.json").read_text()).values()
    assert meta["command"] == "python scripts/profile_ncu.py --smoke" and [r["case"] for r in rows] == ["fwd", "decode"]
    assert meta["statuses"]["ncu"] == "ok (smoke sample)" and meta["ncu_version"] == "smoke"


def test_a_failed_capture_records_its_status_and_the_chapter_shows_nothing(tmp_path):
    mod = load_script("profile_ncu")
    statuses = {"ncu": "error: ncu rc=9: ==ERROR== ERR_NVGPUCTRPERM"}
    path = mod.write_outputs(tmp_path, None, None, {}, None, ["fwd", "decode"], statuses, "python scripts/x.py")
    meta, rows = json.loads(path.read_text()).values()
    assert meta["statuses"] == statuses
    assert [r["status"] for r in rows] == [statuses["ncu"]] * 3 and all(r["id"] is None for r in rows)
    assert ncu.load(tmp_path) is None


def test_a_launch_out_of_plan_is_a_status_not_a_crash(tmp_path):
    mod = load_script("profile_ncu")
    _, kernels = details_by_hand()
    second = sorted(kernels)[1]
    path = mod.write_outputs(tmp_path, DETAILS.read_text(), None, {}, None, ["fwd"], {"ncu": "ok"},
                             "python scripts/x.py")
    meta, rows = json.loads(path.read_text()).values()
    assert meta["statuses"]["cases"].startswith(
        f"error: launch {second} ({ncu.short_name(kernels[second])}) does not follow the plan")
    assert rows[0]["status"] == meta["statuses"]["cases"]
    assert ncu.load(tmp_path) is None       # nothing labelled: the chapter says it is not recorded


def test_cut_raw_keeps_the_chapter_metrics_only():
    mod = load_script("profile_ncu")
    cut = ncu.cut_raw(mod.SMOKE_RAW, mod.METRICS, mod.RAW_PATTERNS)
    header, rows = ncu.csv_table(cut)
    assert "smsp__unwanted.sum" not in header and "dram__bytes_read.sum" in header and header[-1].endswith(".ratio")
    assert rows[0][:11] == [""] * 11 and rows[0][header.index("dram__bytes_read.sum")] == "byte"
    # the recorded page is such a cut already: cutting it again changes nothing
    assert ncu.csv_table(ncu.cut_raw(RAW.read_text(), mod.METRICS, mod.RAW_PATTERNS)) == ncu.csv_table(RAW)


def test_plan_follows_cases_and_filter_names_every_kernel():
    mod = load_script("profile_ncu")
    kernels = {k for c in mod.CASES.values() for k in c["kernels"]}
    assert all(k in mod.KERNELS for k in kernels) and "bwd_preprocess" not in mod.KERNELS
    assert mod.plan(["decode"]) == [("decode", "decode_split_kv", False), ("decode", "combine_kernel", True)]
    as_recorded = {c: dict(spec, shape=list(spec["shape"]), kernels=list(spec["kernels"]))
                   for c, spec in mod.CASES.items()}
    # each recording is of the cases the script runs: the chapter's, and the paged-cache study's
    assert {c: as_recorded[c] for c in mod.DEFAULT_CASES} == META["cases"]
    assert set(mod.DEFAULT_CASES) | set(mod.PAGED_STUDY) == set(mod.CASES)



def test_the_paged_study_is_of_its_cases_and_shows_what_the_chapter_says():
    mod = load_script("profile_ncu")
    study = ncu.load(DATA_DIR / profiling.PAGED_STUDY_DIR)
    assert study is not None and list(study.meta["cases"]) == list(mod.PAGED_STUDY)
    assert {c: dict(spec, shape=list(spec["shape"]), kernels=list(spec["kernels"]))
            for c, spec in mod.CASES.items() if c in mod.PAGED_STUDY} == study.meta["cases"]
    df, values = profiling.paged_study(study)
    first, five, shipped = (df.set_index("case").loc[c] for c in mod.PAGED_STUDY)
    assert (first["stages"], five["stages"], shipped["stages"]) == (3, 5, 5)
    assert (first["offsets"], five["offsets"], shipped["offsets"]) == ("int64", "int64", "int32")
    # two stages more, twice the shared memory (two K/V buffers, not one); int32 offsets, fewer instructions
    assert 1.7 < five["smem_KiB"] / first["smem_KiB"] < 2.1
    assert shipped["instructions"] < five["instructions"] and shipped["time_us"] < five["time_us"] < first["time_us"]
    assert ncu.NOT_RECORDED not in values.values() and values["paged_smem_first"].endswith("KiB")
    # each case's SASS is of the kernel it launched: int64 offsets make the hot loop longer, and the three
    # compiled kernels differ (3 and 5 stages place their loads apart)
    loops = study.sass.set_index("case")
    texts = {c: study.sass_text(c, "decode_split_kv") for c in mod.PAGED_STUDY}
    assert len(set(texts.values())) == len(texts)
    assert loops.loc["paged", "loop_instructions"] < min(loops.loc[c, "loop_instructions"] for c in mod.PAGED_STUDY[:2])
    assert profiling.paged_study(None) == (None, {k: ncu.NOT_RECORDED for k in profiling.PAGED_VALUES})

# ---------------------------------------------------------------------------- the notebook

def _glue_keys() -> set[str]:
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    return set(re.findall(r"\{glue:text\}`([^`]+)`", text))


def _run_cells(monkeypatch, data_dir) -> dict:
    """Every code cell of the chapter, in this process, on the recording in ``data_dir``; what it glued."""
    import fa_lab.core.glue

    glued, shown = {}, []
    monkeypatch.setattr(fa_lab.core.glue, "glue", lambda name, value, display=False: glued.__setitem__(name, value))
    monkeypatch.setattr(ncu, "DATA_DIR", Path(data_dir))
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    namespace = {"display": shown.append}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), str(NOTEBOOK), "exec"), namespace)
    glued["_shown"] = shown
    return glued


def test_chapter_on_the_recording_quotes_every_number(monkeypatch):
    glued = _run_cells(monkeypatch, DATA_DIR)
    keys = _glue_keys()
    assert keys and keys <= set(glued), sorted(keys - set(glued))
    assert not [k for k in keys if glued[k] == ncu.NOT_RECORDED]
    assert len(glued["_shown"]) >= 7          # the tables and both figures


def test_chapter_without_a_recording_still_glues_every_name(monkeypatch, tmp_path):
    from fa_lab.bench import records

    monkeypatch.setattr(records, "load", lambda name: (None, None))   # no benchmark recording either
    glued = _run_cells(monkeypatch, tmp_path)
    assert _glue_keys() <= set(glued)
    assert glued["ch11_fwd_sm"] == ncu.NOT_RECORDED and glued["_shown"] == []


def test_chapter_outputs_are_stripped():
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code)


FAKE_NCU = '''#!{python}
"""A stand-in for ncu: the pages of the shipped recording as its output, and a log of its calls."""
import json, pathlib, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if args == ["--version"]:
    print("NVIDIA (R) Nsight Compute Command Line Profiler\\nCopyright (c) 2018-2025 NVIDIA Corporation\\n"
          "Version {version} (public-release)")
elif args == ["--list-sections"]:
    print("---------- ----------\\nIdentifier   Display Name   Filename\\n---------- ----------")
    for s in ("ComputeWorkloadAnalysis", "LaunchStats", "MemoryWorkloadAnalysis", "MemoryWorkloadAnalysis_Chart",
              "MemoryWorkloadAnalysis_Tables", "Occupancy", "SchedulerStats", "SourceCounters", "SpeedOfLight",
              "SpeedOfLight_RooflineChart", "WarpStateStats"):
        print(f"{{s:<40}} Some Name   /opt/ncu/sections/{{s}}.section")
elif args == ["--query-metrics"]:
    print("Device NVIDIA H100 80GB HBM3 (GH100)\\n----- -----\\nMetric Name   Metric Description\\n----- -----")
    for m in ("dram__bytes_read", "dram__bytes_write", "gpu__time_duration", "lts__t_bytes", "lts__t_sector_hit_rate",
              "sm__throughput", "sm__warps_active", "launch__registers_per_thread", "smsp__inst_executed"):
        print(f"{{m:<50}} # of something")
elif "-i" in args:
    page = args[args.index("--page") + 1]
    print("==PROF== Connected to process 4242")
    print(pathlib.Path({pages!r}, "details.csv" if page == "details" else "raw.csv").read_text())
else:
    out = args[args.index("-o") + 1]
    pathlib.Path(out + ".ncu-rep").write_text("report")
'''


def test_capture_drives_ncu_and_records_its_pages(tmp_path, monkeypatch):
    mod = load_script("profile_ncu")
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    fake = bin_dir / "ncu"
    version = META["ncu_version"]
    fake.write_text(FAKE_NCU.format(python=sys.executable, log=str(log), version=version, pages=str(NCU_DIR)))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    out = tmp_path / "out"
    cases = list(mod.DEFAULT_CASES)   # the chapter's recording: the fake ncu replays its pages
    path = mod.capture(out, cases, quick=False, keep_report=None, command="python scripts/profile_ncu.py")
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    profiled = next(c for c in calls if "-o" in c)
    assert profiled[:4] == ["--profile-from-start", "off", "--clock-control", "none"]
    assert profiled[profiled.index("-k") + 1] == mod.KERNELS
    assert profiled[profiled.index("-c") + 1] == str(len(mod.plan(cases)))
    assert [profiled[i + 1] for i, a in enumerate(profiled) if a == "--section"] == mod.SECTIONS
    metrics = profiled[profiled.index("--metrics") + 1].split(",")
    assert "dram__bytes_read.sum" in metrics and "sm__inst_executed_pipe_xu.sum" not in metrics   # not listed
    assert profiled[profiled.index("--launches") + 1] == ",".join(cases)
    assert sum("-i" in c for c in calls) == 2
    meta, rows = json.loads(path.read_text()).values()
    assert meta["ncu_version"] == version and meta["statuses"]["ncu"] == "ok" and meta["statuses"]["cases"] == "ok"
    # the same pages give the shipped recording's labels (this machine ran no kernel: no configurations, no SASS)
    keys = ("id", "case", "kernel", "grid", "block")
    assert [{k: r.get(k) for k in keys} for r in rows] == [{k: r[k] for k in keys} for r in RECORDS]
    profile = ncu.load(out)
    assert profile.launches()["case"].tolist() == [r["case"] for r in RECORDS]
    assert (out / "ncu" / "details.csv").read_text().strip() == DETAILS.read_text().strip()


def test_run_ends_the_whole_process_group_on_timeout():
    import time

    t0 = time.time()
    with pytest.raises(subprocess.TimeoutExpired):
        ncu.run(["bash", "-c", "sleep 30 & sleep 30"], timeout=1)
    assert time.time() - t0 < 10
