"""The server settings the deployment relies on: the API key from PAGEDSERVE_API_KEY and --shutdown-timeout."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedserve.cli import build_parser


def serve(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def test_an_empty_key_in_the_environment_refuses_to_start():
    # A Secret with an empty value must not quietly serve without authentication.
    proc = serve("--port", "1", PAGEDSERVE_API_KEY="")
    assert proc.returncode == 2
    assert "PAGEDSERVE_API_KEY is set but empty" in proc.stderr


@pytest.mark.parametrize("value", ["-1", "soon"])
def test_shutdown_timeout_must_be_a_non_negative_number(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--shutdown-timeout", value])
    assert "--shutdown-timeout" in capsys.readouterr().err

