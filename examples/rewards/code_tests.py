"""A code task's reward: the response's last Python code block is run against the row's unit tests (a
data column handed over as ``data.fields.extra: [tests]``) in a subprocess with limits.

    data:
      fields: {problem: question, answer: null, extra: [tests]}
    algorithm:
      reward_functions: {solver: examples/rewards/code_tests.py:score}

Score 1.0 when every test passes (the test script exits 0), else 0.0; details say why (``failed``,
``time``, ``memory``, ``no_code``). The limits, each per run of the tests:

- time: ``CPU_S`` seconds of CPU (RLIMIT_CPU) and ``WALL_S`` seconds of wall clock (the whole process
  group is killed);
- memory: ``MEMORY_BYTES`` of address space (RLIMIT_AS), ``FILE_BYTES`` per written file (RLIMIT_FSIZE),
  64 open files, no core dumps;
- no network: the tests run in a network namespace of their own with no interface up (``unshare -n`` as
  root, ``unshare -rn`` in a user namespace otherwise); where neither can be made, the function refuses to
  run code (every output scores 0 with detail ``no_sandbox``, and the reason is printed once);
- a fresh temporary folder as working directory, a clean environment, Python in isolated mode (``-I``).

This is an example of a checker, not a security boundary: the code runs as the user who runs mars, can
read what that user can read, and can use the CPU for ``CPU_S`` seconds. Run untrusted code in a
container or VM of its own.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from functools import cache

from mars_megatron.rewards.functions import RewardResult

CPU_S = 5
WALL_S = 10.0
MEMORY_BYTES = 512 * 2**20
FILE_BYTES = 16 * 2**20
_CODE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def _limits() -> None:
    """In the child, before it runs Python: a session of its own (so the group can be killed) and the
    resource limits."""
    os.setsid()
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_S, CPU_S))
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_BYTES, FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@cache
def network_jail() -> tuple[str, ...] | None:
    """The command prefix that gives a process a network namespace of its own (None: none can be made
    here)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for prefix in ((unshare, "-n"), (unshare, "-rn")):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


def run_tests(code: str, tests: str) -> dict[str, float]:
    """Run ``code`` then ``tests`` in the sandbox; the details of the outcome."""
    jail = network_jail()
    if jail is None:
        print("code_tests: no network namespace can be made here (unshare -n / -rn): not running code",
              file=sys.stderr)  # fmt: skip
        return {"no_sandbox": 1.0}
    with tempfile.TemporaryDirectory(prefix="mars-code-") as folder:
        script = os.path.join(folder, "run_tests.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(code + "\n\n" + tests + "\n")
        env = {"PATH": "/usr/bin:/bin", "HOME": folder, "LANG": "C.UTF-8"}
        proc = subprocess.Popen(
            [*jail, sys.executable, "-I", "-B", script], cwd=folder, env=env, preexec_fn=_limits,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            _, err = proc.communicate(timeout=WALL_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"time": 1.0}
    if proc.returncode == 0:
        return {"passed": 1.0}
    if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return {"time": 1.0}
    if b"MemoryError" in err:
        return {"memory": 1.0}
    return {"failed": 1.0}


def score(request):
    blocks = _CODE.findall(request.response)
    if not blocks:
        return RewardResult(0.0, details={"no_code": 1.0})
    details = run_tests(blocks[-1], str(request.extra["tests"]))
    return RewardResult(details.get("passed", 0.0), details=details)
