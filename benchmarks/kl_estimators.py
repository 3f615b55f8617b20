"""Bias and spread of the k1 and k3 KL estimators between Gaussians as their means separate.

Reproduces the idea of the Composer 2 report's Figure 4. Samples x ~ p_theta = N(0, 1), reference
p_ref = N(mu, 1), r = p_ref(x) / p_theta(x) = exp(mu x - mu^2 / 2); the true KL(p_theta || p_ref) = mu^2 / 2.
Both k1 = -log r and k3 = (r - 1) - log r are unbiased, but

    std(k1) = mu                  std(k3) = sqrt(exp(mu^2) - 1 - mu^2)

so k3's spread explodes as the policies separate, and a finite-sample mean of k3 becomes unreliable (its
heavy right tail is rarely sampled, so typical batch means fall short of the truth). The benchmark
measures mean bias, the median bias of batch means (what a training step typically sees) and the
per-sample std of each estimator, prints k3's std as a ratio against the k1 baseline measured in the same
run, and saves a PNG.

    python benchmarks/kl_estimators.py [--samples 1000000] [--batch 4096] [--out runs/benchmarks/kl_estimators.png]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rl.algorithm import kl_estimate  # noqa: E402

MUS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)


def gaussian_logpdf(x: torch.Tensor, mean: float) -> torch.Tensor:
    return -0.5 * (x - mean) ** 2 - 0.5 * math.log(2 * math.pi)


def measure(mu: float, samples: int, batch: int, gen: torch.Generator) -> dict[str, float]:
    x = torch.randn(samples, generator=gen, dtype=torch.float64)
    logp, ref_logp = gaussian_logpdf(x, 0.0), gaussian_logpdf(x, mu)
    true_kl = mu * mu / 2
    row = {"mu": mu, "true_kl": true_kl}
    for kind in ("k1", "k3"):
        k = kl_estimate(logp, ref_logp, kind)
        batch_means = k[: samples // batch * batch].view(-1, batch).mean(-1)
        row[f"{kind}_bias"] = (k.mean() - true_kl).item()
        row[f"{kind}_bias_stderr"] = (k.std() / math.sqrt(samples)).item()
        row[f"{kind}_median_batch_bias"] = (batch_means.median() - true_kl).item()
        row[f"{kind}_std"] = k.std().item()
    row["k1_std_analytic"] = mu
    row["k3_std_analytic"] = math.sqrt(math.expm1(mu * mu) - mu * mu)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1_000_000, help="samples per mean separation")
    parser.add_argument("--batch", type=int, default=4096, help="tokens per batch for the median batch-mean bias")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/benchmarks/kl_estimators.png", help="where to save the PNG")
    args = parser.parse_args()
    if args.batch > args.samples:
        parser.error(f"--batch ({args.batch}) must not exceed --samples ({args.samples})")

    gen = torch.Generator().manual_seed(args.seed)
    rows = [measure(mu, args.samples, args.batch, gen) for mu in tqdm(MUS, desc="mean separations")]

    print(f"x ~ N(0,1), ref N(mu,1), {args.samples} samples per mu; baseline: k1. "
          f"bias = sample mean - mu^2/2 (+- stderr); median batch bias over batches of {args.batch}")
    header = (f"{'mu':>5} {'KL':>7} | {'k1 bias':>17} {'k1 med.b':>9} {'k1 std':>8} | "
              f"{'k3 bias':>17} {'k3 med.b':>9} {'k3 std':>9} {'(analytic)':>10} | {'std k3/k1':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['mu']:5.2f} {r['true_kl']:7.4f} | {r['k1_bias']:+9.5f}+-{r['k1_bias_stderr']:.5f} "
              f"{r['k1_median_batch_bias']:+9.5f} {r['k1_std']:8.4f} | "
              f"{r['k3_bias']:+9.5f}+-{r['k3_bias_stderr']:.5f} {r['k3_median_batch_bias']:+9.5f} "
              f"{r['k3_std']:9.4f} {r['k3_std_analytic']:10.4f} | {r['k3_std'] / r['k1_std']:9.3f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mus = [r["mu"] for r in rows]
    fig, (ax_bias, ax_std) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, color in (("k1", "tab:blue"), ("k3", "tab:red")):
        ax_bias.plot(mus, [r[f"{kind}_median_batch_bias"] / r["true_kl"] for r in rows], "o-", color=color,
                     label=f"{kind}: median batch mean")
        ax_bias.errorbar(mus, [r[f"{kind}_bias"] / r["true_kl"] for r in rows],
                         yerr=[r[f"{kind}_bias_stderr"] / r["true_kl"] for r in rows], fmt="x--", color=color,
                         alpha=0.6, label=f"{kind}: mean over all samples")
        ax_std.semilogy(mus, [r[f"{kind}_std"] / r["true_kl"] for r in rows], "o-", color=color,
                        label=f"{kind} measured")
    for kind, color in (("k1", "tab:blue"), ("k3", "tab:red")):
        ax_std.semilogy(mus, [r[f"{kind}_std_analytic"] / r["true_kl"] for r in rows], ":", color=color,
                        label=f"{kind} analytic")
    ax_bias.axhline(0.0, color="gray", lw=0.5)
    ax_bias.set(xlabel="mean separation mu", ylabel="relative bias (estimate - KL) / KL",
                title=f"Bias (batches of {args.batch})")
    ax_std.set(xlabel="mean separation mu", ylabel="per-sample std / KL", title="Spread")
    ax_bias.legend(fontsize=7)
    ax_std.legend(fontsize=7)
    fig.suptitle("KL(N(0,1) || N(mu,1)) estimators: k1 = -log r vs k3 = r - 1 - log r")
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
