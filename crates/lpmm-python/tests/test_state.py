"""state_dict / load_state_dict: round trips through torch.save and torch.load, bit-exact resume,
torch's dtype cast of state, LR schedulers, and state dicts that must be refused."""

import io

import pytest
import torch

import lpmm
import lpmm.torch
from conftest import bits, mlp, same_bits, train


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def model_bits(model):
    return [bits(p) for p in model.parameters()]


@pytest.mark.parametrize(
    "cls,dtype,kwargs",
    [
        (lpmm.torch.AdamW8bit, torch.float32, {}),
        (lpmm.torch.AdamW8bit, torch.bfloat16, {}),  # bf16 parameters with stochastic rounding
        (lpmm.torch.AdamW8bit, torch.bfloat16, {"param_storage": "bf16_kahan"}),
        (lpmm.torch.AdamW4bit, torch.bfloat16, {"param_storage": "split_f32"}),
        (lpmm.torch.LPMMSGDM, torch.float32, {}),  # the 8-bit parameter held by lpmm
        (lpmm.torch.Lion8bit, torch.bfloat16, {}),
        (lpmm.torch.CAME, torch.float32, {}),
        (lpmm.torch.ScheduleFreeAdamW8bit, torch.float32, {}),
    ],
    ids=lambda c: getattr(c, "__name__", str(c)).replace("torch.", ""),
)
def test_resume_is_bit_exact(cls, dtype, kwargs):
    """Train 6 steps; or train 3, save model and optimizer through torch.save, load both into a
    fresh model and optimizer (torch.load, load_state_dict: torch casts the state to the
    parameters' dtype), train 3 more: every parameter bit equal."""
    a = mlp(dtype)
    opt_a = cls(a.parameters(), lr=1e-2, seed=4, **kwargs)
    train(a, opt_a, 6)

    b = mlp(dtype)
    opt_b = cls(b.parameters(), lr=1e-2, seed=4, **kwargs)
    train(b, opt_b, 3)
    saved = roundtrip({"model": b.state_dict(), "opt": opt_b.state_dict()})

    c = mlp(dtype, seed=99)  # another initialisation, replaced by the loaded state
    opt_c = cls(c.parameters(), lr=1e-2, seed=4, **kwargs)
    c.load_state_dict(saved["model"])
    casts = []
    policy = torch.optim.Optimizer._process_value_according_to_param_policy

    def spy(*args, **kwargs):
        out = policy(*args, **kwargs)
        casts.append((args[1].dtype, out.dtype))
        return out

    torch.optim.Optimizer._process_value_according_to_param_policy = staticmethod(spy)
    try:
        opt_c.load_state_dict(saved["opt"])
    finally:
        torch.optim.Optimizer._process_value_according_to_param_policy = staticmethod(policy)
    # torch's load_state_dict did cast the state: the byte tensors reached lpmm as the
    # parameters' dtype.
    assert (torch.uint8, dtype) in casts
    train(c, opt_c, 3, seed=0)

    # The continuation saw the same batches as steps 3..5 of the uninterrupted run.
    d = mlp(dtype)
    opt_d = cls(d.parameters(), lr=1e-2, seed=4, **kwargs)
    train(d, opt_d, 3)
    saved_d = roundtrip({"model": d.state_dict(), "opt": opt_d.state_dict()})
    e = mlp(dtype, seed=7)
    opt_e = cls(e.parameters(), lr=1e-2, seed=4, **kwargs)
    opt_e.load_state_dict(saved_d["opt"])  # the optimizer first, the model after: the same
    e.load_state_dict(saved_d["model"])
    gen_steps = train(d, opt_d, 3, seed=0)
    train(e, opt_e, 3, seed=0)
    assert all(same_bits(x, y) for x, y in zip(model_bits(c), model_bits(d))), "resume differs"
    assert all(same_bits(x, y) for x, y in zip(model_bits(e), model_bits(d))), "load order matters"
    assert all(map(lambda v: v == v, gen_steps))
    # The states too.
    sa, sd = opt_c.state_dict()["state"], opt_d.state_dict()["state"]
    for k in sd:
        for key in sd[k]:
            if key != "step":
                assert torch.equal(sa[k][key], sd[k][key]), (k, key)


def test_state_survives_the_cast_only_as_bytes():
    """The premise of the byte layout: torch's load_state_dict casts every state tensor to a
    bf16 parameter's dtype. An f32 absmax would lose bits there; a byte survives."""
    p = torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
    o = torch.optim.SGD([p], lr=0.1)
    absmax = torch.tensor([0.123456789, 3.14159265], dtype=torch.float32)
    o.load_state_dict({"state": {0: {"absmax": absmax, "bytes": torch.arange(256, dtype=torch.uint8)}},
                       "param_groups": o.state_dict()["param_groups"]})
    assert o.state[p]["absmax"].dtype == torch.bfloat16
    assert not torch.equal(o.state[p]["absmax"].float(), absmax)
    assert torch.equal(o.state[p]["bytes"].to(torch.uint8), torch.arange(256, dtype=torch.uint8))


def test_state_dict_layout():
    m = mlp()
    opt = lpmm.torch.AdamW8bit(m.parameters(), lr=1e-3)
    train(m, opt, 2)
    sd = opt.state_dict()
    assert sorted(sd) == ["param_groups", "state"]
    assert len(sd["state"]) == len(list(m.parameters()))
    w = sd["state"][0]
    assert w["step"].item() == 2
    assert {k: v.dtype for k, v in w.items() if k != "step"} == {
        k: torch.uint8 for k in ("lpmm", "state1", "state1.absmax", "state2", "state2.absmax")
    }
    assert sd["param_groups"][0]["betas"] == (0.9, 0.999)
    assert sd["param_groups"][0]["params"] == [0, 1, 2, 3, 4, 5]


def test_schedulers_change_the_learning_rate():
    """torch's schedulers change param_groups' lr between steps; lpmm steps with it, as the same
    optimizer constructed with that lr would."""
    a = mlp()
    opt_a = lpmm.torch.AdamW8bit(a.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.1)
    train(a, opt_a, 3, scheduler=sched)
    assert opt_a.param_groups[0]["lr"] == pytest.approx(1e-3)
    # The same three steps with the rates set by hand.
    b = mlp()
    opt_b = lpmm.torch.AdamW8bit(b.parameters(), lr=1e-2)
    gen_lrs = [1e-2, 1e-2, 1e-2 * 0.1]
    for i, lr in enumerate(gen_lrs):
        for g in opt_b.param_groups:
            g["lr"] = lr
        train_one(b, opt_b, i)
    c = mlp()
    opt_c = lpmm.torch.AdamW8bit(c.parameters(), lr=1e-2)
    train(c, opt_c, 3)  # without the schedule: different
    assert all(same_bits(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(same_bits(x, y) for x, y in zip(a.parameters(), c.parameters()))


def train_one(model, opt, index):
    """Step `index` of `train`'s sequence alone."""
    gen = torch.Generator().manual_seed(1000)
    for _ in range(index + 1):
        x = torch.randn(16, 64, generator=gen)
        y = torch.randn(16, 64, generator=gen)
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    opt.step()


def test_one_cycle_changes_betas_too():
    """OneCycleLR cycles beta1 as well as lr: lpmm follows (its state moved to an optimizer with
    the new betas), as an optimizer constructed with each step's betas would step."""
    a = mlp()
    opt = lpmm.torch.AdamW8bit(a.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    betas = []
    for i in range(4):
        betas.append(opt.param_groups[0]["betas"])
        train_one(a, opt, i)
        sched.step()
    assert len(set(betas)) > 1
    lpmm_state = opt.state_dict()["state"][0]
    assert lpmm_state["step"].item() == 4
    # Against lpmm with the betas set by hand each step.
    b = mlp()
    opt_b = lpmm.torch.AdamW8bit(b.parameters(), lr=1e-2)
    sched_b = torch.optim.lr_scheduler.OneCycleLR(opt_b, max_lr=1e-2, total_steps=10, cycle_momentum=False)
    for i in range(4):
        opt_b.param_groups[0]["betas"] = betas[i]
        train_one(b, opt_b, i)
        sched_b.step()
    assert all(same_bits(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_scheduler_state_round_trip():
    m = mlp()
    opt = lpmm.torch.AdamW4bit(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    train(m, opt, 3, scheduler=sched)
    saved = roundtrip({"opt": opt.state_dict(), "sched": sched.state_dict()})
    m2 = mlp()
    m2.load_state_dict(m.state_dict())
    opt2 = lpmm.torch.AdamW4bit(m2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=10)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    train(m, opt, 2, seed=1, scheduler=sched)
    train(m2, opt2, 2, seed=1, scheduler=sched2)
    assert all(same_bits(x, y) for x, y in zip(m.parameters(), m2.parameters()))


def snapshot(model, opt):
    return [bits(p) for p in model.parameters()], opt.state_dict()


def unchanged(model, opt, before):
    params, sd = before
    now_params, now = snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(params, now_params))
    assert now["param_groups"] == sd["param_groups"]
    for k in sd["state"]:
        for key in sd["state"][k]:
            assert torch.equal(sd["state"][k][key], now["state"][k][key])


@pytest.mark.parametrize("source", ["torch_adamw", "bnb_adamw8bit", "other_preset", "other_model"])
def test_foreign_state_dicts_are_refused(source):
    m = mlp()
    opt = lpmm.torch.AdamW8bit(m.parameters(), lr=1e-3)
    train(m, opt, 2)
    before = snapshot(m, opt)
    other = mlp()
    if source == "torch_adamw":
        o = torch.optim.AdamW(other.parameters(), lr=1e-3)
    elif source == "bnb_adamw8bit":
        bnb = pytest.importorskip("bitsandbytes")
        o = bnb.optim.AdamW8bit(other.parameters(), lr=1e-3)
    elif source == "other_preset":
        o = lpmm.torch.Lion8bit(other.parameters(), lr=1e-3)
    else:
        other = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.GELU(), torch.nn.Linear(80, 64), torch.nn.LayerNorm(64))
        o = lpmm.torch.AdamW8bit(other.parameters(), lr=1e-3)
    train(other, o, 2)
    with pytest.raises((lpmm.StateDictError, ValueError)) as e:
        opt.load_state_dict(roundtrip(o.state_dict()))
    if source in ("torch_adamw", "bnb_adamw8bit"):
        assert isinstance(e.value, lpmm.StateDictError) and "another optimizer" in str(e.value)
    unchanged(m, opt, before)
    train(m, opt, 1)  # still steps


def test_damaged_state_is_refused():
    m = mlp()
    opt = lpmm.torch.AdamW8bit(m.parameters(), lr=1e-3)
    train(m, opt, 2)
    before = snapshot(m, opt)
    sd = roundtrip(opt.state_dict())
    sd["state"][0]["state1.absmax"] = sd["state"][0]["state1.absmax"][:-4]  # truncated
    with pytest.raises(lpmm.StateDictError, match="absmax"):
        opt.load_state_dict(sd)
    unchanged(m, opt, before)
    sd = roundtrip(opt.state_dict())
    sd["state"][0]["state2"] = sd["state"][0]["state2"].float() + 0.5  # not bytes
    with pytest.raises(lpmm.StateDictError, match="not bytes"):
        opt.load_state_dict(sd)
    unchanged(m, opt, before)
    sd = roundtrip(opt.state_dict())
    del sd["state"][1]["lpmm"]
    with pytest.raises(lpmm.StateDictError):
        opt.load_state_dict(sd)
    unchanged(m, opt, before)
