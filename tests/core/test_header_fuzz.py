"""The header parser under hostile input, with safetensors as the oracle (hypothesis).

Each example writes one file: a valid checkpoint (random names, dtypes, shapes, metadata, tensor
order and padding) or one of its mutations (the length field, offsets, dtypes, shapes that
overflow, non-UTF-8 bytes, escapes of lone surrogates, deep nesting, duplicate names, huge counts,
truncation, byte flips).
Opening it and reading every tensor must either give exactly what safetensors gives or raise a
``CheckpointError`` naming the file: never another exception, a hang (each example has a
deadline), or an allocation the size of a lie (peak Python allocation while parsing is bounded by
the header's size; the process's peak RSS may not jump).

Whatever safetensors refuses, fastload refuses too. fastload is stricter in two documented ways:
a header that names a tensor twice is refused (safetensors keeps the last), because which of
the two entries is the tensor is a guess; and so is a shape whose element count or largest
stride passes 2^63 - 1 (possible only with a zero dim: safetensors then hands out an empty tensor
whose strides torch let wrap around, and torch refuses to allocate some of them).
``FUZZ_EXAMPLES`` sets the number of examples (default 300, CI's share); a long run is
``FUZZ_EXAMPLES=100000 FUZZ_DEADLINE_S=0``.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import tempfile
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import vllm_fastload
from vllm_fastload.checkpoint import read_safetensors_file
from vllm_fastload.errors import CheckpointError, HeaderError
from vllm_fastload.format import MAX_HEADER_BYTES

from ._util import raw_bytes

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
#: Seconds an example may take (a hang fails it); ``FUZZ_DEADLINE_S=0`` leaves hangs to pytest-timeout,
#: for a long run that may be paused.
DEADLINE_MS = float(os.environ.get("FUZZ_DEADLINE_S", "30")) * 1000 or None

#: safetensors dtype -> element bytes, for those both torch and safetensors load.
DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8,
          "F16": 2, "BF16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
#: Integers a hostile header might use: around 2**31, 2**32, 2**53, 2**63, 2**64 and beyond.
EDGE_INTS = [-1, 0, 1, 7, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]


@dataclass
class Sample:
    header: bytes           # the JSON text (any bytes once mutated)
    data: bytes
    length_field: int | None = None  # None: the header's real length
    truncate: int | None = None      # keep this many bytes of the file
    what: str = "valid"

    def write(self, path: Path) -> None:
        n = len(self.header) if self.length_field is None else self.length_field
        body = struct.pack("<Q", n % 2**64) + self.header + self.data
        path.write_bytes(body if self.truncate is None else body[:self.truncate])


names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12).filter(
    lambda s: s != "__metadata__")


@st.composite
def valid(draw) -> tuple[dict, bytes]:
    """A header dict and the data section of a valid file (tensors laid out in a random order)."""
    entries = draw(st.dictionaries(names, st.tuples(st.sampled_from(sorted(DTYPES)),
                                                    st.lists(st.integers(0, 5), max_size=4)), max_size=6))
    order = draw(st.permutations(sorted(entries)))
    header: dict = {}
    data = bytearray()
    for name in order:
        dtype, shape = entries[name]
        n = DTYPES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + n]}
        data += draw(st.binary(min_size=n, max_size=n))
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(names, st.text(max_size=8), max_size=3))
    return header, bytes(data)


def dump(header: dict, pad: int = 0) -> bytes:
    return json.dumps(header).encode() + b" " * pad


@st.composite
def samples(draw) -> Sample:
    header, data = draw(valid())
    tensors = [k for k in header if k != "__metadata__"]
    kind = draw(st.sampled_from([
        "valid", "length", "truncate", "offsets", "dtype", "shape", "non_utf8", "nesting", "duplicate",
        "count", "flip", "metadata", "entry", "trailing", "escape"]))
    pad = draw(st.integers(0, 7))
    sample = Sample(dump(header, pad), data, what=kind)
    if kind == "length":
        sample.length_field = draw(st.sampled_from(EDGE_INTS + [MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1])
                                   | st.integers(0, len(sample.header) + len(data) + 16))
    elif kind == "truncate":
        total = 8 + len(sample.header) + len(data)
        sample.truncate = draw(st.integers(0, max(total - 1, 0)))
    elif kind == "trailing":
        sample.data = data + draw(st.binary(min_size=1, max_size=16))
    elif kind in ("offsets", "dtype", "shape", "entry") and tensors:
        entry = header[draw(st.sampled_from(tensors))]
        if kind == "offsets":
            value = st.sampled_from(EDGE_INTS) | st.integers(-5, len(data) + 5)
            entry["data_offsets"] = draw(st.lists(value, min_size=2, max_size=2) | st.sampled_from(
                [[], [0], [0, 0, 0], None, "0", [0.0, 1.0], [True, False], [[0], [1]]]))
        elif kind == "dtype":
            entry["dtype"] = draw(st.sampled_from(["F4", "F6_E2M3", "F8_E8M0", "C64", "f32", "", "F33", 3, None,
                                                   ["F32"]]) | st.sampled_from(sorted(DTYPES)) | st.text(max_size=6))
        elif kind == "shape":
            dim = st.sampled_from(EDGE_INTS) | st.integers(-3, 9) | st.sampled_from([1.5, True, "2", None, [2]])
            entry["shape"] = draw(st.lists(dim, max_size=6) | st.sampled_from(
                [None, 3, "3", {}, [2**40, 2**40], [2**32, 2**32, 0], [0, 7, 2**62], [2**53 + 1, 0, 2**31 - 1],
                 [1] * 1000]))
        else:
            if draw(st.booleans()):
                del entry[draw(st.sampled_from(sorted(entry)))]
            else:
                entry[draw(names)] = draw(st.integers() | st.text(max_size=4))
        sample.header = dump(header, pad)
    elif kind == "non_utf8":
        raw = bytearray(sample.header)
        at = draw(st.integers(0, max(len(raw) - 1, 0)))
        raw[at:at] = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\xf8\x88\x80\x80\x80"]))
        sample.header = bytes(raw)
    elif kind == "nesting":
        depth = draw(st.sampled_from([10, 1000, 100_000]))
        where = draw(st.sampled_from(["metadata", "entry", "top"]))
        deep = "[" * depth + "]" * depth
        if where == "top":
            sample.header = b'{"x": ' + deep.encode() + b"}"
        else:
            target = "__metadata__" if where == "metadata" or not tensors else tensors[0]
            text = json.dumps({k: v for k, v in header.items() if k != target})
            joint = ", " if len(text) > 2 else ""
            sample.header = (text[:-1] + joint + json.dumps(target) + ": " + deep + "}").encode()
    elif kind == "duplicate" and tensors:
        name = draw(st.sampled_from(tensors))
        text = json.dumps(header)
        sample.header = (text[:-1] + ", " + json.dumps(name) + ": " + json.dumps(header[name]) + "}").encode()
    elif kind == "count":
        count = draw(st.sampled_from([1000, 5000]))
        base = len(data)
        many = {f"z{i}": {"dtype": "U8", "shape": [0], "data_offsets": [base, base]} for i in range(count)}
        sample.header = dump({**header, **many}, pad)
    elif kind == "flip":
        raw = bytearray(sample.header)
        for _ in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, max(len(raw) - 1, 0)))
            if raw:
                raw[at] = draw(st.integers(0, 255))
        sample.header = bytes(raw)
    elif kind == "escape":
        # JSON can spell a lone surrogate (not a Unicode string) or a valid pair in escapes.
        escape = draw(st.sampled_from(["\\ud800", "\\udfff", "\\ud800\\udc00", "\\u0000", "\\udc00\\ud800"]))
        meta = '"__metadata__": {"k' + escape + '": "v"}'
        text = json.dumps({k: v for k, v in header.items() if k != "__metadata__"})
        if tensors and draw(st.booleans()):
            name = json.dumps(tensors[0])
            text = text.replace(name, name[:-1] + escape + '"', 1)
        else:
            text = "{" + meta + (", " + text[1:] if len(text) > 2 else "}")
        sample.header = text.encode()
    elif kind == "metadata":
        header["__metadata__"] = draw(st.sampled_from([None, [], 3, "x", {"a": 1}, {"a": None}, {"a": {"b": "c"}},
                                                       {"": ""}, {}]))
        sample.header = dump(header, pad)
    return sample


def oracle(path: Path) -> dict[str, bytes] | Exception:
    """What safetensors loads: every tensor's bytes, or the exception it raised."""
    try:
        out = {}
        with safe_open(path, "pt") as f:
            for name in f.keys():
                out[name] = raw_bytes(f.get_tensor(name))
        return out
    except Exception as exc:  # any refusal counts as one
        return exc


def fastload(path: Path) -> dict[str, bytes] | CheckpointError:
    try:
        with vllm_fastload.open(path, config={"progress": False, "threads": 1}) as ckpt:
            return {name: raw_bytes(tensor) for name, tensor in ckpt.iter_tensors()}
    except CheckpointError as exc:
        assert exc.file == str(path) and str(path) in str(exc), f"error does not name the file: {exc}"
        return exc


_dir = tempfile.TemporaryDirectory(prefix="fastload-fuzz-")
_rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


#: pytest-timeout bounds the whole test, all its examples: 0.1 s each (a few ms is typical) on top
#: of the project's 900 s, so that a long run is not cut off while a hang still ends it.
@pytest.mark.timeout(900 + EXAMPLES // 10)
@settings(max_examples=EXAMPLES, deadline=DEADLINE_MS, derandomize=EXAMPLES <= 1000,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(samples())
def test_fuzzed_headers_load_as_safetensors_or_fail_naming_the_file(sample: Sample) -> None:
    path = Path(_dir.name) / "fuzz.safetensors"
    sample.write(path)
    size = path.stat().st_size

    tracemalloc.start()
    try:
        read_safetensors_file(path).close()
    except CheckpointError:
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # json builds objects several times the size of their text; a lie (a length field, a shape)
    # must not make the parser allocate for it.
    assert peak < 64 * min(size, MAX_HEADER_BYTES) + (1 << 20), f"{sample.what}: parsing {size} bytes allocated {peak}"

    want, got = oracle(path), fastload(path)
    if isinstance(got, CheckpointError):
        if not isinstance(want, Exception):
            # fastload's two deliberate refusals of what safetensors takes: a name given twice, and
            # a shape whose element count or largest stride passes int64 (safetensors hands out
            # such an empty tensor with strides torch wrapped around).
            assert ((sample.what == "duplicate" and "duplicate key" in got.reason)
                    or (sample.what == "shape" and "overflows" in got.reason)), (
                f"{sample.what}: safetensors loads it but fastload refused: {got}")
    else:
        assert not isinstance(want, Exception), f"{sample.what}: safetensors refused ({want}) but fastload loaded it"
        assert got == want, f"{sample.what}: fastload's tensors differ from safetensors'"
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - _rss_start
    assert grown < 1 << 20, f"peak RSS grew by {grown} KiB"  # 1 GiB: no allocation the size of a lie


def test_a_header_over_the_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A length field over 100 MB (safetensors' limit) is refused from the first 8 bytes, even when
    the file really is that long (a sparse file here): nothing of the claimed header is read."""
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{")
        f.truncate(MAX_HEADER_BYTES + 4096)
    tracemalloc.start()
    with pytest.raises(HeaderError) as info:
        read_safetensors_file(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert info.value.file == str(path) and "exceeds" in info.value.reason
    assert peak < 1 << 20, peak
