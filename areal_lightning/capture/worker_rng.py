"""Capture: the random streams of DataLoader worker processes, across a resume.

A map-style ``DataLoader`` with ``num_workers=W`` hands batch ``k`` of an epoch to worker
``k % W`` (round robin, in order), and each worker draws its augmentations (``torch``,
``random``, NumPy) from its own RNG, seeded ``base_seed + worker_id`` when it starts; so the
``k``-th batch's randomness comes from *stream* ``k % W`` after that stream produced the
batches ``k - W, k - 2W, ...``. Neither Lightning nor torchdata keeps these streams: after a
mid-epoch resume the new workers restart their streams from their seeds, so the right samples
get other augmentations.

Here each worker reports, with every batch, its id and its RNG states right after its
collate function returned, and with its first batch also the states right before that
batch's samples were fetched (:class:`WorkerBatch`, unwrapped in the main process by the
loader tracker, which knows every batch's state before it: the state after the same worker's
previous batch, or the directive the batch carried, or the first batch's report). A checkpoint stores, per stream, the state before
its first untrained batch. On resume, the first ``W`` batches of the resumed epoch carry a
directive (:class:`DirectedIndices`, the batch's index list) and the worker that gets one
sets its RNG to that stream's state before fetching: resumed batch ``j`` (worker ``j``) is
batch ``N + j`` of the epoch, of stream ``(N + j) % W``; every later batch of that worker
belongs to the same stream. The resumed workers take those states when they start
(:class:`WorkerHooks` ``initial``; a torchdata ``StatefulDataLoader`` gives batch ``N`` to
worker ``N % W`` itself, so its worker ``w`` takes stream ``w``). With
``persistent_workers=True`` the streams continue across epochs, so the first ``W`` batches
of each later epoch of a resumed process whose workers carry other streams than their own
carry a directive (:class:`DirectedIndices`) with the stream states.

The hooks run in the workers through the loader's ``collate_fn`` and ``worker_init_fn``
(:class:`WorkerHooks`: the user's functions are called as before) and an instance
``__getitems__`` on the worker's copy of the dataset, which torch's map-style fetcher calls
with the batch's indices before fetching.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.data import get_worker_info

from areal_lightning.capture.rng import raw_state, set_raw_state

__all__ = ["WorkerBatch", "DirectedIndices", "WorkerHooks"]

_BEFORE: list[Any] = []  # in a worker: the RNG state before the batch being fetched, for its first batch
_FIRST: list[bool] = [False]  # in a worker: no batch reported yet


class WorkerBatch:
    """A collated batch as a worker returns it: the worker's id, its RNG states after the batch
    and (first batch of the worker only) before it."""

    __slots__ = ("data", "worker", "before", "after")

    def __init__(self, data: Any, worker: int, before: Any, after: Any) -> None:
        self.data, self.worker, self.before, self.after = data, worker, before, after

    def pin_memory(self) -> "WorkerBatch":
        """Pin the batch (the DataLoader's ``pin_memory=True`` thread calls this)."""
        from areal_lightning._torch_internals import pin_memory

        return WorkerBatch(pin_memory(self.data), self.worker, self.before, self.after)


class DirectedIndices(list):
    """A batch's index list carrying the RNG state its worker must take before fetching it."""

    def __init__(self, indices: Any, rng: tuple[bytes, Any, Any]) -> None:
        super().__init__(indices)
        self.rng = rng

    def __reduce__(self) -> Any:  # pickled to the worker with its state
        return (DirectedIndices, (list(self), self.rng))


class WorkerHooks:
    """The ``collate_fn`` and ``worker_init_fn`` given to the DataLoader iterator: the user's
    own, plus the stream capture and the directives (picklable, for ``spawn`` workers too)."""

    def __init__(self, collate_fn: Callable[[Any], Any], worker_init_fn: Callable[[int], None] | None,
                 initial: list[Any] | None = None) -> None:
        self.user_collate = collate_fn
        self.user_init = worker_init_fn
        self.initial = initial  # per worker id: the random stream state it starts from (a resume)

    def collate(self, samples: Any) -> WorkerBatch:
        """Collate with the user's function, then report the worker's states."""
        data = self.user_collate(samples)
        before = _BEFORE.pop() if _BEFORE else None
        _FIRST[0] = False
        info = get_worker_info()
        return WorkerBatch(data, info.id if info is not None else 0, before, raw_state())

    def init(self, worker_id: int) -> None:
        """The user's ``worker_init_fn`` (its seeding included), then the fetch hook."""
        if self.user_init is not None:
            self.user_init(worker_id)
        if self.initial is not None and worker_id < len(self.initial) and self.initial[worker_id] is not None:
            set_raw_state(self.initial[worker_id])
        _FIRST[0] = True
        info = get_worker_info()
        if info is not None:
            _install_fetch_hook(info.dataset)


def _install_fetch_hook(dataset: Any) -> None:
    """Give the worker's copy of ``dataset`` an instance ``__getitems__`` (torch's fetcher calls
    it with a batch's indices) that applies a directive and notes the state before the fetch."""
    original = getattr(dataset, "__getitems__", None)

    def getitems(indices: Any) -> Any:
        rng = getattr(indices, "rng", None)
        if rng is not None:
            set_raw_state(rng)
        if _FIRST[0]:
            _BEFORE[:] = [raw_state()]
        if original is not None:
            return original(indices)
        return [dataset[i] for i in indices]

    try:
        object.__setattr__(dataset, "__getitems__", getitems)
    except (AttributeError, TypeError):  # a dataset with __slots__: no capture (its loader is then not exact)
        pass
