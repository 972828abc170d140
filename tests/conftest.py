import math
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from vitkit import log as vitkit_log
from vitkit.machine import threads as thread_policy

FIXTURES = Path(os.environ.get("VITKIT_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures"))
FIXTURES_HERE = Path(__file__).resolve().parent / "fixtures"  # made by tests/fixtures/make_timm_fixtures.py

# Two threads in one process; under pytest-xdist (`make test` runs `-n auto`) the cores are shared among the workers, so
# that two workers on a 2-core machine do not run four GEMM threads.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads() // WORKERS)))

# The thread policy (vitkit.machine.threads) reads the machine's load, which tests do not control: the thread count
# stays the one above, and a choice measured while other workers ran is cached as on a quiet machine.
# tests/test_threads.py turns both on with readings of its own.
thread_policy.ADAPT = False
thread_policy.BUSY_LIMIT = math.inf

# vitkit's messages (`vitkit.log`) on stderr as the command shows them, in every test and whatever ran before: a test
# reads a library call's warning from capsys as a user of the command would see it (tests/test_log.py checks both ways).
vitkit_log.show()


def pytest_configure(config):
    # pytest-xdist registers the mark when it is loaded; a run with -p no:xdist would warn of an unknown mark
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one worker under --dist loadgroup")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """`--dist loadgroup`: each test marked `xdist_group(name)` gets the suffix `@name` on its node id, by which the
    controller sends a group to one worker. pytest-xdist 3.8 writes the suffix into `item._nodeid`, which pytest 9.2
    no longer reads (its node id is `item._id`, a NodeId): the groups were silently ignored, so a module-scoped
    fixture (a compiled package, a reference training run) was built on both workers. Done here where xdist's own
    renaming did not take."""
    if not (hasattr(config, "workerinput") and config.getvalue("loadgroup")):
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if not names or item.nodeid.rfind("@") > item.nodeid.rfind("]"):
            continue  # no group, or xdist's suffix is in place
        if not hasattr(item, "_id"):  # an older pytest, which would have read xdist's suffix
            continue
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def tiny_kwargs(name: str) -> dict:
    """Shrink a registered model to test size, keeping its family (patch size, hybrid stages, ...)."""
    from vitkit.models import get_entry

    entry = get_entry(name)
    if entry.arch == "resnetv2":
        return dict(img_size=64, num_classes=5, layers=(1, 1, 1, 1), width_factor=1, channels=(128, 128, 256, 256), stem_width=32)
    if entry.arch == "swin":  # four stages of two blocks, shifted windows in the first two (maps 16, 8, 4, 2)
        return dict(img_size=32, patch_size=2, num_classes=5, embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4),
                    window_size=4)
    p = entry.kwargs["patch_size"]
    kw = dict(embed_dim=48, depth=2, num_heads=3, mlp_dim=96, num_classes=5, img_size=2 * p)
    if entry.kwargs.get("hybrid_layers"):
        kw.update(hybrid_width=0.5, hybrid_layers=tuple(1 for _ in entry.kwargs["hybrid_layers"]))
    return kw


class Server:
    """uvicorn in a thread on a free port of 127.0.0.1."""

    def __init__(self, app) -> None:
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
