"""Plain values as bytes without pickle: tagged JSON.

Anything received from another peer is untrusted input, so state values travel as JSON with
tags for the types JSON lacks (tuples, bytes, dicts with non-string keys). Decoding builds
only those plain types; a type the codec does not know is refused when encoding, with a
message that says how to send it instead (a state handler).
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["copy_plain", "decode_values", "encode_values"]

_TAG_TUPLE, _TAG_BYTES, _TAG_DICT = "t", "b", "d"
_PLAIN_TYPES = "None, bool, int, float, str, bytes, and lists/tuples/dicts of those"


class _Unsendable(Exception):
    """A value ``_encode`` cannot send (its path is found afterwards, see ``_unsendable``)."""


def _encode(value: Any) -> Any:
    """One value to a JSON-able tree. Containers become tagged objects so that tuples, bytes
    and non-string dict keys survive; JSON objects only ever appear as tags. Raises
    ``_Unsendable`` on a type it cannot send. (No path is built on the way down: a sync
    encodes every optimizer entry, and naming each one cost more than encoding it.)"""
    kind = type(value)
    # Exact builtins first, by identity: a sync encodes thousands of optimizer entries, and
    # the isinstance chain below (numpy's types, subclasses such as enums) cost most of it.
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    if kind is list:
        return [_encode(v) for v in value]
    if kind is dict:
        return {_TAG_DICT: [[_encode(k), _encode(v)] for k, v in value.items()]}
    if kind is tuple:
        return {_TAG_TUPLE: [_encode(v) for v in value]}
    if isinstance(value, str):
        return str.__str__(value)  # the characters, also for str enums
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, bytes):
        return {_TAG_BYTES: base64.b64encode(value).decode("ascii")}
    raise _Unsendable


def _unsendable(value: Any, path: str) -> tuple[str, Any] | None:
    """The path and value of the first part of ``value`` that ``_encode`` refuses, in the
    order ``_encode`` visits them, or None."""
    if type(value) in (list, tuple):
        parts = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif type(value) is dict:
        parts = [p for k, v in value.items() for p in ((f"{path} key", k), (f"{path}[{k!r}]", v))]
    else:
        try:
            _encode(value)
        except _Unsendable:
            return path, value
        return None
    for sub_path, sub in parts:
        found = _unsendable(sub, sub_path)
        if found is not None:
            return found
    return None


def _refusal(value: Any, path: str) -> TypeError:
    path, value = _unsendable(value, path) or (path, value)
    return TypeError(
        f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which sync() cannot "
        f"send without pickle. Keep plain values ({_PLAIN_TYPES}) in the state, or register a "
        f"handler for this type with peer_elastic.register_handler(type, factory) and "
        f"pass the object to TorchState."
    )


def _decode(obj: Any) -> Any:
    """Inverse of ``_encode``; raises ValueError on anything ``_encode`` cannot produce."""
    kind = type(obj)  # json builds only exact builtins: no subclass to look for
    if kind is str or kind is int or kind is float or kind is bool or obj is None:
        return obj
    if kind is list:
        return [_decode(v) for v in obj]
    if kind is dict and len(obj) == 1:
        ((tag, payload),) = obj.items()
        if tag == _TAG_TUPLE and isinstance(payload, list):
            return tuple(_decode(v) for v in payload)
        if tag == _TAG_BYTES and isinstance(payload, str):
            return base64.b64decode(payload, validate=True)
        if tag == _TAG_DICT and isinstance(payload, list):
            try:
                return {_decode(k): _decode(v) for k, v in payload}
            except (TypeError, ValueError) as exc:
                raise ValueError(f"malformed dict in state payload: {exc}") from None
    raise ValueError(f"malformed state payload: unexpected {type(obj).__name__}")


def encode_values(values: Mapping[str, Any], where: str = "state") -> bytes:
    """Encode named plain values to bytes (UTF-8 JSON). TypeError names the offending path."""
    tree = {}
    for name, value in values.items():
        try:
            tree[name] = _encode(value)
        except _Unsendable:
            raise _refusal(value, f"{where}.{name}") from None
    return json.dumps(tree, separators=(",", ":"), allow_nan=True).encode("utf-8")


def decode_values(data: bytes) -> dict[str, Any]:
    """Decode ``encode_values`` output (safe on untrusted bytes: JSON only)."""
    tree = json.loads(data.decode("utf-8"))
    if not isinstance(tree, dict):
        raise ValueError("malformed state payload: top level is not an object")
    return {str(name): _decode(value) for name, value in tree.items()}


def copy_plain(value: Any) -> Any:
    """Snapshot of a plain value: containers deep (they are small), anything else shallow."""
    if isinstance(value, (list, tuple, dict, set)):
        return copy.deepcopy(value)
    return copy.copy(value)
