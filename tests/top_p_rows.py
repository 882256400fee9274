"""Top-p rows whose cut falls among ties to the last unit, shared by the interpreter's and the GPU's top-p tests."""

from __future__ import annotations

import math

import torch

from k3runtime.sampler import TOP_P_SCALE

# (the row's max, the tied value): cuts positive, negative, zero and tiny
CUTS = ((2.0, 0.7), (1.0, -1.3), (0.0, -0.0), (3.0, 1e-40), (0.25, -2.0 ** -130), (17.5, -3.1))


def tie_weight_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `vocab` tokens: a max, then eight ties (the rest -inf, as after a top-k), three rows a cut, with T on
    the mass of the max and two ties and one fp64 step either side (the sort keeps two ties at or under it, three
    over it): (x [rows, vocab] fp32, top_p [rows] fp64) on the CPU."""
    rows, top_ps = [], []
    for m, c in CUTS:
        x = torch.full((vocab,), float("-inf"))
        x[0], x[1:9] = m, c
        w = (torch.exp((x[:9] - m).double()) * TOP_P_SCALE).round().long()
        total, mass = int(w.sum()), int(w[0] + 2 * w[1])
        p = mass / total
        while p * total < mass:
            p = math.nextafter(p, 2.0)
        while p * total > mass:
            p = math.nextafter(p, 0.0)
        rows += [x] * 3
        top_ps += [math.nextafter(p, 0.0), p, math.nextafter(p, 2.0)]
    return torch.stack(rows), torch.tensor(top_ps, dtype=torch.float64)
