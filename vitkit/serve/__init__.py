"""Serving a checkpoint over HTTP, with a web page (see `app.py`; needs `pip install 'vitkit[serve]'`)."""
try:
    from .app import Limits, create_app
except ImportError as e:  # fastapi, uvicorn, python-multipart, prometheus-client
    from ..errors import UsageError

    raise UsageError(f"vitkit serve needs its web stack: pip install 'vitkit[serve]' ({e})") from e
from .engine import MicroBatcher, OnnxPredictor, TorchPredictor, load_predictor
from ..errors import UsageError
from pathlib import Path
import ipaddress
import socket
import sys

__all__ = ["Limits", "create_app", "MicroBatcher", "OnnxPredictor", "TorchPredictor", "load_predictor", "serve"]


def serve(checkpoint: str, host: str = "127.0.0.1", port: int = 8000, backend: str = "torch", limits: Limits | None = None,
          threads: int | None = None, precision: str = "auto", api_key: str | None = None) -> None:
    """Run the service until interrupted: the checkpoint loaded and the port bound first (a taken port or a bad
    checkpoint is a UsageError/CheckpointError before anything is announced), then "serving ..." on stderr. Bound
    to an address other than loopback without an `api_key`, it warns that anyone who reaches the port can use it."""
    import uvicorn  # optional: the [serve] extra

    limits = limits or Limits()
    app = create_app(load_predictor(checkpoint, backend, threads, precision, limits.max_batch), limits,
                     name=Path(checkpoint).stem, api_key=api_key or None)
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
        print(f"vitkit: warning: serving on {shown}, reachable from other machines, without an API key: anyone who "
              f"can reach this port can use the model. Set --api-key (or VITKIT_API_KEY), or bind 127.0.0.1.",
              file=sys.stderr, flush=True)
    print(f"vitkit: serving {checkpoint} ({backend}) on http://{shown}:{sock.getsockname()[1]}/", file=sys.stderr, flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
