"""For the scenario pool's own tests: every rank writes its process id to ``rank<N>.pid``, then exits with the code
``exit_codes`` gives its rank once every rank has written one, or sleeps forever if its rank has none."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

cfg = json.loads(Path(sys.argv[1]).read_text())
out = Path(cfg["out"])
rank = int(os.environ.get("RANK", "0"))
world_size = int(os.environ.get("WORLD_SIZE", "1"))
(out / f"rank{rank}.pid").write_text(str(os.getpid()))
code = cfg.get("exit_codes", {}).get(str(rank))
if code is None:
    while True:
        time.sleep(60)
# Exit only once every rank is up, so a rank that hangs has written its pid before any grace period starts.
while not all((out / f"rank{r}.pid").exists() for r in range(world_size)):
    time.sleep(0.01)
sys.exit(code)
