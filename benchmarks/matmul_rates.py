"""GFLOP/s of the training step's float32 products on this CPU: torch's BLAS (`torch.mm`, MKL on x86)
against oneDNN (`leangrpo.cpu.onednn.linear`), for the forward (x @ W.T) and both backward products
(grad @ W, grad.T @ x) of SmolLM2-135M's Linear shapes over 850 positions (benchmark row a's update).
What `cpu.matmul: auto` decides between (leangrpo/cpu/onednn.py).

    python benchmarks/matmul_rates.py                # 850 rows, 20 repeats per product
    python benchmarks/matmul_rates.py --rows 256 --repeats 5
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from leangrpo.cpu import onednn
from leangrpo.cpu.onednn import cpu_name

SHAPES = {"q, o": (576, 576), "k, v": (576, 192), "gate, up": (576, 1536), "down": (1536, 576)}
# Each product as torch's BLAS and as oneDNN computes it, from (x [rows, in], W [out, in], grad [rows, out]).
PRODUCTS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    "x @ W.T": (lambda x, w, g: x @ w.T, lambda x, w, g: onednn.linear(x, w)),
    "grad @ W": (lambda x, w, g: g @ w, lambda x, w, g: onednn.linear(g, w.t())),
    "grad.T @ x": (lambda x, w, g: g.T @ x, lambda x, w, g: onednn.linear(g.t(), x.t())),
}


def seconds(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    """The best of `repeats` timed calls, after two warm-up calls."""
    fn(), fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=850)
    parser.add_argument("--repeats", type=int, default=20)
    a = parser.parse_args()
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, {a.rows} rows")
    print(f"{'Linear':10} {'product':12} {'BLAS GFLOP/s':>13} {'oneDNN GFLOP/s':>15} {'ratio':>6}")
    torch.manual_seed(0)
    for name, (k, n) in SHAPES.items():
        operands = torch.randn(a.rows, k), torch.randn(n, k), torch.randn(a.rows, n)  # x, W, grad
        for label, pair in PRODUCTS.items():
            blas, ours = (partial(f, *operands) for f in pair)
            torch.testing.assert_close(ours(), blas(), rtol=1e-4, atol=1e-3)
            flops = 2 * a.rows * k * n
            rate_blas, rate_ours = (flops / seconds(f, a.repeats) / 1e9 for f in (blas, ours))
            print(f"{name:10} {label:12} {rate_blas:13.0f} {rate_ours:15.0f} {rate_ours / rate_blas:6.2f}")


if __name__ == "__main__":
    main()
