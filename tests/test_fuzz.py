"""Bad input, fuzzed (hypothesis): whatever arrives, a clear refusal or a valid result, never a crash.

  * a config file: a valid TideConfig, or ConfigError as one line `FILE: key.path: what`;
  * a role message (random bytes, truncated frames, fields of the wrong type): decoded or dropped
    and counted by the transport;
  * a chunk file truncated or with a bit flipped: read back exactly, or skipped and counted;
  * a prompt set or an arrival trace: prompts, or WorkloadError as one line naming the file.
"""

from __future__ import annotations

import dataclasses
import functools
import socket
import struct
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from test_store import META, assert_runs_equal, make_run

from tide.config import ConfigError, TideConfig, load_config, to_dict
from tide.runtime import messages
from tide.runtime.messages import (
    MAX_BYTES,
    BadMessage,
    Capture,
    Deploy,
    DraftReady,
    Heartbeat,
    InstanceReport,
    Train,
    decode,
    encode,
)
from tide.runtime.transport import SocketTransport
from tide.store import ChunkReader, chunk_name, write_chunk
from tide.workload import WorkloadError
from tide.workload.arrivals import read_trace
from tide.workload.prompts import PARSERS, load_prompts

ROOT = Path(__file__).resolve().parents[1]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                    st.text(max_size=12))
plain = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                      st.dictionaries(st.text(max_size=10), kids, max_size=4)),
                     max_leaves=12)


def fresh(tmp_path: Path) -> Path:
    """A directory of this example's own (hypothesis runs many examples in one tmp_path)."""
    return Path(tempfile.mkdtemp(dir=tmp_path))


def one_line(e: Exception, starts: str | tuple[str, ...]) -> None:
    text = str(e)
    assert "\n" not in text and text.startswith(starts), text


# ---- the config loader ------------------------------------------------------------------------------


def _key_paths(d: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for k, v in d.items():
        out.append((*prefix, k))
        if isinstance(v, dict):
            out += _key_paths(v, (*prefix, k))
    return out


VALID = to_dict(load_config(ROOT / "configs" / "ci.yaml"))
PATHS = _key_paths(VALID)


@FUZZ
@given(edits=st.lists(st.tuples(st.sampled_from(PATHS), plain), min_size=1, max_size=3))
def test_a_config_with_any_values_loads_or_names_the_key(tmp_path: Path, edits: list) -> None:
    """A valid config with up to three values replaced by anything YAML can hold."""
    raw = yaml.safe_load(yaml.safe_dump(VALID))
    for path, value in edits:
        node = raw
        for k in path[:-1]:
            node = node.setdefault(k, {}) if isinstance(node, dict) else node
        if isinstance(node, dict):
            node[path[-1]] = value
    f = fresh(tmp_path) / "fuzz.yaml"
    f.write_text(yaml.safe_dump(raw))
    try:
        assert isinstance(load_config(f), TideConfig)
    except ConfigError as e:
        one_line(e, f"{f}: ")


@FUZZ
@given(text=st.one_of(st.text(max_size=200), st.builds(yaml.safe_dump, plain)))
def test_any_yaml_text_loads_or_is_one_line(tmp_path: Path, text: str) -> None:
    f = fresh(tmp_path) / "fuzz.yaml"
    f.write_text(text)
    try:
        assert isinstance(load_config(f), TideConfig)
    except ConfigError as e:
        one_line(e, f"{f}: ")


# ---- role messages ----------------------------------------------------------------------------------

SAMPLES = [Train(3, 1000, 17, 2, 2, "shift"), Heartbeat("trainer", 1, 2.5),
           DraftReady(1, 2, "drafts/v2", 1.5, 1.2, 1, 1.2, 1, 4096, 3.0, [1, 2, 3, 4], [4, 3, 2, 1], [4, 3, 2, 1]),
           Capture(True, 17), Deploy(2, "eval AL 1.5", [4, 3, 2, 1]), InstanceReport(1, [0.5, 0.75], 4096, 17, [2, -1])]


@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes_decode_or_are_a_bad_message(data: bytes) -> None:
    try:
        assert type(decode(data)) in messages.TYPES.values()
    except BadMessage as e:
        one_line(e, "")


@FUZZ
@given(msg=st.sampled_from(SAMPLES), cut=st.integers(0, 400))
def test_a_truncated_message_is_a_bad_message(msg: messages.Message, cut: int) -> None:
    data = encode(msg)
    assume(cut < len(data))
    with pytest.raises(BadMessage):
        decode(data[:cut])


@FUZZ
@given(msg=st.sampled_from(SAMPLES), field=st.integers(0, 20), value=plain)
def test_a_field_of_another_type_is_a_bad_message(msg: messages.Message, field: int, value: object) -> None:
    """A receiver builds paths and indices from message fields: `version` is an int, never "../x"."""
    d = dataclasses.asdict(msg)
    name = list(d)[field % len(d)]
    d[name] = value
    data = messages.msgpack.packb({"protocol": messages.PROTOCOL, "type": type(msg).__name__, **d})
    try:
        got = decode(data)
    except BadMessage as e:
        one_line(e, "")
        return
    # what decodes is of the declared type, and is the value sent (compared as msgpack: a NaN, which a
    # trainer sends for a loss not yet measured, is a float and never equals itself)
    assert messages.msgpack.packb(getattr(got, name)) == messages.msgpack.packb(value)


def test_a_message_with_a_path_outside_the_run_dir_cannot_name_a_version() -> None:
    d = dataclasses.asdict(SAMPLES[2]) | {"version": "../../etc"}
    with pytest.raises(BadMessage, match=r"DraftReady.version: str where"):
        decode(messages.msgpack.packb({"protocol": messages.PROTOCOL, "type": "DraftReady", **d}))
    with pytest.raises(BadMessage, match="over the limit"):
        decode(b"\x00" * (MAX_BYTES + 1))


@FUZZ
@given(frames=st.lists(st.one_of(st.binary(max_size=64), st.sampled_from([encode(m) for m in SAMPLES])),
                       max_size=8))
def test_the_socket_transport_counts_what_it_drops_and_keeps_the_rest(frames: list[bytes]) -> None:
    a, b = socket.socketpair()
    ours = SocketTransport(a, rank=0, peer=1)
    try:
        for f in frames:
            b.sendall(struct.pack("!I", len(f)) + f)
        got = []
        while len(got) + ours.dropped < len(frames):
            got += ours.poll(timeout=1.0)
        good = [m for m in (_decodes(f) for f in frames) if m is not None]
        assert [m for _, m in got] == good and ours.dropped == len(frames) - len(good)
    finally:
        a.close()
        b.close()


def _decodes(f: bytes) -> messages.Message | None:
    try:
        return decode(f)
    except BadMessage:
        return None


def test_an_oversized_frame_closes_the_socket_transport() -> None:
    a, b = socket.socketpair()
    ours = SocketTransport(a, rank=0, peer=1)
    b.sendall(struct.pack("!I", MAX_BYTES + 1) + b"x" * 100)
    assert ours.poll(timeout=1.0) == [] and ours.closed and ours.dropped == 1
    b.close()


# ---- chunk files ------------------------------------------------------------------------------------


@functools.cache
def a_chunk() -> tuple[bytes, list]:
    """A whole chunk file's bytes and its runs (not a fixture: hypothesis would print the bytes)."""
    runs = [make_run("req-0", 40, seed=1), make_run("req-1", 25, seed=2)]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / chunk_name(0)
        write_chunk(path, META, runs)
        return path.read_bytes(), runs


@FUZZ
@given(damage=st.one_of(st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True)),
                        st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(0, 7))))
@example(damage=("flip", 0.043404780431650414, 0))  # a name that resolves to a named datatype: no .shape
@example(damage=("flip", 0.658203125, 2))  # a run's draft version out of int32's range (OverflowError)
def test_a_damaged_chunk_is_read_back_exactly_or_skipped_and_counted(tmp_path: Path, damage: tuple) -> None:
    data, runs = a_chunk()
    buf = bytearray(data)
    if damage[0] == "truncate":
        buf = buf[: int(damage[1] * len(buf))]
    else:
        buf[int(damage[1] * len(buf))] ^= 1 << damage[2]
    root = fresh(tmp_path)
    (root / chunk_name(0)).write_bytes(bytes(buf))
    reader = ChunkReader(root, expect=META)
    got = reader.load()
    if got:  # the flip hit bytes no reader looks at (HDF5 free space, padding): the data is intact
        assert_runs_equal(got, runs) and reader.skipped == {}
    else:
        assert sum(reader.skipped.values()) == 1, reader.skipped


# ---- prompt sets and traces -------------------------------------------------------------------------

records = st.one_of(plain, st.fixed_dictionaries({"task_id": scalars, "prompt": scalars}),
                    st.fixed_dictionaries({"question": scalars, "answer": scalars}),
                    st.fixed_dictionaries({"question_id": scalars, "category": scalars, "turns": plain}),
                    st.fixed_dictionaries({"id": scalars, "conversations": plain}))


@FUZZ
@given(dataset=st.sampled_from(sorted(PARSERS)), suffix=st.sampled_from([".jsonl", ".json"]),
       lines=st.lists(st.one_of(st.text(max_size=40), st.builds(yaml.safe_dump, records)), max_size=5),
       as_json=st.lists(records, max_size=5))
def test_a_prompt_file_loads_or_is_one_line_naming_it(tmp_path: Path, dataset: str, suffix: str, lines: list,
                                                      as_json: list) -> None:
    import json

    f = fresh(tmp_path) / f"prompts{suffix}"
    try:
        f.write_text(json.dumps(as_json) if suffix == ".json" else "\n".join(lines))
    except ValueError:  # not JSON-able (NaN is): the file is text anyway
        f.write_text(str(as_json))
    try:
        prompts = load_prompts(dataset, str(f))
    except WorkloadError as e:
        one_line(e, ("path: ", "dataset: "))  # the field, then the file
        assert str(f) in str(e)
        return
    assert all(isinstance(p[1], str) for p in prompts)


@FUZZ
@given(lines=st.lists(st.one_of(st.text(max_size=30), st.builds(lambda d: __import__("json").dumps(d), plain),
                                st.builds(lambda t, m: __import__("json").dumps({"timestamp": t, "max_tokens": m}),
                                          scalars, scalars)), max_size=6))
def test_a_trace_loads_or_is_one_line_naming_it(tmp_path: Path, lines: list) -> None:
    f = fresh(tmp_path) / "trace.jsonl"
    f.write_text("\n".join(lines))
    try:
        slots = read_trace(str(f))
    except WorkloadError as e:
        one_line(e, "workload.arrivals.trace: ")
        assert str(f) in str(e)
        return
    assert slots and all(s.arrival is not None and s.arrival >= 0 for s in slots)
