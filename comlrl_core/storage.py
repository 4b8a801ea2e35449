"""Run storage: a local directory or an S3 prefix behind one small interface.

Checkpoints and exports are published as directories with a checksum manifest (see
:mod:`comlrl_core.checkpoint.atomic`). Whether they live on local disk or in S3, a directory counts
only once its ``manifest.json`` is there, and it is checked file by file when read back, so a retry
on another worker can resume from whatever the last complete upload was.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from abc import ABC, abstractmethod
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from .checkpoint.atomic import (
    MANIFEST,
    MANIFEST_FORMAT,
    CheckpointError,
    is_staging_name,
    publish_dir,
    remove_stale_temps,
    sha256_file,
    temp_sibling,
    verify_dir,
)
from .credentials import redact

_MiB = 1 << 20
# Files above 8 MiB (model weights) go up and down in 8 MiB parts, so one failed part is retried, not the file.
_TRANSFER = TransferConfig(multipart_threshold=8 * _MiB, multipart_chunksize=8 * _MiB)
_SEGMENT = re.compile(r"[A-Za-z0-9._=+@-]+")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_MISSING = {"404", "NoSuchKey"}


class StorageError(RuntimeError):
    """Storage unreachable, retries exhausted or an object missing; the message names the URI."""


def safe_key(key: str) -> str:
    """Normalise a relative key so names built from run names or model ids cannot leave the run's prefix."""
    hint = "use a relative posix key whose segments hold only letters, digits and . _ = + @ -"
    if not isinstance(key, str) or not key.strip("/"):
        raise ValueError(f"key {key!r} is empty; {hint}.")
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise ValueError(f"key {key!r} contains a control character; {hint}.")
    if "\\" in key:
        raise ValueError(f"key {key!r} contains a backslash; {hint}.")
    if key.startswith("/"):
        raise ValueError(f"key {key!r} is an absolute path; {hint}.")
    segments = [s for s in key.split("/") if s]
    for segment in segments:
        if segment in (".", ".."):
            raise ValueError(f"key {key!r} contains a {segment!r} segment; {hint}.")
        if not _SEGMENT.fullmatch(segment):
            raise ValueError(f"key {key!r} has a disallowed character in {segment!r}; {hint}.")
    return "/".join(segments)


def open_storage(uri: str) -> Storage:
    """The storage behind ``uri``: ``s3://bucket[/prefix]``, ``file:///abs/path`` or a plain path."""
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"storage={uri!r} is empty; pass s3://bucket[/prefix], file:///abs/path or a directory path.")
    shown = redact(uri)
    if shown != uri:
        raise ValueError(f"storage={shown!r} holds credentials, which a URI must not carry (it is logged and stored "
                         "with the run); use the standard AWS credential chain or environment.")
    if "://" not in uri:
        return LocalStorage(uri)
    scheme, rest = uri.split("://", 1)
    scheme = scheme.lower()
    if scheme == "file":
        if not rest.startswith("/"):
            raise ValueError(f"storage={uri!r} is not a local file URI; write it as file:///absolute/path.")
        return LocalStorage(rest)
    if scheme != "s3":
        raise ValueError(f"storage={uri!r} has unsupported scheme {scheme!r}; use s3://, file:// or a plain path.")
    bucket, _, prefix = rest.partition("/")
    try:
        return S3Storage(bucket, prefix)
    except ValueError as exc:
        raise ValueError(f"storage={uri!r} is not a valid S3 URI: {exc}") from None


class Storage(ABC):
    """Where a run keeps its directories (checkpoints, exports) and small text pointers, addressed by key."""

    @abstractmethod
    def uri(self, key: str = "") -> str:
        """The full URI of ``key`` (the storage root for ``""``), for messages and logs."""

    def put_dir(self, local_dir: str | Path, key: str) -> dict:
        """Publish ``local_dir`` under ``key``, replacing what was there; return its manifest.

        A directory already published with a manifest is verified first and keeps its extra
        manifest fields. The stored directory becomes valid only once it is completely written.
        When ``key`` already holds exactly this directory, intact, nothing is written: a retried
        upload never takes a complete directory out of view.
        """
        key = safe_key(key)
        manifest = _describe_source(Path(local_dir))
        if self.read_manifest(key) == manifest and self._intact(key, manifest):
            return manifest
        self._put(Path(local_dir), key, manifest)
        return manifest

    @abstractmethod
    def _put(self, source: Path, key: str, manifest: dict) -> None:
        """Store ``source``'s listed files under ``key``, ``manifest.json`` last."""

    @abstractmethod
    def _intact(self, key: str, manifest: dict) -> bool:
        """Whether every file ``manifest`` lists is stored under ``key`` with its size and sha256."""

    @abstractmethod
    def list_dirs(self, key: str = "") -> list[str]:
        """Sorted names of the immediate child directories under ``key`` (complete or not)."""

    @abstractmethod
    def put_text(self, key: str, text: str) -> None:
        """Store a small text object, such as a pointer to the latest checkpoint, replacing it whole."""

    @abstractmethod
    def get_text(self, key: str) -> str | None:
        """The text stored under ``key``, or ``None`` when there is none."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the directory or object under ``key``; its manifest goes first so it stops being valid."""

    @abstractmethod
    def _fetch(self, key: str, dest: Path) -> None:
        """Copy the single stored file ``key`` to the local path ``dest``."""

    def get_dir(self, key: str, local_dir: str | Path) -> dict:
        """Download the directory under ``key`` into ``local_dir`` atomically, every file checked; return its manifest.

        Files land in a staging directory beside ``local_dir`` and are renamed into place only when all
        match the manifest, so a failed download leaves ``local_dir`` as it was.
        """
        key = safe_key(key)
        manifest = self.read_manifest(key)
        if manifest is None:
            raise StorageError(
                f"{self.uri(key)} is not a complete directory (no {MANIFEST}): "
                "the upload was interrupted or never happened."
            )
        files = _remote_files(manifest, self.uri(f"{key}/{MANIFEST}"))

        def write(staging: Path) -> None:
            for rel, entry in files.items():
                dest = staging / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                self._fetch(f"{key}/{rel}", dest)
                if dest.stat().st_size != entry["size"] or sha256_file(dest) != entry["sha256"]:
                    raise CheckpointError(
                        f"checksum mismatch in {self.uri(f'{key}/{rel}')}: the stored file is corrupted "
                        "or truncated; upload the directory again."
                    )

        return publish_dir(local_dir, write, extra=_extra(manifest))

    def intact(self, key: str) -> bool:
        """Whether ``key`` holds a complete directory whose stored files still match its manifest
        (locally every byte is hashed; on S3 each object's size and recorded sha256)."""
        try:
            manifest = self.read_manifest(key)
        except CheckpointError:
            return False
        return manifest is not None and self._intact(safe_key(key), manifest)

    def remove_stale(self, key: str = "") -> list[str]:
        """Remove what killed writers left under ``key`` (see ``remove_stale_temps``); returns their
        locations. Object storage has nothing to remove: objects appear whole and the manifest last."""
        return []

    def exists(self, key: str) -> bool:
        """Whether a complete directory (one with its manifest) is stored under ``key``."""
        return self.get_text(f"{safe_key(key)}/{MANIFEST}") is not None

    def read_manifest(self, key: str) -> dict | None:
        """The manifest of the directory under ``key``, or ``None`` when it is missing or incomplete."""
        key = safe_key(key)
        text = self.get_text(f"{key}/{MANIFEST}")
        if text is None:
            return None
        try:
            manifest = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{self.uri(f'{key}/{MANIFEST}')} is not valid JSON ({exc}): corrupted.") from None
        if not isinstance(manifest, dict):
            raise CheckpointError(f"{self.uri(f'{key}/{MANIFEST}')} is not a JSON object: it is corrupted.")
        return manifest


class LocalStorage(Storage):
    """Storage in a local (or network-mounted) directory; ``key`` maps to ``root/key``."""

    def __init__(self, root: str | Path):
        self.root = Path(os.path.abspath(os.path.expanduser(root)))

    def uri(self, key: str = "") -> str:
        return str(self._path(key))

    def _put(self, source: Path, key: str, manifest: dict) -> None:
        # A published source (its manifest was just verified) is never written again: its files are
        # hard-linked, keeping their checksums, where the filesystem allows; anything else is copied.
        published = (source / MANIFEST).is_file()
        linked = {}

        def write(staging: Path) -> None:
            for rel, entry in manifest["files"].items():
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                if published and _hard_link(source / rel, staging / rel):
                    linked[rel] = entry
                else:
                    shutil.copyfile(source / rel, staging / rel)

        publish_dir(self._path(key), write, extra=_extra(manifest), known=linked)

    def _intact(self, key: str, manifest: dict) -> bool:
        try:
            verify_dir(self._path(key))
        except CheckpointError:
            return False
        return True

    def list_dirs(self, key: str = "") -> list[str]:
        base = self._path(key)
        if not base.is_dir():
            return []
        return sorted(
            entry.name for entry in base.iterdir()
            if entry.is_dir() and not entry.is_symlink() and not is_staging_name(entry.name)
        )

    def put_text(self, key: str, text: str) -> None:
        path = self._path(safe_key(key))
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.parent / f".{path.name}.tmp-{secrets.token_hex(8)}"
        try:
            with open(temp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def get_text(self, key: str) -> str | None:
        try:
            return self._regular(key).read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError):
            return None

    def delete(self, key: str) -> None:
        path = self._path(safe_key(key))
        if path.is_dir() and not path.is_symlink():
            # Renaming first removes the whole directory from view at once; the slow delete happens out of sight.
            doomed = temp_sibling(path, "old")
            os.replace(path, doomed)
            shutil.rmtree(doomed)
        elif os.path.lexists(path):
            path.unlink()

    def _fetch(self, key: str, dest: Path) -> None:
        try:
            shutil.copyfile(self._regular(key), dest)
        except FileNotFoundError:
            raise StorageError(
                f"{self.uri(key)} is listed in its manifest but missing: the directory was partly deleted; "
                "upload it again."
            ) from None

    def remove_stale(self, key: str = "") -> list[str]:
        return [str(path) for path in remove_stale_temps(self._path(key))]

    def _path(self, key: str) -> Path:
        return self.root / safe_key(key) if key else self.root

    def _regular(self, key: str) -> Path:
        """The path of ``key``, refusing a symbolic link anywhere below the storage root: stored
        directories hold regular files only, so nothing outside storage is ever read as part of one."""
        path = self.root
        for part in Path(safe_key(key)).parts:
            path = path / part
            if path.is_symlink():
                raise CheckpointError(f"{path} is a symbolic link; stored directories hold regular files only, so "
                                      "it is refused. Replace it with the file itself, or delete the directory.")
        return path


class S3Storage(Storage):
    """Storage under ``s3://bucket/prefix`` on AWS or any S3-compatible server (MinIO, Ceph, moto)."""

    def __init__(self, bucket: str, prefix: str = "", client=None):
        if not isinstance(bucket, str) or not _BUCKET.fullmatch(bucket):
            raise ValueError(
                f"bucket {bucket!r} is not a valid S3 bucket name: use 3-63 lowercase letters, digits, '.' or '-'."
            )
        self.bucket = bucket
        self.prefix = safe_key(prefix) if prefix.strip("/") else ""
        self.client = client if client is not None else _default_client()

    def uri(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self._object(key)}".rstrip("/")

    def _put(self, source: Path, key: str, manifest: dict) -> None:
        # Invalidate the old directory first: while files are replaced, the prefix must not look complete.
        with self._errors("delete", f"{key}/{MANIFEST}"):
            self.client.delete_object(Bucket=self.bucket, Key=self._object(f"{key}/{MANIFEST}"))
        for rel, entry in manifest["files"].items():
            self._upload(source / rel, f"{key}/{rel}", entry)
        self.put_text(f"{key}/{MANIFEST}", json.dumps(manifest, indent=2) + "\n")
        base = self._object(key) + "/"
        keep = {base + rel for rel in manifest["files"]} | {base + MANIFEST}
        self._delete_objects(key, [name for name in self._list_objects(key) if name not in keep])

    def _intact(self, key: str, manifest: dict) -> bool:
        for rel, entry in manifest["files"].items():
            with self._errors("check", f"{key}/{rel}"):
                try:
                    head = self.client.head_object(Bucket=self.bucket, Key=self._object(f"{key}/{rel}"))
                except ClientError as exc:
                    if _error_code(exc) in _MISSING:
                        return False
                    raise
            if head["ContentLength"] != entry["size"] or head.get("Metadata", {}).get("sha256") != entry["sha256"]:
                return False
        return True

    def list_dirs(self, key: str = "") -> list[str]:
        base = self._object(key) + "/" if self._object(key) else ""
        names = set()
        with self._errors("list", key):
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base, Delimiter="/"):
                names.update(p["Prefix"][len(base):].rstrip("/") for p in page.get("CommonPrefixes", []))
        return sorted(names)

    def put_text(self, key: str, text: str) -> None:
        key = safe_key(key)
        with self._errors("upload", key):
            self.client.put_object(
                Bucket=self.bucket, Key=self._object(key), Body=text.encode("utf-8"),
                ContentType="text/plain; charset=utf-8",
            )

    def get_text(self, key: str) -> str | None:
        key = safe_key(key)
        with self._errors("download", key):
            try:
                reply = self.client.get_object(Bucket=self.bucket, Key=self._object(key))
            except ClientError as exc:
                if _error_code(exc) in _MISSING:
                    return None
                raise
            return reply["Body"].read().decode("utf-8")

    def delete(self, key: str) -> None:
        key = safe_key(key)
        manifest = self._object(f"{key}/{MANIFEST}")
        self._delete_objects(key, [manifest])
        rest = [name for name in self._list_objects(key) if name != manifest]
        self._delete_objects(key, [self._object(key)] + rest)

    def _fetch(self, key: str, dest: Path) -> None:
        with self._errors("download", key):
            self.client.download_file(self.bucket, self._object(key), str(dest), Config=_TRANSFER)

    def _upload(self, path: Path, key: str, entry: dict) -> None:
        """Upload one file with its sha256 as metadata, then check what the server stored."""
        name = self._object(key)
        with self._errors("upload", key):
            self.client.upload_file(
                str(path), self.bucket, name, ExtraArgs={"Metadata": {"sha256": entry["sha256"]}}, Config=_TRANSFER
            )
            head = self.client.head_object(Bucket=self.bucket, Key=name)
        if head["ContentLength"] != entry["size"] or head.get("Metadata", {}).get("sha256") != entry["sha256"]:
            raise StorageError(
                f"{self.uri(key)} does not match {path} after upload (size or sha256 metadata differ): "
                "the file changed while uploading or the server altered it; upload the directory again."
            )

    def _list_objects(self, key: str) -> list[str]:
        """Every object name under the directory ``key``."""
        base = self._object(key) + "/"
        names = []
        with self._errors("list", key):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                names.extend(item["Key"] for item in page.get("Contents", []))
        return names

    def _delete_objects(self, key: str, names: list[str]) -> None:
        for start in range(0, len(names), 1000):  # the S3 limit per DeleteObjects request
            batch = names[start:start + 1000]
            with self._errors("delete", key):
                reply = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": name} for name in batch], "Quiet": True}
                )
            if reply.get("Errors"):
                first = reply["Errors"][0]
                raise StorageError(
                    f"could not delete s3://{self.bucket}/{first.get('Key')} ({first.get('Code')}): "
                    "check that the credentials may delete objects in this bucket."
                )

    def _object(self, key: str) -> str:
        return "/".join(part for part in (self.prefix, safe_key(key) if key else "") if part)

    @contextmanager
    def _errors(self, action: str, key: str):
        """Turn botocore/boto3 failures (raised once botocore's retries are spent) into a StorageError."""
        try:
            yield
        except (BotoCoreError, Boto3Error, ClientError) as exc:
            code = _error_code(exc)
            if code in _MISSING:
                hint = "the object does not exist; check the key, or upload it again if it was deleted."
            else:
                hint = (
                    f"check the endpoint ({self.client.meta.endpoint_url}, set by AWS_ENDPOINT_URL), the "
                    f"credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) and that bucket {self.bucket!r} "
                    "exists and is reachable."
                )
            attempts = (self.client.meta.config.retries or {}).get("total_max_attempts")
            tried = f" after {attempts} attempts" if attempts else ""
            raise StorageError(f"S3 {action} of {self.uri(key)} failed{tried} ({code}): {hint}") from exc


def _hard_link(source: Path, dest: Path) -> bool:
    """Link ``dest`` to ``source``; ``False`` across filesystems or where links are not allowed."""
    try:
        os.link(source, dest)
    except OSError:
        return False
    return True


def _default_client():
    """An S3 client from the standard AWS environment and config files, with bounded retries and timeouts.

    botocore retries throttling (503 SlowDown), 5xx replies and dropped connections with jittered
    exponential backoff; ``AWS_MAX_ATTEMPTS`` and ``AWS_RETRY_MODE`` override the 5 attempts (the
    first try included) in standard mode.
    """
    endpoint = urlsplit(os.environ.get("AWS_ENDPOINT_URL", ""))
    if endpoint.username or endpoint.password:
        raise ValueError("AWS_ENDPOINT_URL must not carry credentials (user:password@host): S3 ignores them and they "
                         "would end up in errors and logs; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY instead.")
    session = boto3.session.Session()
    attempts = os.environ.get("AWS_MAX_ATTEMPTS", "5")
    if not attempts.isdigit() or int(attempts) < 1:
        raise ValueError(f"AWS_MAX_ATTEMPTS={attempts!r} must be a positive integer (the attempts per S3 request).")
    config = Config(
        retries={"total_max_attempts": int(attempts), "mode": os.environ.get("AWS_RETRY_MODE", "standard")},
        s3={"addressing_style": "path"},
        connect_timeout=5,
        read_timeout=60,
    )
    return session.client("s3", region_name=session.region_name or "us-east-1", config=config)


def _error_code(exc: BaseException) -> str:
    """The S3 error code of a ClientError (also when boto3 wrapped it, as upload_file does), else the
    botocore (or innermost) exception's class name; never its (possibly verbose) text."""
    chain = [exc]
    while chain[-1].__cause__ or chain[-1].__context__:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    for error in chain:
        if isinstance(error, ClientError):
            return str(error.response.get("Error", {}).get("Code", "unknown"))
        if isinstance(error, BotoCoreError):
            return type(error).__name__
    return type(chain[-1]).__name__


def _extra(manifest: dict) -> dict:
    """The caller's own manifest fields (everything but ``format`` and ``files``), carried across copies."""
    return {name: value for name, value in manifest.items() if name not in ("format", "files")}


def _describe_source(root: Path) -> dict:
    """The manifest to store for ``root``: its own, verified, if it was published; otherwise a fresh one."""
    if not root.is_dir():
        raise ValueError(f"local_dir {root} is not a directory; pass the directory to store.")
    if (root / MANIFEST).exists():
        manifest = verify_dir(root)
    else:
        files = {}
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                if path.is_symlink() or not (path.is_dir() or path.is_file()):
                    raise CheckpointError(f"{path} is a symlink or special file; only regular files can be stored.")
                if path.is_file():
                    rel = path.relative_to(root).as_posix()
                    files[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
        manifest = {"format": MANIFEST_FORMAT, "files": dict(sorted(files.items()))}
    for rel in manifest["files"]:
        try:
            safe_key(rel)
        except ValueError as exc:
            raise ValueError(f"{root / rel} cannot be stored under that name: {exc}") from None
    return manifest


def _remote_files(manifest: dict, where: str) -> dict:
    """The manifest's ``files``, checked before anything is downloaded so a bad entry cannot write outside."""
    files = manifest.get("files")
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
        raise CheckpointError(
            f"{where} is not a format-{MANIFEST_FORMAT} manifest: it is corrupted or from another version."
        )
    for rel, entry in files.items():
        try:
            ok = safe_key(rel) == rel
        except ValueError:
            ok = False
        valid_entry = isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and type(entry.get("size")) is int
        if not (ok and valid_entry):
            raise CheckpointError(
                f"{where} has a malformed entry for {rel!r}: the manifest is corrupted; upload the directory again."
            )
    return files
