"""A worker that will not stop, like a TensorFlow worker blocked in a collective.

It ignores SIGTERM and SIGINT and starts a child that ignores them too (the dispositions are
inherited), in its own process group as a data loader or compiler subprocess would be. Only
SIGKILL to the whole group ends both. Records `<pid_dir>/<index>.pid` and
`<pid_dir>/<index>-child.pid`; the child's command line names `pid_dir`, so a test can tell
it from an unrelated process that later got the same pid.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--pid-dir", required=True)
parser.add_argument("--sleep", type=float, default=120.0)
arguments = parser.parse_args()

for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, signal.SIG_IGN)
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
child = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1]))",
                          str(arguments.sleep), arguments.pid_dir])


def record(name: str, pid: int) -> None:
    # Written whole, then renamed: the test reads every *.pid as soon as it appears.
    path = os.path.join(arguments.pid_dir, name)
    with open(path + ".partial", "w") as handle:
        handle.write(str(pid))
    os.replace(path + ".partial", path)


record(f"{index}-child.pid", child.pid)
record(f"{index}.pid", os.getpid())
print(f"index {index} ignores SIGTERM and SIGINT, as does its child {child.pid}", flush=True)
time.sleep(arguments.sleep)
