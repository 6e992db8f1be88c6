"""The held heap of long CPU training jobs (utils/heap.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = r"""
import resource, sys, torch
if sys.argv[1] == "held":
    from expertcast.utils.heap import hold_heap
    assert hold_heap()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
sizes = (9 << 20, 13 << 20, 21 << 20, 3 << 20)  # 12-84 MB of float32, allocated and freed together as a step does
per_step = []
for _ in range(12):
    f0 = faults()
    xs = [torch.ones(n) for n in sizes]
    del xs
    per_step.append(faults() - f0)
print(sum(per_step[6:]) / 6)  # the steady state: the last 6 steps
"""


def _faults(mode: str) -> float:
    r = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return float(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_held_heap_reuses_freed_pages_instead_of_faulting_them_in_again():
    """By default glibc maps each large block afresh and unmaps it when freed, so a step that allocates 184 MB of
    tensors faults about 46,000 pages in again every time; held, the freed pages are reused (0 faults per step after
    a few steps, measured). Each case in its own interpreter: the setting lasts as long as the process."""
    plain, held = _faults("plain"), _faults("held")
    assert plain > 20000, plain
    assert held < plain / 4, (held, plain)


def test_only_the_fit_command_holds_the_heap(monkeypatch):
    """The console script holds the heap for ``fit`` (its process ends with the job) and for no command whose process
    measures or bounds its resident set (eval, replay, simulate); ``main(argv)`` called by another program (a test
    session) leaves that program's heap alone."""
    import importlib

    from expertcast import cli

    for name in ("fit", "eval", "replay", "simulate", "forecast-eval", "sweep"):
        mod = importlib.import_module(cli.SUBCOMMANDS[name][0])
        assert getattr(mod, "HOLDS_HEAP", False) == (name == "fit"), name
    calls = []
    monkeypatch.setattr("expertcast.utils.heap.hold_heap", lambda: calls.append(1) or True)
    assert cli.main(["fit", "--help"]) == 0  # called with its arguments, from another program: not that program's heap
    assert calls == []
    monkeypatch.setattr(sys, "argv", ["expertcast", "fit", "--help"])
    assert cli.main() == 0  # the console script
    assert calls == [1]
