import pytest
import torch

from k3plugins.router import route


def _naive(x, w, bias, top_k, renorm, scale, groups, topk_group):
    """fp64 per-token loop: returns ids sorted by descending biased score and their weights."""
    s = torch.sigmoid(x.double() @ w.double().T)
    choice = s + bias.double()
    E = w.shape[0]
    ids, wts = [], []
    for m in range(x.shape[0]):
        c = choice[m].clone()
        if groups > 1:
            per = E // groups
            gscore = [sorted(c[i * per:(i + 1) * per].tolist())[-2:] for i in range(groups)]
            best = sorted(range(groups), key=lambda i: -sum(gscore[i]))[:topk_group]
            for i in range(groups):
                if i not in best:
                    c[i * per:(i + 1) * per] = float("-inf")
        order = sorted(range(E), key=lambda e: -c[e].item())[:top_k]
        wt = s[m, order]
        if renorm:
            wt = wt / (wt.sum() + 1e-20)
        ids.append(order)
        wts.append(wt * scale)
    return torch.tensor(ids), torch.stack(wts)


CASES = {
    "E16-k4": dict(M=63, D=48, E=16, top_k=4, renorm=True, scale=1.0, groups=1, topk_group=1),
    "E64-k6-scale2.5": dict(M=100, D=40, E=64, top_k=6, renorm=True, scale=2.5, groups=1, topk_group=1),
    "E32-k3-norenorm": dict(M=17, D=24, E=32, top_k=3, renorm=False, scale=1.0, groups=1, topk_group=1),
    "E64-k8-groups8of3": dict(M=63, D=32, E=64, top_k=8, renorm=True, scale=1.0, groups=8, topk_group=3),
    "E24-k2-groups4of1": dict(M=9, D=16, E=24, top_k=2, renorm=True, scale=1.0, groups=4, topk_group=1),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_route_matches_naive(case):
    g = torch.Generator().manual_seed(case["E"] + case["M"])
    x = torch.randn(case["M"], case["D"], generator=g)
    w = torch.randn(case["E"], case["D"], generator=g) / case["D"] ** 0.5
    bias = torch.randn(case["E"], generator=g) * 0.3
    ids, wts = route(x, w, bias, top_k=case["top_k"], renormalize=case["renorm"], scaling_factor=case["scale"],
                     num_expert_group=case["groups"], topk_group=case["topk_group"])
    ref_ids, ref_w = _naive(x, w, bias, case["top_k"], case["renorm"], case["scale"], case["groups"],
                            case["topk_group"])
    assert ids.dtype == torch.int64 and wts.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(wts.double(), ref_w, rtol=1e-6, atol=1e-7)
    if case["renorm"]:
        torch.testing.assert_close(wts.sum(-1), torch.full((case["M"],), case["scale"]))
    if case["groups"] > 1:
        per = case["E"] // case["groups"]
        assert all(len(set((row // per).tolist())) <= case["topk_group"] for row in ids)


def test_bias_selects_but_does_not_weigh():
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    w = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    bias = torch.zeros(6)
    bias[4] = 10.0                       # expert 4 always wins the selection
    ids, wts = route(x, w, bias, top_k=2, renormalize=False, scaling_factor=1.0)
    assert (ids[:, 0] == 4).all()
    # The weight is the raw sigmoid score, without the bias.
    torch.testing.assert_close(wts[:, 0], torch.sigmoid(x @ w[4]))
    ids_nobias, _ = route(x, w, None, top_k=2, renormalize=False, scaling_factor=1.0)
    assert not torch.equal(ids, ids_nobias)


def test_route_bf16_weights_are_upcast():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(63, 32, generator=g).bfloat16(), torch.randn(16, 32, generator=g).bfloat16()
    bias = torch.randn(16, generator=g) * 0.1
    ids, wts = route(x, w, bias, top_k=4, renormalize=True, scaling_factor=1.0)
    ref_ids, ref_w = _naive(x.float(), w.float(), bias, 4, True, 1.0, 1, 1)
    assert wts.dtype == torch.float32 and torch.equal(ids, ref_ids)
    torch.testing.assert_close(wts.double(), ref_w, rtol=1e-6, atol=1e-7)


def test_route_rejects_bad_config():
    x, w = torch.ones(2, 8), torch.ones(12, 8)
    with pytest.raises(ValueError, match="cannot form 5 groups"):
        route(x, w, None, top_k=2, renormalize=True, scaling_factor=1.0, num_expert_group=5)
    with pytest.raises(ValueError, match="correction_bias must be"):
        route(x, w, torch.zeros(11), top_k=2, renormalize=True, scaling_factor=1.0)
    with pytest.raises(ValueError, match="top_k=13"):
        route(x, w, None, top_k=13, renormalize=True, scaling_factor=1.0)
