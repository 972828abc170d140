"""Serving a checkpoint over HTTP, with a web page (see `app.py`; needs `pip install 'vitkit[serve]'`)."""
try:
    from .app import Limits, _backlog, create_app, fds_needed, uvicorn_config
except ImportError as e:  # fastapi, uvicorn, python-multipart, prometheus-client
    from ..errors import UsageError

    raise UsageError(f"vitkit serve needs its web stack: pip install 'vitkit[serve]' ({e})") from e
from .engine import MicroBatcher, OnnxPredictor, TorchPredictor, load_predictor
from ..errors import UsageError
from pathlib import Path
import ipaddress
import logging
import os
import socket

log = logging.getLogger(__name__)

__all__ = ["Limits", "create_app", "uvicorn_config", "MicroBatcher", "OnnxPredictor", "TorchPredictor", "load_predictor", "serve"]


def serve(checkpoint: str, host: str = "127.0.0.1", port: int = 8000, backend: str = "torch", limits: Limits | None = None,
          threads: int | None = None, precision: str = "auto", api_key: str | None = None,
          trust_package: bool = False) -> None:
    """Run the service until interrupted: the checkpoint loaded and the port bound first (a taken port or a bad
    checkpoint is a UsageError/CheckpointError before anything is announced), then "serving ..." on stderr. Bound
    to an address other than loopback without an `api_key`, it warns that anyone who reaches the port can use it."""
    import uvicorn  # optional: the [serve] extra

    limits = limits or Limits()
    predictor = load_predictor(checkpoint, backend, threads, precision, limits.max_batch, trust_package)
    predictor.threads = threads  # fixed where given; otherwise torch's follow the load (`MicroBatcher`)
    backend = getattr(predictor, "backend", backend)  # an export runs on its own runtime
    app = create_app(predictor, limits, name=Path(checkpoint).stem, api_key=api_key or None)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e} (another server there? pick one with --port)") from e
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    if not api_key and not ipaddress.ip_address(address[0].split("%")[0]).is_loopback:
        log.warning(f"serving on {shown}, reachable from other machines, without an API key: anyone who can reach "
                    f"this port can use the model. Set --api-key (or VITKIT_API_KEY), or bind 127.0.0.1.")
    limits.max_connections = _file_limit_for(limits.max_connections)  # /model shows what is served
    sock.listen(_backlog(limits.max_connections))  # connections queue from here: "serving" means it
    log.info(f"serving {checkpoint} ({backend}) on http://{shown}:{sock.getsockname()[1]}/")
    uvicorn.Server(uvicorn_config(app, limits)).run(sockets=[sock])


def _file_limit_for(connections: int) -> int:
    """The connections this process can hold open: its open-file limit raised (soft, up to the hard limit) to fit
    `connections` and what is open now; where the hard limit is lower, fewer, with a warning. A process out of file
    descriptors stops accepting anyone (the 1,100 idle connections of issue 52 under `ulimit -n 1024`)."""
    try:
        import resource
    except ImportError:  # Windows
        return connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 256
    spare = in_use + 128  # the model's files, threads' pipes, a decode's temporary file
    want = fds_needed(connections) + spare
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want:
        fits = next((c for c in range(connections, 16, -1) if fds_needed(c) + spare <= soft), 16)
        log.warning(f"the open-file limit (ulimit -n) is {soft:,} and cannot be raised (hard limit {hard:,}): serving "
                    f"at most {fits:,} connections at once, not {connections:,}; raise the hard limit (ulimit -Hn, "
                    f"systemd LimitNOFILE) for more")
        return fits
    return connections
