"""`qkscope serve` (the API, and the embedded Ray head unless QKSCOPE_RAY_ADDRESS, under the
home's serve lock) and `qkscope stop`."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkscope import Client
from service.cli.format import progress_style, results_table

if TYPE_CHECKING:
    from service.config import Settings
    from service.control.serve_lock import ServeLock

__all__ = ["CliError", "is_loopback", "serve", "stop"]


class CliError(Exception):
    """A one-line error for the user (no traceback)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _run_study(api_url: str, file: str, exit_when_done: bool) -> int | None:
    with Client(api_url) as qk:
        study = qk.submit(file)
        print(
            f"submitted study {study.id} ({study.name}), Ray job {study.ray_job_id}",
            file=sys.stderr,
        )
        final = qk.wait(study.id, progress=progress_style())
        print(results_table(qk, study.id))
    if exit_when_done:
        return 0 if final.status == "COMPLETED" else 1
    return None


def _port_free(host: str, port: int) -> bool:
    """True when nothing listens on host:port (checked before a Ray head is started for an
    API that could not bind anyway)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def serve(args: argparse.Namespace) -> int:
    """Run the API (and the embedded Ray head) while holding the home's serve lock: a second
    `serve` in the same home refuses before it touches the head, the database or a port."""
    from service.config import get_settings
    from service.control.serve_lock import ServeLock, ServeRunning

    settings = get_settings()
    if not is_loopback(args.host) and not settings.token_list():
        raise CliError(
            "refusing to serve on a non-loopback address without QKSCOPE_API_TOKENS "
            "(set it, or serve on 127.0.0.1)"
        )
    if args.run and not Path(args.run).is_file():
        raise CliError(f"cannot read {args.run}: no such file")
    api_url = f"http://{args.host}:{args.port}"
    lock = ServeLock(settings.home)
    try:
        lock.acquire()
    except ServeRunning as e:
        raise CliError(str(e)) from None
    try:
        lock.update(api_url=api_url, ray_address=settings.ray_address or None, owns_head=False)
        if not _port_free(args.host, args.port):
            raise CliError(f"cannot serve on {api_url}: the port is in use")
        return _serve_locked(args, settings, lock, api_url)
    finally:
        lock.release()


def _local_head(args: argparse.Namespace, settings: Settings, lock: ServeLock) -> Any:
    """The embedded Ray head: one an earlier `serve` left running (adopted), else a new one;
    `settings.ray_address` then points at it."""
    from service.control.ray_cluster import LocalRayHead

    head = LocalRayHead(
        settings.home,
        dashboard_port=args.dashboard_port,
        gcs_port=args.ray_port,
        num_cpus=args.num_cpus,
    )
    if head.adopt():
        _say(
            f"reusing the local Ray head an earlier `qkscope serve` left running "
            f"(pid {head.pid}, dashboard {head.dashboard_url}); its `serve` is gone, so "
            "this one now owns it and stops it on exit"
        )
        settings.ray_address = head.dashboard_url
    else:
        _say(f"starting a local Ray head (dashboard {head.dashboard_url}, token auth on) ...")
        try:
            settings.ray_address = head.start()
        except (RuntimeError, TimeoutError) as e:  # the log it names says why
            raise CliError(f"could not start a local Ray head: {e}") from None
        _say(f"started the local Ray head (pid {head.pid})")
    lock.update(ray_address=settings.ray_address, owns_head=True, head_pid=head.pid)
    return head


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _serve_locked(
    args: argparse.Namespace, settings: Settings, lock: ServeLock, api_url: str
) -> int:
    import uvicorn

    from service.app import create_app
    from service.control.head_watch import HeadWatchdog
    from service.http_guard import uvicorn_config

    if args.run and args.exit_when_done:
        settings.standby = 0  # one study, then exit: a standby would only take CPU from it
    head = None if settings.ray_address else _local_head(args, settings, lock)
    signal.signal(signal.SIGTERM, _terminate)  # docker stop, kill, `qkscope stop`
    server = uvicorn.Server(
        uvicorn_config(  # with a read timeout for slow clients (service/http_guard.py)
            create_app(settings),
            settings.read_timeout_s,
            host=args.host,
            port=args.port,
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    gave_up: list[str] = []

    def _give_up(why: str) -> None:
        _say(f"qkscope serve: {why}; exiting")
        gave_up.append(why)
        server.should_exit = True

    watchdog = None
    if head is not None:
        watchdog = HeadWatchdog(head, settings.head_check_interval_s, _say, _give_up)
    try:
        return _until_done(args, settings, api_url, server, thread, watchdog, gave_up)
    except KeyboardInterrupt:
        return 0
    finally:
        server.should_exit = True
        if watchdog is not None:
            watchdog.close()
        if thread.is_alive():
            thread.join(timeout=10)
        if head is not None:  # started here, or taken over from a `serve` that died
            head.stop()
            _say("stopped the local Ray head")


def _until_done(
    args: argparse.Namespace,
    settings: Settings,
    api_url: str,
    server: Any,
    thread: threading.Thread,
    watchdog: Any,
    gave_up: list[str],
) -> int:
    """Start the API and the head's watchdog, run `--run`'s study, wait for the end."""
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise CliError(f"the API did not start on {api_url}: see the error above")
        time.sleep(0.1)
    if watchdog is not None:
        watchdog.start()
    _say(
        f"qkscope API on {api_url} (docs {api_url}/docs); web UI {api_url}/ui/; "
        f"Ray dashboard {settings.ray_address}"
    )
    if args.run:
        code = _run_study(api_url, args.run, args.exit_when_done)
        if code is not None:
            return code
    thread.join()
    if gave_up:
        raise CliError(gave_up[0])
    return 0


def stop() -> int:
    """End the `qkscope serve` of this home (QKSCOPE_HOME) and the Ray head it started,
    including a head left behind by a `serve` that was killed with SIGKILL."""
    from service.config import get_settings
    from service.control.ray_cluster import LocalRayHead, pid_alive
    from service.control.serve_lock import SERVE_STATE, running_serve

    home = get_settings().home
    did = []
    record = running_serve(home)
    if record is None:
        (home / SERVE_STATE).unlink(missing_ok=True)  # left by a serve that died
    elif not record.get("pid"):
        raise CliError(f"a `qkscope serve` is starting for home {home}; try again in a moment")
    else:
        pid = int(record["pid"])
        os.kill(pid, signal.SIGTERM)  # serve stops its own Ray head on the way out
        deadline = time.monotonic() + 90
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        did.append(f"stopped qkscope serve (pid {pid}, API {record.get('api_url')})")
    head = LocalRayHead(home)
    if (state := head.recorded()) is not None:
        head._adopted_pid = int(state["pid"])
        head.stop()
        did.append(f"stopped the local Ray head (pid {state['pid']})")
    print("; ".join(did) if did else f"nothing of qkscope's is running for home {home}")
    return 0
