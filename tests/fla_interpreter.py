"""Run a test module's ``_compare_with_fla()`` in a subprocess with FLA 0.6.0's Triton kernels on Triton's CPU
interpreter (``TRITON_INTERPRET`` is read when Triton is imported, so it cannot be set inside the test process) and
cula on its reference backend; return the JSON it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fla_interpreter_results(module: str, timeout: int = 900) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", FLA_CULA="0", FLA_FLASH_KDA="0", CULA_BACKEND="reference",
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")]))
    script = f"import json, {module} as t; print('@@' + json.dumps(t._compare_with_fla()))"
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip
    line = [x for x in proc.stdout.splitlines() if x.startswith("@@")]
    assert proc.returncode == 0 and line, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(line[0][2:])
