"""`python -m keras_mwms.benchmark` / `keras-mwms benchmark`: arguments → config → run → report."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from keras_mwms.benchmark.config import BACKENDS, full_config, quick_config

SECTIONS = {"all": ("allreduce", "fit"), "allreduce": ("allreduce",), "fit": ("fit",)}
# Measurements with their own gangs and options (`keras-mwms benchmark NAME --help`).
OWN_COMMANDS = {"accumulation": "gradient accumulation K=4 against K=1",
                "compression": "gradient compression over tc-shaped links (root)",
                "batchnorm": "BatchNormalization's global moments against per-worker statistics",
                "orchestrators": "torch steps/s started by the launcher, srun and mpirun"}


def _names(text: str, allowed: Sequence[str], what: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown or text!r}; choose from {', '.join(allowed)}")
    return names


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes takes comma-separated byte counts, got {text!r}") from None
    if not sizes or any(size < 4 for size in sizes):
        raise argparse.ArgumentTypeError(f"--sizes must be byte counts >= 4, got {text!r}")
    return sizes


def _worker_counts(text: str) -> tuple[int, ...]:
    """`--workers 2` or a sweep `--workers 2,3,4`: distinct counts, smallest first."""
    try:
        counts = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers takes a worker count or comma-separated counts "
                                         f"(e.g. 2 or 2,3,4), got {text!r}") from None
    if not counts:
        raise argparse.ArgumentTypeError(f"--workers takes at least one worker count, got {text!r}")
    return counts


def build_parser(prog: str = "python -m keras_mwms.benchmark") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Measure keras_mwms against each backend's native multi-worker peer: all-reduce "
                    "bandwidth and latency, fit steps/s for one process and N workers, ratios, sync "
                    "overhead and start-up. Prints tables; writes benchmark.json and benchmark.png.",
        epilog="Examples: %(prog)s --quick   |   %(prog)s allreduce --backends torch --workers 2   |   "
               "%(prog)s fit --width 1024 --depth 4 --out build/bench   |   gradient compression over tc-shaped "
               "links (root): %(prog)s compression --link 1gbit,100mbit   |   gradient accumulation K=4 vs K=1: "
               "%(prog)s accumulation --k 1,4   |   BatchNormalization's global moments vs per-worker: "
               "%(prog)s batchnorm",
    )
    parser.add_argument("what", nargs="?", default="all", choices=sorted(SECTIONS) + sorted(OWN_COMMANDS),
                        help="which measurements (default all); "
                             + "; ".join(f"{name}: {summary}" for name, summary in OWN_COMMANDS.items())
                             + " (each has its own --help)")
    parser.add_argument("--quick", action="store_true",
                        help="the short CI preset: 3 sizes, the MLP 256x2 only, 40 steps, one repeat")
    parser.add_argument("--out", default="build/benchmark", help="output folder (default build/benchmark)")
    parser.add_argument("--backends", type=lambda text: _names(text, BACKENDS, "backend"), default=None,
                        help="comma-separated subset of tensorflow,jax,torch (default all)")
    parser.add_argument("--workers", type=_worker_counts, default=None,
                        help="N for the multi-worker gangs (default 2); a list sweeps (2,3,4: the peers at "
                             "the smallest, keras_mwms alone at the others, same per-worker batch, and "
                             "the fitted alpha-beta cost model's projection to 256 workers)")
    parser.add_argument("--models", type=lambda text: _names(text, ("mlp", "conv"), "model"), default=None,
                        help="mlp and/or conv (default: mlp,conv; quick: mlp)")
    parser.add_argument("--width", type=int, default=None, help="MLP hidden width (default 512; quick 256)")
    parser.add_argument("--depth", type=int, default=None, help="MLP hidden layers (default 3; quick 2)")
    parser.add_argument("--global-batch", type=int, default=None, help="examples per step (default 256)")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed fit (default 200; quick 40)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="untimed first steps (default 20; quick 8)")
    parser.add_argument("--repeats", type=int, default=None, help="fits per variant, best counts (default 2; quick 1)")
    parser.add_argument("--sizes", type=_sizes, default=None, help="all-reduce sizes in bytes, comma-separated")
    parser.add_argument("--no-ledger", action="store_const", const=True, default=None,
                        dest="ledger_comparison",
                        help="also fit keras_mwms with the collective ledger off, in the same gangs, "
                             "and report the ledger's overhead (steps/s on vs off)")
    parser.add_argument("--timeout", type=float, default=None, dest="gang_timeout",
                        help="seconds one gang may run (default 900; quick 300)")
    return parser


def config_from_arguments(arguments: argparse.Namespace, parser: argparse.ArgumentParser):
    """The `BenchmarkConfig` the arguments ask for (preset + overrides), validated."""
    overrides = {name: value for name, value in vars(arguments).items()
                 if value is not None and name not in ("what", "quick", "out")}
    overrides["sections"] = SECTIONS[arguments.what]
    if "workers" in overrides:
        overrides["workers"], *sweep = overrides["workers"]
        overrides["scaling_workers"] = tuple(sweep)
    config = (quick_config if arguments.quick else full_config)(**overrides)
    if config.workers < 2:
        parser.error(f"--workers must be at least 2 (one process is always measured too), got {config.workers}")
    if config.global_batch % config.workers:
        parser.error(f"--global-batch {config.global_batch} must divide evenly by --workers {config.workers}")
    if not 1 <= config.warmup_steps < config.steps - 1:
        parser.error(f"--warmup-steps must be in 1..steps-2 (steps {config.steps}), got {config.warmup_steps}")
    if min(config.width, config.depth, config.repeats) < 1:
        parser.error("--width, --depth and --repeats must be at least 1")
    return config


def main(argv: Sequence[str] | None = None, prog: str = "python -m keras_mwms.benchmark") -> int:
    """Runs the benchmark; exit code 0 when every gang succeeded, 1 otherwise (report still written)."""
    from keras_mwms.benchmark import runner

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in OWN_COMMANDS:
        import importlib

        return importlib.import_module(f"keras_mwms.benchmark.{argv[0]}").main(argv[1:], prog)
    parser = build_parser(prog)
    arguments = parser.parse_args(argv)
    config = config_from_arguments(arguments, parser)
    out_dir = Path(arguments.out)
    result = runner.run(config, out_dir)
    print(runner.render(result), flush=True)
    outputs = [out_dir / "benchmark.json"] + [out_dir / name for name in ("benchmark.png", "scaling.png")
                                              if (out_dir / name).exists()]
    print(f"\nwrote {', '.join(str(path) for path in outputs)}", flush=True)
    return 0 if all(gang["ok"] for gang in result["gangs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
