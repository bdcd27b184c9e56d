"""Plain data over a pipe: one JSON line per message, whose values come back with their exact types.

    line = dumps(encode((1, 2.0, {"a": [True, None]})))
    decode(loads(line)) == (1, 2.0, {"a": [True, None]})    # tuple, int, float, dict, list, bool, None

JSON itself keeps None, bool, int (any size), float (nan and the infinities too), str and list apart;
tuple, dict (any plain keys), set, frozenset, bytes and complex travel as one-key tagged objects
({"tuple": [...]}). `decode` builds nothing but these types, so no value it returns runs code of the
sender's: an object whose `__eq__` is always True cannot cross, and comparing what arrives is honest.

Standard library only: `rewards.code` runs this file's text inside its sandboxes too.
"""
import json


def encode(value):
  """A JSON-able form of a plain value; subclasses of the plain types and numpy values become their
  plain equivalents; anything else is a TypeError naming its type."""
  kind = type(value)
  if value is None or kind in (bool, int, float, str):
    return value
  if kind is list:
    return [encode(v) for v in value]
  if kind is tuple:
    return {"tuple": [encode(v) for v in value]}
  if kind is dict:
    return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
  if kind in (set, frozenset):
    return {kind.__name__: [encode(v) for v in value]}
  if kind is bytes:
    return {"bytes": value.hex()}
  if kind is complex:
    return {"complex": [value.real, value.imag]}
  for base, plain in ((int, int.__int__), (float, float.__float__), (str, str.__str__)):
    if isinstance(value, base):  # The base type's own conversion, not one the subclass overrides.
      return plain(value)
  for base in (list, tuple, dict, set, frozenset, bytes, complex):
    if isinstance(value, base):
      return encode(base(value))
  if type(value).__module__.split(".")[0] == "numpy" and hasattr(value, "tolist"):
    return encode(value.tolist())
  raise TypeError(f"a {kind.__module__}.{kind.__qualname__} is not plain data (None, bool, int, float, str, "
                  "bytes, complex, or lists, tuples, dicts and sets of them)")


def decode(data):
  """The value `encode` gave `data` for, built from plain types only; ValueError if it is not one."""
  kind = type(data)
  if data is None or kind in (bool, int, float, str):
    return data
  if kind is list:
    return [decode(v) for v in data]
  if kind is dict and len(data) == 1:
    (tag, items), = data.items()
    if tag == "bytes" and type(items) is str:
      return bytes.fromhex(items)
    if tag == "complex" and type(items) is list and len(items) == 2 and all(type(x) is float for x in items):
      return complex(*items)
    if type(items) is list:
      if tag == "tuple":
        return tuple(decode(v) for v in items)
      if tag in ("set", "frozenset"):
        return (set if tag == "set" else frozenset)(decode(v) for v in items)
      if tag == "dict" and all(type(kv) is list and len(kv) == 2 for kv in items):
        return {decode(k): decode(v) for k, v in items}
  raise ValueError(f"not plain data: {json.dumps(data)[:200]}")


def dumps(message) -> str:
  """One line of JSON (strings' newlines are escaped)."""
  return json.dumps(message, separators=(",", ":"))


def loads(line: str):
  return json.loads(line)
