"""vitkit.cache: the one home of the cache folder and its writes."""
from __future__ import annotations

import os

import pytest

from vitkit import cache


def test_cache_dir_follows_vitkit_home(tmp_path, monkeypatch):
    monkeypatch.setenv("VITKIT_HOME", str(tmp_path / "h"))
    assert cache.cache_dir() == tmp_path / "h"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    f = tmp_path / "sub" / "x.json"
    cache.atomic_write(f, lambda p: p.write_text("old"))

    def half(p):
        p.write_text("ne")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        cache.atomic_write(f, half)
    assert f.read_text() == "old" and sorted(os.listdir(f.parent)) == ["x.json"]


def test_json_caches_never_fail_the_caller(tmp_path):
    f = tmp_path / "c.json"
    assert cache.read_json_cache(f, {"none": 1}) == {"none": 1}  # missing
    f.write_text("{not json")
    assert cache.read_json_cache(f, []) == []  # unreadable
    assert cache.write_json_cache(f, {"a": 1}) and cache.read_json_cache(f, None) == {"a": 1}
    # a home that cannot be written (here a file where the folder should be; a read-only one alike): False
    assert cache.write_json_cache(f / "under-a-file.json", {"a": 1}) is False
