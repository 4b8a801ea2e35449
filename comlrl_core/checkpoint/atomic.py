"""Atomic directory publishing with a checksum manifest.

A checkpoint or export is built in a hidden staging directory next to its final name and renamed
into place only once every file, and the manifest describing them, is on disk. A reader therefore
sees either the previous complete directory or the new complete one, never a half-written one, and
:func:`verify_dir` can prove a directory is complete and intact before anything trusts it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1

_CHUNK = 1 << 20
# ".NAME.staging-HOST-PID-TOKEN": who wrote a leftover, so a later run can tell a dead writer's from a
# live one's (names without HOST-PID come from earlier versions).
_TEMP_NAME = re.compile(r"\..+\.(staging|old)-(?:(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-)?[0-9a-f]+")
STALE_AFTER_SECONDS = 24 * 3600  # a leftover of another host (or of unknown writer) untouched this long


class CheckpointError(ValueError):
    """A checkpoint or export that is corrupt, incomplete or incompatible; the message names the file."""


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks so large weight files never sit in memory whole."""
    with open(path, "rb") as f:
        return _hash(f)


def is_staging_name(name: str) -> bool:
    """Whether ``name`` is a leftover of :func:`publish_dir` (``.X.staging-*`` or ``.X.old-*``).

    Code that lists checkpoints skips these: they are unfinished or about to be deleted.
    """
    return _TEMP_NAME.fullmatch(name) is not None


def process_tag() -> str:
    """This process as ``HOST-PID`` (the host name reduced to letters, digits and ``_``)."""
    return "".join(c if c.isalnum() else "_" for c in socket.gethostname()) + f"-{os.getpid()}"


def process_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        pass
    return True


def temp_sibling(target: Path, kind: str) -> Path:
    """A hidden sibling of ``target`` to stage (``kind="staging"``) or delete (``"old"``) it in."""
    return target.parent / f".{target.name}.{kind}-{process_tag()}-{secrets.token_hex(8)}"


def remove_stale_temps(root: str | Path) -> list[Path]:
    """Remove the staging and being-deleted directories that killed writers left under ``root``:
    those of a process of this host that no longer runs, and any untouched for ``STALE_AFTER_SECONDS``
    (another host's, whose liveness cannot be checked). A live writer's are never touched."""
    host = process_tag().rsplit("-", 1)[0]
    removed = []
    for dirpath, dirnames, _ in os.walk(root):
        for name in sorted(dirnames):
            match = _TEMP_NAME.fullmatch(name)
            if match is None:
                continue
            dirnames.remove(name)  # never walk into one
            path = Path(dirpath) / name
            dead = match["host"] == host and not process_alive(int(match["pid"]))
            if dead or time.time() - _newest_mtime(path) > STALE_AFTER_SECONDS:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _newest_mtime(root: Path) -> float:
    newest = root.lstat().st_mtime
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                newest = max(newest, (Path(dirpath) / name).lstat().st_mtime)
            except FileNotFoundError:
                pass
    return newest


def publish_dir(target: str | Path, write: Callable[[Path], None], *, extra: dict | None = None,
                known: dict | None = None) -> dict:
    """Build a directory with ``write(staging)`` and publish it atomically as ``target``.

    Staging lives in ``target``'s parent so the final rename never crosses a filesystem. The
    manifest is written last, so a directory with a manifest was completely written. An existing
    ``target`` stays in place until the new one is complete on disk. Returns the manifest.

    ``known`` (read after ``write`` returns) holds manifest entries the caller vouches for: files
    ``write`` hard-linked from a directory it has just verified. Those are not hashed again.
    """
    target = Path(target)
    extra = dict(extra or {})
    clash = sorted({"format", "files"} & extra.keys())
    if clash:
        raise ValueError(f"publish_dir(extra=...) must not set {clash}: those manifest keys are reserved.")
    if os.path.lexists(target) and (target.is_symlink() or not target.is_dir()):
        raise CheckpointError(f"{target} exists and is not a directory; remove it or publish under another name.")
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = temp_sibling(target, "staging")
    staging.mkdir()
    try:
        write(staging)
        manifest = {"format": MANIFEST_FORMAT, "files": _describe(staging, known or {}), **extra}
        _write_manifest(staging / MANIFEST, manifest)
        for directory in _directories(staging):
            _fsync_dir(directory)
        _swap_into_place(staging, target)
    except BaseException as exc:
        full = isinstance(exc, Exception) and _out_of_space(exc, parent)
        shutil.rmtree(staging, ignore_errors=True)
        if full:
            raise OSError(errno.ENOSPC, f"no space left on the device holding {target} while writing it ({exc}); "
                          "free some space or write elsewhere. Nothing was published; earlier checkpoints and "
                          "exports there are untouched.") from exc
        raise
    return manifest


def _out_of_space(exc: Exception, directory: Path) -> bool:
    """Whether a failed write ran out of disk. torch.save and safetensors do not raise ENOSPC as such
    (torch reports "unexpected pos ..."), so a filesystem left with under 1 MiB free counts too."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        stat = os.statvfs(directory)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < _CHUNK


def verify_dir(path: str | Path) -> dict:
    """Check that ``path`` holds exactly the files its manifest lists, intact; return the manifest."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist or is not a directory.")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is not a complete checkpoint/export: {MANIFEST} missing — it was interrupted or is not ours."
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{manifest_path} is not valid JSON ({exc}): the checkpoint/export is corrupted."
        ) from None
    listed = _listed_files(manifest, manifest_path)
    for rel, entry in listed.items():
        file = path / rel
        if file.is_symlink() or not file.is_file():
            raise CheckpointError(f"{file} is listed in {manifest_path} but missing: the directory is incomplete.")
        if file.stat().st_size != entry["size"] or sha256_file(file) != entry["sha256"]:
            raise CheckpointError(f"checksum mismatch in {file}: the file is corrupted or truncated.")
    files, others = _walk(path)
    unlisted = sorted(set(files) - set(listed) - {MANIFEST}) + others
    if unlisted:
        raise CheckpointError(
            f"{path / unlisted[0]} is not listed in {manifest_path}: something was added after publishing; "
            "remove it or re-publish the directory."
        )
    return manifest


def _hash(f) -> str:
    digest = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def _walk(root: Path) -> tuple[list[str], list[str]]:
    """Regular files and any other entries (symlinks, sockets, ...) under ``root``, as sorted posix relpaths."""
    files, others = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        # os.walk lists a symlink to a directory under dirnames but does not enter it.
        for name in dirnames + filenames:
            entry = here / name
            rel = entry.relative_to(root).as_posix()
            if entry.is_symlink():
                others.append(rel)
            elif entry.is_file():
                files.append(rel)
            elif not entry.is_dir():
                others.append(rel)
    return sorted(files), sorted(others)


def _describe(staging: Path, known: dict) -> dict:
    """Manifest entries for everything ``write`` produced, each file fsynced as it is hashed (or, for
    a ``known`` file of the recorded size, taken from ``known``)."""
    files, others = _walk(staging)
    if others:
        raise CheckpointError(
            f"{staging / others[0]} is a symlink or special file; a published directory may only hold regular files."
        )
    if MANIFEST in files:
        raise CheckpointError(f"{staging / MANIFEST} was written by the caller; that name is reserved for the manifest.")
    entries = {}
    for rel in files:
        with open(staging / rel, "rb") as f:
            os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
            if rel in known and known[rel]["size"] == size:
                entries[rel] = dict(known[rel])
            else:
                entries[rel] = {"sha256": _hash(f), "size": size}
    return entries


def _write_manifest(path: Path, manifest: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _directories(root: Path) -> list[Path]:
    return [Path(dirpath) for dirpath, _, _ in os.walk(root)]


def _fsync_dir(path: Path) -> None:
    """Make renames and new entries in ``path`` durable, not just the file contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_into_place(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``. An existing target is exchanged with it in one atomic step
    (Linux ``renameat2``), so ``target`` never goes missing, and the old copy is deleted after.
    Where the kernel or filesystem cannot exchange, the old one is renamed aside first."""
    if not os.path.lexists(target):
        os.replace(staging, target)
        _fsync_dir(target.parent)
        return
    if _exchange(staging, target):
        _fsync_dir(target.parent)
        shutil.rmtree(staging)
        return
    old = temp_sibling(target, "old")
    os.replace(target, old)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(old, target)
        raise
    _fsync_dir(target.parent)
    shutil.rmtree(old)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; ``False`` where ``renameat2(RENAME_EXCHANGE)`` is unavailable."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _listed_files(manifest, manifest_path: Path) -> dict:
    """The manifest's ``files`` mapping, checked so a damaged manifest fails clearly instead of with a KeyError."""
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(
            f"{manifest_path} is not a format-{MANIFEST_FORMAT} manifest: it is corrupted or from an incompatible version."
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{manifest_path} has no 'files' mapping: the manifest is corrupted.")
    for rel, entry in files.items():
        parts = Path(rel).parts
        valid_path = bool(parts) and not Path(rel).is_absolute() and ".." not in parts
        valid_entry = (
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and type(entry.get("size")) is int
        )
        if not (valid_path and valid_entry):
            raise CheckpointError(f"{manifest_path} has a malformed entry for {rel!r}: the manifest is corrupted.")
    return files
