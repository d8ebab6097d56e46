"""Run a module as `python -m` would, under cProfile: `loadtest http --profile DIR`.

    python -m herdwick.loadtest.profiled DIR herdwick.cli http-worker --concurrency 512

writes DIR/herdwick.cli-PID.prof when the module exits (a SIGTERM that the module
turns into a clean stop included), for `python -m pstats` or snakeviz. cProfile
costs every Python call, so a profiled process runs slower than a plain one: its
shares of time are the point, not its throughput.
"""

from __future__ import annotations

import cProfile
import os
import runpy
import sys


def profile_path(out_dir: str, module: str, pid: int) -> str:
    return os.path.join(out_dir, f"{module}-{pid}.prof")


def main() -> int:
    if len(sys.argv) < 3:
        print("usage: python -m herdwick.loadtest.profiled DIR MODULE [ARGS...]",
              file=sys.stderr)
        return 2
    out_dir, module, *args = sys.argv[1:]
    os.makedirs(out_dir, exist_ok=True)
    sys.argv = [module, *args]
    profiler = cProfile.Profile()
    code = 0
    try:
        profiler.runcall(runpy.run_module, module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    finally:
        profiler.dump_stats(profile_path(out_dir, module, os.getpid()))
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
