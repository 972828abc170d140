"""vitkit's messages go through `logging` (vitkit/log.py): the command shows them as `vitkit: ...` lines on stderr; a
program that imports vitkit configures them as it would any library's."""
import logging
import subprocess
import sys

from vitkit.cli import main
from vitkit.training.config import apply_overrides
from vitkit.training.presets import PRESETS


def test_library_messages_are_log_records(caplog):
    """A program sees the message as a record of the module's logger, with its level, not as a print."""
    cfg = PRESETS["fashion-mnist"]()
    with caplog.at_level(logging.INFO, logger="vitkit"):
        apply_overrides(cfg, {"model.name": "vit_ti16"})
    (rec,) = [r for r in caplog.records if "overrides are dropped" in r.getMessage()]
    assert rec.name == "vitkit.training.config" and rec.levelno == logging.WARNING


def test_command_shows_messages_with_the_prefix(capsys):
    """The `vitkit` command shows them on stderr as `vitkit: warning: ...` lines."""
    assert main(["train", "fashion-mnist", "--print-config", "model.name=vit_ti16"]) == 0
    err = capsys.readouterr().err
    assert "vitkit: warning: model.name=vit_ti16 replaces r26_vit_s32: its model overrides are dropped" in err


def test_a_library_user_without_logging_config_sees_warnings_not_info():
    """Importing vitkit configures no logging: Python's last-resort handler shows the warning (its message alone), and
    an info message stays quiet until the program asks for it."""
    code = ("import logging; from vitkit.training.config import apply_overrides; "
            "from vitkit.training.presets import PRESETS; "
            "logging.getLogger('vitkit.x').info('an info line'); "
            "apply_overrides(PRESETS['fashion-mnist'](), {'model.name': 'vit_ti16'})")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert "its model overrides are dropped" in err and "an info line" not in err and "vitkit: warning" not in err
