"""The tuned-config cache: a damaged file costs a re-tune (never a crash), and processes that
tune at the same time neither lose each other's entries nor let a reader see half a file."""
import json
import multiprocessing
import time

import pytest

from fa_lab.kernels.triton import ConfigCache

KEY = "float16|d128|q4096|k4096|causal|pipelined"
CFG = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, ws=False)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FA_LAB_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_roundtrip(cache_dir):
    cache = ConfigCache()
    cache.put("Some GPU", KEY, dict(CFG, ms=1.0))
    again = ConfigCache()  # a fresh process reads the file
    assert again.get("Some GPU", KEY) == CFG   # without the timing
    assert again.get("Other GPU", KEY) is None


@pytest.mark.parametrize("content", [
    "[]", "null", '"x"', "3", '{"configs": []}', '{"configs": null}', '{"other": {}}', "{not json", "",
    '{"configs": {"Some GPU": []}}', '{"configs": {"Some GPU": {"k": "x"}}}',
    '{"configs": {"Some GPU": {"k": {"BLOCK_M": "64"}}}}',
], ids=repr)
def test_a_file_of_another_shape_is_empty_with_a_warning(cache_dir, content):
    path = cache_dir / "triton_fwd_configs.json"
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match="triton_fwd_configs.json"):
        cache = ConfigCache()
    assert cache.get("Some GPU", KEY) is None and cache.get("Some GPU", "k") is None
    with pytest.warns(RuntimeWarning):   # the damaged file is read again under the lock, then replaced
        cache.put("Some GPU", KEY, CFG)
    assert json.loads(path.read_text()) == {"configs": {"Some GPU": {KEY: CFG}}}
    assert ConfigCache().get("Some GPU", KEY) == CFG


def test_valid_entries_survive_beside_broken_ones(cache_dir):
    (cache_dir / "triton_fwd_configs.json").write_text(json.dumps(
        {"configs": {"Some GPU": {KEY: CFG, "broken": [1, 2]}, "Other GPU": "x"}}))
    with pytest.warns(RuntimeWarning, match="2 entries"):
        cache = ConfigCache()
    assert cache.get("Some GPU", KEY) == CFG and cache.get("Some GPU", "broken") is None


def test_an_unwritable_cache_keeps_the_result_for_this_process(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("FA_LAB_CACHE_DIR", str(blocker / "cache"))   # a directory below a file: cannot exist
    cache = ConfigCache()
    with pytest.warns(RuntimeWarning, match="not saved"):
        cache.put("Some GPU", KEY, CFG)
    cache.put("Some GPU", "another", CFG)   # warned once
    assert cache.get("Some GPU", KEY) == CFG and cache.get("Some GPU", "another") == CFG


# ---- several processes at once ----

WRITERS, ENTRIES = 3, 100


def _writer(index, start):
    cache = ConfigCache()   # created before the others write: its own view of the file is stale
    start.wait()
    for i in range(ENTRIES):
        cache.put(f"GPU {index % 2}", f"key {index} {i}", dict(CFG, BLOCK_M=16 * (1 + i % 8)))


def _reader(path, stop, bad):
    while not stop.is_set():
        try:
            blob = json.loads(path.read_text())
            assert isinstance(blob["configs"], dict)
        except FileNotFoundError:
            continue
        except (ValueError, KeyError, AssertionError):
            with bad.get_lock():
                bad.value += 1


def test_concurrent_writers_lose_nothing_and_readers_see_whole_files(cache_dir):
    ctx = multiprocessing.get_context("fork")   # the children share this process's imports: quick to start
    start, stop, bad = ctx.Event(), ctx.Event(), ctx.Value("i", 0)
    writers = [ctx.Process(target=_writer, args=(i, start)) for i in range(WRITERS)]
    reader = ctx.Process(target=_reader, args=(cache_dir / "triton_fwd_configs.json", stop, bad))
    for p in writers + [reader]:
        p.start()
    t0 = time.monotonic()
    start.set()
    for p in writers:
        p.join(timeout=60)
    stop.set()
    reader.join(timeout=10)
    assert all(p.exitcode == 0 for p in writers), [p.exitcode for p in writers]
    assert time.monotonic() - t0 < 60
    assert bad.value == 0, f"a reader saw {bad.value} incomplete or invalid files"
    merged = ConfigCache()
    missing = [(w, i) for w in range(WRITERS) for i in range(ENTRIES)
               if merged.get(f"GPU {w % 2}", f"key {w} {i}") is None]
    assert not missing, f"{len(missing)} of {WRITERS * ENTRIES} entries lost, e.g. {missing[:3]}"
    assert merged.get("GPU 1", f"key 1 {ENTRIES - 1}") == dict(CFG, BLOCK_M=16 * (1 + (ENTRIES - 1) % 8))
