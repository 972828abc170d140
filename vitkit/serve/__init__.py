"""Serving a checkpoint over HTTP, with a web page (see `app.py`; needs `pip install 'vitkit[serve]'`)."""
try:
    from .app import Limits, create_app
except ImportError as e:  # fastapi, uvicorn, python-multipart, prometheus-client
    from ..errors import UsageError

    raise UsageError(f"vitkit serve needs its web stack: pip install 'vitkit[serve]' ({e})") from e
from .engine import MicroBatcher, OnnxPredictor, TorchPredictor, load_predictor

__all__ = ["Limits", "create_app", "MicroBatcher", "OnnxPredictor", "TorchPredictor", "load_predictor", "serve"]


def serve(checkpoint: str, host: str = "127.0.0.1", port: int = 8000, backend: str = "torch", limits: Limits | None = None,
          threads: int | None = None, precision: str = "auto") -> None:
    """Run the service until interrupted."""
    import uvicorn

    from pathlib import Path

    limits = limits or Limits()
    app = create_app(load_predictor(checkpoint, backend, threads, precision, limits.max_batch), limits,
                     name=Path(checkpoint).stem)
    uvicorn.run(app, host=host, port=port, log_level="warning")
