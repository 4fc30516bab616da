"""The command-line options every stand-alone gang benchmark shares, declared once.

`accumulation`, `batchnorm`, `compression` and `orchestrators` each run their own gangs of an
MLP and take the same knobs (backends, timed and untimed steps, repeats, the MLP's width and
depth, the global batch, a per-gang timeout, an output folder); each adds only its own.

>>> parser = gang_parser("bench", "demo", "A demo.", steps=40, warmup=8, repeats=2, width=256,
...                      global_batch=64, timeout=900)
>>> arguments = parser.parse_args(["--backends", "torch,jax", "--width", "128"])
>>> chosen_backends(parser, arguments.backends), arguments.width, arguments.out
(['torch', 'jax'], 128, 'build/demo')
"""

from __future__ import annotations

import argparse

from keras_mwms.benchmark.config import BACKENDS


def gang_parser(prog: str, command: str, description: str, *, steps: int, warmup: int, width: int,
                global_batch: int, timeout: float, repeats: int | None = None, depth: int = 3,
                backends: str = ",".join(BACKENDS), unit: str = "steps",
                depth_help: str = "MLP hidden layers", width_help: str = "") -> argparse.ArgumentParser:
    """An `ArgumentParser` for `prog command` with the shared options and these defaults.

    `unit` names what `--steps` counts (e.g. "micro-steps"); `repeats=None` leaves `--repeats`
    out (one fit per gang). The command adds its own options to the returned parser.
    """
    parser = argparse.ArgumentParser(prog=f"{prog} {command}", description=description)
    backends_default = "all three" if backends == ",".join(BACKENDS) else backends
    parser.add_argument("--backends", default=backends, help=f"comma-separated (default {backends_default})")
    parser.add_argument("--steps", type=int, default=steps, help=f"timed {unit} per fit (default {steps})")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed first {unit} (default {warmup})")
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats,
                            help=f"fits per gang, the best counts (default {repeats})")
    parser.add_argument("--width", type=int, default=width, help=f"MLP width (default {width}{width_help})")
    parser.add_argument("--depth", type=int, default=depth, help=f"{depth_help} (default {depth})")
    parser.add_argument("--global-batch", type=int, default=global_batch,
                        help=f"examples per {unit[:-1]} (default {global_batch})")
    parser.add_argument("--timeout", type=float, default=timeout,
                        help=f"seconds one gang may run (default {timeout:g})")
    parser.add_argument("--out", default=f"build/{command}", help=f"output folder (default build/{command})")
    return parser


def chosen_backends(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The backends named in `--backends`; an unknown or empty list is the parser's usage error."""
    backends = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        parser.error(f"--backends takes a comma-separated subset of {', '.join(BACKENDS)}; got {text!r}")
    return backends
