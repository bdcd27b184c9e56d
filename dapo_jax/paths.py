"""Files a directory's metadata names (a sharded index's shards, a tokenizer's `*_file` fields, a
PEFT adapter's files): whether each stays inside the directory. Loaders refuse one that does not,
naming the file and the path, so a downloaded directory cannot make us read elsewhere."""
from __future__ import annotations

import os


def outside(directory: str, name: str) -> str | None:
  """Why `name` (a file a directory's metadata names) points outside `directory`, or None if it does not.

  Refused: an absolute path, a path through '..', and a symlink that resolves outside the directory.
  The Hugging Face cache's layout is inside its repository: snapshots/REV/FILE links to ../../blobs/HASH.
  """
  if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
    return f"{name!r} is a path outside {directory}"
  path = os.path.join(directory, name)
  if not os.path.islink(path):
    return None
  real, root = os.path.realpath(path), os.path.realpath(directory)
  allowed = [root]
  if os.path.basename(os.path.dirname(os.path.abspath(directory))) == "snapshots":
    allowed.append(os.path.realpath(os.path.join(directory, "..", "..", "blobs")))
  if any(os.path.commonpath([real, a]) == a for a in allowed):
    return None
  return f"{name!r} is a symlink to {real}, outside {directory}"
