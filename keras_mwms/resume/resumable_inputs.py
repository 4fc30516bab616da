"""Shuffled `fit` inputs in a resumable order: arrays, `PyDataset`s and torch `DataLoader`s.

When a `fit` is to be resumable (a callback with `RESUMABLE_ORDER` set among its callbacks:
`keras_mwms.callbacks.BackupAndRestore`, `keras_mwms.example_ledger.ExampleLedger`; or Keras'
own `BackupAndRestore`, which runs as keras_mwms') and its input shuffles, each backend's
`fit` patch calls `prepare_fit` first. The input then becomes an
ordered stream: a `keras.utils.PyDataset` without an end whose item `i` is the global batch
at *stream position* `start + i` of a `keras_mwms.resume.data_order.DataOrder` — epoch `p //
steps_per_epoch`, step `p % steps_per_epoch`, in the order `(job seed, epoch)` gives — and
`fit` gets `shuffle=False` and `steps_per_epoch`. Keras keeps one iterator across the epochs
of such an input, so positions run on from epoch to epoch; the backends shard each global
batch as they shard any `PyDataset`. A restored job sets `start` to the saved position: the
first batch it reads is the next one the interrupted job would have read, on any number of
workers, with no batch read only to be thrown away.

| input | one unit | one global step |
|---|---|---|
| arrays (`shuffle=True`) | a row | `batch_size` rows (the last step of an epoch may be short) |
| `PyDataset` (`shuffle=True`) | one of its batches | one batch (Keras shuffles a PyDataset's batch order) |
| torch `DataLoader` with a `RandomSampler` | a dataset item | `batch_size` items, `collate_fn`-ed (`drop_last` kept) |

What is not made resumable is said once at restore (`FitInput.approximate`): a tf.data
pipeline that reshuffles or shuffles unseeded (its order lives in TensorFlow's iterator), and
any shuffled input with `steps_per_epoch` set. A `PyDataset`'s `workers` /
`use_multiprocessing` are not used by the stream (items are read in order in the training
loop's thread), and a `DataLoader`'s worker processes likewise.

Example (one process, the order's first global step):

>>> import numpy as np
>>> from keras_mwms.resume.data_order import DataOrder
>>> stream = make_stream(DataOrder(seed=3, units=5, units_per_step=2),
...                        lambda ids: (np.arange(5)[ids],), global_batch_rows=2)
>>> sorted(np.concatenate([stream[i][0] for i in range(3)]).tolist())
[0, 1, 2, 3, 4]
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from keras_mwms import active
from keras_mwms.backends.keras_api import internals
from keras_mwms.data import tf_shuffles
from keras_mwms.resume.data_order import DataOrder, draw_seed

# A callback class attribute: when true on any of fit's callbacks, shuffled inputs take a
# resumable order.
RESUMABLE_ORDER = "keras_mwms_resumable_order"
_SERVED_KEPT = 256


def _keras_pydataset():
    import keras

    return keras.utils.PyDataset


def _rows(batch: Any) -> int:
    from keras import tree

    for leaf in tree.flatten(batch):
        if leaf is not None and getattr(leaf, "shape", None) is not None and len(leaf.shape):
            return int(leaf.shape[0])
    return 0


def _make_stream_class():
    base = _keras_pydataset()

    class _OrderedStream(base):
        """Global batches of `fetch(units)` at stream positions `order.start + i`, without end.

        `served` maps the last positions served to the global example ids of their batch, for
        `keras_mwms.example_ledger.ExampleLedger`.
        """

        def __init__(self, order: DataOrder, fetch, global_batch_rows: int, inner=None,
                     rows_per_unit: int | None = None):
            super().__init__()
            self.order = order
            self.global_batch_rows = global_batch_rows
            self._fetch = fetch
            self._inner = inner
            self._rows_per_unit = rows_per_unit
            self.served: dict[int, np.ndarray] = {}

        @property
        def num_batches(self):
            return None

        def __getitem__(self, index):
            position = self.order.start + int(index)
            units = self.order.units_at(position)
            batch = self._fetch(units)
            if isinstance(batch, list):
                batch = tuple(batch)
            if self._rows_per_unit is None:
                ids = units
            else:   # one unit is one batch: its rows are examples unit * rows_per_unit + r
                ids = int(units[0]) * self._rows_per_unit + np.arange(_rows(batch))
            self.served[position] = np.asarray(ids, dtype=np.int64)
            if len(self.served) > _SERVED_KEPT:
                del self.served[min(self.served)]
            return batch

        def restart_at(self, position: int) -> None:
            self.order.start = position
            self.served.clear()

        def on_epoch_begin(self):
            if self._inner is not None:
                self._inner.on_epoch_begin()

        def on_epoch_end(self):
            if self._inner is not None:
                self._inner.on_epoch_end()

    return _OrderedStream


_stream_class = None


def make_stream(order: DataOrder, fetch, global_batch_rows: int, inner=None,
                rows_per_unit: int | None = None):
    """An ordered stream (a `keras.utils.PyDataset` without end) over `order`.

    `fetch(units)` reads the global batch of those units; `global_batch_rows` is the global
    batch's rows; `inner` is a wrapped `PyDataset` (its epoch hooks are forwarded), whose one
    unit is a batch of `rows_per_unit` rows.
    """
    global _stream_class
    if _stream_class is None:
        _stream_class = _make_stream_class()
    return _stream_class(order, fetch, global_batch_rows, inner, rows_per_unit)


class FitInput:
    """What the current `fit` of a model reads: its ordered stream, or why a restart of it
    cannot continue the same order (`approximate`), or neither (nothing shuffles)."""

    def __init__(self, model: Any, stream: Any = None, approximate: str | None = None):
        self._model = weakref.ref(model) if model is not None else (lambda: None)
        self.stream = stream
        self.approximate = approximate

    def of(self, model: Any) -> bool:
        return self._model() is model


_active: FitInput | None = None


def _forget_fit_input() -> None:
    global _active
    _active = None


active.register(__name__, "_active", reset=_forget_fit_input, state=lambda: _active)


def active_for(model: Any) -> FitInput | None:
    """The `FitInput` of `model`'s current fit, if `prepare_fit` saw it.

    Example:

    >>> active_for(object()) is None
    True
    """
    return _active if _active is not None and _active.of(model) else None


def wants_resumable_order(callbacks: Any) -> bool:
    """True if one of `callbacks` (a list, a `CallbackList` or None) asks for a resumable order.

    Example:

    >>> class Backup: keras_mwms_resumable_order = True
    >>> wants_resumable_order([object(), Backup()]), wants_resumable_order(None)
    (True, False)
    """
    if callbacks is None:
        return False
    callbacks = getattr(callbacks, "callbacks", callbacks)
    return any(getattr(callback, RESUMABLE_ORDER, False) or _is_keras_backup_and_restore(callback)
               for callback in callbacks)


def _is_keras_backup_and_restore(callback: Any) -> bool:
    """Keras' own BackupAndRestore, which runs as keras_mwms' own while a strategy is active
    (`keras_mwms.callbacks.worker_aware`; `fit` sees the user's object, before that swap)."""
    import sys

    keras = sys.modules.get("keras")
    return keras is not None and type(callback) is keras.callbacks.BackupAndRestore


def _to_numpy(leaf):
    if leaf is None or isinstance(leaf, np.ndarray):
        return leaf
    if hasattr(leaf, "detach"):
        return leaf.detach().cpu().numpy()
    if hasattr(leaf, "numpy"):
        return leaf.numpy()
    return np.asarray(leaf)


def _take_rows(arrays, ids):
    from keras import tree

    picked = tree.map_structure(lambda leaf: None if leaf is None else leaf[ids], arrays)
    picked = tuple(picked)
    while picked and picked[-1] is None:
        picked = picked[:-1]
    return picked


def _shuffling_loader(x) -> Any:
    """The `RandomSampler` of a torch DataLoader that shuffles every item once, else None."""
    import sys

    torch_data = sys.modules.get("torch.utils.data")
    if torch_data is None or not isinstance(x, torch_data.DataLoader):
        return None
    sampler = getattr(getattr(x, "batch_sampler", None), "sampler", None)
    if not isinstance(sampler, torch_data.RandomSampler):
        return None
    return sampler


def _tf_shuffle_problem(x) -> str | None:
    """Why a tf.data input cannot resume its order exactly, or None."""
    import sys

    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(x, tf.data.Dataset):
        return None
    for shuffle in tf_shuffles(x):
        if _unseeded(shuffle):
            return "a shuffle without a seed draws a new order in every process"
        if getattr(shuffle, "_reshuffle_each_iteration", True):
            return ("a shuffle with reshuffle_each_iteration draws each epoch's order inside "
                    "TensorFlow's iterator, which a new process starts again at the first "
                    "epoch's order")
    return None


def _unseeded(shuffle) -> bool:
    """A tf.data shuffle given no seed at all: TF stores (0, 0) for it, and draws a random one."""
    pair = [None if value is None else int(np.asarray(value)) for value in (shuffle._seed, shuffle._seed2)]
    return pair in ([None, None], [0, 0])


def _approximate(what: str, why: str) -> str:
    return (f"BackupAndRestore: this fit reads {what}, and {why}; the resumed epoch skips the "
            "trained steps of a different order, so some examples of that epoch are trained "
            "twice and others not at all (the weights are restored exactly). For an exact "
            "resumption use arrays, a keras.utils.PyDataset or a torch DataLoader with "
            "shuffle=True (keras_mwms then keeps the order), or a tf.data pipeline whose "
            "shuffle has a seed and reshuffle_each_iteration=False.")


def prepare_fit(port: Any, model: Any, arguments: dict) -> None:
    """Makes a shuffled input of a resumable fit an ordered stream (see the module docstring).

    `arguments` are `fit`'s, by name, changed in place; names absent take Keras' defaults.
    Every worker calls it at `fit` entry (one `broadcast_object` when an order is made: the
    chief's seed). `port` offers `broadcast_object(value, root)`.
    """
    global _active
    _active = FitInput(model)
    if not wants_resumable_order(arguments.get("callbacks")):
        return
    x = arguments.get("x")
    shuffle = arguments.get("shuffle", True)
    steps = arguments.get("steps_per_epoch")
    y, sample_weight = arguments.get("y"), arguments.get("sample_weight")
    is_arrays = x is not None and internals.can_convert_arrays((x, y, sample_weight))
    is_pydataset = isinstance(x, _keras_pydataset())
    sampler = _shuffling_loader(x)
    tf_problem = _tf_shuffle_problem(x)
    if tf_problem:
        _active.approximate = _approximate("a tf.data.Dataset", tf_problem)
        return
    shuffles = (shuffle is True and (is_arrays or is_pydataset)) or sampler is not None
    if not shuffles:
        if shuffle == "batch" and is_arrays:
            _active.approximate = _approximate("arrays with shuffle='batch'",
                                               "that order is drawn by Keras in every process")
        return
    if steps is not None:
        _active.approximate = _approximate(
            "a shuffled input with steps_per_epoch set", "its epochs do not follow the data's")
        return
    if is_pydataset and x.num_batches is None:
        _active.approximate = _approximate("an endless PyDataset", "Keras draws its order")
        return
    if sampler is not None and (sampler.replacement or sampler.num_samples != len(x.dataset)):
        _active.approximate = _approximate("a DataLoader whose RandomSampler draws with "
                                           "replacement or a different number of items",
                                           "that sampler draws its order in every process")
        return
    seed = port.broadcast_object(draw_seed(), 0)
    if is_arrays:
        stream = _array_stream(seed, arguments, x, y, sample_weight)
    elif is_pydataset:
        first_rows = _rows(x[0])
        order = DataOrder(seed, x.num_batches, 1, unit="batch")
        stream = make_stream(order, lambda units: x[int(units[0])], first_rows, inner=x,
                             rows_per_unit=first_rows)
    else:
        dataset, collate = x.dataset, x.collate_fn
        order = DataOrder(seed, len(dataset), x.batch_size, drop_remainder=x.drop_last, unit="item")
        stream = make_stream(order, lambda units: collate([dataset[int(i)] for i in units]),
                             x.batch_size)
    # Epoch e starts at its own order also when the user starts at a later epoch.
    stream.restart_at(stream.order.position(arguments.get("initial_epoch") or 0, 0))
    arguments.update(x=stream, shuffle=False, steps_per_epoch=stream.order.steps_per_epoch)
    _active.stream = stream


def _array_stream(seed: int, arguments: dict, x, y, sample_weight):
    from keras import tree

    # validation_split and class weights are applied by now (`keras_mwms.backends.fit_call`).
    x, y, sample_weight = tree.map_structure(_to_numpy, (x, y, sample_weight))
    batch_size = arguments.get("batch_size") or 32
    if arguments.get("validation_data") is not None and arguments.get("validation_batch_size") is None:
        arguments["validation_batch_size"] = batch_size
    arrays = (x, y, sample_weight)
    rows = int(tree.flatten(x)[0].shape[0])
    order = DataOrder(seed, rows, batch_size)
    arguments.update(y=None, sample_weight=None, batch_size=None)
    return make_stream(order, lambda units: _take_rows(arrays, units), batch_size)


def resume(model: Any, saved: dict | None, epoch: int, step: int) -> tuple[int, bool, str | None]:
    """Continues `model`'s current fit from a backup at `(epoch, step)`.

    Returns the step training resumes at, whether the trained steps' batches must still be
    read and discarded (inputs that are not an ordered stream), and one line to print (a
    changed global batch, an input that cannot resume exactly), or None.
    """
    fit_input = active_for(model)
    if fit_input is None or fit_input.stream is None:
        approximate = fit_input.approximate if fit_input is not None else None
        return step, True, approximate if (epoch or step) else None
    stream = fit_input.stream
    if saved is None:
        stream.restart_at(stream.order.position(epoch, step))
        return step, False, None
    step, message = stream.order.resume(saved, epoch, step)
    stream.restart_at(stream.order.start)
    return step, False, message
