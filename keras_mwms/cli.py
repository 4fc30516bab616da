"""The `keras-mwms` command: `launch` a local gang, print a `tf-config`, run a `benchmark`.

Example:

    keras-mwms launch --workers 2 train.py
    keras-mwms tf-config --workers node1:2222,node2:2222 --index 1
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from keras_mwms.startup.cluster import TFConfigError, make_tf_config


def tf_config_main(argv: Sequence[str]) -> int:
    """`keras-mwms tf-config`: prints one worker's TF_CONFIG JSON for shell or Slurm scripts."""
    parser = argparse.ArgumentParser(
        prog="keras-mwms tf-config",
        description="Print the TF_CONFIG JSON of one worker.",
        epilog="Example: export TF_CONFIG=$(keras-mwms tf-config --workers "
               "node1:2222,node2:2222 --index $SLURM_PROCID)",
    )
    parser.add_argument("--workers", required=True,
                        help="comma-separated host:port of every worker, in rank order")
    parser.add_argument("--index", required=True, type=int, help="this task's index")
    parser.add_argument("--chief", default=None,
                        help="host:port of a separate chief task (optional)")
    parser.add_argument("--type", default="worker", choices=["worker", "chief", "evaluator"],
                        help="this task's type (default worker)")
    arguments = parser.parse_args(argv)
    workers = [address.strip() for address in arguments.workers.split(",") if address.strip()]
    try:
        print(make_tf_config(workers, arguments.index, arguments.type, arguments.chief))
    except TFConfigError as error:
        print(f"keras-mwms tf-config: error: {error}", file=sys.stderr)
        return 2
    return 0


COMMANDS = {
    "launch": "start, watch and restart a local gang of workers",
    "tf-config": "print one worker's TF_CONFIG JSON",
    "benchmark": "measure all-reduce and fit speed against each backend's native peer",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatches `keras-mwms <command> ...`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from keras_mwms.version import __version__

        print(f"keras-mwms {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: keras-mwms <command> [options]\n\ncommands:")
        for name, summary in COMMANDS.items():
            print(f"  {name:<10} {summary}")
        print("\nRun 'keras-mwms <command> --help' for a command's options, 'keras-mwms --version' "
              "for the release.")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "launch":
        from keras_mwms import launch

        return launch.main(rest, prog="keras-mwms launch")
    if command == "tf-config":
        return tf_config_main(rest)
    if command == "benchmark":
        from keras_mwms import benchmark

        return benchmark.main(rest)
    print(f"keras-mwms: unknown command {command!r}; expected one of {', '.join(COMMANDS)}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
