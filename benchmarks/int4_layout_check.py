"""Cross-check kvforge's AWQ and GPTQ unpacking against the projects' own code (not a test: the
libraries do not import in the test environment; run by hand, docs/quantization.md records the result).

    pip install --no-deps --target /tmp/qlib autoawq==0.2.9 auto-gptq==0.7.1
    PYTHONPATH=/tmp/qlib python benchmarks/int4_layout_check.py

AutoAWQ: ``awq/utils/packing_utils.py``'s ``dequantize_gemm`` (it imports only torch) on words packed by
the test packer, against kvforge's conversion. AutoGPTQ: ``QuantLinear.pack`` (qlinear_cuda_old)
run on a stand-in module (its package ``__init__`` does not import with transformers 5), on weights
on the quantization grid, against kvforge's unpacking."""
from __future__ import annotations

import importlib.util
import math
import os
import sys
import textwrap
import types

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from kvforge.plugins.quantization import int4  # noqa: E402
from quantized_checkpoints import awq_pack  # noqa: E402

ROOT = next(p for p in sys.path if os.path.isdir(os.path.join(p, "awq")))
K, N, G = 256, 64, 64


def awq() -> float:
    spec = importlib.util.spec_from_file_location("awq_packing", os.path.join(ROOT, "awq/utils/packing_utils.py"))
    lib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lib)
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (K, N), generator=g, dtype=torch.int32)
    z = torch.randint(0, 16, (K // G, N), generator=g, dtype=torch.int32)
    s = torch.rand(K // G, N, generator=g).half()
    ref = lib.dequantize_gemm(awq_pack(q), awq_pack(z), s, 4, G)
    ours = int4.dequantize(int4.pack_rows(int4.unpack_cols(awq_pack(q), int4.AWQ_ORDER)), s.float(),
                           int4.unpack_cols(awq_pack(z), int4.AWQ_ORDER).float(), G)
    return (ref - ours.half()).abs().max().item()


def gptq() -> float:
    import transformers

    src = open(os.path.join(ROOT, "auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py")).read()
    body = src[src.index("    def pack(self, linear, scales, zeros, g_idx):"):]
    ns = {"torch": torch, "np": np, "nn": torch.nn, "math": math, "transformers": transformers}
    exec(textwrap.dedent(body[:body.index("\n    def ", 10)]), ns)
    g = torch.Generator().manual_seed(1)
    scales = torch.rand(N, K // G, generator=g) * 0.1 + 0.01
    zeros = torch.full((N, K // G), 8.0)
    q = torch.randint(0, 16, (N, K), generator=g)
    linear = torch.nn.Linear(K, N, bias=False)
    linear.weight.data = (q - 8) * scales.repeat_interleave(G, 1)  # on the grid: pack must give back q
    module = types.SimpleNamespace(bits=4, group_size=G, infeatures=K, outfeatures=N)
    ns["pack"](module, linear, scales, zeros.clone(), None)
    got_q = int4.unpack_rows(module.qweight)
    got_z = int4.unpack_cols(module.qzeros).float() + 1  # checkpoint_format "gptq": stored minus one
    assert torch.equal(got_q, q.t().int()) and got_z.eq(8).all()
    ours = int4.dequantize(int4.pack_rows(got_q), module.scales.float(), got_z, G)
    return (ours - linear.weight.t()).abs().max().item()


if __name__ == "__main__":
    print(f"AWQ: kvforge vs AutoAWQ dequantize_gemm (fp16), max |diff| = {awq()}")
    print(f"GPTQ: kvforge unpacking of AutoGPTQ QuantLinear.pack, max |diff| = {gptq()}")
