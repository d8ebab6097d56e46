"""Long-running commands collect garbage less often than Python's defaults, unless the
code they run set its own thresholds."""

import subprocess
import sys

# As `herdwick worker` runs: the command's module first, then the handler's (`before`).
PROBE = """
import gc
from herdwick.cli import _collect_less
{before}
_collect_less()
print(gc.get_threshold(), gc.get_freeze_count() > 0)
"""


def _probe(before: str = "") -> str:
    done = subprocess.run([sys.executable, "-c", PROBE.format(before=before)],
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def test_a_service_raises_the_thresholds_and_freezes_what_it_loaded() -> None:
    assert _probe() == "(50000, 20, 100) True"


def test_thresholds_the_code_set_itself_are_kept() -> None:
    assert _probe("gc.set_threshold(1000, 5, 5)") == "(1000, 5, 5) False"
