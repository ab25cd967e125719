"""A stop signal at a random moment of a directory dump's save, through the CLI's interrupt
path (``interruptible`` and ``unwritten``, as ``kvcanary synth`` runs them): the line it
prints tells the truth. The dump at the path is the new one, whole, and the line does not
call it unwritten; or it is the previous one (or none), and the line says "not written".

One child process runs every trial (a few milliseconds each), the signal sent to its main
thread from a timer thread after a random delay spread over the save, the swap of the
directories and the command's last steps after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRIALS = r"""
import contextlib, io, json, os, random, signal, sys, threading, time
import click
import numpy as np
from kvcanary.cli.interrupt import interruptible, unwritten
from kvcanary.dump import load, save

base, trials, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
names = ["SIGTERM", "SIGQUIT", "SIGHUP"]
for name in names:   # a test run under nohup or in the background inherits some ignored
    signal.signal(getattr(signal, name), signal.SIG_DFL)
rng = random.Random(seed)

def arrays(trial):
    return dict(canary=np.zeros((4096, 32), np.uint8), req_to_token=np.ones((4, 64), np.int32),
                req_pool_indices=np.zeros(2, np.int64), seq_lens=np.zeros(2, np.int64),
                **{f"user_part{i}": np.full(4096, trial, np.int64) for i in range(8)})

def version(target):
    try:
        return int(np.load(os.path.join(target, "user_part0.npy"))[0])
    except FileNotFoundError:
        return None

spans = []
for warm in range(4):   # the delays are spread over one save, as long as a warm one takes
    started = time.perf_counter()
    save(os.path.join(base, "timing"), **arrays(0))
    spans.append(time.perf_counter() - started)
span = sorted(spans[1:])[1]
outcomes = []
for trial in range(1, trials + 1):
    target = os.path.join(base, f"d{trial}")
    if trial % 2:
        save(target, **arrays(-trial))   # a previous version to replace
    name = names[trial % len(names)]
    delay = rng.uniform(0, 1.2 * span)
    main = threading.main_thread().ident
    timer = threading.Timer(delay, signal.pthread_kill, (main, getattr(signal, name)))

    @click.command("synth")
    def command():
        with unwritten(target):
            timer.start()
            save(target, **arrays(trial))
            timer.join()   # the signal lands here when the save was quicker

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            interruptible(command).callback()
        except SystemExit:
            pass
    timer.join()
    line = err.getvalue().strip()
    now = version(target)
    whole = True
    if now is not None:
        try:
            load(target)
        except Exception:
            whole = False
    leftovers = [n for n in os.listdir(base) if n.endswith(".partial") or n.endswith(".old")]
    outcomes.append(dict(trial=trial, signal=name, delay=round(delay * 1e3, 2), line=line,
                         version=now, whole=whole, leftovers=leftovers))
print(json.dumps(outcomes))
"""


def run_trials(tmp_path, trials: int, seed: int) -> list:
    done = subprocess.run([sys.executable, "-c", TRIALS, str(tmp_path), str(trials), str(seed)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def wrong(outcome: dict) -> bool:
    said_unwritten = "not written" in outcome["line"]
    is_new = outcome["version"] == outcome["trial"]
    return (not outcome["line"].startswith("kvcanary: synth interrupted by ")
            or said_unwritten == is_new or not outcome["whole"] or bool(outcome["leftovers"]))


@pytest.mark.parametrize("seed", [36, 13])
def test_the_line_after_a_signal_tells_whether_the_dump_was_written(tmp_path, seed):
    outcomes = run_trials(tmp_path, 30, seed)
    assert [o for o in outcomes if wrong(o)] == []


def test_a_signal_handled_inside_a_hold_is_raised_when_it_ends():
    """A signal delivered just before a hold has its Python handler run inside it (Python
    runs handlers between bytecodes): the Interrupted waits for the end of the hold."""
    import signal

    from kvcanary.system.signals import Interrupted, signals_held, signals_raise

    steps = []
    with pytest.raises(Interrupted) as caught:
        with signals_raise():
            with signals_held():
                signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)   # as Python runs it
                steps.append("after the handler")
            steps.append("after the hold")
    assert steps == ["after the handler"] and caught.value.signal_name == "SIGTERM"


def test_an_interrupt_a_writer_turned_into_its_own_error_stops_as_an_interrupt(tmp_path):
    """numpy's ``tofile`` reports an exception raised inside it as a ``TypeError``: the save
    stops as interrupted, the temporary removed, the target as it was."""
    import signal

    from kvcanary.system.atomic import replacing
    from kvcanary.system.signals import Interrupted, signals_raise

    target = tmp_path / "out"
    with pytest.raises(Interrupted) as caught:
        with signals_raise(), replacing(str(target), directory=True):
            try:
                signal.getsignal(signal.SIGQUIT)(signal.SIGQUIT, None)
            except Interrupted:
                raise TypeError("expected str, bytes or os.PathLike object") from None
    assert caught.value.signal_name == "SIGQUIT"
    assert os.listdir(tmp_path) == []
