"""Hidden-state store: real h5py files under tmp_path, written, damaged and read back."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from tide.store import (
    ChunkError,
    ChunkMeta,
    ChunkReader,
    ChunkWriter,
    Run,
    bf16_to_u16,
    chunk_name,
    is_eval,
    read_chunk,
    u16_to_bf16,
    write_chunk,
)
from tide.store import writer as writer_mod

META = ChunkMeta("tiny-target", "abc123", hidden_size=8, layer_ids=(1, 2, 3))  # rows of D = 24


def make_run(request_id: str, n: int, seed: int = 0, meta: ChunkMeta = META, **kw) -> Run:
    """A run of n rows with random bf16 hidden states (via the real bf16 conversion)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, meta.row_dim, generator=g).to(torch.bfloat16)
    return Run(request_id, tokens=np.arange(n, dtype=np.int32) + seed, positions=np.arange(n, dtype=np.int32),
               hidden=bf16_to_u16(hidden), is_output=np.arange(n) % 3 == 0, **kw)


def assert_runs_equal(a: list[Run], b: list[Run]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.request_id, x.workload, x.draft_version) == (y.request_id, y.workload, y.draft_version)
        assert x.acceptance == pytest.approx(y.acceptance, nan_ok=True)
        for name in ("tokens", "positions", "hidden", "is_output"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)


def write_chunks(root: Path, count: int, rows: int = 10, meta: ChunkMeta = META) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / chunk_name(i) for i in range(count)]
    for i, p in enumerate(paths):
        write_chunk(p, meta, [make_run(f"req-{i}", rows, seed=i, meta=meta)])
    return paths


# ---- schema ---------------------------------------------------------------------------------------
def test_bf16_helpers_are_bit_exact():
    bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)  # every bf16 pattern, NaNs included
    np.testing.assert_array_equal(bf16_to_u16(u16_to_bf16(bits)), bits)
    t = torch.randn(5, 7).to(torch.bfloat16)
    assert torch.equal(u16_to_bf16(bf16_to_u16(t)).view(torch.int16), t.view(torch.int16))


def test_round_trip(tmp_path):
    runs = [make_run("a", 5, 1, workload="code", acceptance=2.5, draft_version=3),
            make_run("b", 1, 2), make_run("ü-unicode-id", 17, 3, workload="chat", acceptance=1.0)]
    path = tmp_path / chunk_name(0)
    size = write_chunk(path, META, runs)
    assert size == path.stat().st_size > 23 * META.row_dim * 2
    assert not list(tmp_path.glob("*.tmp"))
    back = read_chunk(path, expect=META)
    assert_runs_equal(runs, back)
    assert back[1].draft_version == -1 and np.isnan(back[1].acceptance)
    with h5py.File(path) as f:
        assert f.attrs["num_tokens"] == 23 and tuple(f.attrs["layer_ids"]) == (1, 2, 3)
        assert f["hidden"].dtype == np.uint16 and f["hidden"].shape == (23, 24)


def test_write_rejects_bad_runs(tmp_path):
    bad = make_run("a", 4)
    bad.hidden = bad.hidden[:, :10]
    with pytest.raises(ValueError, match="hidden"):
        write_chunk(tmp_path / "x.h5", META, [bad])
    assert not list(tmp_path.iterdir())


def test_h5dump_reads_the_file(tmp_path):
    if shutil.which("h5dump") is None:
        pytest.skip("h5dump not installed (apt-get install hdf5-tools)")
    path = write_chunks(tmp_path, 1)[0]
    out = subprocess.run(["h5dump", "-H", str(path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    for name in ("tokens", "positions", "hidden", "is_output", "run_offsets", "run_request_id",
                 "run_workload", "run_acceptance", "run_draft_version", "format_version", "target_id",
                 "target_hash", "hidden_size", "layer_ids", "num_tokens", "checksum"):
        assert f'"{name}"' in out.stdout, name


# ---- damaged files --------------------------------------------------------------------------------
def test_truncated_file_is_skipped(tmp_path, caplog):
    good_old, bad, good_new = write_chunks(tmp_path, 3)
    with open(bad, "r+b") as f:
        f.truncate(bad.stat().st_size // 2)
    with pytest.raises(ChunkError, match=bad.name):
        read_chunk(bad)
    reader = ChunkReader(tmp_path, expect=META)
    with caplog.at_level(logging.WARNING):
        runs = reader.load()
    assert [r.request_id for r in runs] == ["req-2", "req-0"]  # newest first, the bad one gone
    assert reader.skipped == {"corrupt": 1}
    assert [r for r in caplog.records if bad.name in r.getMessage()]


def test_foreign_chunk_is_skipped(tmp_path, caplog):
    write_chunks(tmp_path, 2)
    other = ChunkMeta(META.target_id, META.target_hash, hidden_size=16, layer_ids=META.layer_ids)
    write_chunks(tmp_path, 1, meta=other)
    reader = ChunkReader(tmp_path, expect=META)
    with caplog.at_level(logging.WARNING):
        assert len(reader.load()) == 2
    assert reader.skipped == {"foreign": 1}
    assert "hidden_size" in caplog.text
    assert len(ChunkReader(tmp_path).load()) == 3  # no expectation: all three are valid files


def test_flipped_hidden_bits_fail_the_checksum(tmp_path):
    paths = write_chunks(tmp_path, 2)
    with h5py.File(paths[0], "r+") as f:
        f["hidden"][3, 5] = f["hidden"][3, 5] ^ 0x0100
    with pytest.raises(ChunkError, match="checksum"):
        read_chunk(paths[0])
    reader = ChunkReader(tmp_path, expect=META)
    assert [r.request_id for r in reader.load()] == ["req-1"]
    assert reader.skipped == {"checksum": 1}


KILL_SCRIPT = """
import sys, numpy as np
from pathlib import Path
from tide.store import ChunkMeta, Run, chunk_name, write_chunk
meta = ChunkMeta("t", "h", hidden_size=1024, layer_ids=(1, 2, 3))
n = 4096  # 24 MiB of hidden rows per chunk: a kill lands mid-write most of the time
hidden = np.random.default_rng(0).integers(0, 1 << 16, (n, meta.row_dim), dtype=np.uint16)
run = Run("r", np.zeros(n, np.int32), np.arange(n, dtype=np.int32), hidden, np.zeros(n, bool))
for i in range(1000):
    write_chunk(Path(sys.argv[1]) / chunk_name(i), meta, [run])
"""


def test_writer_killed_mid_write_leaves_only_complete_files(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(tmp_path)], env=env,
                          stderr=subprocess.PIPE) as proc:
        deadline = time.monotonic() + 15
        while not list(tmp_path.glob("*.h5")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read().decode()  # still writing chunks
        time.sleep(0.3)  # a few more chunks; the kill lands inside one of them (most of the time)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    (tmp_path / "chunk-9999999999999999999-1-000000.h5.tmp").write_bytes(b"half a file")  # newest name
    meta = ChunkMeta("t", "h", hidden_size=1024, layer_ids=(1, 2, 3))
    reader = ChunkReader(tmp_path, expect=meta)
    listed = reader.list_chunks()
    assert listed and all(p.suffix == ".h5" for p in listed)
    for p in listed:
        assert len(read_chunk(p, meta)[0]) == 4096
    assert len(reader.load()) == len(listed) and reader.skipped == {}


# ---- writer ----------------------------------------------------------------------------------------
def test_writer_splits_runs_and_flushes(tmp_path):
    seen = []
    with ChunkWriter(tmp_path, META, chunk_tokens=16, on_chunk=lambda p, n: seen.append((p, n))) as w:
        runs = [make_run("long", 40, 1, workload="math"), make_run("short", 3, 2)]
        assert all(w.add(r) for r in runs)
    assert [n for _, n in seen] == [16, 16, 11]
    assert w.stats()["tokens"] == 43 and w.stats()["files"] == 3 and w.stats()["dropped_tokens"] == 0
    back = [r for p in ChunkReader(tmp_path).list_chunks()[::-1] for r in read_chunk(p, META)]  # oldest first
    assert [(r.request_id, len(r)) for r in back] == [("long", 16), ("long", 16), ("long", 8), ("short", 3)]
    np.testing.assert_array_equal(np.concatenate([r.hidden for r in back[:3]]), runs[0].hidden)
    w.close()  # idempotent
    assert w.add(make_run("late", 2)) is False


def test_retention_keeps_newest_window(tmp_path):
    write_chunks(tmp_path, 2, rows=10)  # chunks from an earlier run count towards the window too
    with ChunkWriter(tmp_path, META, chunk_tokens=10, retention_tokens=30) as w:
        for i in range(6):
            w.add(make_run(f"w-{i}", 10, seed=i))
            w.flush()
    assert w.stats()["deleted_files"] == 5 and w.stats()["files"] == 6
    reader = ChunkReader(tmp_path, expect=META)
    assert len(reader.list_chunks()) == 3 and reader.total_tokens() == 30
    assert [r.request_id for r in reader.load(window_tokens=20)] == ["w-5", "w-4"]


def test_a_window_since_a_time_leaves_older_chunks_out(tmp_path):
    """What the coordinator asks a cycle to train on: the chunks written since collection started."""
    with ChunkWriter(tmp_path, META, chunk_tokens=10) as w:
        for i in range(4):
            if i == 2:
                since = time.time_ns()
            w.add(make_run(f"w-{i}", 10, seed=i))
            w.flush()
    reader = ChunkReader(tmp_path, expect=META)
    assert [r.request_id for r in reader.load(since_ns=since)] == ["w-3", "w-2"]
    assert [r.request_id for r in reader.load(window_tokens=10, since_ns=since)] == ["w-3"]
    assert len(reader.list_chunks(since_ns=since)) == 2 and len(reader.list_chunks()) == 4


def test_blocked_disk_drops_runs_without_blocking(tmp_path, monkeypatch):
    release, real = threading.Event(), writer_mod.write_chunk

    def slow_write(path, meta, runs):
        release.wait(10)
        return real(path, meta, runs)

    monkeypatch.setattr(writer_mod, "write_chunk", slow_write)
    w = ChunkWriter(tmp_path, META, chunk_tokens=10, max_pending_chunks=2)
    t0 = time.monotonic()
    results = [w.add(make_run(f"r{i}", 10, seed=i)) for i in range(5)]
    assert time.monotonic() - t0 < 1.0
    assert results == [True, True, False, False, False]
    assert w.stats()["dropped_tokens"] == 30
    release.set()
    w.close()
    assert w.stats()["files"] == 2 and len(ChunkReader(tmp_path).load()) == 2


def test_disk_error_is_counted_not_raised(tmp_path, monkeypatch, caplog):
    def full_disk(path, meta, runs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(writer_mod, "write_chunk", full_disk)
    with caplog.at_level(logging.ERROR), ChunkWriter(tmp_path, META, chunk_tokens=5, pause_s=0) as w:
        for i in range(4):
            assert w.add(make_run(f"r{i}", 5, seed=i))  # no pause: every run is tried
            w.flush()
    assert w.stats()["errors"] == 4 and w.stats()["files"] == 0 and w.stats()["pauses"] == 4
    assert caplog.text.count("ENOSPC") == 1  # logged once per kind
    assert not list(tmp_path.iterdir())


def test_real_write_failure_removes_tmp(tmp_path, monkeypatch):
    def fail_fsync(fd):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", fail_fsync)
    with ChunkWriter(tmp_path, META, chunk_tokens=5) as w:
        w.add(make_run("r", 5))
    assert w.stats()["errors"] == 1 and not list(tmp_path.iterdir())


# ---- split -----------------------------------------------------------------------------------------
def test_split_is_deterministic_and_disjoint(tmp_path):
    ids = [f"req-{i}" for i in range(1000)]
    flags = [is_eval(i, 0.1) for i in ids]
    assert flags == [is_eval(i, 0.1) for i in ids]
    assert 60 <= sum(flags) <= 140
    runs = [make_run(i, 2, seed=k) for k, i in enumerate(ids[:200])]
    with ChunkWriter(tmp_path, META, chunk_tokens=7, max_pending_chunks=64) as w:  # straddling runs
        for r in runs:
            w.add(r)
    reader = ChunkReader(tmp_path, expect=META)
    train = {r.request_id for r in reader.load(split="train", eval_fraction=0.1)}
    evals = {r.request_id for r in reader.load(split="eval", eval_fraction=0.1)}
    assert not train & evals and train | evals == set(ids[:200])
    assert evals == {i for i in ids[:200] if is_eval(i, 0.1)}


def test_chunks_deleted_or_replaced_while_a_reader_reads_them(tmp_path):
    """Retention or an operator deletes chunks, a writer republishes one under the same name (atomic
    rename), all while the trainer reads: every run read is whole (one of the versions written), a
    chunk that vanished is skipped as missing, nothing raises."""
    paths = write_chunks(tmp_path, 6, rows=20)
    versions = {p.name: [[make_run(f"req-{i}", 20, seed=i)], [make_run(f"req-{i}", 20, seed=100 + i)]]
                for i, p in enumerate(paths)}
    stop = threading.Event()

    def churn() -> None:
        rng = np.random.default_rng(0)
        while not stop.is_set():
            p = paths[rng.integers(len(paths))]
            if rng.random() < 0.3:
                p.unlink(missing_ok=True)
            else:
                write_chunk(p, META, versions[p.name][int(rng.integers(2))])

    t = threading.Thread(target=churn)
    t.start()
    reader, loads, missing = ChunkReader(tmp_path, expect=META), 0, 0
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            runs = reader.load()
            loads += 1
            assert set(reader.skipped) <= {"missing"}, reader.skipped
            missing += reader.skipped.get("missing", 0)
            for r in runs:
                i = int(r.request_id.split("-")[1])
                assert any(np.array_equal(r.hidden, v[0].hidden) for v in versions[paths[i].name]), r.request_id
    finally:
        stop.set()
        t.join()
    assert loads > 10


def test_a_draft_publisher_killed_at_any_moment_leaves_only_whole_drafts(tiny_target, tmp_path):
    """SIGKILL to a process publishing drafts, at random moments: every published vN loads and
    passes the swap's checks, and the next publish takes the next version."""
    from tide.draft import DraftRegistry, init_draft
    from tide.draft.io import checked_weights, weight_shapes

    code = ("import itertools, sys; from pathlib import Path; from tide.draft import DraftRegistry, init_draft\n"
            "reg = DraftRegistry(Path(sys.argv[2])); m = init_draft(Path(sys.argv[1]), (1, 2, 3), 256)\n"
            "print('ready', flush=True)\n"
            "for i in itertools.count(): reg.publish(m, {'i': i})\n")
    rng = np.random.default_rng(1)
    for _ in range(4):
        p = subprocess.Popen([sys.executable, "-c", code, str(tiny_target.path), str(tmp_path / "drafts")],
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(float(rng.uniform(0.05, 0.4)))
        p.send_signal(signal.SIGKILL)
        p.wait()
    reg = DraftRegistry(tmp_path / "drafts")
    versions = reg.versions()
    assert versions == list(range(1, len(versions) + 1)) and len(versions) >= 4
    shapes = weight_shapes(reg.path(1))
    for v in versions:
        checked_weights(reg.path(v), shapes)
        assert reg.meta(v)["version"] == v
    head = init_draft(tiny_target.path, tiny_target.layer_ids, 256)
    assert reg.publish(head, {}) == versions[-1] + 1
    assert not list(reg.root.glob(".v*")), "a killed publisher's temporary dirs are cleaned up"
