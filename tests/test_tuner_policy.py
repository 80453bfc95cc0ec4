"""What the Triton forward runs on a key no cache holds: the quick choice among the winners of the
nearest tuned keys (the default), the full search, or no timing (FA_LAB_TRITON_AUTOTUNE).

The GPU-only parts (the device's name, timing a candidate) are replaced by stand-ins, so the
policy itself runs in either world.
"""
import json

import pytest
import torch

from fa_lab.core.spec import make_spec
from fa_lab.kernels.triton import FINAL, ConfigCache, config_key, tuner

DEVICE = "Some GPU"
SHIPPED = {
    "bfloat16|d128|q4096|k4096|causal|pipelined": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
    "float16|d128|q8192|k8192|causal|pipelined": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
    "bfloat16|d128|q512|k512|causal|pipelined": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    "bfloat16|d128|q65536|k65536|causal|pipelined": dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=4),
    # other head dim, other mask, other space, exact fp32: never neighbours of a bf16 d128 causal key
    "bfloat16|d64|q2048|k2048|causal|pipelined": dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1),
    "bfloat16|d128|q2048|k2048|none|pipelined": dict(BLOCK_M=16, BLOCK_N=32, num_warps=1, num_stages=1),
    "bfloat16|d128|q2048|k2048|causal|tuned": dict(BLOCK_M=32, BLOCK_N=16, num_warps=1, num_stages=1),
    "float32|d128|q2048|k2048|causal|pipelined": dict(BLOCK_M=32, BLOCK_N=64, num_warps=1, num_stages=1),
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache whose shipped table is SHIPPED, with an empty user file."""
    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps({"configs": {DEVICE: {k: dict(v, ws=False) for k, v in SHIPPED.items()}},
                                   "devices": {DEVICE: [9, 0]}}))
    monkeypatch.setattr(ConfigCache, "SHIPPED", shipped)
    monkeypatch.setenv("FA_LAB_CACHE_DIR", str(tmp_path / "user"))
    fresh = ConfigCache()
    monkeypatch.setattr(tuner, "CACHE", fresh)
    return fresh


@pytest.fixture
def gpu(cache, monkeypatch):
    """choose_config as on a GPU: the device is DEVICE, and tune() records what it was given."""
    calls = []

    def fake_tune(launch, candidates, key, *, refine=()):
        calls.append([dict(c) for c in candidates])
        return dict(candidates[-1], ms=1.0)   # the last one "wins": distinguishable from the first

    monkeypatch.setattr(tuner, "ON_GPU", True)
    monkeypatch.setattr(tuner, "device_index", lambda spec: 0)
    monkeypatch.setattr(tuner, "device_facts", lambda index: (DEVICE, (9, 0)))
    monkeypatch.setattr(tuner, "tune", fake_tune)
    monkeypatch.setattr(tuner, "_RESOLVED", {})
    return calls


def problem(n=2048, dtype=torch.bfloat16, causal=True, d=128):
    q = torch.empty(1, 2, n, d, dtype=dtype)
    return make_spec(q, q, q, causal=causal), dtype


def choose(spec, dtype):
    return tuner.choose_config(lambda cfg, warmup=False: None, spec, dtype, FINAL)


def strip(cfg):
    return {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}


@pytest.mark.parametrize("value, mode", [(None, "quick"), ("", "quick"), ("quick", "quick"), ("1", "full"),
                                         ("FULL", "full"), ("0", "off"), ("no", "off"), (" off ", "off")])
def test_autotune_mode(value, mode, monkeypatch):
    if value is None:
        monkeypatch.delenv("FA_LAB_TRITON_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("FA_LAB_TRITON_AUTOTUNE", value)
    assert tuner.autotune_mode() == mode


def test_an_unknown_autotune_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("FA_LAB_TRITON_AUTOTUNE", "sometimes")
    with pytest.raises(ValueError, match="FA_LAB_TRITON_AUTOTUNE='sometimes'.*quick.*full.*off"):
        tuner.autotune_mode()


def test_neighbours_are_the_nearest_keys_of_the_same_head_dim_mask_and_space(cache):
    key = "bfloat16|d128|q2048|k2048|causal|pipelined"
    near = [strip(c) for c in tuner.neighbour_configs(DEVICE, key, limit=10)]
    # 4096 (one power of two away), 8192 (two, and fp16: +0.5), 512 (two), 65536 (five)
    assert near == [SHIPPED["bfloat16|d128|q4096|k4096|causal|pipelined"],
                    SHIPPED["bfloat16|d128|q512|k512|causal|pipelined"],
                    SHIPPED["float16|d128|q8192|k8192|causal|pipelined"],
                    SHIPPED["bfloat16|d128|q65536|k65536|causal|pipelined"]]
    assert len(tuner.neighbour_configs(DEVICE, key)) == tuner.QUICK_NEIGHBOURS
    assert tuner.neighbour_configs("Another GPU", key) == []
    # exact fp32 has no 16-bit neighbours, and 16-bit keys none in fp32
    assert [strip(c) for c in tuner.neighbour_configs(DEVICE, "float32|d128|q4096|k4096|causal|pipelined")] == \
        [SHIPPED["float32|d128|q2048|k2048|causal|pipelined"]]


def test_a_gpu_without_entries_takes_those_of_its_architecture(gpu, cache, monkeypatch):
    monkeypatch.setenv("FA_LAB_TRITON_AUTOTUNE", "off")
    spec, dtype = problem(n=4096)
    key = config_key(spec, dtype, "pipelined")
    assert cache.get("Sibling GPU", key) is None            # by name alone: nothing
    assert strip(cache.get("Sibling GPU", key, (9, 0))) == SHIPPED[key]
    assert cache.search("Sibling GPU", key, (9, 0)) == "full"
    assert cache.get("Other arch GPU", key, (10, 0)) is None
    near = tuner.neighbour_configs("Sibling GPU", "bfloat16|d128|q2048|k2048|causal|pipelined", capability=(9, 0))
    assert near == tuner.neighbour_configs(DEVICE, "bfloat16|d128|q2048|k2048|causal|pipelined")
    # through choose_config: the stand-in entry runs without timing anything
    monkeypatch.setattr(tuner, "device_facts", lambda index: ("Sibling GPU", (9, 0)))
    monkeypatch.delenv("FA_LAB_TRITON_AUTOTUNE")
    assert strip(choose(spec, dtype)) == SHIPPED[key] and gpu == []
    # a GPU with shipped entries of its own never borrows: a key it lacks is a miss (no neighbours here:
    # the default runs)
    monkeypatch.setattr(tuner, "device_facts", lambda index: ("Own GPU", (9, 0)))
    monkeypatch.setattr(tuner, "_RESOLVED", {})
    cache.shipped_entries()["Own GPU"] = {"bfloat16|d64|q512|k512|none|pipelined": dict(SHIPPED[key])}
    assert cache.get("Own GPU", key, (9, 0)) is None
    assert strip(choose(spec, dtype)) == strip(tuner.configs.default_config("pipelined", 128, 4096, "causal"))


def test_shipping_names_the_device_architecture(tmp_path, monkeypatch):
    from fa_lab.bench.tune import ship

    path = tmp_path / "shipped.json"
    path.write_text(json.dumps({"configs": {}, "note": "kept"}))
    key = "bfloat16|d128|q4096|k4096|causal|pipelined"
    ship("New GPU", {key: dict(SHIPPED[key], ws=False)}, path, capability=(9, 0))
    monkeypatch.setattr(ConfigCache, "SHIPPED", path)
    monkeypatch.setenv("FA_LAB_CACHE_DIR", str(tmp_path / "user"))
    assert strip(ConfigCache().get("Another GPU", key, (9, 0))) == SHIPPED[key]
    assert json.loads(path.read_text())["note"] == "kept"


def test_the_default_is_timed_once_when_a_neighbour_has_it(gpu, cache, monkeypatch):
    monkeypatch.delenv("FA_LAB_TRITON_AUTOTUNE", raising=False)
    default = tuner.configs.default_config("pipelined", 128, 2048, "causal")
    cache.put(DEVICE, "bfloat16|d128|q4096|k4096|causal|pipelined", dict(default))   # the user's entry wins
    choose(*problem(n=2048))
    assert len(gpu[0]) == 3 and gpu[0][0] == default


def test_a_miss_times_only_the_nearest_winners_and_the_default(gpu, cache, monkeypatch):
    monkeypatch.delenv("FA_LAB_TRITON_AUTOTUNE", raising=False)
    spec, dtype = problem(n=2048)
    cfg = choose(spec, dtype)
    assert len(gpu) == 1
    timed = [strip(c) for c in gpu[0]]
    assert timed[:3] == [strip(c) for c in tuner.neighbour_configs(DEVICE, config_key(spec, dtype, "pipelined"))]
    assert len(timed) == 4 and strip(tuner.configs.default_config("pipelined", 128, 2048, "causal")) == timed[3]
    key = config_key(spec, dtype, "pipelined")
    assert cache.search(DEVICE, key) == "quick" and strip(cache.get(DEVICE, key)) == strip(cfg)
    assert ConfigCache().search(DEVICE, key) == "quick"   # persisted for the next process
    choose(spec, dtype)
    assert len(gpu) == 1                                    # the second call finds it


def test_the_full_search_replaces_a_quick_choice(gpu, cache, monkeypatch):
    monkeypatch.delenv("FA_LAB_TRITON_AUTOTUNE", raising=False)
    spec, dtype = problem(n=2048)
    choose(spec, dtype)
    monkeypatch.setenv("FA_LAB_TRITON_AUTOTUNE", "1")
    monkeypatch.setattr(tuner, "_RESOLVED", {})
    choose(spec, dtype)
    assert len(gpu) == 2 and len(gpu[1]) > 4                # the whole candidate space this time
    assert cache.search(DEVICE, config_key(spec, dtype, "pipelined")) == "full"


def test_off_times_nothing_and_runs_the_nearest_winner(gpu, cache, monkeypatch):
    monkeypatch.setenv("FA_LAB_TRITON_AUTOTUNE", "0")
    spec, dtype = problem(n=2048)
    cfg = choose(spec, dtype)
    assert gpu == [] and strip(cfg) == SHIPPED["bfloat16|d128|q4096|k4096|causal|pipelined"]
    assert cache.search(DEVICE, config_key(spec, dtype, "pipelined")) is None   # nothing chosen, nothing kept


def test_a_key_with_no_neighbour_gets_the_default_untimed(gpu, cache, monkeypatch):
    monkeypatch.delenv("FA_LAB_TRITON_AUTOTUNE", raising=False)
    spec, dtype = problem(n=2048, d=256)
    cfg = choose(spec, dtype)
    assert gpu == [] and cfg == tuner.configs.default_config("pipelined", 256, 2048, "causal")


def test_a_shipped_key_is_never_timed(gpu, cache, monkeypatch):
    monkeypatch.setenv("FA_LAB_TRITON_AUTOTUNE", "1")
    spec, dtype = problem(n=4096)
    assert strip(choose(spec, dtype)) == SHIPPED["bfloat16|d128|q4096|k4096|causal|pipelined"]
    assert gpu == []


def test_the_messages_say_what_is_timed(gpu, cache, monkeypatch, capsys):
    monkeypatch.delenv("FA_LAB_TRITON_AUTOTUNE", raising=False)
    choose(*problem(n=2048))
    err = capsys.readouterr().err
    assert "bfloat16|d128|q2048|k2048|causal|pipelined is not tuned yet" in err
    assert "timing 4 configurations" in err and "fa-lab tune" in err and "chosen in" in err
