"""Doors that must not wait forever (issue 42, item 4): a FIFO, socket or device handed to vitkit where a file is
expected is refused from its stat before anything blocks on it, and every network fetch has an overall deadline
(`vitkit.safety.Deadline`) besides its per-read timeout, so a server that sends one byte at a time is cut off with an
error naming the URL and the deadline.

Each call runs in a thread joined with a generous bound: a regression fails the test instead of hanging the suite
(the FIFOs are then opened for writing and closed, which releases a reader blocked on them)."""
import http.server
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

import vitkit
from vitkit.cli import main
from vitkit.errors import CheckpointError, UsageError

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")

BOUND_S = 30  # "it returned at all": far beyond the fraction of a second a refusal takes


def _release(fifos) -> None:
    """A reader blocked opening a FIFO gets EOF once a writer opens and closes it."""
    for f in fifos:
        try:
            os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def returns(fn, *fifos):
    """fn() run in a thread: ("ok", value) or ("raised", exception); a test failure if it has not returned within
    BOUND_S (the FIFOs are released so the thread ends)."""
    out = {}

    def run():
        try:
            out["ok"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["raised"] = e

    t = threading.Thread(target=run, daemon=True)
    start = time.monotonic()
    t.start()
    t.join(BOUND_S)
    if t.is_alive():
        _release(fifos)
        t.join(5)
        pytest.fail(f"no answer within {BOUND_S} s: blocked on {[str(f) for f in fifos]}")
    return next(iter(out.items())) + (time.monotonic() - start,)


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "m.safetensors"
    vitkit.save(vitkit.create_model("vit_ti16", img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2,
                                    mlp_dim=64, num_classes=3), path)
    return path


# ---- FIFOs where files are expected --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_a_fifo_as_the_weights_of_a_model_folder_is_refused(tmp_path, name):
    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "config.json").write_text('{"architecture": "vit_tiny_patch16_224", "num_classes": 3}')
    fifo = _fifo(folder / name)
    how, e, _ = returns(lambda: vitkit.load(folder), fifo)
    assert how == "raised" and isinstance(e, CheckpointError), e
    assert str(e) == (f"{fifo}: a FIFO (named pipe), not a regular file: refused (vitkit reads regular files only: "
                      f"reading from a pipe, socket or device can wait forever)")


@pytest.mark.parametrize("name", ["w.safetensors", "w.npz", "w.pth", "config.json"])
def test_a_fifo_as_a_checkpoint_path_is_refused_by_the_api_and_the_cli(tmp_path, capsys, name):
    fifo = _fifo(tmp_path / name)
    how, e, _ = returns(lambda: vitkit.load(fifo), fifo)
    assert how == "raised" and isinstance(e, CheckpointError) and "a FIFO (named pipe)" in str(e), e
    how, code, _ = returns(lambda: main(["info", str(fifo)]), fifo)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"vitkit: error: {e}"], err


def test_a_fifo_as_an_image_is_one_unreadable_image_not_a_hang(ckpt, tmp_path, capsys):
    from PIL import Image

    from vitkit.data.datasets import FileDataset
    from vitkit.data.image import BadSample, ImageDecodeError, load_image

    fifo, good = _fifo(tmp_path / "pipe.png"), tmp_path / "good.png"
    Image.new("RGB", (20, 20), (200, 10, 10)).save(good)
    how, e, _ = returns(lambda: load_image(fifo), fifo)
    assert how == "raised" and isinstance(e, ImageDecodeError) and f"{fifo}: a FIFO (named pipe)" in str(e)
    how, code, _ = returns(lambda: main(["predict", str(fifo), str(good), "--checkpoint", str(ckpt),
                                                        "--precision", "fp32"]), fifo)
    io = capsys.readouterr()
    assert code == 1 and f"{fifo}: ERROR {fifo}: a FIFO (named pipe)" in io.out and "1 of 2 image(s)" in io.err, io
    # in a dataset it is a skipped sample, as a corrupt file is
    ds = FileDataset([(str(fifo), 0), (str(good), 1)], ["a", "b"], img_size=(16, 16))
    how, sample, _ = returns(lambda: ds[0], fifo)
    assert how == "ok" and isinstance(sample, BadSample) and "FIFO" in sample.reason
    assert ds[1][1] == 1


def test_a_fifo_as_a_shard_index_a_config_or_a_csv_is_refused(tmp_path):
    from vitkit.data.datasets import csv_list, load_dataset
    from vitkit.training.config import load_config_file

    index = _fifo(tmp_path / "shards" / "train" / "index.json")
    how, e, _ = returns(lambda: load_dataset(str(tmp_path / "shards")), index)
    assert how == "raised" and isinstance(e, UsageError) and f"{index}: a FIFO (named pipe)" in str(e), e
    for path, fn in ((_fifo(tmp_path / "c.yaml"), load_config_file), (_fifo(tmp_path / "train.csv"), csv_list)):
        how, e, _ = returns(lambda: fn(path), path)
        assert how == "raised" and f"{path}: a FIFO (named pipe)" in str(e), e


def test_sockets_devices_and_folders_are_refused_by_the_one_door(tmp_path):
    from vitkit.safety import open_regular, read_bytes

    sock_path = tmp_path / "s.sock"
    srv = socket.socket(socket.AF_UNIX)
    try:
        srv.bind(str(sock_path))
        with pytest.raises(UsageError, match="a socket, not a regular file"):
            read_bytes(sock_path)
    finally:
        srv.close()
    if os.path.exists("/dev/zero"):
        with pytest.raises(CheckpointError, match="/dev/zero: a character device, not a regular file"):
            open_regular("/dev/zero", error=CheckpointError)
    with pytest.raises(IsADirectoryError, match="a folder where a file was expected"):
        read_bytes(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_bytes(tmp_path / "nothing")
    (tmp_path / "f").write_bytes(b"abc")
    os.symlink(tmp_path / "f", tmp_path / "link")  # a symlink to a regular file is one
    assert read_bytes(tmp_path / "link") == b"abc" and open_regular(tmp_path / "f").name == str(tmp_path / "f")


# ---- servers that drip ---------------------------------------------------------------------------------------------

class Drip(http.server.BaseHTTPRequestHandler):
    """Answers every GET (a Range one with 206) with a body of `size` bytes sent one byte every 0.5 s, at most 120
    bytes (a bounded loop: a minute at most, whoever stops listening); /headers/... drips its status line instead."""

    protocol_version = "HTTP/1.1"
    size = 4000

    def log_message(self, *args):
        pass

    def _drip(self, data: bytes) -> None:
        for i in range(min(len(data), 120)):
            try:
                self.wfile.write(data[i:i + 1])
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.5)

    def do_GET(self):
        if self.path.startswith("/headers/"):
            self._drip(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            return
        self.send_response(206 if self.headers.get("Range") else 200)
        self.send_header("Content-Length", str(self.size))
        self.end_headers()
        self._drip(b"{" + b" " * (self.size - 2) + b"}")


@pytest.fixture
def drip(monkeypatch):
    monkeypatch.setenv("VITKIT_FETCH_DEADLINE_S", "1.5")  # the knob: every fetch's floor
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


DEADLINE = "no complete answer within the fetch's deadline of 1.54 s (VITKIT_FETCH_DEADLINE_S=1.5, plus 4,000 bytes"


def test_a_dripping_shard_server_is_cut_off_at_the_deadline(drip, tmp_path, capsys):
    """`vitkit train data.dataset=http://...` whose index.json comes one byte every 0.5 s: one error line naming the
    URL and the deadline, seconds later (was: waiting as long as the server kept sending, the 60 s timeout being
    per read)."""
    how, code, took = returns(lambda: main(["train", f"data.dataset={drip}", f"run.out_dir={tmp_path / 'run'}",
                                            "run.progress=false", "run.precision=fp32"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert how == "ok" and code == 2 and err[-1].startswith(f"vitkit: error: {drip}/train/index.json: {DEADLINE}"), err
    assert took < BOUND_S


def test_a_dripping_sample_a_dripping_download_and_dripping_headers_are_cut_off(drip, tmp_path):
    from vitkit.download import download
    from vitkit.data.shards import _Bytes, fetch_small

    how, e, _ = returns(lambda: _Bytes().read(f"{drip}/shard-000000.tar", 0, 4000))  # one sample's Range request
    assert how == "raised" and isinstance(e, TimeoutError) and str(e).startswith(f"{drip}/shard-000000.tar: {DEADLINE}")
    how, e, _ = returns(lambda: download(f"{drip}/w.safetensors", tmp_path / "w.safetensors"))
    assert how == "raised" and isinstance(e, CheckpointError), e
    assert str(e).startswith(f"could not download {drip}/w.safetensors: {DEADLINE}") and "resumed next time" in str(e)
    assert not (tmp_path / "w.safetensors").exists()
    how, e, _ = returns(lambda: fetch_small(f"{drip}/headers/index.json"))  # the status line itself, one byte at a time
    assert how == "raised" and isinstance(e, UsageError) and "deadline of 1.5 s (VITKIT_FETCH_DEADLINE_S=1.5)" in str(e)


def test_the_budget_scales_with_the_size_and_reads_the_knobs(monkeypatch):
    from vitkit.safety import fetch_budget

    assert fetch_budget() == 60.0 and fetch_budget(350_000_000) == 60.0 + 3500.0  # a ViT-B in an hour
    monkeypatch.setenv("VITKIT_FETCH_DEADLINE_S", "5")
    monkeypatch.setenv("VITKIT_FETCH_MIN_RATE", "1000")
    assert fetch_budget(10_000) == 15.0
    monkeypatch.setenv("VITKIT_FETCH_DEADLINE_S", "nonsense")  # refused by name (was: 60 s, silently)
    with pytest.raises(UsageError, match=r"^VITKIT_FETCH_DEADLINE_S='nonsense': must be a finite number"):
        fetch_budget()


if sys.platform != "linux":  # the device and socket cases assume Linux's /dev and AF_UNIX
    test_sockets_devices_and_folders_are_refused_by_the_one_door = pytest.mark.skip(
        test_sockets_devices_and_folders_are_refused_by_the_one_door)
