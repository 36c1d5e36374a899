"""Write: the on-disk format of a nested checkpoint inside a flat DCP state dict.

Tensors are stored under their dotted path (``state_dict.layer.weight``), as a plain
``dcp.save`` of the nested dict would name them; every non-tensor part is stored once, as a
"skeleton" object (the structure with each tensor replaced by a :class:`TensorSlot`: the one
:data:`UNNAMED` slot where the tensor's key is its path, a slot naming the key otherwise), which DCP pickles into one byte item under :data:`SKELETON_KEY`. This keeps integer
keys (optimizer ``state`` keys), empty containers and container types, which DCP's own
flattening loses. :func:`flatten` makes the flat dict, :func:`unflatten` rebuilds the structure.
"""

from __future__ import annotations

import codecs
import copy
import copyreg
import io
import pickle
import warnings
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any

import torch

# Every module reading or writing DCP imports this one. DCP warns on every rank-local save/load
# that it "assumes the intent" of a single process; that is exactly our intent, so this one
# message is silenced (nothing else is).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

__all__ = ["SKELETON_KEY", "SLOT_NAMES", "TensorSlot", "UNNAMED", "SlotUnpickler", "PlainUnpickler", "NOT_PLAIN", "load_plain", "save_skeleton", "PROTOCOL", "slot_globals", "flatten", "unflatten", "flat_tensors",
           "Refusal", "weights_only_refusal"]

SKELETON_KEY = "__areal_lightning_skeleton__"
"""The flat-dict key of the pickled skeleton (part of the on-disk format)."""


@dataclass(frozen=True)
class TensorSlot:
    """Placeholder for a tensor inside the skeleton (part of the on-disk format: pickled by
    its module and name, see :data:`SLOT_NAMES`)."""

    fqn: str


UNNAMED = TensorSlot("")
"""The slot of a tensor whose key is its path (since 0.3.0): one object for all of them, which
the skeleton's pickle holds once and references after that (a named slot costs the weights-only
unpickler an object per tensor). :func:`unflatten` names it again from where it sits."""


SLOT_NAMES = ("areal_lightning.write.dcp_format.TensorSlot", "areal_lightning.engine._TensorSlot")
"""Every name :class:`TensorSlot` has been pickled under, this release's first: 0.1.0 wrote
``areal_lightning.engine._TensorSlot``. Loads accept them all (:func:`slot_globals`,
:class:`SlotUnpickler`); a rename of the class or its module must add the new name here."""


_PLAIN: dict[str, Any] = {**dict.fromkeys(SLOT_NAMES, TensorSlot), "collections.OrderedDict": OrderedDict,
                          "collections.Counter": Counter, "builtins.set": set, "builtins.complex": complex,
                          "builtins.bytearray": bytearray,
                          f"{codecs.encode.__module__}.{codecs.encode.__name__}": codecs.encode}
"""The globals :class:`PlainUnpickler` finds: the slot, and the builtins and ``collections``
types that torch's weights-only unpickler allows as well (protocol 2 pickles a set, a ``bytes``
and a ``bytearray`` through them)."""


class _NotPlain(Exception):
    """A global or a persistent id :class:`PlainUnpickler` does not take."""


class PlainUnpickler(pickle.Unpickler):
    """Python's compiled unpickler finding only :class:`TensorSlot` (under every name) and the
    few plain types ``torch.load(weights_only=True)`` itself allows (:data:`_PLAIN`); any other
    global, a persistent id (a storage), or anything else it cannot take raises, and
    :func:`load_plain` says "not plain" (the caller then loads with ``torch.load``). Without a
    global, a pickle makes only builtin values (``None``, numbers, strings, bytes, lists, tuples,
    dicts, sets); every object it makes otherwise is of a type found here."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "__builtin__":  # protocol 2 (torch.save's) names builtins as Python 2 did, as torch maps them
            module = "builtins"
        found = _PLAIN.get(f"{module}.{name}")
        if found is None:
            raise _NotPlain(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _NotPlain("a persistent id")


NOT_PLAIN = object()
"""What :func:`load_plain` returns for bytes it leaves to ``torch.load``."""


def load_plain(data: bytes) -> Any:
    """The object ``torch.save`` wrote into ``data`` (a zip archive of one pickle, ``data.pkl``)
    when it is made of builtin values, :class:`TensorSlot` and the plain types of
    :class:`PlainUnpickler` only (a checkpoint's skeleton usually is), read by Python's compiled
    unpickler; else :data:`NOT_PLAIN` (a tensor, any other type, damaged bytes, an archive laid
    out otherwise than torch reads it: the caller loads it with ``torch.load(weights_only=True)``,
    which refuses or raises as it does). It exists for speed: torch's weights-only unpickler is
    Python, about 6 µs per entry of a dict (2,000 tensors' skeleton: 12 ms against 1 ms).

    What it can make is what ``weights_only=True`` can: builtin values, and objects of the
    allowed types made by the allowed callables. Python's unpickler also takes a few encodings
    of them that torch's does not implement (a frozenset's and a ``bytes``' own opcodes of
    protocols 3 and 4, a class looked up by ``STACK_GLOBAL``: data only); ``torch.save`` writes
    protocol 2, whose frozenset goes through a global it does not find. An extension code
    (``copyreg.add_extension``), which Python's unpickler resolves from a cache without
    ``find_class``, is refused by skipping this path while any is registered in the process. As
    with torch's unpickler, a crafted pickle can ask for much memory (a memo index, a
    ``bytearray``'s size)."""
    if copyreg._inverted_registry:  # noqa: SLF001 - an EXT opcode could skip find_class (see above)
        return NOT_PLAIN
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = archive.namelist()
            prefix = names[0].split("/", 1)[0] if names else ""  # as torch's reader: the first record's folder
            if f"{prefix}/version" not in names or f"{prefix}/data.pkl" not in names \
                    or not all(name.startswith(f"{prefix}/") for name in names):
                return NOT_PLAIN
            return PlainUnpickler(io.BytesIO(archive.read(f"{prefix}/data.pkl"))).load()
    except Exception:  # noqa: BLE001 - any doubt: torch.load decides, with its own errors
        return NOT_PLAIN


PROTOCOL = 2
"""The pickle protocol of a skeleton: ``torch.save``'s default (``DEFAULT_PROTOCOL``), passed
to it explicitly by :func:`save_skeleton`."""


class _HasStorage(Exception):
    """A storage (or a tensor, whose reduction holds one) met by :class:`_PlainPickler`."""


class _PlainPickler(pickle.Pickler):
    """Python's compiled pickler, stopped by a storage: what ``torch.save``'s own pickler writes
    for an object that holds none (its ``persistent_id``, a Python call for every object
    pickled, returns ``None`` for all the others). ``reducer_override`` is consulted only for
    objects that are not builtin values or containers, and not met before; every storage is such
    an object, whatever holds it."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.storage.TypedStorage)) or torch.is_storage(obj):
            raise _HasStorage
        return NotImplemented


class _Pickled:
    """``torch.save``'s ``pickle_module`` for a pickle made beforehand: its pickler writes the
    bytes it is given as the archive's ``data.pkl`` (torch writes the archive around them)."""

    class Pickler:
        def __init__(self, file: Any, protocol: int | None = None) -> None:
            self._file = file

        def dump(self, data: bytes) -> None:
            self._file.write(data)


def save_skeleton(skeleton: Any, file: Any) -> None:
    """``torch.save(skeleton, file)``: the same archive, its ``data.pkl`` the same bytes. Where
    the skeleton holds no storage (a checkpoint's skeleton usually holds none: its tensors are
    slots) it is pickled by Python's compiled pickler first, and ``torch.save`` writes those
    bytes (through its documented ``pickle_module`` argument) instead of pickling it with a
    Python ``persistent_id`` call per object (2,000 tensors' skeleton: about 1.5 ms against 0.15);
    else, or where that pickler fails, ``torch.save`` pickles it as always."""
    buffer = io.BytesIO()
    try:
        _PlainPickler(buffer, protocol=PROTOCOL).dump(skeleton)
    except Exception:  # noqa: BLE001 - a storage, or what torch.save reports in its own words
        torch.save(skeleton, file, pickle_protocol=PROTOCOL)
        return
    torch.save(buffer.getvalue(), file, pickle_module=_Pickled, pickle_protocol=PROTOCOL)


def slot_globals() -> list[tuple[type, str]]:
    """``torch.serialization.safe_globals`` entries allowing the slot under every name."""
    return [(TensorSlot, name) for name in SLOT_NAMES]


class SlotUnpickler(pickle.Unpickler):
    """A plain unpickler (trusted loads) that also finds :class:`TensorSlot` under its old names."""

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" in SLOT_NAMES:
            return TensorSlot
        return super().find_class(module, name)


_ATOMIC = (type(None), bool, int, float, complex, str, bytes)

_BULK = 16
"""Dicts of this many entries or more are first tried as a whole (see :func:`flatten`)."""

_STR = {str}
_ATOMS = set(_ATOMIC)
_SEQUENCES = {list, tuple}
_DICT = {dict}
_KEYS = {str, int}


def flatten(state: Mapping[str, Any], memo: dict[str, tuple[Any, ...]] | None = None) -> dict[str, Any]:
    """Flat DCP dict: ``{dotted path: tensor}`` plus the skeleton under ``SKELETON_KEY``.

    The skeleton is a point-in-time copy of every non-tensor value, taken now in the
    caller's thread, so later mutation of Python state cannot leak into an async save.

    ``memo`` (a dict the caller keeps between calls, for states of the same shape: a saver's
    saves): the dotted paths of each dict taken whole (a state dict's tensors) are remembered
    there, and reused, the same ``str`` objects, while that dict's keys stay the same, in order:
    no path is built and hashed again (2,000 tensors: 0.25 ms a save, caches cold), and a
    comparison of the result's keys with the last result's finds them identical. It keeps the
    dicts of this call only (a prefix that changes every save holds no memory)."""
    tensors: dict[str, torch.Tensor] = {}
    tensor_type = torch.Tensor
    used: set[str] = set()  # the memo's prefixes met by this call

    def leaf(obj: torch.Tensor, base: str, by_path: bool) -> TensorSlot:
        fqn, n = base, 1
        while fqn in tensors or fqn == SKELETON_KEY:
            fqn, n = f"{base}#{n}", n + 1
        tensors[fqn] = obj
        return UNNAMED if by_path and fqn == base else TensorSlot(fqn)

    def bulk(obj: dict[Any, Any], prefix: str) -> dict[Any, Any] | None:
        # A dict or OrderedDict of tensors only, under str keys (a model's state dict): taken by
        # calls that loop in C; None (nothing done) for any other dict, or where a key would
        # meet one taken before (then walk names it). Its skeleton is made by fromkeys (copy.copy
        # of an OrderedDict sets item by item in Python), with the attributes copy.copy copies
        # (a state dict's _metadata).
        cls = type(obj)
        if cls is not dict and cls is not OrderedDict:
            return None
        names = list(obj)
        # an OrderedDict's values in its order: its dict's (a plain dict's iteration, without a
        # lookup per key) where that is the same order (it differs after a move_to_end)
        values = list(dict.values(obj)) if cls is dict or names == list(dict.keys(obj)) \
            else list(map(obj.__getitem__, names))
        if set(map(type, names)) != _STR or not all(map(isinstance, values, repeat(tensor_type))):
            return None
        seen = None
        if memo is not None:
            seen = memo.get(prefix)
            used.add(prefix)
        if seen is not None and seen[0] == "bulk" and seen[1] == names:  # equal strs: the same paths
            names, children = seen[1], seen[2]  # (the remembered keys: their hashes computed once)
        else:
            children = list(map(prefix.__add__, names))
            if memo is not None:
                memo[prefix] = ("bulk", names, children)
        if tensors and not tensors.keys().isdisjoint(children) \
                or SKELETON_KEY.startswith(prefix) and SKELETON_KEY in children:
            return None
        tensors.update(zip(children, values))
        out = cls.fromkeys(names, UNNAMED)
        if cls is OrderedDict:
            out.__dict__.update(obj.__dict__)
        return out

    def nested(obj: dict[Any, Any], prefix: str) -> dict[Any, Any] | None:
        # A dict (str or int keys) of dicts of tensors under str keys: an optimizer's state per
        # parameter ({0: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}, ...}), taken by calls
        # that loop in C as bulk takes a state dict (walked, 2,000 parameters of Adam cost about
        # 4 ms a save); its paths and skeleton remembered in the memo while its keys stay. None
        # (nothing done) for any other dict, or where a path would meet another one.
        inner = list(obj.values())
        if type(obj) is not dict or set(map(type, inner)) != _DICT or not set(map(type, obj)) <= _KEYS:
            return None
        values = list(chain.from_iterable(map(dict.values, inner)))
        if not all(map(isinstance, values, repeat(tensor_type))):
            return None
        outer, names = list(obj), list(map(tuple, inner))
        if not set(map(type, chain.from_iterable(names))) <= _STR:
            return None  # (checked before the memo: a str subclass equals the str it was)
        seen = memo.get(prefix) if memo is not None else None
        if memo is not None:
            used.add(prefix)
        if seen is not None and seen[0] == "nested" and seen[1] == outer and seen[2] == names:
            children, template = seen[3], seen[4]
        else:
            children = [f"{prefix}{key}.{name}" for key, keys in zip(outer, names) for name in keys]
            if len(set(children)) != len(children):
                return None  # two paths alike (1 and "1", or dotted keys): walk names them
            template = [dict.fromkeys(keys, UNNAMED) for keys in names]
            if memo is not None:
                memo[prefix] = ("nested", outer, names, children, template)
        if not tensors.keys().isdisjoint(children) or SKELETON_KEY in children:
            return None
        tensors.update(zip(children, values))
        return dict(zip(outer, map(dict.copy, template)))

    def walk(obj: Any, base: str | None, by_path: bool) -> Any:
        # base: obj's dotted path (None: the root); by_path: every dict key on the way is a str
        # or an int, whose str() unflatten recomputes as is. A tensor in a dict is taken there
        # (no call per tensor: this runs for every tensor of every save).
        if isinstance(obj, tensor_type):
            return leaf(obj, base or "", by_path)
        if isinstance(obj, _ATOMIC):
            return obj
        prefix = "" if base is None else base + "."
        if isinstance(obj, dict):
            if by_path and len(obj) >= _BULK:
                out = nested(obj, prefix) if type(next(iter(obj.values()))) is dict else bulk(obj, prefix)
                if out is not None:
                    return out
            out = copy.copy(obj)
            for key, value in obj.items():
                child, keyed = prefix + str(key), by_path and type(key) in (str, int)
                if isinstance(value, tensor_type) and child not in tensors and child != SKELETON_KEY:
                    tensors[child] = value
                    out[key] = UNNAMED if keyed else TensorSlot(child)
                else:
                    out[key] = walk(value, child, keyed)
            return out
        if type(obj) in _SEQUENCES and set(map(type, obj)) <= _ATOMS:  # e.g. a param group's parameter ids
            return obj[:]  # its items immutable, a copy of the list (a tuple is itself)
        if isinstance(obj, list):
            return [walk(v, prefix + str(i), by_path) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            items = [walk(v, prefix + str(i), by_path) for i, v in enumerate(obj)]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        return copy.deepcopy(obj)

    skeleton = walk(dict(state), None, True)
    if memo is not None and len(memo) > len(used):
        for prefix in memo.keys() - used:
            del memo[prefix]
    tensors[SKELETON_KEY] = skeleton  # (no tensor is under that key: every way in refuses it)
    return tensors


def unflatten(obj: Any, tensors: Mapping[str, torch.Tensor], path: tuple[str, ...] = ()) -> Any:
    """Replace every slot in a freshly loaded skeleton by its tensor (in place where possible);
    an unnamed slot (:data:`UNNAMED`) is the tensor saved under its path."""
    if isinstance(obj, TensorSlot):
        return tensors[obj.fqn or ".".join(path)]
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = unflatten(value, tensors, (*path, str(key)))
        return obj
    if isinstance(obj, list):
        obj[:] = [unflatten(v, tensors, (*path, str(i))) for i, v in enumerate(obj)]
        return obj
    if isinstance(obj, tuple):
        items = [unflatten(v, tensors, (*path, str(i))) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def flat_tensors(template: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors of a template under the dotted paths :func:`flatten` would give them."""
    flat = flatten(template)
    flat.pop(SKELETON_KEY)
    return flat




@dataclass(frozen=True)
class Refusal:
    """An object of a checkpoint that ``torch.load(weights_only=True)`` would refuse."""

    path: str  # where it sits, e.g. ``checkpoint['replay_buffer']``
    type_name: str  # its type, e.g. ``collections.deque``
    reason: str  # torch's message


def _reason(exc: BaseException) -> str:
    """The part of torch's weights-only message that says what was refused."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
    text = " ".join(text.split())
    return text[:300] or repr(exc)


def _type_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def weights_only_refusal(state: Mapping[str, Any]) -> Refusal | None:
    """Whether the non-tensor part of ``state`` (what :func:`flatten` pickles into the skeleton)
    would load under ``torch.load(weights_only=True)`` (with the types the user allowlisted);
    the first refused object otherwise. One pickle round trip of the skeleton: tensors are
    slots, so the cost does not grow with the model."""
    skeleton = flatten(state)[SKELETON_KEY]
    error = _weights_only_error(skeleton)
    if error is None:
        return None
    reason = _reason(error)
    return _first_refused(skeleton, ("checkpoint",), reason) or Refusal("checkpoint", "?", reason)


def _weights_only_error(obj: Any) -> pickle.UnpicklingError | None:
    """What ``torch.load(weights_only=True)`` of ``obj`` saved with ``torch.save`` raises
    (tensor slots allowed), or ``None``."""
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    try:
        with torch.serialization.safe_globals(slot_globals()):
            torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as exc:
        return exc
    return None


def _first_refused(obj: Any, path: tuple[str, ...], reason: str) -> Refusal | None:
    """The first object under ``obj`` that does not load alone under ``weights_only=True``
    (containers are searched before being blamed)."""
    if isinstance(obj, (TensorSlot, *_ATOMIC)):
        return None
    children: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        children = [(f"[{k!r}]", v) for k, v in obj.items()]
        children += [(f" key {k!r}", k) for k in obj if not isinstance(k, _ATOMIC)]
    elif isinstance(obj, (list, tuple)):
        children = [(f"[{i}]", v) for i, v in enumerate(obj)]
    for suffix, child in children:
        found = _first_refused(child, (*path, suffix), reason)
        if found is not None:
            return found
    error = _weights_only_error(obj)
    return None if error is None else Refusal("".join(path), _type_name(obj), _reason(error))
