"""scripts/setup_env.sh, which both README commands run first: one set-up at a time in a clone (a second waits for
the first's lock instead of installing into the same .venv beside it). Run on a copy of the script in a folder whose
.venv is already marked installed, so that the script installs nothing."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def clone(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts/setup_env.sh", tmp_path / "scripts/setup_env.sh")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (tmp_path / ".venv/bin").mkdir(parents=True)
    (tmp_path / ".venv/bin/python").symlink_to(sys.executable)
    marker = tmp_path / ".venv/.expertcast-installed"
    marker.touch()
    later = time.time() + 5
    os.utime(marker, (later, later))  # newer than pyproject.toml: nothing to install
    return tmp_path


@pytest.mark.skipif(shutil.which("flock") is None, reason="flock (util-linux) is not installed")
def test_a_second_set_up_waits_for_the_first(clone):
    script = ["bash", str(clone / "scripts/setup_env.sh")]
    assert subprocess.run(script, capture_output=True, timeout=60).returncode == 0  # alone: done at once
    with open(clone / ".setup_env.lock", "w") as held:  # a first set-up holds the clone's lock
        fcntl.flock(held, fcntl.LOCK_EX)
        second = subprocess.Popen(script, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(1.5)
        waiting = second.poll() is None
        fcntl.flock(held, fcntl.LOCK_UN)
    assert waiting, "the second set-up ran beside the first instead of waiting for its lock"
    assert second.wait(timeout=60) == 0
