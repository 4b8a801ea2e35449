"""Starting a data-parallel job with ``accelerate launch`` and following it from the calling process.

accelerate's torchrun-based launcher (``--multi_gpu``) starts ``num_processes`` processes on this
machine whether or not it has GPUs; each trainer then joins the process group (NCCL on GPUs, gloo on
CPU, see ``comlrl_core.distributed``). If one process fails, the launcher stops the others.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable


def free_port() -> int:
    """A loopback port nobody listens on now: two jobs on one machine must not share a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_command(num_processes: int, target: list[str]) -> list[str]:
    """``accelerate launch`` running ``target`` (a script or ``-m module`` and its arguments) on
    ``num_processes`` local processes, each with one CPU thread unless ``OMP_NUM_THREADS`` says otherwise."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(num_processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--num_cpu_threads_per_process", os.environ.get("OMP_NUM_THREADS", "1"),
            "--main_process_port", str(free_port()), *target]


# A traceback's last line, as a rank prints it ("[rank0]: RuntimeError: ..." under torchrun).
_EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)(?::.*)?)$")


def run_streaming(command: list[str], log: Callable[[str], None]) -> None:
    """Run ``command``, passing each line it prints to ``log`` as it comes; a non-zero exit raises
    ``RuntimeError`` naming the first exception any process printed (the root cause: the other ranks
    fail after it, on the closed connection) and the last lines, so the calling Prefect task fails
    (a flow retry or rerun then resumes the stage from its last uploaded checkpoint)."""
    tail: list[str] = []
    first = None
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as process:
        for line in process.stdout:
            line = line.rstrip()
            log(line)
            tail = (tail + [line])[-20:]
            if first is None and (error := _EXCEPTION.match(line)):
                first = error.group(1)
    if process.returncode != 0:
        cause = f" (first error: {first})" if first else ""
        raise RuntimeError(f"{' '.join(command[:3])} ... exited with status {process.returncode}{cause}:\n"
                           + "\n".join(tail))
