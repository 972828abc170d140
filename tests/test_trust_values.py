"""Issue 52, values from outside: environment knobs parsed in one place (`vitkit.env`), config and checkpoint values
that would give non-finite outputs or be truncated refused by name, and Ctrl-C in `vitkit train` losing no work."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from vitkit.cli import main
from vitkit.errors import CheckpointError, UsageError

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(vitkit.__file__).resolve().parent  # the vitkit under test (PYTHONPATH may name another checkout)


# ---- 1. environment knobs -----------------------------------------------------------------------------------------

def _py(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent,
                          env={**os.environ, "PYTHONPATH": str(PACKAGE.parent), **env})


def test_import_and_help_work_whatever_the_environment_holds():
    """`VITKIT_MAX_IMAGE_PIXELS=abc` made `import vitkit` (and so `vitkit --help`) raise a ValueError."""
    bad = {"VITKIT_MAX_IMAGE_PIXELS": "abc", "VITKIT_MAX_TENSOR_BYTES": "1.5", "VITKIT_MAX_DOWNLOAD_BYTES": "x",
           "VITKIT_GEMM": "fast"}
    r = _py("import vitkit, vitkit.cli, vitkit.data.image, vitkit.download, vitkit.machine.gemm\n"
            "try:\n    vitkit.cli.main(['--help'])\nexcept SystemExit as e:\n    raise SystemExit(e.code)", **bad)
    assert r.returncode == 0 and "COMMAND" in r.stdout, r.stderr[-1500:]


BAD_KNOBS = [  # (variable, value, what the one line says it must be)
    ("VITKIT_FETCH_DEADLINE_S", "abc", "a finite number in (0, "),
    ("VITKIT_FETCH_DEADLINE_S", "-1", "a finite number in (0, "),
    ("VITKIT_FETCH_DEADLINE_S", "1e999", "a finite number in (0, "),
    ("VITKIT_FETCH_DEADLINE_S", "nan", "a finite number in (0, "),
    ("VITKIT_FETCH_MIN_RATE", "0", "a finite number in [1, "),
    ("VITKIT_MAX_IMAGE_PIXELS", "abc", "an integer >= 1"),
    ("VITKIT_MAX_TENSOR_BYTES", "1.5", "an integer >= 1"),
    ("VITKIT_MAX_TEXT_BYTES", "-5", "an integer >= 1"),
    ("VITKIT_MAX_NESTING", "0", "an integer in [1, "),
    ("VITKIT_MAX_DOWNLOAD_BYTES", "64G", "an integer >= 1"),
    ("VITKIT_GEMM", "fast", "one of mkl, mkl-packed, onednn-packed"),
]


@pytest.mark.parametrize("name,value,must", BAD_KNOBS, ids=[f"{n}={v}" for n, v, _ in BAD_KNOBS])
def test_a_command_refuses_a_bad_knob_by_name_before_any_work(monkeypatch, capsys, name, value, must):
    """`vitkit COMMAND` with a bad knob: one line naming the variable, its value and what it must be, exit 2, before
    the command ran (was: a traceback at import, or the default used silently)."""
    monkeypatch.setenv(name, value)
    code = main(["models", "--pattern", "vit_ti16", "--json-out"])
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"vitkit: error: {name}={value!r}: must be {must}"), err
    assert cap.out == ""  # nothing listed: refused before the command's work


def test_knobs_are_read_when_used_and_a_bad_one_is_refused_there(monkeypatch, tmp_path):
    from vitkit.data.image import ImageDecodeError, load_image
    from vitkit.safety import check_tensor, fetch_budget

    monkeypatch.setenv("VITKIT_MAX_TENSOR_BYTES", "1024")  # set after import: read at use
    with pytest.raises(CheckpointError, match="over the limit of 1.0 KiB|VITKIT_MAX_TENSOR_BYTES"):
        check_tensor("w", (1000,), 4, "f.safetensors")
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    monkeypatch.setenv("VITKIT_MAX_IMAGE_PIXELS", "10")
    with pytest.raises(ImageDecodeError, match="8 x 8 = 64 pixels, over the limit of 10"):
        load_image(tmp_path / "a.png")
    for name, value in (("VITKIT_FETCH_DEADLINE_S", "1e999"), ("VITKIT_FETCH_MIN_RATE", "0")):
        monkeypatch.setenv(name, value)
        with pytest.raises(UsageError, match=rf"^{name}='{value}': must be a finite number"):
            fetch_budget(10)
        monkeypatch.delenv(name)
    monkeypatch.setenv("VITKIT_MAX_IMAGE_PIXELS", "many")
    with pytest.raises(UsageError, match="^VITKIT_MAX_IMAGE_PIXELS='many': must be an integer >= 1"):
        load_image(tmp_path / "a.png")


def test_a_forced_gemm_path_is_checked_against_the_choices(monkeypatch):
    from vitkit import env
    from vitkit.machine import gemm

    assert env.KNOBS["VITKIT_GEMM"].choices == gemm.PATHS
    monkeypatch.setattr(gemm, "FORCE", "fastest")  # the attribute tests set, checked as the variable is
    with pytest.raises(UsageError, match="^VITKIT_GEMM='fastest': must be one of mkl, mkl-packed, onednn-packed"):
        gemm.choose(64, 64, 8)
    monkeypatch.setattr(gemm, "FORCE", gemm.FROM_ENV)
    monkeypatch.setenv("VITKIT_GEMM", "mkl")  # the variable, read at use
    assert gemm.choose(64, 64, 8) == "mkl"


def test_every_knob_the_package_names_is_in_the_table_and_the_docs_show_the_table():
    from vitkit import env

    named, direct = set(), []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        named |= set(re.findall(r"VITKIT_[A-Z_]+[A-Z]", text))
        if path.name != "env.py":  # the one place that reads them
            direct += [f"{path.name}: {m}" for m in re.findall(r"(?:environ|getenv)[^\n]{0,12}VITKIT_\w+", text)]
    assert named <= set(env.KNOBS), named - set(env.KNOBS)
    assert not direct, direct
    doc = (REPO / "docs" / "safety.md").read_text()
    shown = doc.split("<!-- env-knobs: generated by vitkit.env.markdown_table() -->\n", 1)[1].split("\n<!--", 1)[0]
    assert shown == env.markdown_table(), "docs/safety.md's table: regenerate it from vitkit.env.markdown_table()"
    for knob in env.KNOBS.values():  # every default passes its own check
        assert env.parse(knob.name, None) == env.parse(knob.name, str(knob.default) if knob.default is not None else None)
