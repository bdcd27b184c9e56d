"""What every config section shares: built from a plain dict with one-line errors, and field checks.

A section is a frozen dataclass whose field names are the names users type (`--config.dapo.eps_high`);
each field carries its default and a one-line doc. `Section.check` refuses the values that cannot
work on their own; checks that read two sections live in `dapo_jax.builders.checks`.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, ClassVar, Mapping

from dapo_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Section:
  """Base of the config sections. `NAME` is the dotted path users type before a field."""
  NAME: ClassVar[str] = ""

  def check(self) -> None:
    """Raises ConfigError for a field value that cannot work, naming it (overridden per section)."""

  @classmethod
  def from_dict(cls, values: Mapping[str, Any], name: str = ""):
    """The section of `values` (field -> value): unknown names and nested sections
    are refused or built here, tuples restored from lists; the section's `check` runs last."""
    name = name or cls.NAME
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in values if k not in fields]
    if unknown:
      close = difflib.get_close_matches(unknown[0], fields, n=1)
      hint = f"; did you mean {name}.{close[0]}?" if close else f"; known: {', '.join(sorted(fields))}"
      raise ConfigError(f"{name}.{unknown[0]} is not a setting{hint}")
    kw = {}
    for key, value in values.items():
      default = _default(fields[key])
      if isinstance(default, Section):
        value = value if isinstance(value, Section) else type(default).from_dict(value, f"{name}.{key}")
      elif isinstance(default, tuple) and isinstance(value, (list, tuple)):
        value = tuple(value)
      kw[key] = value
    try:
      section = cls(**kw)
      section.check()
    except ConfigError:
      raise
    except (ValueError, TypeError) as e:  # A library class's own check of the values (ModelConfig, LoraConfig).
      raise ConfigError(f"{name}: {e}") from None
    return section

  def to_dict(self) -> dict:
    """The section as plain values (nested sections as dicts, tuples kept)."""
    return {f.name: (v.to_dict() if isinstance(v := getattr(self, f.name), Section) else v)
            for f in dataclasses.fields(self)}

  # Field checks, each naming `NAME.field` in its error.

  def number(self, field: str, lo=None, hi=None, *, lo_open=False, hi_open=False, integer=False, allowed=""):
    """The value of `field`, checked to be a number (an integer) in the given range."""
    return number(f"{self.NAME}.{field}", getattr(self, field), lo, hi, lo_open=lo_open, hi_open=hi_open,
                  integer=integer, allowed=allowed)

  def choice(self, field: str, options, allowed: str = ""):
    """The value of `field`, checked to be one of `options`."""
    value = getattr(self, field)
    check(value in options, f"{self.NAME}.{field}", value, allowed or f"one of {tuple(options)}")
    return value


def _default(field: dataclasses.Field):
  if field.default is not dataclasses.MISSING:
    return field.default
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return None


def check(ok, field: str, value, allowed: str) -> None:
  """Raises ConfigError "field=value: expected allowed" unless `ok`."""
  if not ok:
    raise ConfigError(f"{field}={value!r}: expected {allowed}")


def number(field: str, value, lo=None, hi=None, *, lo_open=False, hi_open=False, integer=False, allowed=""):
  """`value` of the dotted `field`, checked to be a number (an integer) in the given range."""
  kind = "an integer" if integer else "a number"
  if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or value != value:
    raise ConfigError(f"{field}={value!r}: expected {kind}{' ' + allowed if allowed else ''}")
  bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
  bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
  if bad_lo or bad_hi:
    if not allowed:
      parts = []
      if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo}")
      if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi}")
      allowed = " and ".join(parts)
    raise ConfigError(f"{field}={value!r}: expected {allowed}")
  return value


def pick(cls, *sections: Section, **given):
  """An instance of the library dataclass `cls`, each field taken from `given`, else from the one section
  of `sections` that has a field of its name, else `cls`'s default. A name two sections hold with two
  values must be given: which one `cls` means is the caller's to say."""
  names = {f.name for f in dataclasses.fields(cls) if f.init}
  unknown = set(given) - names
  if unknown:
    raise TypeError(f"{cls.__name__} has no field {sorted(unknown)[0]!r}")
  kw = dict(given)
  for name in names - set(given):
    found = {s.NAME: getattr(s, name) for s in sections if name in {f.name for f in dataclasses.fields(s)}}
    if len(set(map(repr, found.values()))) > 1:
      raise TypeError(f"{cls.__name__}.{name}: {' and '.join(f'{k}.{name}' for k in found)} differ; pass it")
    if found:
      kw[name] = next(iter(found.values()))
  return cls(**kw)
