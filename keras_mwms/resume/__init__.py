"""Resume: a killed job continues at the same global example, on any number of workers.

* `data_order` — each epoch's order a pure function of (job seed, epoch), and the stream
  position a backup stores (no ML framework);
* `resumable_inputs` — a shuffled `fit` input turned into that ordered stream when the fit is
  resumable (`keras_mwms.callbacks.BackupAndRestore`, `keras_mwms.example_ledger.ExampleLedger`);
* `backup_files` — the on-disk backup `BackupAndRestore` writes and reads (numpy, no Keras);
* `io` — crash-safe file writes for backups and checkpoints.

The callback itself is `keras_mwms.callbacks.BackupAndRestore`; the Keras patch that skips the
steps a restored job already trained is `keras_mwms.backends.resume`.
"""
