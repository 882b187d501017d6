"""kvforge.kernels holds every Triton kernel (module-level ``@triton.jit``); nothing outside it imports
triton when it is imported, so ``import kvforge`` and plugin discovery stay free of triton (and CUDA),
and a missing or broken triton leaves the torch references running. Each check runs in a fresh Python:
this process may have imported triton already."""
import subprocess
import sys

#: every kvforge module but the kernel modules, imported one by one after plugin discovery
NO_TRITON_ON_IMPORT = """
import importlib, pkgutil, sys
import kvforge, kvforge.plugins, kvforge.server, kvforge.bench
from kvforge.plugin_manager import get_plugin_manager

get_plugin_manager()  # discovery: every registered plugin module is loaded
assert "triton" not in sys.modules, "plugin discovery imported triton"
names = set()
for pkg in (kvforge, kvforge.plugins, kvforge.server, kvforge.bench):
    names.update(m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."))
names = sorted(n for n in names if not n.startswith("kvforge.kernels."))
for name in names:
    importlib.import_module(name)
    assert "triton" not in sys.modules, f"importing {name} imported triton"
print(len(names), "modules")
"""

#: triton as if it were not installed: every caller keeps to its torch reference
WITHOUT_TRITON = """
import os, sys
sys.modules["triton"] = None  # an import of triton raises ImportError
os.environ["TRITON_INTERPRET"] = "1"  # the kernels would run on CPU tensors, if triton imported
import torch
from kvforge import kernels
from kvforge.layers import fused_moe
from kvforge.plugins.models import fused_ops
from kvforge.plugins.quantization import fp8, int4

assert not kernels.triton_imports()
x = torch.randn(3, 64)
assert not kernels.runs_on(x) and not fused_moe.use_triton(x) and not fused_ops.use_fused(x)
q, s = fp8.quantize_per_token_fp8(x)
assert torch.equal(s, fp8.quantize_rows(x)[1])
qweight, scales, zeros = torch.zeros(8, 16, dtype=torch.int32), torch.ones(1, 16), torch.zeros(1, 16)
assert torch.equal(int4.w4a16_gemm(x, qweight, scales, zeros, 64), x @ int4.dequantize(qweight, scales, zeros, 64))
print("ok")
"""


def _run(script: str) -> str:
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc.stdout


def test_importing_kvforge_and_its_plugins_does_not_import_triton():
    assert " modules" in _run(NO_TRITON_ON_IMPORT)


def test_without_triton_no_kernel_module_loads():
    assert _run(WITHOUT_TRITON).strip() == "ok"
