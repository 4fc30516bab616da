"""Start-up: from the job's description to workers that have met, before any backend starts.

* `cluster` — `TF_CONFIG` (or an explicit cluster spec) → a validated `ClusterSpec` and this
  task, behind the `ClusterResolver` every source implements (`keras_mwms.resolvers` adds the
  orchestrators' variables);
* `rendezvous` — a bounded, fingerprinted TCP meeting of every worker (versions, cluster order,
  GPUs) before any collective engine starts;
* `network` — which local interface and socket an engine binds for a `TF_CONFIG` host;
* `advice` — the fix a start-up or lost-worker error names, worded for how the job was started;
* `preload` — a process that imported Keras once and forks workers from there (`--preload`).

Pure Python: nothing here imports an ML framework (but the preloaded process, in itself).
"""
