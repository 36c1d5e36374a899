"""Exact resume of the training dataloader position, with no change to the user's loader code.

Lightning restores the position only of loaders that have ``state_dict``/``load_state_dict``
(torchdata ``StatefulDataLoader``); a plain ``DataLoader`` restarts mid-epoch at a fresh
permutation. :class:`LoaderTracker` makes the train ``DataLoader`` objects resumable by
giving each one a small subclass (same object, same arguments) whose ``__iter__`` and
index sampler:

- record the torch RNG state right before the iterator is created (from which it draws the
  worker base seed) and at the first draw of its sampler (from which a ``RandomSampler``
  draws its permutation: at the first batch without workers, inside ``iter()`` with), and
- on the first ``iter()`` after a resume, set the torch RNG back to those recorded states
  and fast-forward past the batches the interrupted run had already trained on: at the
  sampler (``fast_forward="sampler"``: the trained batches' indices are drawn and dropped,
  not one sample is fetched), or by fetching them again (``"replay"``).

So the resumed epoch yields the same batches in the same order, through the same worker
seeds, as the uninterrupted run. At an epoch boundary nothing is skipped: the iterator of
the next epoch is created from the RNG state saved with the checkpoint. An
``IterableDataset`` has no sampler: one with ``state_dict``/``load_state_dict`` iterated in
this process gets its state from before its first untrained batch back (its state is kept
per fetch: Lightning reads an unsized loader one batch ahead); one without is replayed.

A ``StatefulDataLoader`` mid-epoch gets its own ``state_dict`` back (per rank, also when
Lightning itself drops it, issue #20550; from before Lightning's read-ahead for unsized
datasets); at an epoch boundary its exhausted state is dropped (Lightning would otherwise
skip the next epoch) and the state of its sampler's generator is restored instead. Under
DDP Lightning wraps its sampler into a ``DistributedSamplerWrapper`` whose permutation the
loader's state does not hold: such a loader is replayed like a plain one, its sampler's
generator set back to where the epoch began (:func:`restores_itself`). A changed
``batch_size`` or ``num_workers`` is refused.

With ``num_workers > 0`` the randomness each worker draws in ``Dataset.__getitem__`` and
``collate_fn`` (torch, ``random``, NumPy) continues exactly too: the workers' random streams
are captured with every batch and given back to the resumed workers
(:mod:`~areal_lightning.capture.worker_rng`), also with ``persistent_workers=True``, whose
streams run on across epochs (after an epoch-end checkpoint the new persistent iterator draws
its worker base seed from a spare generator, as the run that saved drew none).
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from areal_lightning._torch_internals import loader_subclass, swap_class
from areal_lightning.capture.rng import from_saved, to_saved
from areal_lightning.capture.worker_rng import DirectedIndices, WorkerBatch, WorkerHooks
from areal_lightning.config import FAST_FORWARD_MODES
from areal_lightning.errors import ConfigError, RecoverMismatchError, start_fresh
from areal_lightning.namespaces import fabric_classes

__all__ = ["LoaderTracker", "is_stateful_loader", "restores_itself", "remap_position"]

log = logging.getLogger(__name__)


def is_stateful_loader(loader: Any) -> bool:
    """True for loaders Lightning saves and restores itself (``state_dict``/``load_state_dict``)."""
    return _has_state(loader)


def ordering_sampler(loader: Any) -> Any:
    """The sampler that orders the samples: the batch sampler's (where Lightning injects its
    distributed sampler into a ``StatefulDataLoader``), else the loader's."""
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return inner if inner is not None else getattr(loader, "sampler", None)


def _sampler_generator(loader: Any, unwrap: Callable[[Any], Any]) -> torch.Generator | None:
    """The ``torch.Generator`` the loader's sampler draws its permutation from, if it has one
    (torchdata's ``RandomSampler`` always has one, also inside Lightning's wrapper)."""
    sampler = unwrap(ordering_sampler(loader))
    gen = getattr(sampler, "generator", None)
    return gen if isinstance(gen, torch.Generator) else None


def restores_itself(loader: Any) -> bool:
    """True when the loader's own ``state_dict`` brings back its exact position: a stateful
    loader whose sampler is stateful or deterministic. Under DDP Lightning wraps a
    ``StatefulDataLoader``'s sampler into a ``DistributedSamplerWrapper``, whose permutation
    the loader's state does not hold; such loaders are replayed like a plain ``DataLoader``."""
    wrapper = fabric_classes("utilities.distributed.DistributedSamplerWrapper")
    return is_stateful_loader(loader) and not isinstance(ordering_sampler(loader), wrapper)


def _resumable_subclass(cls: type) -> type:
    """A subclass of ``cls`` that routes ``__iter__`` and its index sampler through the
    tracker (set as class attributes).

    Built with ``type()`` and no extra base, so the object layout equals ``cls``'s and an
    existing loader's ``__class__`` can be swapped in place. ``_index_sampler`` is the
    (batch) sampler ``torch``'s DataLoader iterators read their indices from: the tracker
    wraps it to record where the epoch's order was drawn and to fast-forward it after a resume.
    """

    def __iter__(self: Any) -> Iterator[Any]:
        return type(self)._areal_tracker._iterate(self, type(self)._areal_index, super(sub, self).__iter__)

    def tracked_sampler(self: Any, inner: Any) -> Any:
        if is_stateful_loader(self):  # a StatefulDataLoader fast-forwards (and saves) its own sampler
            return inner
        return _TrackedSampler(inner, type(self)._areal_tracker, type(self)._areal_index)

    def make_iterator(self: Any, build: Callable[[], Any]) -> Any:
        return type(self)._areal_tracker._make_iterator(self, build)

    sub = loader_subclass(cls, f"Resumable{cls.__name__}",
                          {"__iter__": __iter__, "__module__": cls.__module__, "_areal_resumable": True},
                          index_sampler=tracked_sampler, make_iterator=make_iterator)
    return sub


class _TrackedSampler:
    """The loader's (batch) sampler, seen by the DataLoader iterator: notes the torch RNG state
    at its first draw (where a ``RandomSampler`` draws its seed: at the first batch without
    workers, inside ``iter()`` with workers), and after a resume skips the batches already
    trained on without fetching a single sample: the same RNG state is set for the first
    draw, the indices of the skipped batches are drawn and dropped, the RNG is put back."""

    def __init__(self, inner: Any, tracker: "LoaderTracker", index: int) -> None:
        self._inner = inner
        self._tracker = tracker
        self._index = index

    def __len__(self) -> int:
        return len(self._inner)

    def __iter__(self) -> Iterator[Any]:
        rec = self._tracker.record(self._index)
        streams, rec.directives = rec.directives, None
        skip, rec.sampler_skip = rec.sampler_skip, None
        batches = self._fast_forward(*skip) if skip is not None else self._draw()
        if streams is None:
            rec.directed = None
            yield from batches
            return
        # The first batch each worker gets carries its random stream's state (worker_rng).
        directed = rec.directed = {}
        for j, batch in enumerate(batches):
            state = streams[j] if j < len(streams) else None
            if state is not None and isinstance(batch, list):
                directed[j] = state
                batch = DirectedIndices(batch, state)
            yield batch
            if j + 1 >= len(streams):
                break
        yield from batches

    def _draw(self) -> Iterator[Any]:
        indices = iter(self._inner)
        state = torch.get_rng_state()
        first = next(indices, _END)
        if first is _END:
            return
        self._tracker.record(self._index).first_rng = state
        yield first
        yield from indices

    def _fast_forward(self, count: int, first_rng: torch.Tensor) -> Iterator[Any]:
        """Draw the epoch's order from ``first_rng``, drop ``count`` batches, yield the rest.
        Under torch's own ``BatchSampler`` the ``count * batch_size`` indices are dropped from
        its sampler and the rest batched here as ``BatchSampler`` does (3x faster: no batch
        lists are built for the dropped part)."""
        self._tracker.record(self._index).first_rng = first_rng
        start = time.perf_counter()
        plain_batches = type(self._inner) is BatchSampler
        current = torch.get_rng_state()
        torch.set_rng_state(first_rng.to(torch.uint8))
        try:
            if plain_batches:
                bs = self._inner.batch_size
                indices = iter(self._inner.sampler)
                dropped = _drop(indices, count * bs)
                done = -(-dropped // bs)  # a short last batch counts as one
            else:
                indices = iter(self._inner)
                dropped = done = _drop(indices, count)
            if done < count or (plain_batches and dropped < count * bs):
                raise RecoverMismatchError(_ended_early(done, count))
        finally:
            torch.set_rng_state(current)
        self._tracker._note(self._index, f"skipped {count} trained batches at the sampler "
                                         f"(no sample fetched) in {time.perf_counter() - start:.3f}s")
        if not plain_batches:
            yield from indices
            return
        while True:
            batch = list(itertools.islice(indices, bs))
            if not batch or (self._inner.drop_last and len(batch) < bs):
                return
            yield batch


def _drop(iterator: Iterator[Any], n: int) -> int:
    """Advance ``iterator`` by up to ``n`` items (at C speed); how many it had."""
    last = collections.deque(zip(range(n), iterator), maxlen=1)
    return last[0][0] + 1 if last else 0


_END = object()


def _check_loader(loader: Any, index: int, pending: dict[str, Any]) -> None:
    """A resumed loader must have the saved ``batch_size`` and (map-style) ``num_workers``."""
    want = pending.get("batch_size")
    if want is not None and getattr(loader, "batch_size", want) != want:
        raise RecoverMismatchError(
            f"resume: train dataloader {index} has batch_size={loader.batch_size}, but the checkpoint was "
            f"written with batch_size={want}; the saved position would point at other samples. Use the "
            f"same batch size, or {start_fresh()}.")
    saved_workers = pending.get("num_workers")
    workers = getattr(loader, "num_workers", 0)
    if saved_workers is not None and saved_workers != workers and not isinstance(loader.dataset, IterableDataset):
        raise RecoverMismatchError(
            f"resume: train dataloader {index} has num_workers={workers}, but the checkpoint was written with "
            f"num_workers={saved_workers}; random augmentations drawn in the workers (or in this process "
            f"without workers) would come from other streams. Use num_workers={saved_workers}, or "
            f"{start_fresh()}.")


_DISTRIBUTED_SAMPLERS = ("DistributedSampler", "DistributedSamplerWrapper")


def _check_sampler(loader: Any, index: int, pending: dict[str, Any]) -> None:
    """A mid-epoch position counts batches of the saved sampler's order: the loader Lightning
    iterates now must draw the same kind of order (a ``DistributedSampler``, which Lightning
    injects under DDP/FSDP whatever the world size, or not)."""
    saved = pending.get("sampler")
    if pending.get("at_boundary") or not pending.get("done") or saved is None:
        return
    live = type(ordering_sampler(loader)).__name__
    if (saved in _DISTRIBUTED_SAMPLERS) == (live in _DISTRIBUTED_SAMPLERS):
        return
    like = ("a strategy that shards the data (DDP, FSDP: any world size)" if saved in _DISTRIBUTED_SAMPLERS
            else "one process without a DistributedSampler")
    raise RecoverMismatchError(
        f"resume: train dataloader {index} was checkpointed after {pending['done']} batches of an epoch drawn by a "
        f"{saved}, but this run draws its batches with a {live}, whose order differs: the position would point at "
        f"other samples. Resume this mid-epoch checkpoint with {like}, or resume from a checkpoint taken at an "
        f"epoch boundary (any strategy), or {start_fresh()}.")


def _ended_early(done: int, wanted: int) -> str:
    return (f"resume: the train dataloader ended after {done} batches, but the checkpoint was taken after "
            f"{wanted} batches of this epoch; the dataset changed since the checkpoint was written. Restore it, "
            f"or {start_fresh()}.")


class _TrackedIterator:
    """Iterator proxy that counts the batches of the epoch it hands out (``position``), keeps
    an ``IterableDataset``'s ``state_dict`` from before each of the latest fetches, notes the
    torch RNG state at the first ``next()`` of an ``IterableDataset`` and, where the loader
    cannot skip at the sampler, replays the first ``skip`` batches through the dataset from
    that state before handing out the next one.

    The replay runs at the first ``next()``, not at ``iter()``, so that several loaders
    iterated together draw in the order of the uninterrupted run; the RNG stream of the
    training loop is put back afterwards.
    """

    _KEEP = 8  # dataset states kept: Lightning fetches at most a few batches ahead

    def __init__(self, inner: Iterator[Any], tracker: "LoaderTracker", index: int, *, offset: int = 0,
                 replay: int = 0, first_rng: torch.Tensor | None = None, dataset: Any = None,
                 record_rng: bool = False, stateful_loader: Any = None) -> None:
        self._inner = inner
        self._tracker = tracker
        self._index = index
        self._replay = replay
        self._first_rng = first_rng
        self._record_rng = record_rng
        self._dataset = dataset  # an IterableDataset whose state_dict is kept per fetch
        self.dataset_states: dict[int, Any] = {}
        self._stateful_loader = stateful_loader  # a StatefulDataLoader read ahead: its state_dict per fetch
        self.loader_states: dict[int, Any] = {}
        self.position = offset + replay
        self._started = False
        self.workers = 0  # > 0: batches come from worker processes reporting their random streams
        self.before: dict[int, Any] = {}  # position -> its stream's RNG state before the batch
        self.after: dict[int, Any] = {}  # position -> ... after the batch
        self._ahead: collections.deque = collections.deque()  # read ahead (see ensure_received)
        self._received = self.position  # positions received from the inner iterator
        self._start = self.position

    def __iter__(self) -> "_TrackedIterator":
        return self

    def __next__(self) -> Any:
        if not self._started:
            self._started = True
            if self._first_rng is not None:
                self._tracker.record(self._index).first_rng = self._first_rng
            elif self._record_rng:
                self._tracker.record(self._index).first_rng = torch.get_rng_state()
            if self._replay:
                self._replay_batches()
        if self._dataset is not None:
            self.dataset_states[self.position] = self._dataset.state_dict()
            self.dataset_states.pop(self.position - self._KEEP, None)
        if self._stateful_loader is not None:
            self.loader_states[self.position] = self._stateful_loader.state_dict()
            self.loader_states.pop(self.position - self._KEEP, None)
        batch = self._ahead.popleft() if self._ahead else self._receive()
        self.position += 1
        return batch

    def _receive(self) -> Any:
        batch = next(self._inner)
        if isinstance(batch, WorkerBatch):
            at = self._received
            rec = self._tracker.record(self._index)
            last = rec.worker_after
            directed = (rec.directed or {}).get(at - self._start)
            # The state before this batch: the worker's report (its first batch), the directive
            # it carried, or the state after the same worker's previous batch.
            self.before[at] = batch.before if batch.before is not None else \
                directed if directed is not None else last.get(batch.worker)
            self.after[at] = last[batch.worker] = batch.after
            self._tracker.record(self._index).stream_after[at % self.workers] = batch.after
            for old in [k for k in self.before if k < at - 2 * self.workers - self._KEEP]:
                self.before.pop(old, None)
                self.after.pop(old, None)
            batch = batch.data
        self._received += 1
        return batch

    def ensure_received(self, upto: int) -> None:
        """Receive the batches up to position ``upto`` (exclusive) now, keeping them for
        ``next()``: their workers fetched them already (the DataLoader prefetches); their
        reports tell the random streams' states at a save."""
        while self._received < upto:
            try:
                self._ahead.append(self._receive())
            except StopIteration:
                return

    def _replay_batches(self) -> None:
        start = time.perf_counter()
        training_rng = torch.get_rng_state()
        if self._first_rng is not None:
            torch.set_rng_state(self._first_rng.to(torch.uint8))
        try:
            for done in range(self._replay):
                if next(self._inner, _END) is _END:
                    raise RecoverMismatchError(_ended_early(done, self._replay))
        finally:
            torch.set_rng_state(training_rng)
        took = time.perf_counter() - start
        reason = self._tracker.record(self._index).replay_reason or "fast_forward='replay'"
        self._tracker._note(self._index, f"replayed {self._replay} trained batches through the dataset in "
                                         f"{took:.2f}s (it cannot skip at the sampler: {reason})")

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def remap_position(state: dict[str, Any], old_world: int, new_world: int) -> dict[str, Any]:
    """Map one rank's saved loader positions to a run with ``new_world`` ranks.

    Exact when every rank's loader iterates a ``DistributedSampler`` (Lightning injects one
    under DDP/FSDP; its permutation depends on seed and epoch only, and rank ``r`` takes
    every ``world``-th index of it): after ``k`` batches of size ``b`` on each of ``W`` ranks
    the first ``k*b*W`` indices were consumed, so each new rank skips ``k*W/W'`` batches --
    which must be a whole number. Anything else raises ``ValueError`` explaining why.
    """
    if old_world == new_world or state.get("at_boundary"):
        return state  # an epoch boundary maps to the next epoch's start on any world size
    loaders = {}
    for key, entry in state.get("loaders", {}).items():
        where = (f"train dataloader {key}: the checkpoint was taken after {entry['batches_done']} batches of the "
                 f"epoch on each of {old_world} ranks")
        if entry.get("sampler") not in _DISTRIBUTED_SAMPLERS or entry.get("stateful"):
            raise ValueError(
                f"{where} with a {entry.get('sampler')} sampler, whose position cannot be mapped to {new_world} ranks "
                "(only a DistributedSampler's order is the same for every world size). Resume with "
                f"{old_world} processes, or from a checkpoint taken at an epoch boundary.")
        consumed = int(entry["batches_done"]) * old_world
        if consumed % new_world:
            raise ValueError(
                f"{where}, {consumed} batches in all; that is not a whole number of batches for each of {new_world} "
                f"ranks. Resume with {old_world} processes (or a world size dividing {consumed}), or from a "
                "checkpoint taken at an epoch boundary.")
        loaders[key] = {**entry, "batches_done": consumed // new_world}
    return {**state, "loaders": loaders}



def _has_len(loader: Any) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


def _has_state(obj: Any) -> bool:
    """Whether ``obj`` (a loader or a dataset) has ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


@dataclass
class TrackedLoader:
    """What :class:`LoaderTracker` keeps for one train loader."""

    loader: Any = None  # the object Lightning iterates (None once the fit ended)
    iterator: Any = None  # its current iterator
    pending: dict[str, Any] | None = None  # the saved position its next iterator restores
    first_rng: torch.Tensor | None = None  # torch's RNG state at the epoch order's first draw
    iter_rng: torch.Tensor | None = None  # torch's RNG state when the iterator was made
    iter_gen: torch.Tensor | None = None  # the sampler's own generator state then
    sampler_skip: tuple[int, torch.Tensor] | None = None  # (batches, first_rng) the next iterator skips
    replay_reason: str | None = None  # why the skipped batches are replayed (the log line)
    directives: list[Any] | None = None  # stream states for the next iterator's first batches
    directed: dict[int, Any] | None = None  # batch j of the iterator -> its directive state
    stream_after: dict[int, Any] = field(default_factory=dict)  # stream -> state after its latest batch
    worker_after: dict[int, Any] = field(default_factory=dict)  # worker id -> state after its latest batch
    initial: list[Any] | None = None  # per worker id: the stream state its workers start from
    rotated: bool = False  # a persistent loader whose workers carry other streams than their ids
    spare_base_seed: bool = False  # see _make_iterator


class LoaderTracker:
    """Tracks the train loaders of one run and restores their position after a resume.

    Args:
        unwrap_sampler: returns the user's sampler inside a framework's sampler wrapper
            (Lightning's ``DistributedSamplerWrapper``), whose generator holds the epoch's
            permutation; identity by default.
        fast_forward: one of :data:`FAST_FORWARD_MODES`.
    """

    def __init__(self, unwrap_sampler: Callable[[Any], Any] = lambda sampler: sampler,
                 fast_forward: str = "sampler") -> None:
        if fast_forward not in FAST_FORWARD_MODES:
            raise ConfigError("fast_forward", f"unknown mode {fast_forward!r}; allowed: {', '.join(FAST_FORWARD_MODES)}")
        self.fast_forward = fast_forward
        self._unwrap_sampler = unwrap_sampler
        self._records: dict[int, TrackedLoader] = {}  # by loader index
        self.replayed: list[str] = []

    def record(self, index: int) -> "TrackedLoader":
        """What the tracker keeps for the ``index``-th train loader (made empty on first use)."""
        rec = self._records.get(index)
        if rec is None:
            rec = self._records[index] = TrackedLoader()
        return rec

    def _tracked(self) -> list[tuple[int, "TrackedLoader"]]:
        """The loaders tracked in this fit, by index."""
        return [(i, rec) for i, rec in sorted(self._records.items()) if rec.loader is not None]

    # -- wiring ----------------------------------------------------------------------------

    def track(self, loader: Any, index: int) -> Any:
        """Make ``loader`` (the ``index``-th train loader) resumable; returns the same object."""
        if not isinstance(loader, DataLoader):
            return loader
        cls = type(loader)
        if cls.__dict__.get("_areal_resumable", False):
            cls = cls.__mro__[1]
        # One subclass per loader; its class attributes survive Lightning re-instantiating
        # the loader (DistributedSampler injection builds a new object of the same class).
        pending = self.record(index).pending
        if pending is not None:  # raised here, before Lightning iterates (its teardown would mask it)
            _check_loader(loader, index, pending)
        sub = _resumable_subclass(cls)
        sub._areal_tracker = self
        sub._areal_index = index
        swap_class(loader, sub)
        self.record(index).loader = loader
        return loader

    def _take_initial(self, index: int) -> list[Any] | None:
        rec = self.record(index)
        initial, rec.initial = rec.initial, None
        return initial

    def untrack(self) -> None:
        """Give every tracked loader its own class back and let go of their iterators: an
        iterator kept here would keep its worker processes running after ``fit`` (Lightning
        ends them by dropping its last reference) and leave them to the garbage collector."""
        for _, rec in self._tracked():
            loader = rec.loader
            cls = type(loader)
            if cls.__dict__.get("_areal_resumable", False):
                swap_class(loader, cls.__mro__[1])
        for rec in self._records.values():
            rec.loader = rec.iterator = None

    def streams_apply(self, loader: Any) -> bool:
        """Whether ``loader``'s worker random streams are captured and restored: map-style,
        batched, ``num_workers > 0``, and ``fast_forward="sampler"`` or a ``StatefulDataLoader``
        (which restores its own position)."""
        return (getattr(loader, "num_workers", 0) > 0 and not isinstance(loader.dataset, IterableDataset)
                and loader.batch_sampler is not None
                and (self.fast_forward == "sampler" or is_stateful_loader(loader)))

    def _make_iterator(self, loader: Any, make: Callable[[], Any]) -> Any:
        """Build the DataLoader's own iterator (``_get_iterator``), with the worker hooks
        (:mod:`~areal_lightning.capture.worker_rng`) where the streams apply.

        After an epoch-end checkpoint, a loader with persistent workers is created anew where
        the run that saved reused its iterator, which draws no worker base seed from the
        global RNG: the new iterator draws it from a spare generator, so the sampler's order
        and the training's randomness see the same global RNG stream."""
        index = type(loader)._areal_index
        user = loader.collate_fn, loader.worker_init_fn, loader.generator
        if self.streams_apply(loader):
            hooks = WorkerHooks(loader.collate_fn, loader.worker_init_fn, self._take_initial(index))
            loader.collate_fn, loader.worker_init_fn = hooks.collate, hooks.init
        if self.record(index).spare_base_seed:
            self.record(index).spare_base_seed = False
            loader.generator = torch.Generator().manual_seed(0)  # the workers' streams are set at their start
        try:
            return make()
        finally:
            loader.collate_fn, loader.worker_init_fn, loader.generator = user

    # -- save / load -----------------------------------------------------------------------

    def state_dict(self, batches_done: int, at_boundary: bool, prefetched: int = 0) -> dict[str, Any]:
        """Position of every tracked loader.

        ``batches_done``: batches of the current epoch already trained on; ``prefetched``:
        batches the training loop has fetched but not trained on yet. A loader that was
        re-iterated inside the epoch (a shorter loader cycled by Lightning's CombinedLoader)
        counts from its latest ``iter()``.
        """
        loaders = {}
        for index, rec in self._tracked():
            loader = rec.loader
            stateful = restores_itself(loader)
            iterator = rec.iterator
            position = getattr(iterator, "position", None)
            done = position - prefetched if isinstance(position, int) else batches_done
            entry: dict[str, Any] = {"stateful": stateful, "batches_done": done,
                                     "batch_size": getattr(loader, "batch_size", None),
                                     "num_workers": getattr(loader, "num_workers", 0)}
            streams = self._streams(index, loader, iterator, done, at_boundary)
            if streams is not None:
                entry["worker_streams"] = streams
            states = getattr(iterator, "dataset_states", {})
            if not at_boundary and not stateful and done in states:
                entry["dataset_state"] = states[done]  # the IterableDataset before its first untrained batch
            if not at_boundary and not stateful:
                if rec.iter_rng is None or rec.first_rng is None:
                    raise RuntimeError("internal: train loader position requested before its first batch")
                entry["iter_rng"] = rec.iter_rng
                entry["first_rng"] = rec.first_rng
                if rec.iter_gen is not None:  # the sampler's own generator, as this epoch began
                    entry["sampler_generator"] = rec.iter_gen
            gen = _sampler_generator(loader, self._unwrap_sampler)
            if at_boundary and gen is not None:
                entry["sampler_generator"] = gen.get_state()
            sampler = ordering_sampler(loader)
            entry["sampler"] = type(sampler).__name__
            epoch = getattr(sampler, "epoch", None)
            if isinstance(epoch, int):  # DistributedSampler: the epoch its permutation is (next) drawn for
                entry["sampler_epoch"] = epoch + 1 if at_boundary else epoch
            loaders[str(index)] = entry
        return {"at_boundary": at_boundary, "loaders": loaders}

    def _streams(self, index: int, loader: Any, iterator: Any, done: int, at_boundary: bool) -> list[Any] | None:
        """Per worker stream ``s``, its RNG state before its next batch (saved form; ``None``
        where unknown): mid-epoch the state before the stream's first untrained batch (received
        now if needed); at an epoch boundary, for persistent workers, the state after the
        stream's last batch (workers that do not persist are seeded anew next epoch)."""
        workers = getattr(iterator, "workers", 0)
        if not workers or not self.streams_apply(loader):
            return None
        if at_boundary:
            if not loader.persistent_workers:
                return None
            latest = self.record(index).stream_after
            return [to_saved(latest[s]) if latest.get(s) is not None else None for s in range(workers)]
        if not is_stateful_loader(loader):
            # A StatefulDataLoader's fresh workers start from their original seeds (it restores its
            # base seed and worker order): a stream not reported yet needs nothing. Others read on.
            iterator.ensure_received(done + workers)
        out: list[Any] = []
        for s in range(workers):
            k = done + (s - done) % workers  # the stream's first untrained batch
            state = iterator.before.get(k)
            if state is None and k - workers >= 0:  # the epoch ends before it: after the stream's last batch
                state = iterator.after.get(k - workers)
            if state is None and loader.persistent_workers:
                state = self.record(index).stream_after.get(s)
            out.append(to_saved(state) if state is not None else None)
        return out

    def load_state_dict(self, state: dict[str, Any], checkpoint_rng: torch.Tensor) -> None:
        """Arm the replay for the next ``iter()`` of each loader.

        ``checkpoint_rng`` is the torch RNG state saved with the checkpoint: at an epoch
        boundary the next epoch's iterator is created from it.
        """
        for rec in self._records.values():
            rec.pending = None
        for key, entry in state.get("loaders", {}).items():
            common = {"batch_size": entry.get("batch_size"), "sampler_epoch": entry.get("sampler_epoch"),
                      "num_workers": entry.get("num_workers"), "worker_streams": entry.get("worker_streams"),
                      "sampler": entry.get("sampler"),
                      "done": 0 if state["at_boundary"] else int(entry["batches_done"]),
                      "at_boundary": bool(state["at_boundary"])}
            if state["at_boundary"]:
                self.record(int(key)).pending = {**common, "rng": checkpoint_rng, "skip": 0,
                                           "sampler_generator": entry.get("sampler_generator")}
            elif not entry["stateful"]:
                self.record(int(key)).pending = {**common, "rng": entry["iter_rng"], "first_rng": entry["first_rng"],
                                           "skip": int(entry["batches_done"]),
                                           "sampler_generator": entry.get("sampler_generator"),
                                           "dataset_state": entry.get("dataset_state")}
            else:
                # The loader's own state, as Lightning saved it. Lightning restores it too, except
                # when configure_optimizers built the loader early (estimated_stepping_batches,
                # Lightning issue #20550); loading the same state twice is harmless.
                self.record(int(key)).pending = {**common, "rng": None, "skip": 0, "loader_state": entry.get("loader_state")}

    # -- the iterator ----------------------------------------------------------------------

    def _iterate(self, loader: Any, index: int, make_iter: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        rec = self.record(index)
        rec.loader = loader  # the object Lightning iterates (it may have re-created it)
        pending, rec.pending = rec.pending, None
        gen = _sampler_generator(loader, self._unwrap_sampler)
        if pending is not None:
            _check_loader(loader, index, pending)
            _check_sampler(loader, index, pending)
            self._arm_streams(loader, index, pending)
            sampler = ordering_sampler(loader)
            if pending.get("sampler_epoch") is not None and callable(getattr(sampler, "set_epoch", None)):
                # Lightning creates the resumed iterator before it sets the sampler's epoch; a
                # StatefulDataLoader draws its permutation right then, so set the epoch first.
                sampler.set_epoch(pending["sampler_epoch"])
            if pending.get("loader_state") is not None:
                loader.load_state_dict(pending["loader_state"])
            if pending.get("rng") is not None:
                torch.set_rng_state(pending["rng"].to(torch.uint8))
            gen_state = pending.get("sampler_generator")
            if gen_state is not None and gen is not None:
                gen.set_state(gen_state.to(torch.uint8))
        rec.iter_rng = torch.get_rng_state()
        if gen is not None:
            rec.iter_gen = gen.get_state()
        rec.first_rng = None
        rec.sampler_skip = None
        iterable = isinstance(loader.dataset, IterableDataset)
        # An IterableDataset iterated in this process (no workers) with state_dict: its state is
        # kept per fetch, and restored instead of replaying its batches.
        dataset = loader.dataset if iterable and not loader.num_workers and _has_state(loader.dataset) else None
        skip = pending["skip"] if pending is not None and pending.get("first_rng") is not None else 0
        offset = replay = 0
        what = ""
        if pending is not None and pending.get("loader_state") is not None:
            offset = pending.get("done", 0)  # the loader continues from its own state: count on from there
        if skip and dataset is not None and pending.get("dataset_state") is not None:
            dataset.load_state_dict(pending["dataset_state"])
            offset, what = skip, f"its IterableDataset's state after {skip} trained batches restored"
        elif skip and not iterable and self.fast_forward == "sampler" and not is_stateful_loader(loader):
            rec.sampler_skip = (skip, pending["first_rng"])
            offset, what = skip, f"skips {skip} trained batches at the sampler"
        elif skip:
            replay, what = skip, f"replays {skip} trained batches"
            rec.replay_reason = (
                "a StatefulDataLoader whose sampler Lightning wrapped" if is_stateful_loader(loader) and not iterable
                else "fast_forward='replay'" if not iterable else
                "an IterableDataset without state_dict/load_state_dict" if not _has_state(loader.dataset) else
                "its IterableDataset runs in worker processes; a StatefulDataLoader keeps their state")
        if pending is None and rec.rotated and self.streams_apply(loader):
            # Persistent workers of a resumed process carry the streams of other workers: each
            # epoch's first batches give every worker its own stream's state back.
            latest = rec.stream_after
            rec.directives = [latest.get(s) for s in range(loader.num_workers)]
        # A stateful loader over an unsized dataset: Lightning fetches a batch ahead, which its own
        # state_dict at save time would count as consumed; its state from before each fetch is kept.
        ahead = loader if is_stateful_loader(loader) and iterable and not _has_len(loader) else None
        iterator = _TrackedIterator(make_iter(), self, index, offset=offset, replay=replay,
                                    first_rng=pending["first_rng"] if replay else None, dataset=dataset,
                                    record_rng=iterable or is_stateful_loader(loader), stateful_loader=ahead)
        rec.iterator = iterator
        if self.streams_apply(loader):
            iterator.workers = loader.num_workers
        if pending is not None:
            if not what:
                what = "its own state restored" if pending.get("loader_state") is not None else "epoch start"
            self.replayed.append(f"loader {index}: {what}")
            log.debug("train loader %d resumed: %s", index, what)
        return iterator

    def _arm_streams(self, loader: Any, index: int, pending: dict[str, Any]) -> None:
        """Before a resumed iterator: the stream state each new worker starts from (and, for
        persistent workers, what later epochs need); a spare base seed after an epoch end."""
        if pending.get("at_boundary") and getattr(loader, "persistent_workers", False) and loader.num_workers > 0:
            self.record(index).spare_base_seed = True
        workers = getattr(loader, "num_workers", 0)
        streams = pending.get("worker_streams")
        if not streams or not self.streams_apply(loader):
            return
        done = pending.get("done", 0)
        # Resumed batch j goes to worker j: it is batch done + j of the epoch, of stream (done + j) % W.
        # A StatefulDataLoader hands batch done to worker done % W itself: worker w takes stream w.
        rotation = 0 if is_stateful_loader(loader) else done % workers
        first = [streams[(rotation + w) % workers] for w in range(workers)]
        self.record(index).initial = [from_saved(d) if d is not None else None for d in first]
        if loader.persistent_workers:
            self.record(index).stream_after = {s: from_saved(d) for s, d in enumerate(streams) if d is not None}
            if rotation:
                self.record(index).rotated = True

    def loader_state(self, index: int, loader: Any, batches_done: int) -> Any:
        """A stateful loader's own state at its position ``batches_done``: the one kept from
        before that batch's fetch when the loader was read ahead, else ``loader.state_dict()``."""
        kept = getattr(self.record(index).iterator, "loader_states", {})
        return kept[batches_done] if batches_done in kept else loader.state_dict()

    def _note(self, index: int, what: str) -> None:
        """A fast-forward done (logged with its time)."""
        log.info("RecoverCallback: train loader %d: %s", index, what)
