"""A gang member for the launcher's `--min-workers` test: worker 2 always dies (a lost machine).

Reads its index and the gang's size from TF_CONFIG (no ML framework: the launcher's decisions
are under test); worker 2 exits with code 3 at once, every other worker prints the gang size
and exits 0 after a short wait, so a gang with a worker 2 always fails through it.
"""

import json
import os
import sys
import time

config = json.loads(os.environ["TF_CONFIG"])
index, workers = config["task"]["index"], len(config["cluster"]["worker"])
if index == 2:
    print(f"worker 2 of {workers}: this machine is lost", flush=True)
    sys.exit(3)
time.sleep(1.0)
print(f"worker {index} of {workers}: trained", flush=True)
