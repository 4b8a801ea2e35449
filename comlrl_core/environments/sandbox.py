"""Run untrusted Python (model-written code and its tests) in a throwaway subprocess, and say whether it passed.

What holds against any code is the operating system's part: a fresh temporary directory as the working
directory, a minimal environment, resource limits (memory, CPU seconds, file size, open files, no core
dumps), a wall-clock timeout after which the whole process group gets SIGKILL, and, when we run as root
and the interpreter allows it, an unprivileged user (``nobody``) so that the kernel itself keeps the code
off our files and our processes and caps its process count.

A short prelude inside the child also turns off networking, process spawning, signalling and early exits,
and refuses writes outside the working directory. That is defence in depth against accidents and casual
reward hacks, not a security boundary: code that sets out to undo a Python-level guard can (the real
functions stay reachable, e.g. through the wrappers' closures). Reads are not restricted, and disk use is
bounded per file and by the timeout, not in total. Run code you must not trust at all in a container or VM.
"""

from __future__ import annotations

import functools
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

PYTHON = sys.executable  # the interpreter that runs the code
NOBODY = 65534  # uid and gid of the unprivileged user, when we run as root
FILE_LIMIT = 1 << 20  # bytes: the most any file the code writes may hold (its output included)
OPEN_FILES = 64
PROCESSES = 64  # per user, so only set when the code runs as nobody (root ignores the limit)
OUTPUT_CHARS = 2000

# Runs in the child before the untrusted code, which it reads from solution.py and runs in a fresh
# namespace. Everything it keeps is a local of _sandbox(), out of reach of the code's globals.
_PRELUDE = r'''
import builtins, io, os, posix, socket, sys, _io, _socket

MUTATORS = ("chmod", "chown", "lchown", "chflags", "lchflags", "lchmod", "link", "mkdir", "mkfifo", "mknod",
            "remove", "rename", "replace", "rmdir", "symlink", "truncate", "unlink", "utime", "setxattr",
            "removexattr")
FORBIDDEN = ("system", "popen", "fork", "forkpty", "execv", "execve", "posix_spawn", "posix_spawnp", "kill",
             "killpg", "pidfd_open", "setsid", "setpgid", "setpgrp", "chroot", "_exit")
NETWORK = ("socket", "SocketType", "socketpair", "create_connection", "create_server", "fromfd", "getaddrinfo",
           "gethostbyname", "gethostbyname_ex", "gethostbyaddr")
BLOCKED = {"_socket", "_ssl", "subprocess", "_posixsubprocess", "multiprocessing", "_multiprocessing", "ctypes",
           "_ctypes", "pty", "posix", "_io"}


def _sandbox():
    exit, show_error, exc_info, caught = os._exit, sys.__excepthook__, sys.exc_info, BaseException
    realpath, fsdecode, sep, path_like = os.path.realpath, os.fsdecode, os.sep, os.PathLike
    real_open, real_os_open = _io.open, os.open
    home = realpath(os.getcwd())
    with open("solution.py", encoding="utf-8") as file:
        source = file.read()

    def refuse(*args, **kwargs):
        raise PermissionError("blocked by the sandbox")

    def check_paths(*paths):
        for path in paths:
            if not isinstance(path, int):  # a descriptor was checked when it was opened
                path = realpath(fsdecode(path))
                if path != home and not path.startswith(home + sep):
                    refuse()

    def guard(func):
        def guarded(*args, **kwargs):
            if any(key.endswith("dir_fd") and value is not None for key, value in kwargs.items()):
                refuse()  # a path relative to a directory descriptor cannot be checked here
            check_paths(*[a for a in (*args, *kwargs.values()) if isinstance(a, (str, bytes, path_like))])
            return func(*args, **kwargs)
        return guarded

    write_modes = set("wax+")
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def guarded_open(file, mode="r", *args, **kwargs):
        if write_modes & set(mode):
            check_paths(file)
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if flags & write_flags:
            if kwargs.get("dir_fd") is not None:
                refuse()
            check_paths(path)
        return real_os_open(path, flags, *args, **kwargs)

    class FileIO(_io.FileIO):
        def __init__(self, file, mode="r", *args, **kwargs):
            if write_modes & set(mode):
                check_paths(file)
            super().__init__(file, mode, *args, **kwargs)

    builtins.open = io.open = _io.open = guarded_open
    io.FileIO = _io.FileIO = FileIO
    for module in (os, posix):
        module.open = guarded_os_open
        for name in MUTATORS:
            if hasattr(module, name):
                setattr(module, name, guard(getattr(module, name)))
        for name in FORBIDDEN:
            if hasattr(module, name):
                setattr(module, name, refuse)
    for module in (socket, _socket):
        for name in NETWORK:
            if hasattr(module, name):
                setattr(module, name, refuse)

    class Blocker:  # a fresh import would bring the real functions back
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ImportError(f"importing {name} is blocked by the sandbox")
            return None

    sys.modules.pop("_socket", None)
    sys.meta_path.insert(0, Blocker)
    try:  # a SystemExit before the tests ran must not count as a pass
        exec(compile(source, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except caught:
        try:
            show_error(*exc_info())
        finally:
            exit(1)
    exit(0)


_sandbox()
'''


REFUSED = "blocked by the sandbox"  # in every refusal the prelude raises


@dataclass(frozen=True)
class SandboxResult:
    """``passed``: the code ran to its end (no exception, exit, signal or timeout). ``returncode`` is
    None when the process could not start; ``output`` is the tail of its stdout and stderr."""

    passed: bool
    timed_out: bool
    returncode: int | None
    output: str

    @property
    def refused(self) -> bool:
        """The code tried something the prelude refuses (network, writes outside, processes, exits)."""
        return REFUSED in self.output


def run_python(source: str, *, timeout: float = 5.0, memory_mb: int = 512) -> SandboxResult:
    """Run ``source`` as a script in a fresh sandboxed interpreter, for at most ``timeout`` wall-clock seconds
    and ``memory_mb`` of address space. Bad code (syntax errors, exceptions, endless loops, memory or
    fork bombs, blocked actions) only fails; this raises only on bad arguments."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a string, got {type(source).__name__}.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 1:
        raise ValueError(f"memory_mb must be a positive integer, got {memory_mb!r}.")
    try:
        with tempfile.TemporaryDirectory(prefix="comlrl-sandbox-", ignore_cleanup_errors=True) as workdir, \
                tempfile.TemporaryFile() as output:
            with open(os.path.join(workdir, "solution.py"), "w", encoding="utf-8") as file:
                file.write(source)
            as_nobody = _unprivileged(PYTHON)
            if as_nobody:
                os.chown(workdir, NOBODY, NOBODY)
            process = subprocess.Popen(
                [PYTHON, "-I", "-S", "-u", "-c", _PRELUDE], cwd=workdir, env=_environment(workdir),
                stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=functools.partial(_limit, timeout, memory_mb, as_nobody),
                **(_NOBODY if as_nobody else {}))
            try:
                returncode, timed_out = process.wait(timeout=timeout), False
            except subprocess.TimeoutExpired:
                returncode, timed_out = None, True
            finally:
                _kill_group(process.pid)  # the timed-out child and anything it started
            if timed_out:
                returncode = process.wait()
            text = _tail(output)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:  # e.g. no processes left, unencodable source
        return SandboxResult(False, False, None, f"the sandbox could not run the code: {exc!r}")
    if timed_out:
        text += f"\n[timed out after {timeout} s]"
    return SandboxResult(returncode == 0 and not timed_out, timed_out, returncode, text[-OUTPUT_CHARS:])


_NOBODY = {"user": NOBODY, "group": NOBODY, "extra_groups": []}


def _environment(workdir: str) -> dict[str, str]:
    """Nothing of ours (credentials, proxies, paths) reaches the code."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}


def _limit(timeout: float, memory_mb: int, as_nobody: bool) -> None:
    """Runs in the child between fork and exec (after the switch to nobody): lower soft and hard limits."""
    def cap(limit: int, value: int) -> None:
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))

    cap(resource.RLIMIT_AS, memory_mb << 20)
    cap(resource.RLIMIT_CPU, math.ceil(timeout) + 1)
    cap(resource.RLIMIT_FSIZE, FILE_LIMIT)
    cap(resource.RLIMIT_NOFILE, OPEN_FILES)
    cap(resource.RLIMIT_CORE, 0)
    if as_nobody:
        cap(resource.RLIMIT_NPROC, PROCESSES)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is already gone
        pass


def _tail(output) -> str:
    output.seek(0, os.SEEK_END)
    output.seek(max(0, output.tell() - 4 * OUTPUT_CHARS))
    return output.read().decode("utf-8", "replace")[-OUTPUT_CHARS:]


@functools.lru_cache(maxsize=None)
def _unprivileged(python: str) -> bool:
    """Whether to run the code as nobody: only when we are root, and only when nobody gets the same
    interpreter as root does (it may be unable to read the install, e.g. under /root, and fall back
    to another Python, or fail)."""
    if os.geteuid() != 0:
        return False
    probe = [python, "-I", "-S", "-c", "import sys; print(sys.version, sys.prefix, sys.path)"]
    try:
        with tempfile.TemporaryDirectory(prefix="comlrl-sandbox-") as workdir:
            os.chown(workdir, NOBODY, NOBODY)
            seen = [subprocess.run(probe, cwd=workdir, env=_environment(workdir), stdin=subprocess.DEVNULL,
                                   capture_output=True, timeout=60, **kwargs)
                    for kwargs in ({}, _NOBODY)]
    except (OSError, subprocess.SubprocessError):
        return False
    return all(run.returncode == 0 for run in seen) and seen[0].stdout == seen[1].stdout
