"""Fetching a file by URL into place, verified: resumed from a partial `dest.part` (HTTP Range), checked against a
recorded SHA-256 or MD5, else against the hash the server publishes with the file (Google Cloud Storage's MD5 in
`x-goog-hash`, the Hugging Face hub's SHA-256 of an LFS file in `x-linked-etag`), refused before it starts when its
declared size is over the limit or the disk's free space, and cut off by an overall deadline
(`vitkit.safety.Deadline`). Used by the checkpoint catalog and the dataset downloads alike."""
from __future__ import annotations

import base64
import hashlib
import http.client
import os
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from . import env
from .errors import CheckpointError
from .safety import Deadline, fetch_budget, open_regular, open_url


# Servers that publish a checksum with every file, and how: "gcs" (Google Cloud Storage: the object's MD5 in
# `x-goog-hash`) or "hf" (the Hugging Face hub: an LFS file's SHA-256 in `x-linked-etag` on its redirect, a small
# file's git blob SHA-1 as its `etag`). A mirror that behaves the same can be added here.
HASH_PUBLISHERS = {"storage.googleapis.com": "gcs", "huggingface.co": "hf"}


def server_hash_kind(url: str) -> str | None:
    """"gcs" or "hf" when the server of `url` publishes a checksum with each file (HASH_PUBLISHERS), else None."""
    return HASH_PUBLISHERS.get(urllib.parse.urlparse(url).hostname or "")


def _published_hashes(url: str, headers) -> dict[str, str]:
    """{"md5" | "sha256" | "git-sha1": hex} that the server of `url` states in these response headers."""
    kind, out = server_hash_kind(url), {}
    if kind == "gcs":
        for part in (headers.get("x-goog-hash") or "").split(","):
            algo, _, value = part.strip().partition("=")
            if algo == "md5" and value:
                out["md5"] = base64.b64decode(value).hex()
    elif kind == "hf":
        linked = (headers.get("x-linked-etag") or "").strip().removeprefix("W/").strip('"')
        etag = (headers.get("etag") or "").strip().removeprefix("W/").strip('"')
        if re.fullmatch(r"[0-9a-f]{64}", linked):
            out["sha256"] = linked
        elif re.fullmatch(r"[0-9a-f]{40}", etag):
            out["git-sha1"] = etag
    return out


class _RecordRedirects(urllib.request.HTTPRedirectHandler):
    """Keeps (URL, headers) of every redirect: the Hugging Face hub states an LFS file's SHA-256 on its redirect."""

    def __init__(self) -> None:
        self.seen: list = []

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.seen.append((req.full_url, headers))
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def file_digest(path: Path, algo: str) -> str:
    """The hex digest of a file: hashlib's algorithms, and "git-sha1", git's blob id (SHA-1 of a header + content)."""
    if algo == "git-sha1":
        h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    else:
        h = hashlib.new(algo)
    with open_regular(path, error=CheckpointError) as f:  # a FIFO or device is refused, not read forever
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_of(path: Path) -> str:
    return file_digest(path, "sha256")


def download(url: str, dest: Path, sha256: str | None = None, timeout: float = 30.0, md5: str | None = None) -> Path:
    """Fetch `url` to `dest`, resuming a partial `dest.part`, and verify it: against `sha256` or `md5` where given,
    else against the hash the server publishes with the file (see the module's docstring). A mismatch removes
    the download and raises a CheckpointError. Processes downloading into the same folder at once take turns (a lock
    on the folder itself, no file left behind): the first downloads, the others then find the file."""
    if dest.exists():
        return dest
    fetch_budget(), env.get("VITKIT_MAX_DOWNLOAD_BYTES")  # the knobs this reads: a bad value is named before anything
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl  # fcntl: POSIX only
    except ImportError:  # not POSIX: no lock
        return _download(url, dest, sha256, timeout, md5)
    folder = os.open(dest.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        return dest if dest.exists() else _download(url, dest, sha256, timeout, md5)
    finally:
        os.close(folder)  # and the lock with it


def _download(url: str, dest: Path, sha256: str | None, timeout: float, md5: str | None) -> Path:
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    req = urllib.request.Request(url, headers={"User-Agent": "vitkit", **({"Range": f"bytes={have}-"} if have else {})})
    published: dict[str, str] = {}
    deadline = Deadline(url)
    try:
        if url.startswith("file://"):
            with open_regular(urllib.request.url2pathname(url[len("file://"):]), error=CheckpointError) as src, \
                    open(part, "wb") as f:
                shutil.copyfileobj(src, f, 1 << 20)
        else:
            redirects = _RecordRedirects()
            with deadline, open_url(req, deadline, timeout, redirects) as r:
                for where, h in [*redirects.seen, (r.url, r.headers)]:
                    published.update(_published_hashes(where, h))
                resumed = have and r.status == 206
                length = r.headers.get("Content-Length")
                _check_download_size(url, length, part.parent)
                if length and length.isdigit():
                    deadline.expect(int(length))  # the whole fetch within VITKIT_FETCH_DEADLINE_S + its size's share
                with open(part, "ab" if resumed else "wb") as f:
                    written, cap = f.tell(), env.get("VITKIT_MAX_DOWNLOAD_BYTES")
                    while chunk := r.read(1 << 20):
                        written += len(chunk)
                        if written > cap:  # a server that sends without end (or lies in its header)
                            raise CheckpointError(f"{url}: more than {cap:,} bytes: refused "
                                                  f"(VITKIT_MAX_DOWNLOAD_BYTES)")
                        f.write(chunk)
                deadline.check()  # a body cut short by the deadline ends like a complete one
    except CheckpointError:
        raise
    except (urllib.error.URLError, OSError, TimeoutError, http.client.HTTPException, ValueError) as e:
        if deadline.expired:
            raise CheckpointError(f"could not download {deadline.exceeded()} (a partial download is kept at {part} "
                                  f"and resumed next time)") from None
        raise CheckpointError(
            f"could not download {url} ({getattr(e, 'reason', e)}). If this machine is offline, fetch that URL by "
            f"hand and put the file at {dest} (a partial download is kept at {part} and resumed next time)"
        ) from e
    expected = {"sha256": sha256, "md5": md5} if (sha256 or md5) else published
    for algo, want in expected.items():
        if not want:
            continue
        got = file_digest(part, algo)
        if got != want.lower():
            part.unlink()
            source = "recorded" if (sha256 or md5) else "published by the server"
            raise CheckpointError(f"checksum mismatch for {url}: expected {algo} {want} ({source}), got {got}; "
                                  f"the download was removed")
    from .cache import replace_output  # the one rename of an output: a FIFO or device at `dest` is refused, not replaced

    replace_output(part, dest)
    return dest


def _check_download_size(url: str, length: str | None, folder: Path) -> None:
    """A download whose declared size is over the limit or over the disk's free space is refused before it starts."""
    if length is None or not length.isdigit():
        return
    n, free, cap = int(length), shutil.disk_usage(folder).free, env.get("VITKIT_MAX_DOWNLOAD_BYTES")
    if n > cap:
        raise CheckpointError(f"{url} declares {n:,} bytes, over the limit of {cap:,} "
                              f"(VITKIT_MAX_DOWNLOAD_BYTES): refused")
    if n > free:
        raise CheckpointError(f"{url} declares {n:,} bytes; {folder} has {free:,} free: refused before downloading")
