"""`python -m keras_mwms.benchmark`: what keras_mwms costs per step, against the native peers.

Two measurements, each in real worker gangs started by the launcher:

* `allreduce` — bus bandwidth and latency of the engine keras_mwms uses on each backend, for
  sizes 4 KiB…64 MiB, with nccl-tests' algbw/busbw columns and the ring lower bound
  2(n−1)/n · bytes / bandwidth at the loopback TCP bandwidth measured on this machine;
* `fit` — steps/s and examples/s of an MLP (width × depth) and a small conv net, for one
  process and N workers, for keras_mwms and, in the same run, each backend's native peer
  (TF: Keras 3 + tf.distribute with only the crash fixes, and tf-keras 2.21 + tf.distribute;
  JAX: plain `keras.distribution.DataParallel`; torch: a hand-written DDP loop), with ratios,
  per-step sync overhead against the raw gradient all-reduce, start-up to the first step and,
  for torch.compile'd fits, TorchDynamo's graph breaks.

Output: tables on stdout, `benchmark.json` and `benchmark.png` in `--out`.

Example:

    python -m keras_mwms.benchmark --quick                    # the CI preset (make bench-quick)
    keras-mwms benchmark allreduce --backends torch --workers 2
    python -m keras_mwms.benchmark fit --width 1024 --depth 4 --out build/bench

Modules: `config` (what is measured), `bandwidth` (link probes, ring bound), `allreduce`
(engine timing), `models`, `timing`, `fit` and `peers` (the timed variants), `worker` (one
worker process), `analysis` (ratios, overhead), `report` (tables, JSON, PNG), `cost_model` (the
α-β model) and `scaling` (`--workers 2,3,4`: the sweep, the fit, the projection to 256 workers,
`scaling.png`), `runner` (the driver), `command` (the CLI), `compression` and
`compression_worker` (`python -m keras_mwms.benchmark compression --link 1gbit,100mbit`: gradient
compression across two network namespaces over a tc-shaped veth pair; needs root).

It measures what a user can run: it imports only the public API (`keras_mwms`, the strategy,
the launcher) and the neutral core, never a backend adapter (`keras_mwms.backends.tensorflow`,
`.jax`, `.torch`) or the Keras firewall (`keras_mwms.backends.keras_api`); what it needs from a
backend it asks the core (`tests/test_architecture.py` keeps it so).
"""

from keras_mwms.benchmark.command import main

__all__ = ["main"]
