"""The command line: demo, help, bad options."""

from __future__ import annotations

import subprocess
import sys

import pytest

from multiscale_jac.cli import main


def test_demo_prints_table_and_passes(capsys) -> None:
    assert main(["demo", "--samples", "3", "--entries", "40"]) == 0
    out = capsys.readouterr().out
    assert "strategy" in out and "max |diff|" in out
    assert "head.*" in out and "40 entries" in out
    assert "bucketed" in out  # mixed sizes -> buckets
    assert "OK: every Jacobian equals the loop reference" in out


def test_help_lists_commands(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "demo" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "--samples" in out and "--device" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--samples", "0"], "expected a positive integer, got '0'"),
        (["demo", "--device", "tpu"], "invalid choice: 'tpu'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_options_exit_nonzero(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_no_command_prints_help(capsys) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_module_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "multiscale_jac", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "demo" in out.stdout
