"""Our GGUF header reader against the gguf package's own reader and writer, and its refusals."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from radixserve.model.gguf_file import GGUFFile, open_gguf  # noqa: E402
from radixserve.model.loader import default_model_path  # noqa: E402


def _assert_same_as_reader(path: str) -> None:
    ours = GGUFFile(path)
    theirs = gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected
    assert list(ours.metadata) == list(expected)  # key order kept
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type) == (b.name, b.tensor_type)
        assert a.shape == tuple(int(x) for x in b.shape.tolist())
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert a.data.tobytes() == b.data.tobytes(), a.name


def _write(path: Path, fill: Any) -> str:
    w = gguf.GGUFWriter(str(path), "llama")
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _every_kind(w: Any) -> None:
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ünï"])
    w.add_array("t.bools", [True, False, True])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.BF16):
        x = rng.standard_normal((2, 64)).astype(np.float32)
        q = gguf.quants.quantize(x, qtype)
        w.add_tensor(f"q.{qtype.name}", q, raw_shape=q.shape, raw_dtype=qtype)


def test_equal_to_the_gguf_reader_on_the_bundled_model() -> None:
    _assert_same_as_reader(default_model_path())


def test_equal_to_the_gguf_reader_on_every_value_kind_and_tensor_type(tmp_path: Path) -> None:
    path = _write(tmp_path / "kinds.gguf", _every_kind)
    _assert_same_as_reader(path)
    meta = GGUFFile(path).metadata
    assert meta["t.str"] == "héllo ✓" and meta["t.strs"] == ["a", "", "ünï"]
    assert meta["t.bools"] == [True, False, True]
    assert meta["t.u64"] == 2**60 and meta["t.i8"] == -5 and meta["t.bool"] is True


def test_dequantizes_like_the_reader(tmp_path: Path) -> None:
    path = _write(tmp_path / "kinds.gguf", _every_kind)
    theirs = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for t in GGUFFile(path).tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.I32:
            continue  # gguf dequantizes float and block types only
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        b = gguf.quants.dequantize(theirs[t.name].data, theirs[t.name].tensor_type)
        np.testing.assert_array_equal(a, b)


def test_nested_and_empty_arrays(tmp_path: Path) -> None:
    # The gguf package's writer drops empty arrays and flattens nested ones; write them by hand.
    def s(x: str) -> bytes:
        return struct.pack("<Q", len(x.encode())) + x.encode()

    inner = [struct.pack("<IQ", 5, 2) + struct.pack("<ii", 1, 2), struct.pack("<IQ", 8, 1) + s("x"),
             struct.pack("<IQ", 8, 0)]
    body = s("t.nested") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 3) + b"".join(inner)
    path = tmp_path / "nested.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body)
    assert GGUFFile(str(path)).metadata == {"t.nested": [[1, 2], ["x"], []]}


def _header(version: int = 3, n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


@pytest.mark.parametrize(
    "content, why",
    [
        (b"", "the file is empty"),
        (b"GGML" + bytes(20), "no GGUF magic"),
        (_header(version=1), "GGUF version 1"),
        (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
        (_header(n_kv=1)[:-4], "ends inside its header"),
        (_header(n_kv=1) + struct.pack("<Q", 3) + b"key" + struct.pack("<I", 77), "unknown value type 77"),
        (_header(n_kv=1) + struct.pack("<Q", 1 << 40), "a string of"),
        (_header(n_kv=1) + struct.pack("<Q", 3) + b"key" + struct.pack("<I", 8) + struct.pack("<Q", 10) + b"short", "ends inside"),
        (_header(n_kv=1) + struct.pack("<Q", 2) + b"\xff\xfe" + struct.pack("<IB", 0, 1), "not UTF-8"),
        # the same inside an array of strings (a vocabulary), which is read in one loop
        (_header(n_kv=1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 3) + struct.pack("<Q", 1) + b"a",
         "ends inside"),
        (_header(n_kv=1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 2) + struct.pack("<Q", 1) + b"a"
         + struct.pack("<Q", 5) + b"ab", "ends inside"),
        (_header(n_kv=1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 2) + struct.pack("<Q", 1 << 40),
         "a string of"),
        (_header(n_kv=1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 2) + struct.pack("<Q", 1) + b"a"
         + struct.pack("<Q", 2) + b"\xff\xfe", "not UTF-8"),
    ],
)
def test_refuses_a_broken_header_with_one_line(tmp_path: Path, content: bytes, why: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        GGUFFile(str(path))
    msg = str(err.value)
    assert msg.startswith(f"{path} is not a readable GGUF file: ") and why in msg and "\n" not in msg


def test_refuses_a_tensor_past_the_end_of_the_file(tmp_path: Path) -> None:
    def fill(w: Any) -> None:
        w.add_tensor("w", np.ones((64, 64), dtype=np.float32))

    path = tmp_path / "cut.gguf"
    _write(path, fill)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="tensor 'w' ends at byte .* past the end of the file"):
        GGUFFile(str(path))


def test_a_missing_file_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        open_gguf(str(tmp_path / "absent.gguf"))


def test_the_front_end_processes_never_import_torch() -> None:
    code = (
        "import sys\n"
        "import radixserve.cli, radixserve.server.launch, radixserve.server.detokenizer_proc, radixserve.server.frontend.http_server\n"
        "from radixserve.model.tokenizer import Tokenizer\n"
        "from radixserve.model.loader import load_config\n"
        "Tokenizer.from_model_path(None); load_config(None)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _mapped_rss_kb(path: str) -> int:
    """This process's resident kB of its mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's first line
                inside = head[-1] == path
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
def test_released_pages_leave_the_resident_memory_and_map_back_on_use(tmp_path: Path) -> None:
    values = np.arange(512 * 512, dtype=np.float32).reshape(512, 512)  # 1 MiB: 256 pages

    def fill(w: Any) -> None:
        w.add_tensor("w", values)

    path = _write(tmp_path / "pages.gguf", fill)
    f = GGUFFile(path)
    data = f.tensors[0].data
    assert float(data.sum()) == float(values.sum())  # every page read
    before = _mapped_rss_kb(path)
    assert before >= 1024
    f.release_pages()
    assert _mapped_rss_kb(path) < before - 900
    np.testing.assert_array_equal(data, values)  # read again: mapped back, the same bytes
    assert _mapped_rss_kb(path) >= 1024
