"""A plain-Python worker for the launcher tests (no ML backend).

Records its pid in `<pid_dir>/<attempt>-<index>.pid`, prints its identity, then behaves as the
flags say: exit with a code on one index, fail on the first attempt only, or sleep (ignoring
SIGTERM if asked, as TensorFlow does).
"""

import sys

KERAS_ALREADY_IMPORTED = "keras" in sys.modules   # a worker forked by `--preload` starts with it

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--pid-dir", required=True)
parser.add_argument("--fail-index", type=int, default=-1)
parser.add_argument("--fail-code", type=int, default=3)
parser.add_argument("--fail-after", type=float, default=0.5)
parser.add_argument("--fail-first-attempt", action="store_true")
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--ignore-sigterm", action="store_true")
arguments = parser.parse_args()

config = json.loads(os.environ["TF_CONFIG"])
index = config["task"]["index"]
attempt = int(os.environ["KERAS_MWMS_ATTEMPT"])
with open(os.path.join(arguments.pid_dir, f"{attempt}-{index}.pid"), "w") as handle:
    handle.write(str(os.getpid()))
if arguments.ignore_sigterm:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"hello from index {index} attempt {attempt} of {len(config['cluster']['worker'])} "
      f"threads={os.environ.get('OMP_NUM_THREADS')} preloaded={KERAS_ALREADY_IMPORTED}", flush=True)
print(f"stderr line from {index}", file=sys.stderr, flush=True)
if arguments.fail_first_attempt and attempt == 0 and index == 1:
    time.sleep(arguments.fail_after)
    sys.exit(7)
if index == arguments.fail_index:
    time.sleep(arguments.fail_after)
    sys.exit(arguments.fail_code)
time.sleep(arguments.sleep)
print(f"index {index} done", flush=True)
