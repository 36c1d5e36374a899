"""A fork server for the test suite's Python processes: torch, Lightning and transformers are
imported once per xdist worker, and every test script is a ``fork`` of that process instead of
a fresh interpreter paying ~5 s of imports (on CI's two cores, most of a short job).

How it works: ``sys.executable`` in the pytest worker (and in every process started through the
server) is a tiny launcher (:data:`LAUNCHER`, run with ``python -S``). Started as
``python [-u] script.py ...``, ``python -m torch.distributed.run ...`` or
``python -m areal_lightning ...``, it passes its stdin/stdout/stderr, argv, environment and
working directory over a Unix socket to a server process that has the libraries imported; the
server forks a child that takes them over and runs the script as ``__main__`` (``runpy``), then
reports the child's exit status, which the launcher exits with (a child killed by a signal: the
launcher kills itself with the same signal, so the caller sees ``-9`` for a SIGKILL). Anything
else (``-c``, other ``-m`` modules, interpreter flags, file descriptors passed to a child)
``exec``s the real interpreter.

What stays real: every script runs from its first line in a process of its own, with its own
``__main__``, environment, working directory, file descriptors, signals and exit status; a
SIGKILL kills it for real. Catchable signals sent to the launcher (SIGTERM from Lightning's or
torchrun's launcher, a test's preemption notice) are forwarded to the child. SIGKILL of the
launcher (a test's ``proc.kill()``, a process group killed by certify) kills the child and
everything it started (the child leads a process group of its own). Two servers with different
hash seeds serve even and odd ranks (``RANK``/``LOCAL_RANK``), so the ranks of a job do not
share ``PYTHONHASHSEED`` (as fresh interpreters would not); Python's and NumPy's global random
generators are re-seeded from the OS in every child, and Lightning's import-time rank
(``rank_zero_only.rank``) is read again from the child's environment.

``AREAL_TEST_FORK_SERVER=0`` turns it off (every process a fresh interpreter); a test marked
``fresh_interpreter`` runs without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ENV = "AREAL_TEST_ZYGOTES"  # the servers' socket paths (os.pathsep-separated), read by the launcher
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "lightning.pytorch", "pytorch_lightning",
           "transformers", "safetensors.torch", "torchdata.stateful_dataloader", "omegaconf")
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT")

LAUNCHER = r'''#!{python} -S
# The test suite's stand-in for sys.executable: see tests/harness/forkserver.py.
import json, os, signal, socket, sys, time

REAL = {python!r}
MODULES = ("torch.distributed.run", "areal_lightning")


def fresh():
    os.execv(REAL, [REAL] + sys.argv[1:])


args = sys.argv[1:]
unbuffered = bool(args) and args[0] == "-u"
if unbuffered:
    args = args[1:]
servers = [p for p in os.environ.get("{env}", "").split(os.pathsep) if p]
if not servers or not args:
    fresh()
if args[0] == "-m" and len(args) > 1 and args[1] in MODULES:
    mode, target, rest = "module", args[1], args[2:]
elif args[0].endswith(".py") and os.path.isfile(args[0]):
    mode, target, rest = "script", args[0], args[1:]
else:
    fresh()
rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or "0"
path = servers[int(rank) % len(servers)] if rank.isdigit() else servers[0]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
deadline = time.monotonic() + 180  # the server may still be importing
while True:
    try:
        sock.connect(path)
        break
    except OSError:
        if time.monotonic() > deadline:
            fresh()
        time.sleep(0.05)
fds = []
for fd in (0, 1, 2):
    try:
        os.fstat(fd)
        fds.append(fd)
    except OSError:
        fds.append(os.open(os.devnull, os.O_RDWR))
request = json.dumps({{"mode": mode, "target": target, "argv": rest, "env": dict(os.environ), "cwd": os.getcwd(),
                      "unbuffered": unbuffered}}).encode()
socket.send_fds(sock, [len(request).to_bytes(8, "little")], fds)
sock.sendall(request)


def forward(signum, frame):
    try:
        sock.send(bytes([signum]))
    except OSError:
        pass


for name in {forwarded!r}:
    signal.signal(getattr(signal, name), forward)
status = b""
while len(status) < 4:
    chunk = sock.recv(4 - len(status))
    if not chunk:  # the server went away
        os._exit(255)
    status += chunk
status = int.from_bytes(status, "little", signed=True)
if os.WIFSIGNALED(status):
    if os.WTERMSIG(status) != signal.SIGKILL:
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
os._exit(os.waitstatus_to_exitcode(status))
'''


def launcher_path(python: str) -> Path:
    """Write the launcher for interpreter ``python`` (once per content: every worker of a run, and
    the reference runs they share, see the same ``sys.executable``); its path."""
    text = LAUNCHER.format(python=python, env=ENV, forwarded=FORWARDED)
    folder = Path(tempfile.gettempdir()) / f"areal-test-python-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    path = folder / "python"
    if not path.exists():
        folder.mkdir(exist_ok=True)
        tmp = folder / f"python.{os.getpid()}.tmp"
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, path)
    return path


class ForkServers:
    """The two servers of this pytest process (even and odd ranks), started in the background."""

    def __init__(self) -> None:
        self.python = sys.executable
        self.launcher = str(launcher_path(self.python))
        self.folder = Path(tempfile.mkdtemp(prefix="areal-fork-"))
        self.sockets = [str(self.folder / f"{k}.sock") for k in range(2)]
        self.procs = []
        for k, path in enumerate(self.sockets):
            env = {**os.environ, "PYTHONHASHSEED": str(int.from_bytes(os.urandom(4), "little"))}
            env.pop(ENV, None)
            self.procs.append(subprocess.Popen([self.python, __file__, path, self.launcher], env=env,
                                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                               stderr=open(self.folder / f"{k}.log", "w")))

    def install(self) -> None:
        """From now on this process starts Python through the servers."""
        os.environ[ENV] = os.pathsep.join(self.sockets)
        sys.executable = self.launcher

    def close(self) -> None:
        os.environ.pop(ENV, None)
        sys.executable = self.python
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


# -- the server -----------------------------------------------------------------------------

def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, 8, 3)
    while len(header) < 8:
        more = conn.recv(8 - len(header))
        if not more:
            raise ConnectionError("the launcher went away")
        header += more
    size, body = int.from_bytes(header, "little"), b""
    while len(body) < size:
        more = conn.recv(min(1 << 20, size - len(body)))
        if not more:
            raise ConnectionError("the launcher went away")
        body += more
    return json.loads(body), list(fds)


def _watch(conn: socket.socket) -> None:
    """In the child: signals the launcher forwards; its end of the socket closing (the launcher
    was SIGKILLed) kills this child's process group."""
    while True:
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        if not data:
            try:
                os.killpg(0, signal.SIGKILL)
            finally:
                os.kill(os.getpid(), signal.SIGKILL)
        for signum in data:
            os.kill(os.getpid(), signum)


def _child(request: dict, conn: socket.socket, fds: list[int], launcher: str, base_path: list[str],
           others: list[socket.socket]) -> int:
    import atexit
    import random
    import runpy
    import threading
    import traceback

    for name in FORWARDED + ("SIGCHLD",):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setpgid(0, 0)
    for other in others:  # the other children's connections
        other.close()
    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    target = request["target"]
    first = os.path.dirname(os.path.realpath(target)) if request["mode"] == "script" else os.getcwd()
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *base_path]
    sys.executable = launcher
    sys.argv = [target if request["mode"] == "script" else "-m", *request["argv"]]
    if request["unbuffered"] or os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    random.seed()
    # Lightning reads the rank from the environment when it is imported (rank_zero_only.rank): as
    # a fresh interpreter of this rank would have it
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero") or \
        sys.modules.get("lightning_fabric.utilities.rank_zero")
    if rank_zero is not None:
        rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS")
    if torch is not None and threads and threads.isdigit() and int(threads) != torch.get_num_threads():
        torch.set_num_threads(int(threads))
    threading.Thread(target=_watch, args=(conn,), daemon=True, name="forkserver-watch").start()
    code: int = 0
    try:
        if request["mode"] == "script":
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
        try:
            sys.excepthook(*sys.exc_info())
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        code = 1
    for step in (threading._shutdown, atexit._run_exitfuncs, sys.stdout.flush, sys.stderr.flush):  # noqa: SLF001
        try:
            step()
        except BaseException:  # noqa: BLE001 - as at interpreter exit
            pass
    return code & 0xFF


def serve(path: str, launcher: str) -> None:
    """Import the libraries, then fork a child per request on socket ``path`` until the parent exits."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    own = set(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    base_path = [p for p in sys.path[1:] if p not in own]
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}"
    server.bind(tmp)
    server.listen(128)
    os.replace(tmp, path)  # the launchers connect once the imports are done
    parent, waiting = os.getppid(), {}
    while os.getppid() == parent:
        try:
            ready, _, _ = select.select([server, wake_r], [], [], 1.0)
        except InterruptedError:
            ready = []
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(status.to_bytes(4, "little", signed=True))
                except OSError:
                    pass
                conn.close()
        if server in ready:
            conn, _ = server.accept()
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 70
                try:
                    server.close()
                    signal.set_wakeup_fd(-1)
                    os.close(wake_r)
                    os.close(wake_w)
                    code = _child(request, conn, fds, launcher, base_path, list(waiting.values()))
                finally:
                    os._exit(code)
            for fd in fds:
                os.close(fd)
            waiting[pid] = conn


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
