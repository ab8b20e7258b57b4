"""kiln.convert, kiln.quantize and kiln.verify.layers drive the command-line tools' library
code: same files (tensor bytes identical, metadata identical but for the time of writing),
same verdicts, same error messages.

The command-line binaries come from conftest's KILN_BIN (default: target/release under the
repository root); the tests comparing with them are skipped when they are not built
(`cargo build --release -p kiln-convert -p kiln-quantize -p kiln-verify`).
"""

import json
import os
import re
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest

import kiln
import kiln.verify

from conftest import BIN as BIN_DIR
from conftest import ROOT as REPO

MODEL = "llama-tied-f32"
CHECKPOINT = REPO / "fixtures" / "tiny" / MODEL
REFERENCE = REPO / "fixtures" / "reference" / "tiny" / MODEL / "0.safetensors"
RFC3339 = re.compile(rb'"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"')


def binary(name):
    path = BIN_DIR / name
    if not path.is_file():
        pytest.skip(f"{path} is not built (set KILN_BIN or run cargo build --release)")
    return str(path)


def cli(name, *args):
    """Run a Kiln binary; returns (exit status, stdout, stderr)."""
    p = subprocess.run([binary(name), *map(str, args)], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def cli_error(name, *args):
    """The message a failing Kiln binary prints, without its `program: error: ` prefix."""
    status, _, stderr = cli(name, *args)
    assert status == 2, stderr
    line = stderr.strip().splitlines()[-1]
    return re.sub(r"^(kiln-[a-z]+: )?error: ", "", line)


def parts(path):
    """A .kiln file as (metadata JSON with its timestamps masked, index and data bytes)."""
    b = Path(path).read_bytes()
    meta_off, meta_len, index_off = struct.unpack_from("<QQQ", b, 16)
    meta = RFC3339.sub(b'"<time>"', b[meta_off : meta_off + meta_len])
    return json.loads(meta), b[index_off:]


@pytest.fixture(scope="module")
def f32(tmp_path_factory):
    """The fixture converted once, by Python."""
    out = tmp_path_factory.mktemp("convert") / "model.kiln"
    summary = kiln.convert(CHECKPOINT, out)
    assert summary["tensors"] > 0 and summary["output"] == str(out)
    assert summary["bytes_out"] == out.stat().st_size
    return out


def test_convert_writes_what_the_cli_writes(f32, tmp_path):
    out = tmp_path / "model.kiln"
    status, _, err = cli("kiln-convert", "hf", CHECKPOINT, "-o", out)
    assert status == 0, err
    assert parts(out)[1] == parts(f32)[1]


def test_convert_refuses_to_replace_without_force_and_replaces_with_it(f32):
    with pytest.raises(kiln.KilnError, match="exists"):
        kiln.convert(CHECKPOINT, f32)
    assert kiln.convert(CHECKPOINT, f32, force=True)["tensors"] > 0


def test_convert_bad_dtype_is_refused():
    with pytest.raises(kiln.InvalidRequestError, match="--dtype f8"):
        kiln.convert(CHECKPOINT, "unused.kiln", dtype="f8")


@pytest.mark.parametrize("to", ["q8_0", "q4_0"])
def test_quantize_writes_what_the_cli_writes_and_reports_progress(f32, tmp_path, to):
    calls = []
    out = tmp_path / "py" / f"{to}.kiln"
    out.parent.mkdir()
    report = kiln.quantize(f32, out, to=to, progress=lambda *a: calls.append(a))
    assert calls, "the progress callback was never called"
    done = [c[0] for c in calls]
    assert done == sorted(done) and calls[-1][0] == calls[-1][1]
    names = {t["name"] for t in report["tensors"]}
    assert {c[2] for c in calls} == names
    assert any(t["to"] == to for t in report["tensors"])
    cli_out = tmp_path / "cli" / f"{to}.kiln"
    cli_out.parent.mkdir()
    status, stdout, err = cli("kiln-quantize", f32, cli_out, "--to", to, "--json", "-q")
    assert status == 0, err
    assert parts(out) == parts(cli_out)
    cli_report = json.loads(stdout)
    assert [t["rmse"] for t in cli_report["tensors"]] == [t["rmse"] for t in report["tensors"]]


def test_a_raising_progress_callback_stops_and_leaves_nothing(f32, tmp_path):
    def progress(done, total, name):
        raise ValueError("stop here")

    with pytest.raises(ValueError, match="stop here"):
        kiln.quantize(f32, tmp_path / "out.kiln", to="q8_0", progress=progress)
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_stops_and_leaves_nothing(f32, tmp_path):
    sent = []

    def progress(done, total, name):
        if not sent:
            sent.append(name)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)  # the GIL released: the calling thread sees the signal meanwhile

    with pytest.raises(KeyboardInterrupt):
        kiln.quantize(f32, tmp_path / "out.kiln", to="q8_0", progress=progress)
    assert sent and list(tmp_path.iterdir()) == []


def test_bad_to_is_refused_with_the_cli_message(f32, tmp_path):
    with pytest.raises(kiln.InvalidRequestError) as e:
        kiln.quantize(f32, tmp_path / "out.kiln", to="q9_0")
    assert str(e.value).startswith("--to q9_0: the target must be one of")
    assert e.value.param == "to"
    assert str(e.value) == cli_error("kiln-quantize", f32, tmp_path / "cli.kiln", "--to", "q9_0")


def test_out_of_range_numbers_are_refused_naming_the_flag(f32, tmp_path):
    with pytest.raises(kiln.InvalidRequestError, match="--calib-tokens.*from 64"):
        kiln.quantize(f32, tmp_path / "o.kiln", to="q8_0", calib_tokens=-1)


def test_missing_input_messages_are_the_cli_messages(tmp_path):
    missing = tmp_path / "missing.kiln"
    cases = [
        (lambda: kiln.convert(tmp_path / "nodir", tmp_path / "o.kiln"),
         ("kiln-convert", "hf", tmp_path / "nodir", "-o", tmp_path / "o.kiln")),
        (lambda: kiln.quantize(missing, tmp_path / "o.kiln", to="q8_0"),
         ("kiln-quantize", missing, tmp_path / "o.kiln", "--to", "q8_0")),
        (lambda: kiln.verify.layers(missing, REFERENCE),
         ("kiln-verify", "layers", missing, "--reference", REFERENCE)),
    ]
    for call, args in cases:
        with pytest.raises(kiln.KilnError) as e:
            call()
        assert "missing" in str(e.value) or "nodir" in str(e.value)
        assert str(e.value) == cli_error(*args)


def test_verify_layers_passes_on_the_reference(f32):
    r = kiln.verify.layers(f32, REFERENCE)
    assert r["pass"] is True and r["first_failure"] is None
    assert r["entries"] and all(e["pass"] for e in r["entries"])
    status, stdout, _ = cli("kiln-verify", "layers", f32, "--reference", REFERENCE, "--json")
    assert status == 0
    assert [e["nmse"] for e in json.loads(stdout)["entries"]] == [e["nmse"] for e in r["entries"]]


def poisoned_dump(tmp_path):
    """The reference dump with the first activation's values pushed far off."""
    b = bytearray(REFERENCE.read_bytes())
    (n,) = struct.unpack_from("<Q", b, 0)
    header = json.loads(b[8 : 8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    start, end = header[name]["data_offsets"]
    for i in range(8 + n + start, 8 + n + end, 4):
        struct.pack_into("<f", b, i, struct.unpack_from("<f", b, i)[0] * 3 + 1)
    out = tmp_path / "poisoned.safetensors"
    out.write_bytes(bytes(b))
    return out, name


def test_verify_layers_out_of_tolerance_is_a_result(f32, tmp_path):
    dump, name = poisoned_dump(tmp_path)
    r = kiln.verify.layers(f32, dump)
    assert r["pass"] is False and r["first_failure"] == name
    status, _, _ = cli("kiln-verify", "layers", f32, "--reference", dump)
    assert status == 1


def test_verify_layers_corrupt_model_is_an_error(f32, tmp_path):
    bad = tmp_path / "corrupt.kiln"
    b = bytearray(f32.read_bytes())
    b[-100] ^= 0xFF
    bad.write_bytes(bytes(b))
    with pytest.raises(kiln.KilnError) as e:
        kiln.verify.layers(bad, REFERENCE)
    assert str(e.value) == cli_error("kiln-verify", "layers", bad, "--reference", REFERENCE)
