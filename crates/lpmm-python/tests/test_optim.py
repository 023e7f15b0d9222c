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
    "Muon8bit": "muon_8bit",
    "Muon4bit": "muon_4bit",
}


def stepped(preset, model):
    """The parameters a preset steps: Muon's only the matrices (torch's Muon takes only those)."""
    if preset.startswith("muon"):
        return [p for p in model.parameters() if p.dim() == 2]
    return list(model.parameters())


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
    preset = CLASSES[name]
    opt = cls(stepped(preset, m), **({} if name == "Adafactor" else {"lr": 1e-3}))
    generic = lpmm.torch.LpmmOptimizer(stepped(preset, mlp()), preset, lr=1e-3)
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
    opt = lpmm.torch.LpmmOptimizer(stepped(preset, m), preset, lr=lr)
    train(m, opt, 2)
    assert opt.last_report["updated"] == len(stepped(preset, m))
    sd = opt.state_dict()
    opt2 = lpmm.torch.LpmmOptimizer(stepped(preset, m), preset, lr=lr)
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


def test_muon_follows_torch_optim_muon():
    """lpmm's f32 Muon against torch 2.15's ``torch.optim.Muon`` on the same matrices and
    gradients, 30 steps, each configuration torch has: within 1e-2 of each tensor's largest
    |value| (the bound of lpmm-optim's golden test, tests/muon.rs; torch orthogonalises in bf16,
    lpmm in f32)."""
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("this torch has no torch.optim.Muon")
    configs = [
        {},
        {"nesterov": False, "ns_steps": 3, "weight_decay": 0.01, "adjust_lr_fn": "match_rms_adamw"},
    ]
    for cfg in configs:
        torch.manual_seed(4)
        shapes = [(40, 96), (120, 36), (48, 48)]
        ours = [torch.nn.Parameter(torch.randn(s) * 0.5) for s in shapes]
        theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        hyper = dict(cfg)
        if "adjust_lr_fn" in hyper:  # torch's name and value, lpmm's field
            assert hyper.pop("adjust_lr_fn") == "match_rms_adamw"
            hyper["adjust_lr"] = "MatchRmsAdamW"
        a = lpmm.torch.LpmmOptimizer(ours, "muon_f32", lr=0.02, **hyper)
        b = torch.optim.Muon(theirs, lr=0.02, **cfg)
        gen = torch.Generator().manual_seed(9)
        for _ in range(30):
            for p, q in zip(ours, theirs):
                g = torch.randn(p.shape, generator=gen) * 0.01
                p.grad, q.grad = g.clone(), g.clone()
            a.step()
            b.step()
        for p, q in zip(ours, theirs):
            scale = q.detach().abs().max().item()
            diff = (p.detach() - q.detach()).abs().max().item()
            print(f"torch.optim.Muon {cfg or 'defaults'} {tuple(p.shape)}: {diff / scale:.2e}")
            assert diff <= 1e-2 * scale, (cfg, p.shape, diff / scale)
    # The bound can fail: AdamW's step from the same point lands far outside it.
    c = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    lpmm_adamw = lpmm.torch.LpmmOptimizer(c, "adamw_f32", lr=0.02)
    for p, q in zip(c, theirs):
        p.grad = torch.ones_like(p)
    lpmm_adamw.step()
    assert max((p.detach() - q.detach()).abs().max().item() for p, q in zip(c, theirs)) > 1e-2


def test_muon_refuses_what_is_not_a_matrix_naming_it():
    m = mlp()
    named = list(m.named_parameters())
    with pytest.raises(lpmm.ConfigError, match=r"0\.bias"):
        opt = lpmm.torch.Muon8bit(named, lr=1e-2)
        train(m, opt, 1)
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        lpmm.torch.Muon8bit(stepped("muon_8bit", m), adjust_lr_fn="spectral")
    # torch's adjust_lr_fn names reach lpmm's rule.
    opt = lpmm.torch.Muon4bit(stepped("muon_4bit", m), adjust_lr_fn="match_rms_adamw")
    assert opt.defaults["adjust_lr"] == "MatchRmsAdamW"
    train(m, opt, 2)
