"""Flatten a nested training state into tensor and object leaves, and put values back.

Rules (FORMAT.md, "Keys"):
* The root is a mapping; its top-level keys are always entries.
* A dict, list or tuple that contains a tensor somewhere below is traversed when its
  keys are ``str`` or ``int``. Any other container is one object leaf: one with no
  tensor below it (optimizer ``param_groups``, a scheduler's state), and a dict with
  other keys (its tensors are then stored inline in the object encoding).
* Every tensor is a leaf. Everything else is an object leaf.
* A leaf's FQN joins its keys with "."; its key path keeps the keys' types and the
  containers' kinds, so a state can be rebuilt without a template.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import json
import sys
from collections.abc import Container, Iterable, Iterator, Mapping
from itertools import repeat
from typing import Any, NamedTuple

import torch

from bcp.errors import FormatError, UnsupportedStateError, listed
from bcp.shards import RankValues, is_tensor_like

#: ("d", key) dict entry, ("l", i) list item, ("t", i) tuple item
PathElem = tuple[str, str | int]
KeyPath = tuple[PathElem, ...]


def fqn_of(path: KeyPath) -> str:
    return ".".join(str(k) for _kind, k in path)


def path_to_json(path: KeyPath) -> list:
    return [[kind, key] for kind, key in path]


def path_from_json(doc: Any, *, fqn: str, where: str | None = None) -> KeyPath:
    """A stored key path, checked (FORMAT.md, "Keys"): a non-empty list of ``[kind, key]``
    pairs whose keys joined by ``.`` are ``fqn``; FormatError naming ``fqn`` (and
    ``where``, the file it came from) otherwise, since any other path would put the
    value somewhere else in the rebuilt state."""
    ok = type(doc) is list and len(doc) > 0
    for elem in doc if ok else ():
        ok = (
            type(elem) is list
            and len(elem) == 2
            and elem[0] in ("d", "l", "t")
            and (type(elem[1]) is int or (elem[0] == "d" and type(elem[1]) is str))
            and (elem[0] == "d" or (isinstance(elem[1], int) and elem[1] >= 0))
        )
        if not ok:
            break
    path: KeyPath = tuple((kind, key) for kind, key in doc) if ok else ()
    if not ok or fqn_of(path) != fqn:
        text = repr(doc)
        text = text if len(text) <= 120 else text[:117] + "..."
        raise FormatError(f"{where + ': ' if where else ''}malformed key path for {fqn!r}: {text}")
    return path


def a_dot_prefix_is_a_key(keys: set[str]) -> bool:
    """Whether the part of some key before one of its dots is itself a key (``a`` beside
    ``a.b``): the parents of every key, a level at a time, each level a set tested in C
    (parents repeat, so each level up is smaller), not every dot of every key in turn."""
    level = {k.rpartition(".")[0] for k in keys if "." in k}
    seen: set[str] = set()
    while level:
        if not level.isdisjoint(keys):
            return True
        seen |= level
        level = {p.rpartition(".")[0] for p in level if "." in p} - seen
    return False


#: one encoder for every key path: json.dumps with options builds a new one per call
#: (a third of the cost, paid once per tensor of every save)
_PATH_ENCODER = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))


@functools.lru_cache(maxsize=1 << 16)
def path_to_str(path: KeyPath) -> str:
    """A key path as stored (compact JSON); remembered, since the same state is saved
    again and again (keys are str or int, never bool, so equal paths encode equally)."""
    return _PATH_ENCODER.encode(path_to_json(path))


class Leaf(NamedTuple):
    """One leaf of a flattened state: a tuple, so that a dict of plain tensors has its
    leaves made by C loops (:func:`_walk_str_keys`, no Python call a tensor: flattening
    runs for every tensor of every save and load); nothing changes a leaf once made."""

    fqn: str
    path: KeyPath
    value: Any

    @property
    def is_tensor(self) -> bool:
        return is_tensor_like(self.value)


def _contains_tensor(value: Any) -> bool:
    """True also for a Stateful object: the container holding it is traversed, so
    that the object is expanded into its state_dict() where it stands."""
    if type(value) in _SEQUENCES and set(map(type, value)) <= _SCALARS:
        return False  # e.g. a param group's 10,000 parameter ids: one C pass, not a call each
    if is_tensor_like(value) or is_stateful(value):
        return True
    if isinstance(value, Mapping):
        return any(_contains_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_contains_tensor(v) for v in value)
    return False


#: containers of exactly these types holding only exactly these hold no tensor and nothing Stateful
_SEQUENCES = (list, tuple)
_SCALARS = {int, float, str, bool, bytes, type(None)}


def flatten_state(state: Mapping) -> dict[str, Leaf]:
    """FQN -> leaf for every tensor and object leaf of ``state``, in traversal order."""
    if not isinstance(state, Mapping):
        raise UnsupportedStateError(
            f"the state must be a mapping (a dict of named entries), got {type(state).__name__}"
        )
    leaves: dict[str, Leaf] = {}
    _walk_children(state, (), leaves, "")
    return leaves


def _plain_key(key: Any) -> bool:
    return isinstance(key, (str, int)) and not isinstance(key, bool)


#: Leaves with nothing to expand or refuse, taken at once (exact types: a subclass may be
#: anything, a legacy ShardedTensor among them): flattening runs for every tensor of every save.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _walk_children(container: Any, path: KeyPath, leaves: dict[str, Leaf], fqn: str) -> None:
    """``fqn``: the container's own (``fqn_of(path)``), its children's prefix."""
    if type(container) in _PLAIN_DICTS and set(map(type, container)) in _ONE_KEY_TYPE:
        _walk_str_keys(container, path, leaves, fqn)
    elif isinstance(container, Mapping):
        seen: dict[str, Any] = {}
        for key, value in container.items():
            if type(key) is not str and not _plain_key(key):
                raise UnsupportedStateError(
                    f"key {key!r} at the top of the state is a {type(key).__name__}; top-level keys must be str or int"
                )
            if str(key) in seen:
                raise UnsupportedStateError(
                    f"keys {seen[str(key)]!r} and {key!r} under {fqn_of(path) or '<root>'!r} "
                    f"both flatten to {str(key)!r}"
                )
            seen[str(key)] = key
            _walk(value, (*path, ("d", key)), leaves, f"{fqn}.{key!s}" if path else str(key))
    else:
        kind = "t" if isinstance(container, tuple) else "l"
        for i, value in enumerate(container):
            _walk(value, (*path, (kind, i)), leaves, f"{fqn}.{i!s}" if path else str(i))


_STR_ONLY = {str}
#: ``tuple.__new__``: a :class:`Leaf` from a (fqn, path, value) tuple, in C
_NEW = tuple.__new__
#: dicts walked by ``_walk_str_keys``: exact types (a subclass may be anything, RankValues
#: among them), keys all ``str`` or all ``int`` (no two of which flatten to one name)
_PLAIN_DICTS = (dict, collections.OrderedDict)
_ONE_KEY_TYPE = ({str}, {int})
_PLAIN_SET = frozenset(_PLAIN_TENSORS)


def _walk_str_keys(container: dict[Any, Any], path: KeyPath, leaves: dict[str, Leaf], fqn: str) -> None:
    """A dict whose keys are all ``str`` (the usual state; or all ``int``, an optimizer's
    state): no two of its keys flatten to the same name, and a plain tensor is taken
    here (``_walk``'s first case, inline: this loop runs for every tensor of every save).
    The children's names and key paths are those of the last dict of these keys at this
    place (:func:`_children`)."""
    plain = _leaf_tensor_types()
    _keys, names, paths = _children(container, path, fqn)
    values = container.values()
    if set(map(type, values)) <= plain and leaves.keys().isdisjoint(names):
        # every value a plain tensor, no name taken yet: the leaves made and stored by C loops
        leaves.update(zip(names, map(_NEW, repeat(Leaf), zip(names, paths, values, strict=True)), strict=True))
        return
    for child, child_path, value in zip(names, paths, values, strict=True):
        if type(value) in plain and child not in leaves:
            leaves[child] = Leaf(child, child_path, value)
        else:
            _walk(value, child_path, leaves, child)


def _leaf_tensor_types() -> frozenset[type]:
    """The tensor types a str-keyed dict's values are taken as leaves by: plain tensors and,
    once its module is imported, DTensor (an FSDP2 state: ``_walk`` would find each one a
    leaf after five checks, 5 us a tensor). No import just to ask (see ``shards.is_dtensor``)."""
    module = sys.modules.get("torch.distributed.tensor")
    return _PLAIN_SET if module is None else _with_dtensor(module.DTensor)


@functools.cache
def _with_dtensor(dtensor: type) -> frozenset[type]:
    """The leaf types with DTensor: made once, not at every dict of every save."""
    return _PLAIN_SET | {dtensor}


#: (path, fqn, key count, first and last key) -> (keys, children's names, children's key paths)
#: of the str-keyed dicts flattened lately: the same state is flattened at every save, and
#: its keys compared as one list (at C speed) cost less than a name and a path made per key
#: (the same path objects each time also compare as themselves in ``bcp.kept_plans``)
_CHILDREN: dict[tuple, tuple[list[Any], list[str], list[KeyPath]]] = {}
#: at most this many keys' names and paths kept (some tens of MB at most), and how many are
#: (counted as kept, without a lock: only the bound depends on it)
_CHILDREN_KEYS = 1 << 18
_children_held = 0


def _children(container: dict[Any, Any], path: KeyPath, fqn: str) -> tuple[list[Any], list[str], list[KeyPath]]:
    """(keys, children's fqns, children's key paths) of a str- or int-keyed dict at ``path``."""
    keys = list(container)
    at = (path, fqn, len(keys), keys[0] if keys else None, keys[-1] if keys else None)
    kept = _CHILDREN.get(at)
    if kept is None or kept[0] != keys:
        names = [f"{fqn}.{key}" for key in keys] if path else [f"{key}" for key in keys]
        kept = (keys, names, [(*path, ("d", key)) for key in keys])
        global _children_held
        if _children_held + len(keys) > _CHILDREN_KEYS:
            _CHILDREN.clear()
            _children_held = 0
        if len(keys) <= _CHILDREN_KEYS:
            _CHILDREN[at] = kept
            _children_held += len(keys)
    return kept


#: set while bcp takes a Stateful's state_dict() to save it (flatten_state), unset while
#: it takes one as a load's template (detach_stateful) or anyone else calls it
_TAKEN_FOR_SAVE: contextvars.ContextVar[bool] = contextvars.ContextVar("bcp_taken_for_save", default=False)


@contextlib.contextmanager
def taking_for_save() -> Iterator[None]:
    """Within it, :func:`taken_for_save` is True: the state_dict() calls are for a save."""
    token = _TAKEN_FOR_SAVE.set(True)
    try:
        yield
    finally:
        _TAKEN_FOR_SAVE.reset(token)


def taken_for_save() -> bool:
    """Whether a ``state_dict()`` being called now is bcp saving it. A Stateful may record
    in what it saves what a template must not hold (``bcp.TrainingState`` marks an
    optimizer saved before its first step; the same mark in a template would be a key
    that a strict DCP load finds missing from a checkpoint of a stepped optimizer)."""
    return _TAKEN_FOR_SAVE.get()


def is_stateful(value: Any) -> bool:
    """An object saved through its ``state_dict()`` and loaded through its
    ``load_state_dict()`` (DCP's ``Stateful``: modules, optimizers, schedulers,
    ``StatefulDataLoader``, :class:`bcp.TrainingState`). Tensors, containers and
    classes themselves are not."""
    if isinstance(value, (torch.Tensor, Mapping, list, tuple, type)):
        return False
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _refuse_sharded_tensor(value: Any, path: KeyPath) -> None:
    """A legacy ShardedTensor (FSDP1's SHARDED_STATE_DICT) would fail deep inside
    torch; say what to use instead. Matched by name: its class lives in a private
    torch module (torch.distributed._shard), which bcp does not import."""
    cls = type(value)
    if cls.__name__ == "ShardedTensor" and cls.__module__.startswith("torch.distributed"):
        raise UnsupportedStateError(
            f"key {fqn_of(path)!r} is a legacy ShardedTensor (FSDP1's sharded state dict), which bcp does not "
            "store: use DTensor (FSDP2's fully_shard, or get_state_dict from torch.distributed.checkpoint.state_dict "
            "on an FSDP2 model), or wrap each local shard in bcp.TensorShard"
        )


def _refuse_rank_values(value: Any, path: KeyPath) -> None:
    """Every rank's values, read back without a template, are not one rank's state:
    saved as a dict they would come back as one where a per-rank object was."""
    if isinstance(value, RankValues):
        raise UnsupportedStateError(
            f"key {fqn_of(path)!r} holds a bcp.RankValues (the value every saved rank had of a per-rank object, "
            f"ranks {sorted(value)}, as bcp.open(...).state() reads it): save each rank's own value from that "
            "rank, wrapped in bcp.PerRank, or pick one (value[rank])"
        )


def _walk(value: Any, path: KeyPath, leaves: dict[str, Leaf], fqn: str) -> None:
    """``fqn``: ``fqn_of(path)``, built key by key on the way down."""
    if type(value) in _PLAIN_TENSORS and fqn not in leaves:
        leaves[fqn] = Leaf(fqn, path, value)
        return
    # a plain dict: nothing to refuse or expand, as below without the checks (a plain tensor value found at C speed)
    plain_dict = type(value) in _PLAIN_DICTS and set(map(type, value)) in _ONE_KEY_TYPE
    if plain_dict and (not _PLAIN_SET.isdisjoint(map(type, value.values())) or _contains_tensor(value)):
        _walk_str_keys(value, path, leaves, fqn)
        return
    _refuse_sharded_tensor(value, path)
    _refuse_rank_values(value, path)
    if is_stateful(value):  # saved as what its state_dict() returns, as DCP does
        with taking_for_save():
            value = value.state_dict()
    traversable = isinstance(value, (list, tuple)) and not isinstance(value, torch.Size)
    traversable |= isinstance(value, Mapping) and all(_plain_key(k) for k in value)
    if traversable and _contains_tensor(value):
        _walk_children(value, path, leaves, fqn)
        return
    if fqn in leaves:
        raise UnsupportedStateError(
            f"two entries flatten to the same key {fqn!r}: {path_to_str(leaves[fqn].path)} and {path_to_str(path)} "
            "(a '.' inside a key collides with nesting; rename one)"
        )
    leaves[fqn] = Leaf(fqn, path, value)


def get_at(root: Any, path: KeyPath) -> Any:
    """The value at ``path`` inside ``root``."""
    for _kind, key in path:
        root = root[key]
    return root


def detach_stateful(state: Mapping) -> tuple[Mapping, list[tuple[KeyPath, Any]]]:
    """``state`` with every Stateful object replaced by its ``state_dict()`` (the
    template a load fills), and the (path, object) pairs replaced. Containers on the
    way to one are copied, so the caller's state keeps its objects if the load fails;
    a state without any is returned as it is. A Stateful inside another's state_dict
    is expanded too, as the save did, but not listed: the outer one's load_state_dict
    receives what was loaded for it."""
    found: list[tuple[KeyPath, Any]] = []
    detached = _detach(state, (), found)
    return (detached if found else state), found


def _detach(value: Any, path: KeyPath, found: list[tuple[KeyPath, Any]] | None) -> Any:
    """``found`` is None below a Stateful: nested ones are expanded, not listed."""
    if is_stateful(value):
        if found is not None:
            found.append((path, value))
        return _detach(value.state_dict(), path, None)
    if type(value) is dict and set(map(type, value)) <= _STR_ONLY and set(map(type, value.values())) <= _PLAIN_SET:
        return value  # str keys and plain tensors only (the usual state): nothing to detach, no call a key
    if isinstance(value, Mapping) and all(_plain_key(k) for k in value):
        # a plain tensor leaf is kept as it is without a call or a path (10,000 of them per load)
        plain = _PLAIN_TENSORS
        items = {k: v if type(v) in plain else _detach(v, (*path, ("d", k)), found) for k, v in value.items()}
        if all(items[k] is v for k, v in value.items()):
            return value
        return collections.OrderedDict(items) if isinstance(value, collections.OrderedDict) else items
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        kind = "t" if isinstance(value, tuple) else "l"
        new = [_detach(v, (*path, (kind, i)), found) for i, v in enumerate(value)]
        if all(a is b for a, b in zip(new, value, strict=True)):
            return value
        return _rebuilt_tuple(value, new) if isinstance(value, tuple) else new
    return value


def _rebuilt_tuple(like: tuple, items: list) -> tuple:
    """A tuple of ``like``'s type holding ``items`` (a namedtuple through ``_make``)."""
    make = getattr(type(like), "_make", None)
    return make(items) if make is not None else type(like)(items)


def replace_at(root: Any, path: KeyPath, value: Any) -> Any:
    """Put ``value`` at ``path`` inside ``root``; dicts and lists change in place,
    tuples are rebuilt. Returns the (possibly new) root."""
    if not path:
        return value
    (_kind, key), rest = path[0], path[1:]
    if isinstance(root, tuple):
        assert isinstance(key, int), f"tuple step {key!r} of a key path"
        items = list(root)
        items[key] = replace_at(items[key], rest, value)
        return _rebuilt_tuple(root, items)
    root[key] = replace_at(root[key], rest, value)
    return root


def build_nested(entries: Iterable[tuple[KeyPath, Any]]) -> dict:
    """Rebuild a nested state from (key path, value) pairs, without a template.
    FormatError, naming the container, where two paths disagree on its kind (a list
    item of one, a dict key of another) or a list's items are not 0, 1, 2, ..."""
    tree: dict = {}
    kinds: dict[int, tuple[str, KeyPath]] = {}  # a container's kind, and its path (for errors)
    for path, value in entries:
        node = tree
        for i, (kind, key) in enumerate(path):
            first = kinds.setdefault(id(node), (kind, path[:i]))[0]
            if first != kind:
                raise FormatError(
                    f"key paths disagree on the container at {fqn_of(path[:i]) or 'the top'!r}: "
                    f"{_KIND_NAMES.get(first, first)} in one, {_KIND_NAMES.get(kind, kind)} in "
                    f"{fqn_of(path)!r}"
                )
            if i == len(path) - 1:
                node[key] = value
            else:
                node = node.setdefault(key, {})
    return _materialize(tree, kinds, root=True)


_KIND_NAMES = {"d": "a dict", "l": "a list", "t": "a tuple"}


def _materialize(node: Any, kinds: dict[int, tuple[str, KeyPath]], root: bool = False) -> Any:
    if not isinstance(node, dict) or (id(node) not in kinds and not root):
        return node
    kind, path = kinds.get(id(node), ("d", ()))
    items = {k: _materialize(v, kinds) for k, v in node.items()}
    if kind == "d":
        return items
    ordered = [items[i] for i in sorted(items)]
    if sorted(items) != list(range(len(items))):
        indices = listed([str(i) for i in sorted(items)])
        raise FormatError(
            f"{fqn_of(path) or 'the top'!r}: list entries with indices {indices} are not contiguous from 0"
        )
    return ordered if kind == "l" else tuple(ordered)


def clashing_keys(tensors: Mapping[str, Any], objects: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first (inner, outer) pair of entries that have no place of their own in the
    rebuilt state, or None: a tensor with an object's key (inner == outer), or an entry
    whose key path lies inside another's (a tensor ``a.b`` under an object ``a``, which
    ranks saving ``{"a": {"b": t}}`` and ``{"a": {}}`` make). ``tensors``, ``objects``:
    fqn -> key path (``[[kind, key], ...]``, or that as JSON text). What
    ``CheckpointReader.check_keys`` refuses, found before a save writes anything."""
    both = next((fqn for fqn in tensors if fqn in objects), None)
    if both is not None:
        return both, both
    paths = {**objects, **tensors}
    if not a_dot_prefix_is_a_key(set(paths)):
        return None  # no key's part before a dot is a key (the usual state): none is parsed

    def keys(path: Any) -> list:
        return [key for _kind, key in (json.loads(path) if isinstance(path, str) else path)]

    for fqn in paths:
        start = 0
        while (dot := fqn.find(".", start)) != -1:
            start, outer = dot + 1, fqn[:dot]
            if outer in paths and keys(paths[fqn])[: len(keys(paths[outer]))] == keys(paths[outer]):
                return fqn, outer
    return None


def fit_templates(
    state: Mapping, stateful: list[tuple[KeyPath, Any]], tensors: Container[str], objects: Container[str]
) -> Mapping:
    """``state`` (a load's template, :func:`detach_stateful`'s) with each Stateful
    object's part fitted to the checkpoint holding ``tensors`` and ``objects`` (FQNs),
    where the object says how (``fit_template(template, stored)``, ``stored(key)``:
    whether the checkpoint holds the key below it): a ``bcp.TrainingState`` with a fresh
    optimizer, whose template has state for parameters the checkpoint holds none for."""
    for path, obj in stateful:
        fit = getattr(obj, "fit_template", None)
        if fit is not None:
            prefix = fqn_of(path) + "." if path else ""
            stored = lambda key, p=prefix: p + key in tensors or p + key in objects  # noqa: E731
            state = replace_at(state, path, fit(get_at(state, path), stored))
    return state
