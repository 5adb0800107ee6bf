"""How a survivor tells a lost rank from a live one on its own node: by process id, zombies counting as gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from lightning_gaudi_fsdp import _liveness
from lightning_gaudi_fsdp._liveness import Verdict, _process_alive


def test_a_running_process_is_alive_and_a_killed_unreaped_one_is_not():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _process_alive(child.pid)
        child.kill()
        # not reaped (no wait()): a zombie, as a SIGKILLed rank is until Lightning's launcher polls it
        deadline = time.monotonic() + 10
        while _process_alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _process_alive(child.pid)
        assert child.poll() is not None  # ... and it really was killed, not gone some other way
    finally:
        child.wait()
    assert not _process_alive(child.pid)


def test_the_verdict_names_lost_ranks_and_the_first_error_another_rank_raised():
    verdict = Verdict(lost=[2, 3], errors=[(0, "OSError: disk full"), (1, "ValueError: x")])
    assert verdict.message(rank=0, world_size=4) == (
        "lightning_gaudi_fsdp: ranks 2, 3 of 4 stopped without reporting an error (killed, out of memory, or "
        "crashed); the collective failure on the surviving ranks follows from that; rank 1 failed first with: "
        "ValueError: x"
    )
    assert Verdict().message(rank=0, world_size=4) is None


def _leave_with_launcher_in_a_child(launcher_pid: str) -> subprocess.CompletedProcess[str]:
    code = "from lightning_gaudi_fsdp import _liveness; _liveness.leave_with_launcher(); print('stayed')"
    env = {**os.environ, "LIGHTNING_GAUDI_FSDP_LAUNCHER_PID": launcher_pid}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_rank_whose_launcher_is_gone_leaves_at_once_and_an_unrelated_live_pid_is_left_alone():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid is free, nobody runs under it
    gone = _leave_with_launcher_in_a_child(str(dead.pid))
    assert gone.returncode == 1
    assert f"the process that launched this rank (pid {dead.pid}, global rank 0) is gone" in gone.stderr
    # pid 1 runs and is not the child's parent: a variable leaked from an outer launch, not our launcher
    alive = _leave_with_launcher_in_a_child("1")
    assert alive.returncode == 0
    assert alive.stdout.strip() == "stayed"


def test_an_exception_that_ends_the_script_is_reported_once_before_the_previous_hook_prints_it():
    """Fabric's door reports through sys.excepthook: the heartbeat's report runs first (its note is printed with the
    traceback), the hook that was there before still runs, and installing twice chains only once."""
    # _liveness alone (standard library only at import), without the package's torch and Lightning imports
    code = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_liveness", {_liveness.__file__!r})
_liveness = sys.modules["_liveness"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_liveness)

class Recording(_liveness.Heartbeat):
    def report(self, exception):
        exception.add_note(f"reported by rank {{self.rank}}")
        return None

def previous(kind, value, tb):
    sys.stderr.write("previous hook: " + " | ".join([str(value), *value.__notes__]) + "\\n")

sys.excepthook = previous
_liveness.report_uncaught(Recording(0, 2, "node"))
_liveness.report_uncaught(Recording(1, 2, "node"))  # the same hook, now for rank 1
raise RuntimeError("boom")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "previous hook: boom | reported by rank 1"
