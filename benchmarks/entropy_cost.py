"""What the per-token entropy costs in the chunked log-prob pass (forward + backward), at SmolLM2-135M's
lm_head shape: the same call with and without `with_entropy`, interleaved, medians and their ratio.

    python benchmarks/entropy_cost.py --rows 2048 --repeats 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from leangrpo.core.logprobs import token_logprobs


def timed(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, with_entropy: bool) -> float:
    """Seconds for one forward + backward of the chunked log-probs."""
    h = hidden.detach().requires_grad_()
    start = time.perf_counter()
    out = token_logprobs(h, weight, targets, 1.0, with_entropy=with_entropy)
    logp = out[0] if with_entropy else out
    logp.sum().backward()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048, help="completion tokens in the micro-batch")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, args.rows, args.hidden, generator=g).to(device)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.05).to(device)
    targets = torch.randint(0, args.vocab, (1, args.rows), generator=g).to(device)
    times: dict[bool, list[float]] = {False: [], True: []}
    timed(hidden, weight, targets, True)  # warm-up
    for _ in range(args.repeats):
        for flag in (False, True):
            times[flag].append(timed(hidden, weight, targets, flag))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"device {device}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    print(f"rows {args.rows}, hidden {args.hidden}, vocab {args.vocab}, repeats {args.repeats}")
    print(f"log-probs fwd+bwd: {off:.3f} s without entropy, {on:.3f} s with; ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
