"""Write: async saves written by a checkpoint process (the ``process`` async executor).

An async save in a thread of the training process (the default, DCP's THREAD checkpointer)
shares the GIL with training: each item's Python work in the writer thread holds it, and the
training loop waits. With ``async_executor="process"`` the files of a save that needs no
plan (:mod:`areal_lightning.write.direct`: one rank's plain tensors to a local folder) are
written by a long-lived child process instead, as DCP's PROCESS checkpointer does:

* the state is staged into one shared memory segment (``memfd``, not ``/dev/shm``: a
  container's small ``/dev/shm`` does not limit it), each tensor at its place, by the
  engine's background thread (:func:`~areal_lightning.stage.host.copy_into`);
* the child, started once (a fresh interpreter running this module: the user's script is
  not imported again, unlike ``multiprocessing``'s spawn) gets the segment's descriptor
  once per layout over a Unix socket, then one short message per save; it writes the files
  from the segment, checksums them, commits ``.metadata`` and answers with what it wrote
  (:class:`~areal_lightning.write.checksum.Written`);
* a failure in the child is sent back and raised like any background failure; a child that
  dies (killed, out of memory) fails the save in flight, and the next save starts a new one.
  The child is killed when the training process dies (``PR_SET_PDEATHSIG``, tied to the
  engine's upload thread that started it, which ends only when the engine closes).

Costs (measured in ``benchmarks/async_checkpointer.py``): the child's start (an interpreter
and ``import torch``: seconds, once, in the background: the first save is durable later);
host memory of one copy of the state (as the thread executor's staging buffers); the segment
is pageable memory (the thread executor stages into pinned memory on CUDA), so a GPU -> host
copy runs at pageable speed. Everything else (collective saves, sharded tensors, object
stores) is written by the thread executor.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import torch

from areal_lightning.config import ASYNC_EXECUTORS
from areal_lightning.errors import CheckpointWriteError
from areal_lightning.write import direct
from areal_lightning.write.checksum import Written

__all__ = ["ASYNC_EXECUTORS", "CheckpointProcess"]


_ALIGN = 64
"""Alignment of each tensor in the segment (a typed view of a byte buffer needs its itemsize)."""

_HEADER = struct.Struct("<Q")


def _send(sock: socket.socket, message: Any, fds: list[int] | None = None) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [header], fds)
    else:
        sock.sendall(header)
    sock.sendall(data)


def _receive(sock: socket.socket) -> tuple[Any, list[int]]:
    """One message and the descriptors sent with it; ``EOFError`` when the peer is gone."""
    header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
    while header and len(header) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(header))
        if not more:
            break
        header += more
    if len(header) < _HEADER.size:
        raise EOFError("the peer closed the connection")
    (size,) = _HEADER.unpack(header)
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(min(size - got, 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return pickle.loads(b"".join(chunks)), list(fds)


class _Segment:
    """A shared memory segment holding one staged copy of a layout's tensors."""

    def __init__(self, layout: direct.ByteLayout) -> None:
        self.places: dict[str, int] = {}
        size = 0
        for items in layout.files:
            for item in items:
                self.places[item.key] = size
                size += (item.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.size = max(size, _ALIGN)
        self.fd = os.memfd_create("areal-checkpoint", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.map = mmap.mmap(self.fd, self.size)
        buffer = torch.frombuffer(self.map, dtype=torch.uint8)
        self.views: dict[str, torch.Tensor] = {}
        for (key, shape, dtype, _, _) in layout.key:
            start = self.places[key]
            nbytes = shape.numel() * dtype.itemsize
            self.views[key] = buffer[start:start + nbytes].view(dtype).view(shape)
        del buffer

    def close(self) -> None:
        self.views.clear()
        try:
            self.map.close()
        except BufferError:  # a view still exported: the mapping goes with the last reference
            pass
        os.close(self.fd)


class CheckpointProcess:
    """The training process's side of the checkpoint process (see module doc). Used by
    :class:`~areal_lightning.write.dcp.DCPEngine` from one background thread at a time."""

    def __init__(self, thread_count: int = 2) -> None:
        self.thread_count = thread_count  # the child's writer threads (files per save)
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._segment: _Segment | None = None
        self._segment_layout: direct.ByteLayout | None = None
        self._layout: direct.ByteLayout | None = None
        self._sent: direct.ByteLayout | None = None  # the layout the running child has
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The checkpoint process's pid while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def layout_for(self, key: tuple[Any, ...] | None) -> direct.ByteLayout | None:
        """The layout of a save whose signature (:func:`~areal_lightning.write.direct.signature`,
        unpinned) is ``key``, reused while it stays; ``None`` when the save needs a plan (``key``
        ``None``: then the thread executor writes it)."""
        if key is None:
            return None
        if self._layout is None or self._layout.key != key:
            self._layout = direct.ByteLayout(key, self.thread_count)
        return self._layout

    def buffers(self, layout: direct.ByteLayout) -> dict[str, torch.Tensor]:
        """The segment of ``layout`` (made on its first save), as one tensor per key to stage into."""
        if self._segment is None or self._segment_layout is not layout:
            if self._segment is not None:
                self._segment.close()
            self._segment = _Segment(layout)
            self._segment_layout = layout
        return self._segment.views

    def save(self, path: Path, skeleton: bytes, written: Written) -> None:
        """Have the checkpoint process write the staged state and ``skeleton`` to ``path`` and
        commit it; fills ``written``. Raises :class:`CheckpointWriteError` naming ``path``."""
        with self._lock:
            self._start()
            assert self._sock is not None and self._segment is not None
            try:
                if self._sent is not self._segment_layout:
                    _send(self._sock, ("layout", self._segment_layout, self._segment.places, self._segment.size),
                          [self._segment.fd])
                    self._sent = self._segment_layout
                _send(self._sock, ("save", str(path), skeleton))
                reply, _ = _receive(self._sock)
            except (OSError, EOFError) as exc:
                code = self._stop()
                raise CheckpointWriteError(f"the checkpoint process died while writing {path} "
                                           f"(exit status {code}): {exc!r}") from exc
            if reply[0] == "error":
                raise CheckpointWriteError(f"the checkpoint process failed to write {path}: {reply[1]}\n{reply[2]}")
            for field, value in vars(reply[1]).items():
                setattr(written, field, value)

    def _start(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # the package's own folder first on the child's path: it imports this very copy
            # (also when the training script put it on sys.path itself, uninstalled)
            root = str(Path(__file__).resolve().parents[2])
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
            self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                          pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        self._sock = ours
        self._sent = None

    def _stop(self) -> int | None:
        """End the child (a closed socket ends its loop); its exit status."""
        code = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                code = self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                code = self._proc.wait()
            self._proc = None
        self._sent = None
        return code

    def close(self) -> None:
        """Stop the checkpoint process and free the segment."""
        with self._lock:
            self._stop()
            if self._segment is not None:
                self._segment.close()
                self._segment = None
            self._segment_layout = self._layout = None


def _die_with_parent() -> None:
    """Linux: be killed when the thread that started this process ends (best effort): the
    engine's upload thread, which lives until the engine closes, or the training process's
    death, whatever kills it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(fd: int) -> None:
    """The checkpoint process: write each save asked for over the socket ``fd`` until it closes."""
    _die_with_parent()
    sock = socket.socket(fileno=fd)
    layout: direct.ByteLayout | None = None
    places: dict[str, int] = {}
    view: memoryview | None = None
    while True:
        try:
            message, fds = _receive(sock)
        except (EOFError, OSError):
            return
        if message[0] == "layout":
            _, layout, places, size = message
            segment = mmap.mmap(fds[0], size, prot=mmap.PROT_READ)
            os.close(fds[0])
            view = memoryview(segment)
            continue
        _, path, skeleton = message
        written = Written()
        try:
            assert layout is not None and view is not None, "a save before its layout"
            source_view = view

            def source(item: Any) -> memoryview:
                start = places[item.key]
                return source_view[start:start + item.nbytes]

            direct.save(source, skeleton, Path(path), layout, written)
            reply: tuple[Any, ...] = ("ok", written)
        except BaseException as exc:  # noqa: BLE001 - sent to the training process
            reply = ("error", repr(exc), traceback.format_exc())
        _send(sock, reply)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
