"""Sandboxes: a managed, limited, always-cleaned-up place where an attempt's program and its reward run.

One sandbox per attempt, created from the task's repository state (a mapping ``path -> text``)::

    backend = LocalBackend(max_sandboxes=16)                 # reaps leftovers of dead owners when created
    async with await backend.create(files, SandboxLimits(wall_s=60)) as box:
        result = await box.exec(["python", "-c", "print(1)"], timeout=10)
        proc = await box.start(["my-harness"], env=...)      # a long-running program inside the sandbox
        fresh = await backend.create(box.snapshot() | hidden_tests)   # a fresh copy for the verifier

What the local-process backend enforces (``describe_enforcement()`` says it at run time):

* isolation (``describe_enforcement()["isolation"]``): ``per-sandbox-user`` where root (each sandbox its own uid in
  its own PID/mount/IPC/UTS namespaces, in a view of the machine that holds only the system, Python, the command's
  program files, its workspace, a private ``/tmp`` and home); ``shared-user`` (the trainer's uid, limits only) only
  when accepted explicitly (``isolation="shared-user"``), else creating the backend raises ``SandboxError``;

* wall time: every process of a sandbox is killed (its process group, SIGTERM then SIGKILL) at its ``timeout``
  and at the sandbox's ``wall_s`` deadline;
* CPU time, address space (memory), file size, open files: ``setrlimit`` in every process it starts (inherited by
  their children);
* process count: a ``pids`` cgroup (``pids.max``) when the cgroup filesystem is writable, else ``RLIMIT_NPROC``
  (which the kernel does not apply to root); memory also through a ``memory`` cgroup when writable;
* network: commands run by ``exec`` go through ``unshare -n`` (a network namespace with nothing in it) when the OS
  permits it. ``start`` (a harness that must reach the proxy) keeps the network;
* a cap on how many sandboxes exist at once (``create`` waits for a slot, ``SandboxError`` after ``create_timeout_s``);
* cleanup: ``close`` kills every process and removes the directory, on success, error, timeout and cancellation.
  A worker killed with SIGKILL cannot clean up: each sandbox records its owner (pid + start time), and the next
  backend created on the same root reaps sandboxes whose owner is gone (processes found by cgroup, recorded
  process groups and an environment marker, then the directory).

A sandbox that cannot be created or run raises ``SandboxError``: the attempt fails (and is retried), it never
turns into a reward of 0.
"""

from lightning_sdk.sandbox._base import ExecResult, Sandbox, SandboxBackend, SandboxError, SandboxLimits
from lightning_sdk.sandbox._local import (
    ISOLATION_SHARED,
    ISOLATION_USER,
    ISOLATIONS,
    LocalBackend,
    LocalSandbox,
    describe_enforcement,
    reap_leftovers,
)
from lightning_sdk.sandbox._spec import BACKENDS, BackendRegistry, SandboxSpec, get_backend

__all__ = [
    "BACKENDS",
    "ISOLATIONS",
    "ISOLATION_SHARED",
    "ISOLATION_USER",
    "BackendRegistry",
    "ExecResult",
    "LocalBackend",
    "LocalSandbox",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxLimits",
    "SandboxSpec",
    "describe_enforcement",
    "get_backend",
    "reap_leftovers",
]
