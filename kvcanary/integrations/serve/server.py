"""The guarded server's life: :func:`run` patches transformers' serving (its continuous-batching
generate manager and its app factory), starts ``transformers serve`` on a thread, waits for
SIGINT or SIGTERM, drains and restores."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from ...format.errors import GUARD_PREFIX
from ..transformers import GuardError
from ..transformers.drills import DrillSet, parse_drill
from .state import ON_VIOLATION, ServeState

logger = logging.getLogger("kvcanary")


def run(model: str, *, sources="k0", hash_mode="all", check_tokens=True,
        plan_from="read_indices", on_violation="log", canary_log=None, drills=(),
        serve_args=()) -> int:
    """Serve ``model`` (a path or hub name, as ``transformers serve`` takes it) guarded,
    until SIGINT or SIGTERM; ``serve_args`` are ``transformers serve`` options. Returns the
    exit status: 0 after a drained stop, 1 when ``on_violation="exit"`` stopped it, 2
    when the server ended by itself.
    Raises :class:`GuardError`
    for a bad option, ``ImportError`` when a serving package is missing."""
    drill_set = DrillSet([parse_drill(d) for d in drills])
    _require_packages()
    state = ServeState(sources=sources, hash_mode=hash_mode, check_tokens=check_tokens,
                       plan_from=plan_from, on_violation=on_violation,
                       canary_log=canary_log, drills=drill_set)
    _log_to_stderr()
    patches = _Patches(state)
    stop = _Stop()
    try:
        patches.apply()
        drill_set.install()
        with stop.on_signals():          # also while the model loads
            serve = _start(model, serve_args)
            _wait_started(serve, stop)
            while serve._thread.is_alive() and not stop.event.wait(0.2):
                if state.exit_requested.is_set():
                    break
            _drain(serve)
    finally:
        drill_set.uninstall()
        patches.restore()
        state.close()
    code = state.exit_code
    if stop.name:
        why = stop.name
    elif code:
        why = "a finding (--on-violation exit)"
    else:
        why, code = "its own end (see the server's log above)", 2
    totals = state.totals()
    print(f"{GUARD_PREFIX}serve stopped by {why}: {totals['requests_guarded']} requests guarded, "
          f"{state.findings_total} findings", file=sys.stderr)
    return code


def _require_packages() -> None:
    try:
        import prometheus_client  # noqa: F401
        from transformers.utils.import_utils import is_serve_available
    except ImportError as exc:
        raise ImportError(f"{exc.name or exc}; kvcanary serve needs kvcanary[serve]") from None
    if not is_serve_available():
        raise ImportError("transformers' serving packages (fastapi, uvicorn, pydantic, openai); "
                          "kvcanary serve needs kvcanary[serve]")


def _log_to_stderr() -> None:
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _start(model: str, serve_args):
    """transformers' ``Serve`` of ``model`` with ``serve_args``, parsed by its own command
    line (continuous batching forced on), its server started on a thread."""
    import click
    import typer
    from transformers.cli.serve import Serve

    app = typer.Typer(add_completion=False)
    app.command(name="serve")(Serve)
    command = typer.main.get_command(app)
    args = [str(model), *serve_args, "--continuous-batching", "--non-blocking"]
    try:
        serve = command.main(args, prog_name="kvcanary serve MODEL --", standalone_mode=False)
    except click.ClickException as exc:
        raise GuardError(f"transformers serve options: {exc.format_message()}") from None
    if not isinstance(serve, Serve):
        raise GuardError("transformers serve did not start (--help?)")
    return serve


class _Stop:
    """SIGINT and SIGTERM while the server runs: the first drains, a second stops at once."""

    def __init__(self):
        self.event = threading.Event()
        self.name = None
        self.count = 0
        self.serve = None

    def on_signals(self):
        import contextlib

        @contextlib.contextmanager
        def installed():
            saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

            def handler(signum, frame):
                self.count += 1
                self.name = self.name or signal.Signals(signum).name
                self.event.set()
                if self.count > 1 and self.serve is not None:
                    self.serve.server.force_exit = True

            for sig in saved:
                signal.signal(sig, handler)
            try:
                yield
            finally:
                for sig, previous in saved.items():
                    signal.signal(sig, previous)

        return installed()


def _wait_started(serve, stop: _Stop) -> None:
    stop.serve = serve
    while not serve.server.started and serve._thread.is_alive() and not stop.event.is_set():
        stop.event.wait(0.05)
    if not serve.server.started and not stop.event.is_set():
        serve._thread.join(5)
        raise GuardError("the server did not start (see its log above)")
    config = serve.server.config
    logger.info("kvcanary serve: guarded server listening on http://%s:%s", config.host,
                config.port)


def _drain(serve) -> None:
    """Stop accepting, let the requests in flight finish (uvicorn's graceful shutdown), then
    stop the engine."""
    serve.server.should_exit = True
    serve._thread.join()
    serve._generation_state.shutdown()
    serve._model_manager.shutdown()


class _Patches:
    """transformers' serving attributes this server replaces, restored exactly."""

    def __init__(self, state: ServeState):
        self.state = state
        self.saved = []

    def apply(self) -> None:
        from transformers.cli.serving import server as serving_server
        from transformers.cli.serving import utils as serving_utils

        from .routes import add_routes

        state = self.state
        manager_cls = serving_utils.CBGenerateManager
        init_cb, stop = manager_cls.init_cb, manager_cls.stop
        build_server = serving_server.build_server

        def guarded_init_cb(manager, model, gen_config):
            if manager._cb is None:
                _synchronous(manager)
                manager._kvcanary_guard = state.guard_for(model)
            try:
                return init_cb(manager, model, gen_config)
            except BaseException:
                _leave(manager, state)
                raise

        def guarded_stop(manager):
            try:
                return stop(manager)
            finally:
                _leave(manager, state)

        def guarded_build_server(*args, **kwargs):
            app = build_server(*args, **kwargs)
            add_routes(app, state)
            return app

        for owner, name, value in ((manager_cls, "init_cb", guarded_init_cb),
                                   (manager_cls, "stop", guarded_stop),
                                   (serving_server, "build_server", guarded_build_server)):
            self.saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

    def restore(self) -> None:
        while self.saved:
            owner, name, value = self.saved.pop()
            setattr(owner, name, value)


def _synchronous(manager) -> None:
    """The guard runs with synchronous batching (asynchronous batching is refused)."""
    from transformers import ContinuousBatchingConfig

    if manager._cb_config is None:
        manager._cb_config = ContinuousBatchingConfig()
    manager._cb_config.use_async_batching = False


def _leave(manager, state: ServeState) -> None:
    g = manager.__dict__.pop("_kvcanary_guard", None)
    if g is not None:
        state.release(g)
