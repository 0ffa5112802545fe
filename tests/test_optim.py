"""The shared AdamW: fused where the device allows, the same update as torch's per-tensor AdamW."""

import copy

import torch

from judgeloop.optim import adamw


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(7, 5), (5,), (3, 3, 2)]]


def test_adamw_is_fused_on_cpu_and_matches_the_per_tensor_update():
    fused_params, plain_params = _params(0), _params(0)
    groups = [
        {"params": fused_params[:2], "weight_decay": 0.1},
        {"params": fused_params[2:], "weight_decay": 0.0},
    ]
    fused = adamw(groups, lr=0.01)
    plain = torch.optim.AdamW(
        [
            {"params": plain_params[:2], "weight_decay": 0.1},
            {"params": plain_params[2:], "weight_decay": 0.0},
        ],
        lr=0.01,
        foreach=False,
    )
    assert fused.defaults["fused"] is True and plain.defaults["fused"] is not True
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for a, b in zip(fused_params, plain_params):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        fused.step()
        plain.step()
    for a, b, start in zip(fused_params, plain_params, _params(0)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(a, start)  # the steps moved the weights
    # the state dict is the same AdamW state: after 5 steps it loads into a per-tensor optimizer, and the
    # next step from there equals the fused optimizer's next step
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in fused_params]
    resumed = torch.optim.AdamW(
        [
            {"params": resumed_params[:2], "weight_decay": 0.1},
            {"params": resumed_params[2:], "weight_decay": 0.0},
        ],
        lr=0.01,
        foreach=False,
    )
    resumed.load_state_dict(copy.deepcopy(fused.state_dict()))  # a copy, as a checkpoint on disk is
    for a, b in zip(fused_params, resumed_params):
        grad = torch.randn(a.shape, generator=g)
        a.grad, b.grad = grad.clone(), grad.clone()
    fused.step()
    resumed.step()
    for a, b in zip(fused_params, resumed_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_adamw_falls_back_when_it_cannot_fuse():
    ints = [
        torch.nn.Parameter(torch.randn(2)),
        torch.nn.Parameter(torch.ones(2, dtype=torch.long), requires_grad=False),
    ]
    assert not adamw(ints, lr=0.1).defaults["fused"]  # a non-float tensor: torch's default path
    meta = [torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.randn(2, device="meta"))]
    opt = adamw(meta, lr=0.1)  # two devices: torch's default path
    assert not opt.defaults["fused"]
