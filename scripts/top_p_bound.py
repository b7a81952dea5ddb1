"""How close top-p's drawn token sits to its cut, on rows drawn like the bench's.

Top-p with Gumbel-max draws the entry with the best perturbed score among the smallest prefix
(by logit, ties by index) whose mass reaches p of the row's. Scanned in logit order, that is
the last record of the running maximum score whose prefix mass before it is below p·U (U the
row's mass). A fused sampler that keeps only per-tile summaries of the mass (a histogram over
logit bins, say) knows each prefix mass to within the mass of one bin around it; it settles
the row only when that uncertainty is below the margin between p·U and the prefix masses of
the two records that straddle it. This script measures that margin (as a fraction of U) and
rho, the row's mass per unit of logit near the cut (a bin of width w around the cut holds about
rho·w of the mass), so P(margin < rho·w) is the share of rows such a summary leaves unsettled.

    python3 scripts/top_p_bound.py [--rows 300] [--vocab 151936] [--p 0.9]

The bench's logits are close to normal with sigma 2.1 (W uniform on ±0.05, x on ±2, D = 4096);
sigma 1 and 4 bracket flatter and sharper rows. Seeded, so reruns print the same figures.
"""
import argparse

import numpy as np


def row_margin(rng, vocab, p, sigma):
    logits = rng.normal(0.0, sigma, vocab)
    gumbel = rng.gumbel(size=vocab)
    order = np.argsort(-logits, kind="stable")
    sorted_logits = logits[order]
    mass = np.exp(sorted_logits - sorted_logits[0])
    through = np.cumsum(mass)
    total = through[-1]
    before = through - mass
    cut = int(np.searchsorted(through, p * total))
    scores = sorted_logits + gumbel[order]
    records = np.nonzero(scores >= np.maximum.accumulate(scores))[0]
    drawn = records[records <= cut][-1]
    margins = [(p * total - before[drawn]) / total]
    after = records[records > cut]
    if len(after):
        margins.append((before[after[0]] - p * total) / total)
    tau = sorted_logits[cut]
    near = (sorted_logits > tau - 0.05) & (sorted_logits <= tau + 0.05)
    rho = mass[near].sum() / total / 0.1
    return cut + 1, min(margins), rho


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--p", type=float, default=0.9)
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    for sigma in (2.1, 4.0, 1.0):
        rows = [row_margin(rng, args.vocab, args.p, sigma) for _ in range(args.rows)]
        kept = np.array([r[0] for r in rows])
        margin = np.array([r[1] for r in rows])
        rho = np.array([r[2] for r in rows])
        print(
            f"sigma {sigma}: kept median {np.median(kept):.0f} of {args.vocab}; "
            f"rho median {np.median(rho):.3f}; margin quantiles 1/5/50 %: "
            + ", ".join(f"{q:.2e}" for q in np.quantile(margin, [0.01, 0.05, 0.5]))
        )
        for d in (1e-2, 1e-3, 1e-4):
            print(f"    P(margin < {d:g}) = {np.mean(margin < d):.4f}")


if __name__ == "__main__":
    main()
