"""attnkit's core needs NumPy only: importing attnkit and every module outside attnkit.torch loads no torch."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import importlib, pathlib, sys
import attnkit
root = pathlib.Path(attnkit.__file__).parent
names = []
for path in sorted(root.rglob("*.py")):
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[1:2] == ["torch"] or parts[-1] == "__main__":
        continue
    names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
for name in names:
    importlib.import_module(name)
    if "torch" in sys.modules:
        print("torch imported by", name)
        sys.exit(1)
print(len(names))
"""


def test_no_module_outside_attnkit_torch_imports_torch():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert int(done.stdout.split()[-1]) > 50  # the walk really visited the package
