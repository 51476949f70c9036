"""Which checkpoint an engine runs: a canonical model name and an identity of its weights.

Both go into the namespace, so KV computed with other weights is never served, and one checkpoint
named two ways (``./ckpt``, ``/models/ckpt``, a symlink) shares its blocks. A local checkpoint is
named by its resolved path; its weights identity digests ``config.json`` and the name, size and
modification time of every weight file (reading gigabytes of weights at start-up is not an option;
an in-place overwrite changes sizes or times). A hub model is named by its id; its identity is the
commit of the snapshot in the local hub cache when there is one, else the requested revision.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import xxhash

#: files whose bytes are weights (names, sizes and times are digested; contents are not read)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz", ".h5", ".msgpack")
#: small files that change what the weights compute (read whole)
CONFIG_FILES = ("config.json", "params.json")


@dataclass(frozen=True)
class ModelIdentity:
    """``name``: canonical model name; ``weights``: 16 hex digits naming the weights (or a hub revision)."""

    name: str
    weights: str


def checkpoint_digest(directory: Path) -> str:
    """Digest of a checkpoint directory: config files' bytes, and each weight file's name, size and mtime."""
    digest = xxhash.xxh3_64()
    for name in CONFIG_FILES:
        path = directory / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    weights = []
    for root, _, files in os.walk(directory, followlinks=True):
        for name in files:
            if name.endswith(WEIGHT_SUFFIXES):
                path = Path(root, name)
                stat = path.stat()  # follows links: a hub snapshot's files link into its blob store
                weights.append(f"{path.relative_to(directory).as_posix()}|{stat.st_size}|{stat.st_mtime_ns}")
    for line in sorted(weights):
        digest.update(line.encode() + b"\n")
    return digest.hexdigest()


def model_identity(model: str, revision: str | None = None) -> ModelIdentity:
    """The canonical name and weights identity of ``model`` (a local path or a hub id)."""
    path = Path(model).expanduser()
    if path.is_dir():
        resolved = path.resolve()
        return ModelIdentity(str(resolved), checkpoint_digest(resolved))
    snapshot = _hub_snapshot(model, revision)
    if snapshot is not None:
        return ModelIdentity(model, f"{snapshot.name[:12]}-{checkpoint_digest(snapshot)}")
    return ModelIdentity(model, f"rev-{revision or 'main'}")


def _hub_snapshot(model: str, revision: str | None) -> Path | None:
    """The local hub-cache snapshot directory of ``model`` at ``revision``, if it is cached."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for name in CONFIG_FILES:
        try:
            found = try_to_load_from_cache(model, name, revision=revision)
        except Exception:  # not a valid repo id: no snapshot to name
            return None
        if isinstance(found, str):
            return Path(found).parent
    return None
