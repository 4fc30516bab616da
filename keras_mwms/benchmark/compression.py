"""`python -m keras_mwms.benchmark compression`: gradient compression on a bandwidth-limited link.

Two workers, each in its own network namespace, joined by a veth pair whose both ends are
shaped with `tc` (a token bucket at `--link` rates, e.g. `1gbit,100mbit`): the nearest thing to
two machines on a slow network that one box gives. For each link rate and backend one gang
(`keras_mwms.benchmark.compression_worker`, TF_CONFIG on the veth addresses) fits a
~10 M-parameter MLP uncompressed, with bf16 and with fp16, in the same processes, and reports
seconds per step, the bytes each worker put on the wire per step (the veth's transmit counter:
payload plus TCP/IP headers and the engine's own traffic) and the bytes handed to the engine
(`keras_mwms.backends.compression.WIRE`), side by side with the speed-up over uncompressed.

Needs root (`ip netns`, `tc`); without it the command says so and exits 0 having done nothing.
The namespaces (and with them the veth pair and its shaping) are deleted whatever happens,
and every worker's process group is killed at the end.

    sudo python -m keras_mwms.benchmark compression --link 1gbit,100mbit --out build/compression

Example (the rate parser; nothing is started):

>>> parse_rate("100mbit"), parse_rate("1gbit"), parse_rate("2.5gbit")
(100000000, 1000000000, 2500000000)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from keras_mwms.benchmark.compression_worker import mlp_parameters
from keras_mwms.benchmark.gang_options import chosen_backends, gang_parser
from keras_mwms.benchmark.processes import run_bounded
from keras_mwms.benchmark.report import format_table

COMPRESSIONS = (None, "bf16", "fp16")
_UNITS = {"kbit": 10 ** 3, "mbit": 10 ** 6, "gbit": 10 ** 9}


def parse_rate(text: str) -> int:
    """A tc rate (`100mbit`, `1gbit`) in bits per second.

    Example:

    >>> parse_rate("500kbit")
    500000
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(kbit|mbit|gbit)\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"--link takes tc rates such as 1gbit or 100mbit, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def not_runnable_reason() -> str | None:
    """Why this machine cannot run the measurement (None: it can)."""
    if os.name != "posix" or os.geteuid() != 0:
        return "network namespaces and tc need root: run it as root (sudo), e.g. in a container"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2)"
    return None


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=30)


class ShapedLink:
    """Two namespaces joined by a veth pair; `shape(rate)` limits both directions with tbf."""

    def __init__(self):
        tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
        subnet = random.randrange(1, 255)
        self.namespaces = (f"kmc{tag}a", f"kmc{tag}b")
        self.devices = (f"kmc{tag}va", f"kmc{tag}vb")
        self.addresses = (f"10.78.{subnet}.1", f"10.78.{subnet}.2")

    def __enter__(self) -> ShapedLink:
        try:
            for namespace in self.namespaces:
                _run("ip", "netns", "add", namespace)
            _run("ip", "link", "add", self.devices[0], "type", "veth", "peer", "name", self.devices[1])
            for namespace, device, address in zip(self.namespaces, self.devices, self.addresses):
                _run("ip", "link", "set", device, "netns", namespace)
                _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", device)
                _run("ip", "-n", namespace, "link", "set", device, "up")
                _run("ip", "-n", namespace, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def shape(self, rate_bits: int) -> None:
        # A bucket of 10 ms at the rate (at least 256 KiB, so a veth's 64 KiB GSO packets pass).
        burst = max(256 * 1024, rate_bits // 8 // 100)
        for namespace, device in zip(self.namespaces, self.devices):
            _run("ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root", "tbf",
                 "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "100ms")

    def __exit__(self, *exc) -> None:
        for namespace in self.namespaces:   # deleting a namespace deletes its veth end and the pair
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "delete", self.devices[0]], capture_output=True, timeout=30)


def run_gang(link: ShapedLink, backend: str, settings: dict, out: Path, timeout: float) -> list[dict]:
    """One 2-worker gang across the namespaces; each worker's rows (raises with the logs on failure)."""
    port = random.randrange(20000, 40000)   # each namespace has its own ports: any is free
    workers = [f"{address}:{port}" for address in link.addresses]
    base = {key: value for key, value in os.environ.items() if key != "TF_CONFIG"}
    commands = []
    for index, namespace in enumerate(link.namespaces):
        settings_path = out / f"{backend}.settings{index}.json"
        settings_path.write_text(json.dumps(dict(settings, device=link.devices[index])))
        env = dict(base, KERAS_BACKEND=backend, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2",
                   TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
                   XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
                   TF_CONFIG=json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}))
        commands.append((["ip", "netns", "exec", namespace, sys.executable, "-m",
                          "keras_mwms.benchmark.compression_worker", str(out / f"{backend}.worker{index}.json"),
                          str(settings_path)], env, out / f"{backend}.worker{index}.log"))
    run_bounded(commands, timeout, f"{backend} gang")
    return [json.loads((out / f"{backend}.worker{index}.json").read_text()) for index in range(2)]


def rows_for(link_name: str, backend: str, workers: list[dict]) -> list[list[object]]:
    """Table rows: worker 0's clock (the step is a collective: both agree), both workers' bytes."""
    chief = workers[0]["rows"]
    baseline = chief[0]["seconds_per_step"]
    table = []
    for position, row in enumerate(chief):
        wire = sum(worker["rows"][position]["wire_bytes_per_step"] for worker in workers) / len(workers)
        table.append([link_name, backend, row["compression"], row["seconds_per_step"] * 1000,
                      baseline / row["seconds_per_step"], wire / 1e6, row["engine_bytes_per_step"] / 1e6,
                      row["loss"]])
    return table


HEADERS = ["link", "backend", "compression", "ms/step", "speed-up", "wire MB/step/worker",
           "engine MB/step", "loss"]


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = gang_parser(prog, "compression", __doc__.split("\n\n")[0], steps=6, warmup=2, width=2176,
                         global_batch=32, timeout=900, width_help=": ~10 M parameters")
    parser.add_argument("--link", type=lambda text: [(part.strip(), parse_rate(part)) for part in text.split(",")
                                                     if part.strip()],
                        default=[("1gbit", 10 ** 9), ("100mbit", 10 ** 8)],
                        help="tc rates, comma-separated (default 1gbit,100mbit)")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m keras_mwms.benchmark") -> int:
    """Runs the measurement; prints the table and writes compression.json under --out."""
    parser = build_parser(prog)
    arguments = parser.parse_args(argv)
    links = arguments.link
    backends = chosen_backends(parser, arguments.backends)
    reason = not_runnable_reason()
    if reason:
        print(f"compression benchmark skipped: {reason}.", flush=True)
        return 0
    out = Path(arguments.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"steps": arguments.steps, "warmup": arguments.warmup, "width": arguments.width,
                "depth": arguments.depth, "features": 256, "classes": 10,
                "global_batch": arguments.global_batch, "compressions": list(COMPRESSIONS)}
    started = datetime.datetime.now(datetime.timezone.utc)
    table, failures = [], []
    with ShapedLink() as link:
        for link_name, rate in links:
            link.shape(rate)
            for backend in backends:
                print(f"[compression] {backend} over {link_name} ...", flush=True)
                try:
                    workers = run_gang(link, backend, settings, out, arguments.timeout)
                except RuntimeError as error:
                    failures.append(str(error))
                    print(str(error), flush=True)
                    continue
                table += rows_for(link_name, backend, workers)
                print(format_table(HEADERS, table[-len(COMPRESSIONS):]), flush=True)
    load = os.getloadavg()
    parameters = mlp_parameters(settings["features"], arguments.width, arguments.depth, settings["classes"])
    header = (f"{started:%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} cores, load "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end; 2 workers in 2 network namespaces "
              f"over a tc-shaped veth pair; MLP 256-{arguments.width}x{arguments.depth}-10 "
              f"({parameters / 1e6:.1f} M parameters), global batch {arguments.global_batch}, SGD, "
              f"{arguments.steps} timed steps after {arguments.warmup}")
    print("\n" + header + "\n" + format_table(HEADERS, table), flush=True)
    (out / "compression.json").write_text(json.dumps({"header": header, "headers": HEADERS, "rows": table,
                                                      "failures": failures}, indent=1))
    return 1 if failures else 0
