"""lpmm.torch as a torch user meets it: the package, the classes and their arguments, param
groups, closures, every preset, gradient release, schedule-free evaluation."""

import subprocess
import sys

import pytest
import torch

import lpmm
import lpmm.torch
from conftest import bits, mlp, same_bits, train

CLASSES = {
    "AdamW8bit": "adamw_8bit",
    "AdamW4bit": "adamw_4bit",
    "LPMMSGDM": "lpmm_sgdm",
    "Lion8bit": "lion_8bit",
    "Adafactor": "adafactor_8bit",
    "CAME": "came_8bit",
    "AdEMAMix8bit": "ademamix_8bit",
    "ScheduleFreeAdamW8bit": "schedule_free_adamw_8bit",
    "RMSprop8bit": "rmsprop_8bit",
    "Adagrad8bit": "adagrad_8bit",
    "LAMB8bit": "lamb_8bit",
}


def test_import_lpmm_needs_no_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import lpmm\n"
        "assert 'adamw_8bit' in lpmm.PRESETS and lpmm.__version__\n"
        "try:\n"
        "    import lpmm.torch\n"
        "except ImportError:\n"
        "    print('lpmm.torch needs torch')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "lpmm.torch needs torch"


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_classes_train_with_their_presets_defaults(name):
    """Each class is its preset with torch's argument names; its defaults are the preset's (the
    Rust crate's), except Adafactor's relative step, whose learning rate is None."""
    cls = getattr(lpmm.torch, name)
    m = mlp()
    opt = cls(m.parameters(), **({} if name == "Adafactor" else {"lr": 1e-3}))
    generic = lpmm.torch.LpmmOptimizer(mlp().parameters(), CLASSES[name], lr=1e-3)
    mine = {k: v for k, v in opt.defaults.items()}
    theirs = dict(generic.defaults)
    if name == "Adafactor":
        assert mine.pop("relative_step") and mine.pop("lr") == 0.0
        theirs.pop("relative_step"), theirs.pop("lr")
    if name == "LPMMSGDM":
        assert opt.param_info()[0]["lent"] is False  # its 8-bit parameter
    assert mine == theirs
    assert isinstance(opt, torch.optim.Optimizer)
    losses = train(m, opt, 12)
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("preset", lpmm.PRESETS)
def test_every_preset_steps_and_round_trips(preset):
    m = mlp()
    lr = 0.0 if preset.startswith("adafactor") else 1e-3
    opt = lpmm.torch.LpmmOptimizer(m.parameters(), preset, lr=lr)
    train(m, opt, 2)
    assert opt.last_report["updated"] == len(list(m.parameters()))
    sd = opt.state_dict()
    opt2 = lpmm.torch.LpmmOptimizer(m.parameters(), preset, lr=lr)
    opt2.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(opt2.state_dict()["state"][0].values(), sd["state"][0].values()))


def test_closure_zero_grad_and_groups():
    m = mlp()
    decay = [p for n, p in m.named_parameters() if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in m.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    opt = lpmm.torch.AdamW8bit(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 0.0}], lr=1e-2
    )
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    frozen = [bits(p) for p in rest]
    losses = train(m, opt, 3, closure=True)
    assert all(isinstance(x, float) for x in losses)
    assert all(torch.equal(bits(p), b) for p, b in zip(rest, frozen)), "lr 0 moves nothing"
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    # A group added during training trains from then on.
    head = torch.nn.Linear(64, 64)
    opt.add_param_group({"params": head.parameters(), "lr": 1e-2})
    before = bits(head.weight)
    (head(m(torch.randn(4, 64))) ** 2).mean().backward()
    opt.step()
    assert not torch.equal(bits(head.weight), before)
    assert opt.param_groups[2]["betas"] == (0.9, 0.999)
    assert "AdamW8bit" in repr(opt)


def test_named_parameters_name_the_parameters():
    m = mlp()
    opt = lpmm.torch.AdamW8bit(m.named_parameters())
    assert [i["name"] for i in opt.param_info()] == [n for n, _ in m.named_parameters()]
    opt = lpmm.torch.AdamW8bit(m.parameters())
    assert opt.param_info()[1]["name"] == "param_groups[0]['params'][1]"


def test_parameters_without_gradients_are_skipped():
    m = mlp()
    m[0].weight.requires_grad_(False)
    opt = lpmm.torch.AdamW8bit(m.parameters(), lr=1e-2)
    before = bits(m[0].weight)
    train(m, opt, 2)
    assert torch.equal(bits(m[0].weight), before)
    assert opt.last_report["updated"] == len(list(m.parameters())) - 1
    warn = lpmm.torch.AdamW8bit(mlp().named_parameters(), missing_gradient="error")
    m2 = mlp()
    warn = lpmm.torch.AdamW8bit(m2.named_parameters(), missing_gradient="error")
    m2[0].weight.requires_grad_(False)
    with pytest.raises(lpmm.StepError, match="0.weight"):
        train(m2, warn, 1)


def test_bf16_parameters_with_stochastic_rounding_move_where_nearest_does_not():
    """Updates far below bf16's resolution: round-to-nearest loses them all, stochastic rounding
    keeps them on average (what lets bf16 parameters train)."""
    for storage, moves in (("bf16", False), ("bf16_sr", True), ("bf16_kahan", True)):
        p = torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16))
        opt = lpmm.torch.LpmmOptimizer([p], "sgdm_f32", lr=1e-4, momentum=0.0, param_storage=storage)
        for _ in range(20):
            p.grad = torch.ones_like(p)
            opt.step()
        moved = (p.float() != 1).any().item()
        assert moved == moves, storage
        # SR: the mean of the bf16 values is the true value; Kahan: each bf16 value is the true
        # value rounded (the compensation, lpmm's, holds the rest).
        tolerance = {"bf16_sr": 2e-4, "bf16_kahan": 2.0**-9}.get(storage)
        if moves:
            assert abs(p.float().mean().item() - (1 - 20e-4)) <= tolerance, storage


@pytest.mark.parametrize("cls", [lpmm.torch.AdamW8bit, lpmm.torch.AdamW4bit])
def test_gradient_release_steps_as_step_does(cls):
    """grad_release steps each parameter from its post-accumulate-grad hook and frees its
    gradient: the same bits as step() after backward, and no gradient left."""
    a, b = mlp(), mlp()
    opt_a = cls(a.parameters(), lr=1e-2, seed=3)
    opt_b = cls(b.parameters(), lr=1e-2, seed=3, grad_release=True)
    train(a, opt_a, 3)
    gen = torch.Generator().manual_seed(1000)
    for _ in range(3):
        x = torch.randn(16, 64, generator=gen)
        y = torch.randn(16, 64, generator=gen)
        (b(x) - y).pow(2).mean().backward()
        assert all(p.grad is None for p in b.parameters()), "gradients freed as they arrive"
        opt_b.step()  # nothing left to do
        opt_b.zero_grad()
    assert all(same_bits(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_schedule_free_eval_and_train():
    m = mlp()
    opt = lpmm.torch.ScheduleFreeAdamW8bit(m.parameters(), lr=1e-2)
    train(m, opt, 3)
    y = [p.detach().clone() for p in m.parameters()]
    opt.eval()
    assert any(not torch.equal(p, q) for p, q in zip(m.parameters(), y)), "x differs from y"
    (m(torch.randn(4, 64)) ** 2).mean().backward()
    with pytest.raises(lpmm.StepError, match="eval"):
        opt.step()
    with pytest.raises(lpmm.StateDictError, match="train"):
        opt.state_dict()
    opt.train()
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(m.parameters(), y))
    opt.zero_grad()
    train(m, opt, 1)
