"""One verdict from every worker's hang report: who is behind, where, doing what.

Pure logic over the reports the side channel collected (`keras_mwms.diagnostics.report`);
the chief (or the launcher, when no worker could) prints the result. The rules, in order:

0. **called on some workers only** — the workers that did not report had *left* the job (their
   script ended or closed its strategy; `left`) before the collective the others wait in:
   e.g. `if strategy.is_chief: model.evaluate(...)`, which every worker must call.
1. **no answer** — a worker did not report within the collection window: it is stopped
   (SIGSTOP, a debugger), dead, or unreachable; the others wait for it.
2. **data wait** — a worker's input pipeline has been making one batch for a long time
   (at least half the hang threshold): that worker is behind, at that batch.
3. **behind** — a worker is not inside a collective while its peers are (user code, a
   callback, a computation on one worker only). A worker still computing inside its train
   step (a long first compile) is not named: no verdict yet; the engine's timeout still holds.
4. **desync** — every worker is inside a collective, but not the same one: different train
   steps or different sequence numbers or kinds at one number. The odd worker is the
   minority; between two, the one that ran more train steps (or issued more collectives):
   one extra `train_on_batch` on one worker reads exactly like that.
5. otherwise every worker waits in the same collective: no verdict (a slow step, not a hang).

Example:

>>> def report(worker, sequence, step, kind="gradient all-reduce"):
...     return {"worker": worker, "threshold": 3.0, "stack": [], "label": f"worker {worker}",
...             "ledger": {"sequence": sequence, "step": step, "phase": "all-reduce", "data": None,
...                        "in_collective": {"sequence": sequence, "kind": kind, "nbytes": 8,
...                                          "step": step, "seconds": 4.0}, "entries": []}}
>>> verdict = decide({0: report(0, 40, 16), 1: report(1, 43, 17)}, num_workers=2)
>>> verdict.kind, verdict.workers
('desync', [1])
>>> decide({0: report(0, 40, 16), 1: report(1, 40, 16)}, num_workers=2) is None
True
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

HEADLINE = "keras_mwms hang verdict:"
COMPUTING = ("forward-backward", "apply")
STACK_LINES = 40


@dataclass(frozen=True)
class Verdict:
    """The outcome: its `kind`, the workers it names, and the text every reader prints.

    Example:

    >>> Verdict("no answer", [1], "...").kind
    'no answer'
    """

    kind: str
    workers: list[int]
    text: str


def _where(report: dict) -> str:
    ledger = report["ledger"]
    current = ledger.get("in_collective")
    if current:
        return (f"waiting {current['seconds']:.1f} s in collective #{current['sequence']} "
                f"'{current['kind']}' ({current['nbytes']} bytes) during train step {current['step']}")
    data = ledger.get("data")
    if data:
        return (f"making batch {data['batch']} of its input for {data['seconds']:.1f} s, after "
                f"{ledger['step']} train step(s) and collective #{ledger['sequence']}")
    return (f"not in a collective (phase '{ledger['phase']}') after {ledger['step']} train step(s) "
            f"and collective #{ledger['sequence']}")


def _last_collective(report: dict) -> str:
    entries = report["ledger"].get("entries") or []
    if not entries:
        return "none yet"
    sequence, kind, _, step, phase, _ = entries[-1]
    return f"#{sequence} '{kind}' at train step {step} ({phase})"


def _stack(report: dict, key: str = "stack", title: str = "main thread") -> list[str]:
    frames = report.get(key) or []
    if not frames:
        return []
    lines = [f"  stack of worker {report['worker']} ({title}), innermost last:"]
    text = "".join(frames).rstrip("\n").splitlines()[-STACK_LINES:]
    return lines + [f"    {line}" for line in text]


def _odd_ones(values: dict[int, object]) -> list[int]:
    """The workers holding the minority value; between equals in count, the larger value."""
    counts = collections.Counter(values.values())
    odd_value = min(counts, key=lambda value: (counts[value], _negated(value)))
    return sorted(worker for worker, value in values.items() if value == odd_value)


def _negated(value):
    return tuple(-part if isinstance(part, (int, float)) else part for part in value) \
        if isinstance(value, tuple) else -value if isinstance(value, (int, float)) else value


def _signature(report: dict) -> tuple:
    """(train step, sequence number, kind) of the collective a worker is in, or was in last."""
    ledger = report["ledger"]
    current = ledger.get("in_collective")
    if current:
        return (current["step"], current["sequence"], current["kind"])
    entries = ledger.get("entries") or []
    if entries:
        sequence, kind, _, step, _, _ = entries[-1]
        return (step, sequence, kind)
    return (ledger["step"], ledger["sequence"], "")


def _in_call(call: str) -> str:
    """Where a worker is, for the verdict: `model.fit`, or a call its report could not name (it
    had left the call when it reported, before its first train step)."""
    return "a call it could not name" if call in ("", "?") else f"model.{call}"


def _desync(reports: dict[int, dict], signatures: dict[int, tuple]) -> tuple[list[int], str]:
    """Which workers are out of step, and how (see the module docstring)."""
    calls = {worker: report.get("call") or "?" for worker, report in reports.items()}
    if len(set(calls.values())) > 1:
        counts = collections.Counter(calls.values())
        fewest = min(counts.values())
        rare = {call for call, count in counts.items() if count == fewest}
        single = {call for call in rare if call.endswith("_on_batch")}
        chosen = single or rare
        if len(chosen) == 1:
            call = chosen.pop()
            odd = sorted(worker for worker, value in calls.items() if value == call)
            others = sorted({_in_call(value) for worker, value in calls.items() if value != call})
            return odd, (f"{', '.join(f'worker {worker}' for worker in odd)} is in {_in_call(call)} while "
                         f"the others are in {' / '.join(others)} (one worker called something the "
                         "others did not, e.g. an extra train_on_batch)")
    steps = {worker: signature[0] for worker, signature in signatures.items()}
    sequences = {worker: signature[1] for worker, signature in signatures.items()}
    if len(set(steps.values())) > 1:
        odd = _odd_ones(steps)
        other = next(worker for worker in steps if worker not in odd)
        difference = steps[odd[0]] - steps[other]
        return odd, (f"worker {odd[0]} ran {abs(difference)} train step(s) "
                     f"{'more' if difference > 0 else 'fewer'} than worker {other} (for example an "
                     "extra train_on_batch, fit or evaluate on one worker only)")
    if len(set(sequences.values())) > 1:
        odd = _odd_ones(sequences)
        other = next(worker for worker in sequences if worker not in odd)
        difference = sequences[odd[0]] - sequences[other]
        return odd, (f"worker {odd[0]} issued {abs(difference)} collective(s) "
                     f"{'more' if difference > 0 else 'fewer'} than worker {other} in the same train step")
    odd = _odd_ones({worker: signature[2] for worker, signature in signatures.items()})
    return odd, f"worker {odd[0]} entered a different collective at the same sequence number"


def _called_alone(reports: dict[int, dict], left: dict[int, dict], everyone: list[str]) -> Verdict:
    """Rule 0: the workers that answered entered a collective after the others had left."""
    calls = collections.Counter(report.get("call") or "" for report in reports.values())
    call = _in_call(calls.most_common(1)[0][0])
    stayed = ", ".join(str(worker) for worker in sorted(reports))
    gone = sorted(left)
    first = reports[min(reports)]["ledger"]
    current = first.get("in_collective") or {}
    entered = (f"collective #{current['sequence']} '{current['kind']}'" if current
               else f"collective #{first['sequence']}")
    text = [f"{HEADLINE} called on some workers only: {call} was called on worker{'s' * (len(reports) > 1)} "
            f"{stayed} only; every worker must call it. "
            + "; ".join(f"worker {worker} had left the job (its script ended after collective "
                        f"#{left[worker].get('sequence')}, in {_in_call(left[worker].get('call') or '')})"
                        for worker in gone)
            + f" when worker {min(reports)} entered {entered}. Call it on every worker (not under "
            "`if strategy.is_chief:`); only model.predict, saving and loading may run on one worker "
            "alone.", *everyone]
    return Verdict("called alone", list(reports), "\n".join(text))


def left_before(reports: dict[int, dict], left: dict[int, dict]) -> bool:
    """Whether every answering worker entered a collective (by sequence) after every worker in
    `left` had left, and only those are missing: none of them can join it any more.

    Example:

    >>> left_before({0: {"ledger": {"sequence": 12}}}, {1: {"sequence": 10}})
    True
    """
    last_left = max((int(message.get("sequence") or 0) for message in left.values()), default=None)
    return (last_left is not None and bool(reports)
            and all(report["ledger"]["sequence"] > last_left for report in reports.values()))


def decide(reports: dict[int, dict], num_workers: int, settled: bool = False,
           left: dict[int, dict] | None = None) -> Verdict | None:
    """The verdict for the collected `reports` (worker index → report), or None: no hang.

    See the module docstring for the rules; `num_workers` tells who should have answered.
    `settled`: the round follows a failed collective: no data-wait verdict; workers whose
    report says `failed` are compared by the collective they were in last (a desync).
    `left`: the workers that announced leaving the job (worker → its last sequence and call).
    """
    threshold = max((float(report.get("threshold") or 0) for report in reports.values()), default=0.0)
    everyone = [f"  worker {worker} (in {_in_call(reports[worker].get('call') or '')}): "
                f"{_where(reports[worker])}; last collective "
                f"{_last_collective(reports[worker])}" for worker in sorted(reports)]
    missing = [worker for worker in range(num_workers) if worker not in reports]
    gone = {worker: message for worker, message in (left or {}).items() if worker in missing}
    if missing and len(gone) == len(missing) and left_before(reports, gone):
        return _called_alone(reports, gone, everyone)
    if missing:
        names = ", ".join(f"worker {worker}" for worker in missing)
        text = [f"{HEADLINE} no answer: {names} did not answer the hang report "
                "(stopped, dead or unreachable); the other workers wait for it.", *everyone]
        return Verdict("no answer", missing, "\n".join(text))

    data = {worker: report["ledger"]["data"] for worker, report in reports.items()
            if report["ledger"].get("data") and report["ledger"]["data"]["seconds"] >= threshold / 2
            and not settled}
    if data:
        worker = max(sorted(data), key=lambda index: data[index]["seconds"])
        report = reports[worker]
        text = [f"{HEADLINE} data wait: worker {worker} is behind, waiting for data: its input "
                f"pipeline has been making batch {data[worker]['batch']} of this epoch for "
                f"{data[worker]['seconds']:.1f} s (after {report['ledger']['step']} train step(s) "
                f"and collective #{report['ledger']['sequence']}).", *everyone,
                *_stack(report, "data_stack", "input pipeline thread"), *_stack(report)]
        return Verdict("data wait", [worker], "\n".join(text))

    # A worker whose own collective failed is compared by where it was last (a desync), not
    # by where it is now.
    outside = sorted(worker for worker, report in reports.items()
                     if not report["ledger"].get("in_collective") and not report.get("failed"))
    if any(reports[worker]["ledger"]["phase"] in COMPUTING for worker in outside):
        return None    # still computing its step (a long first compile, a big batch): not yet a hang
    if outside and len(outside) < len(reports):
        names = ", ".join(f"worker {worker}" for worker in outside)
        first = reports[outside[0]]["ledger"]
        text = [f"{HEADLINE} behind: {names} not in a collective while the others wait: phase "
                f"'{first['phase']}' after {first['step']} train step(s) and collective "
                f"#{first['sequence']}.", *everyone]
        for worker in outside:
            text += _stack(reports[worker])
        return Verdict("behind", outside, "\n".join(text))
    if outside:
        return None   # nobody waits in a collective: not a collective hang

    signatures = {worker: _signature(report) for worker, report in reports.items()}
    calls = {report.get("call") or "?" for report in reports.values()}
    if len(set(signatures.values())) == 1 and len(calls) == 1:
        return None   # (a train_on_batch in one worker's callback has fit's numbers: the call differs)
    odd, detail = _desync(reports, signatures)
    names = ", ".join(f"worker {worker}" for worker in odd)
    text = [f"{HEADLINE} desync: the workers wait in different collectives; {names} is out of "
            f"step: {detail}. Every worker must run the same fit/evaluate/train_on_batch calls.",
            *everyone]
    for worker in odd:
        text += _stack(reports[worker])
    return Verdict("desync", odd, "\n".join(text))
