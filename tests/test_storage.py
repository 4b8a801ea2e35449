"""Run storage against a local directory and a real S3-compatible server (moto) on loopback."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from moto.server import ThreadedMotoServer

from comlrl_core.checkpoint import CheckpointError, publish_dir, sha256_file, verify_dir
from comlrl_core.checkpoint.atomic import process_tag
from comlrl_core.storage import LocalStorage, S3Storage, StorageError, open_storage, safe_key

BIG = 9 << 20  # above the 8 MiB multipart threshold: two parts


@pytest.fixture(scope="module")
def s3_endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def raw_client(endpoint, secret="testing", **config):
    """A boto3 client that talks to the server directly, to set up or damage what the storage stored."""
    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key=secret,
        config=Config(s3={"addressing_style": "path"}, **config),
    )


class LocalRaw:
    """Direct access to a LocalStorage's files."""

    def __init__(self, root):
        self.root = Path(root)

    def put(self, key, data):
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def names(self, key):
        base = self.root / key
        return {p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()}


class S3Raw:
    """Direct access to an S3Storage's objects."""

    def __init__(self, client, bucket, prefix):
        self.client, self.bucket, self.prefix = client, bucket, prefix

    def put(self, key, data):
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)

    def names(self, key):
        base = f"{self.prefix}/{key}/"
        reply = self.client.list_objects_v2(Bucket=self.bucket, Prefix=base)
        return {item["Key"][len(base):] for item in reply.get("Contents", [])}


@pytest.fixture(params=["local", "s3"])
def backend(request, tmp_path, monkeypatch):
    """``(storage, raw)`` for each backend; the S3 one is opened from a URI with its client built from the env."""
    if request.param == "local":
        root = tmp_path / "store"
        return open_storage(str(root)), LocalRaw(root)
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    client = raw_client(endpoint)
    client.create_bucket(Bucket=bucket)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for name in ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    storage = open_storage(f"s3://{bucket}/runs/exp1")
    assert storage.client.meta.region_name == "us-east-1"
    return storage, S3Raw(client, bucket, "runs/exp1")


def make_dir(path, files):
    """Write ``files`` (relpath -> bytes) under ``path``; return ``path``."""
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return path


def tree(path):
    """``{relpath: sha256}`` of the regular files under ``path``."""
    return {p.relative_to(path).as_posix(): sha256_file(p) for p in sorted(path.rglob("*")) if p.is_file()}


def test_put_get_round_trip(backend, tmp_path):
    storage, raw = backend
    files = {"model.safetensors": os.urandom(BIG), "config.json": b"{}", "sub/deep/optimizer.pt": os.urandom(1000)}
    source = tmp_path / "ckpt"
    publish_dir(source, lambda staging: make_dir(staging, files), extra={"kind": "checkpoint"})

    manifest = storage.put_dir(source, "ckpt/step-1")

    assert set(manifest["files"]) == set(files)
    assert manifest["kind"] == "checkpoint"
    assert storage.exists("ckpt/step-1") and not storage.exists("ckpt/step-2")
    assert storage.read_manifest("ckpt/step-1") == manifest
    assert storage.read_manifest("ckpt/step-2") is None
    out = tmp_path / "restored" / "step-1"
    assert storage.get_dir("ckpt/step-1", out) == manifest
    assert verify_dir(out) == manifest
    assert tree(out) == tree(source)
    if isinstance(storage, S3Storage):
        head = raw.client.head_object(Bucket=raw.bucket, Key="runs/exp1/ckpt/step-1/model.safetensors")
        assert head["ETag"].endswith('-2"'), "the big file should have been uploaded in two parts"
        assert head["Metadata"]["sha256"] == manifest["files"]["model.safetensors"]["sha256"]


def test_replacing_a_directory_drops_files_it_no_longer_has(backend, tmp_path):
    storage, raw = backend
    storage.put_dir(make_dir(tmp_path / "a", {"keep.bin": b"old", "gone/old.bin": b"x"}), "export")
    manifest = storage.put_dir(make_dir(tmp_path / "b", {"keep.bin": b"new", "new.bin": b"y"}), "export")

    assert set(manifest["files"]) == {"keep.bin", "new.bin"}
    assert raw.names("export") == {"keep.bin", "new.bin", "manifest.json"}
    storage.get_dir("export", tmp_path / "out")
    restored = tree(tmp_path / "out")
    assert restored.pop("manifest.json") and restored == tree(tmp_path / "b")


def test_get_dir_of_a_missing_key_fails_and_creates_nothing(backend, tmp_path):
    storage, _ = backend
    with pytest.raises(StorageError, match="no manifest.json") as err:
        storage.get_dir("nothing/here", tmp_path / "out")
    assert storage.uri("nothing/here") in str(err.value)
    assert not (tmp_path / "out").exists()


def test_interrupted_upload_is_not_a_directory(backend, tmp_path):
    storage, raw = backend
    raw.put("half/model.safetensors", b"weights")  # files went up, the manifest never did

    assert not storage.exists("half")
    assert storage.read_manifest("half") is None
    with pytest.raises(StorageError, match="not a complete directory"):
        storage.get_dir("half", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_corrupted_file_fails_get_dir_naming_it_and_leaves_nothing(backend, tmp_path):
    storage, raw = backend
    storage.put_dir(make_dir(tmp_path / "src", {"a.bin": b"a" * 100, "sub/b.bin": b"b" * 100}), "ckpt")
    raw.put("ckpt/sub/b.bin", b"B" * 100)
    dest_parent = tmp_path / "restore"
    dest_parent.mkdir()

    with pytest.raises(CheckpointError, match="checksum mismatch") as err:
        storage.get_dir("ckpt", dest_parent / "ckpt")
    assert storage.uri("ckpt/sub/b.bin") in str(err.value)
    assert list(dest_parent.iterdir()) == []  # no partial directory, no staging leftovers


def test_list_dirs(backend, tmp_path):
    storage, _ = backend
    src = make_dir(tmp_path / "src", {"w.bin": b"w"})
    storage.put_dir(src, "runs/b/ckpt")
    storage.put_dir(src, "runs/a/ckpt")
    storage.put_text("runs/c/latest", "ckpt")

    assert storage.list_dirs("runs") == ["a", "b", "c"]
    assert storage.list_dirs() == ["runs"]
    assert storage.list_dirs("runs/a") == ["ckpt"]
    assert storage.list_dirs("nothing") == []


def test_put_and_get_text(backend):
    storage, _ = backend
    assert storage.get_text("run/latest") is None
    storage.put_text("run/latest", "step-1")
    storage.put_text("run/latest", "step-2 ✓")
    assert storage.get_text("run/latest") == "step-2 ✓"


def test_delete(backend, tmp_path):
    storage, raw = backend
    storage.put_dir(make_dir(tmp_path / "src", {"w.bin": b"w", "sub/x.bin": b"x"}), "run/ckpt")
    storage.put_text("run/latest", "ckpt")

    storage.delete("run/ckpt")
    storage.delete("run/latest")
    storage.delete("run/never-existed")

    assert not storage.exists("run/ckpt")
    assert raw.names("run/ckpt") == set()
    assert storage.get_text("run/latest") is None
    assert storage.list_dirs("run") == []
    with pytest.raises(StorageError):
        storage.get_dir("run/ckpt", tmp_path / "out")


def test_local_listing_skips_staging_leftovers(tmp_path):
    storage = LocalStorage(tmp_path)
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / ".b.staging-0123abcd").mkdir()
    assert storage.list_dirs("runs") == ["a"]


@pytest.mark.parametrize("link", ["sub/b.bin", "sub", "manifest.json"])
def test_a_symlink_inside_a_stored_directory_is_refused_by_name(tmp_path, link):
    """Even a link to identical bytes (so every checksum matches) is never followed out of storage."""
    storage = LocalStorage(tmp_path / "store")
    storage.put_dir(make_dir(tmp_path / "src", {"a.bin": b"a" * 10, "sub/b.bin": b"b" * 10}), "ckpt")
    stored = Path(storage.uri("ckpt")) / link
    outside = tmp_path / "outside"
    os.replace(stored, outside)
    os.symlink(outside, stored)

    with pytest.raises(CheckpointError, match=f"{stored} is a symbolic link"):
        storage.get_dir("ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not storage.intact("ckpt")


def test_leftovers_of_killed_writers_are_removed_and_a_live_writers_kept(tmp_path):
    storage = LocalStorage(tmp_path / "store")
    parent = Path(storage.uri("run/stage/partial/owner"))
    # A writer SIGKILLed in the middle of a publish leaves its staging directory behind.
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from comlrl_core.checkpoint import publish_dir

        def write(staging):
            (staging / "weights.bin").write_bytes(b"w" * 100)
            time.sleep(600)

        publish_dir({str(parent / "checkpoint-1")!r}, write)
        """)])
    while not list(parent.glob(".checkpoint-1.staging-*/weights.bin")):
        time.sleep(0.05)
    writer.kill()
    writer.wait()
    [killed] = parent.glob(".checkpoint-1.staging-*")

    def leftover(name: str, age_days: float = 0) -> Path:
        path = parent / name
        (path / "agents").mkdir(parents=True)
        (path / "agents" / "0.safetensors").write_bytes(b"x")
        stamp = time.time() - age_days * 86400
        for p in (path / "agents" / "0.safetensors", path / "agents", path):
            os.utime(p, (stamp, stamp))
        return path

    host = process_tag().rsplit("-", 1)[0]
    live = leftover(f".checkpoint-2.staging-{host}-{os.getpid()}-{'b' * 16}")  # this process: alive
    fresh = leftover(f".checkpoint-3.staging-otherhost-7-{'c' * 16}")  # another host's, recent
    old = leftover(f".checkpoint-4.old-otherhost-7-{'d' * 16}", age_days=2)  # another host's, untouched for days
    legacy = leftover(f".checkpoint-5.staging-{'e' * 16}", age_days=2)  # no writer in the name
    storage.put_dir(make_dir(tmp_path / "src", {"a.bin": b"a"}), "run/stage/final")

    assert sorted(storage.remove_stale("run")) == sorted(str(p) for p in (killed, old, legacy))
    assert live.is_dir() and fresh.is_dir() and storage.intact("run/stage/final")
    assert storage.remove_stale("run") == []


def test_unreachable_endpoint_fails_fast_without_leaking_the_secret(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again when the block ends: nothing listens there
    sentinel = "SENTINEL-secret-key-do-not-print"
    client = raw_client(
        f"http://127.0.0.1:{port}", secret=sentinel,
        retries={"max_attempts": 2, "mode": "standard"}, connect_timeout=0.5, read_timeout=0.5,
    )
    storage = S3Storage("my-bucket", "runs", client=client)
    src = make_dir(tmp_path / "src", {"w.bin": b"w"})

    start = time.monotonic()
    for attempt in (lambda: storage.exists("x"), lambda: storage.put_dir(src, "x"),
                    lambda: storage.get_dir("x", tmp_path / "out"), lambda: storage.list_dirs()):
        with pytest.raises(StorageError) as err:
            attempt()
        message = str(err.value)
        assert "s3://my-bucket/runs" in message and "endpoint" in message
        assert sentinel not in message and sentinel not in repr(err.value)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("key, expected", [
    ("run-1/ckpt/step=10", "run-1/ckpt/step=10"),
    ("org/model@v1.2+x_y/", "org/model@v1.2+x_y"),
    ("a//b", "a/b"),
])
def test_safe_key_accepts_normal_keys(key, expected):
    assert safe_key(key) == expected


@pytest.mark.parametrize("key", ["../x", "/abs", "a/../b", "a/./b", "a\\b", "a b", "", "/", "a\x00b", "a\nb", "ü"])
def test_safe_key_rejects_escaping_or_odd_keys(key):
    with pytest.raises(ValueError, match="key"):
        safe_key(key)


def test_open_storage_parses_uris(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    s3 = open_storage("s3://my-bucket/runs/exp1/")
    assert (s3.bucket, s3.prefix) == ("my-bucket", "runs/exp1")
    assert s3.uri("ckpt/step-1") == "s3://my-bucket/runs/exp1/ckpt/step-1"
    bare = open_storage("s3://my-bucket")
    assert (bare.prefix, bare.uri(), bare.uri("a")) == ("", "s3://my-bucket", "s3://my-bucket/a")

    assert open_storage(f"file://{tmp_path}/store").root == tmp_path / "store"
    monkeypatch.chdir(tmp_path)
    local = open_storage("relative/store")
    assert isinstance(local, LocalStorage) and local.root == tmp_path / "relative" / "store"
    assert local.uri("a/b") == str(tmp_path / "relative/store/a/b")


@pytest.mark.parametrize("uri", ["", "  ", "s3://", "s3:///prefix", "s3://x/p", "s3://Bad_Bucket/p",
                                 "s3://my-bucket/../p", "gs://my-bucket/p", "file://host/path"])
def test_open_storage_rejects_bad_uris(uri):
    with pytest.raises(ValueError, match="storage="):
        open_storage(uri)


def test_manifest_is_json_with_the_publish_dir_format(backend, tmp_path):
    storage, _ = backend
    manifest = storage.put_dir(make_dir(tmp_path / "src", {"w.bin": b"w"}), "d")
    assert json.loads(storage.get_text("d/manifest.json")) == manifest
    assert manifest == {"format": 1, "files": {"w.bin": {"sha256": sha256_file(tmp_path / "src/w.bin"), "size": 1}}}


def test_local_storage_links_a_published_directory_and_copies_anything_else(tmp_path):
    storage = LocalStorage(tmp_path / "store")
    published = tmp_path / "checkpoint-1"
    manifest = publish_dir(published, lambda staging: (staging / "w.bin").write_bytes(b"w" * 100))
    assert storage.put_dir(published, "ck/checkpoint-1") == manifest
    stored = tmp_path / "store" / "ck" / "checkpoint-1"
    assert (stored / "w.bin").stat().st_ino == (published / "w.bin").stat().st_ino  # no copy, no re-hash
    assert verify_dir(stored) == manifest
    plain = make_dir(tmp_path / "plain", {"w.bin": b"w" * 100})  # mutable: its owner may write it again
    storage.put_dir(plain, "ck/plain")
    assert (tmp_path / "store" / "ck" / "plain" / "w.bin").stat().st_ino != (plain / "w.bin").stat().st_ino
