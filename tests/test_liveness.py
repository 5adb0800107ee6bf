"""How a survivor tells a lost rank from a live one on its own node: by process id, zombies counting as gone."""

from __future__ import annotations

import subprocess
import sys
import time

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
