"""The command line's errors: expected failures on one line, bugs with their traceback, bad overrides by name."""

import vitkit.cli as cli


def test_expected_errors_are_one_line(capsys):
    assert cli.main(["train", "fashion-mnist", "optim.lr=abc"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitkit: error: optim.lr='abc': not a valid float") and "Traceback" not in err
    assert cli.main(["train", "fashion-mnist", "run.ema=[1, 2"]) == 2
    assert "run.ema='[1, 2': not a valid" in capsys.readouterr().err
    assert cli.main(["info", "no/such/checkpoint.safetensors"]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    assert cli.main(["--debug", "info", "no/such/checkpoint.safetensors"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_unexpected_errors_keep_their_traceback(capsys, monkeypatch):
    def broken(x: int = 1) -> None:
        """A command with a bug in it."""
        return {}["missing"]

    monkeypatch.setitem(cli.COMMANDS, "broken", broken)
    assert cli.main(["broken"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'missing'" in err and "unexpected error" in err
