"""Python code run as if each piece were the first of a fresh interpreter, for what mailpipe does
once per process: which modules an import pulls in, the settings read from the environment.

One interpreter imports the third-party libraries named, then forks a child for each piece of
code. No mailpipe module is loaded before the fork (that is checked), so what the code imports of
mailpipe, and what mailpipe reads from the child's environment, is as in a fresh interpreter,
without the libraries' imports, seconds of CPU, paid once a case.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence

_PARENT = r"""
import importlib, json, os, sys, traceback

job = json.load(sys.stdin)
for name in job["preload"]:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m == "mailpipe" or m.startswith("mailpipe."))
if loaded:
    sys.exit(f"importing {job['preload']} imported mailpipe: {loaded}")
outputs = []
for code, env in job["cases"]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.dup2(write, 1)
        os.environ.update(env)
        try:
            exec(code, {"__name__": "__main__"})
            sys.stdout.flush()
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        outputs.append(pipe.read())
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        sys.exit(f"failed with environment {env}:\n{code}")
sys.stdout.write(json.dumps(outputs))
"""


def run_forked(
    cases: Sequence[tuple[str, Mapping[str, str]]], preload: Sequence[str] = ()
) -> list[str]:
    """What each piece of code printed, run with its environment added, in one child each of an
    interpreter that imported `preload` first."""
    done = subprocess.run(
        [sys.executable, "-c", _PARENT],
        input=json.dumps({"preload": list(preload), "cases": [[c, dict(e)] for c, e in cases]}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
