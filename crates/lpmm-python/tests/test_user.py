"""What a careless or hostile torch user did to lpmm.torch (each case once a defect): typed
hyperparameters, param-group edits, refusals that must change nothing, copies, hooks that
outlive their optimizer, damaged state dicts."""

import copy
import gc
import pickle
import warnings

import pytest
import torch

import lpmm
import lpmm.torch
from conftest import same_bits


def matrix(seed=0, shape=(64, 64)):
    torch.manual_seed(seed)
    return torch.nn.Parameter(torch.randn(*shape))


def test_an_int_default_does_not_truncate_a_groups_float():
    """weight_decay=0 (an int) as the constructor's default, 0.5 in a group: the group decays by
    0.5, as with weight_decay=0.0 (the kind of a hyperparameter is lpmm's, not the user's)."""
    out = []
    for wd in (0, 0.0):
        w = torch.nn.Parameter(torch.ones(64, 64))
        opt = lpmm.torch.AdamW8bit([{"params": [w], "weight_decay": 0.5}], lr=0.1, weight_decay=wd)
        w.grad = torch.zeros_like(w)
        opt.step()
        out.append(w.detach().clone())
    assert out[0][0, 0].item() == pytest.approx(0.95)
    assert same_bits(out[0], out[1])
    # A float hyperparameter whose default is None (AdaLomo's clip_grad_value) stays a float.
    w = matrix()
    opt = lpmm.torch.LpmmOptimizer([w], "adalomo_f32", lr=1e-2)
    opt.param_groups[0]["clip_grad_value"] = 0.5
    w.grad = torch.randn_like(w)
    opt.step()
    assert opt._synced[0]["clip_grad_value"] == 0.5


def test_a_whole_number_hyperparameter_refuses_a_fraction():
    w = matrix()
    opt = lpmm.torch.Muon8bit([w], lr=1e-2)
    opt.param_groups[0]["ns_steps"] = 4.5
    w.grad = torch.randn_like(w)
    before = w.detach().clone()
    with pytest.raises(lpmm.ConfigError, match="ns_steps"):
        opt.step()
    assert same_bits(w, before)


def test_another_preset_of_the_same_rule_is_refused():
    for src, dst in [
        (lpmm.torch.AdamW8bit, lpmm.torch.AdamW4bit),
        (lpmm.torch.Muon8bit, lpmm.torch.Muon4bit),
    ]:
        a, b = matrix(0, (128, 128)), matrix(1, (128, 128))
        o_src, o_dst = src([a]), dst([b])
        a.grad = torch.randn_like(a)
        o_src.step()
        memory = o_dst.memory()
        with pytest.raises(lpmm.StateDictError, match="another preset"):
            o_dst.load_state_dict(o_src.state_dict())
        assert o_dst.memory() == memory
    a, b = matrix(0, (128, 128)), matrix(1, (128, 128))
    f32 = lpmm.torch.LpmmOptimizer([a], "adamw_f32")
    a.grad = torch.randn_like(a)
    f32.step()
    with pytest.raises(lpmm.StateDictError):
        lpmm.torch.AdamW8bit([b]).load_state_dict(f32.state_dict())


def test_a_refused_muon_group_changes_nothing():
    W, b = matrix(), torch.nn.Parameter(torch.randn(64))
    opt = lpmm.torch.Muon8bit([W], lr=1e-2)
    with pytest.raises(lpmm.ConfigError, match="matrices only"):
        opt.add_param_group({"params": [b]})
    assert len(opt.param_groups) == 1
    W.grad = torch.randn_like(W)
    opt.step()  # still usable
    # A refused constructor writes no parameter (a storage lpmm holds would overwrite it) and
    # leaves no gradient-release hook behind.
    W2, b2 = matrix(2), torch.nn.Parameter(torch.randn(64))
    before = W2.detach().clone()
    with pytest.raises(lpmm.ConfigError):
        lpmm.torch.LpmmOptimizer([W2, b2], "muon_8bit", param_storage="linear8_sr", grad_release=True)
    assert same_bits(W2, before)
    W2.sum().backward()  # no hook of the refused optimizer runs
    assert W2.grad is not None and same_bits(W2, before)


def test_copies_and_pickles_are_refused_with_what_to_do():
    w = matrix()
    opt = lpmm.torch.AdamW8bit([w])
    w.grad = torch.randn_like(w)
    opt.step()
    for attempt in (lambda: copy.deepcopy(opt), lambda: pickle.dumps(opt)):
        with pytest.raises(TypeError, match="state_dict"):
            attempt()
    opt.step()  # the optimizer itself is untouched


def test_gradient_release_hooks_go_with_their_optimizer():
    w = matrix()
    old = lpmm.torch.AdamW8bit([w], lr=1e-2, grad_release=True)
    del old
    gc.collect()
    new = lpmm.torch.AdamW8bit([w], lr=0.0, weight_decay=0.0, grad_release=True)
    before = w.detach().clone()
    w.sum().backward()
    assert same_bits(w, before)  # lr 0: only the live optimizer stepped
    assert new.last_report is not None and new.last_report["updated"] == 1


@pytest.mark.parametrize("missing_gradient", ["ignore", "error"])
def test_param_group_edits_are_followed_as_torch_follows_them(missing_gradient):
    a, b = matrix(0), matrix(1)
    opt = lpmm.torch.AdamW8bit([a], lr=1e-2, missing_gradient=missing_gradient)
    opt.add_param_group({"params": [b]})
    removed = opt.param_groups.pop()
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    before = b.detach().clone()
    opt.step()  # b is not stepped, and not missing a gradient either
    assert same_bits(b, before)
    opt.param_groups.append(removed)
    opt.step()
    assert not same_bits(b, before)
    # A tensor put into a group directly has no lpmm state: refused, not silently skipped.
    c = matrix(2)
    opt.param_groups[0]["params"].append(c)
    c.grad = torch.randn_like(c)
    with pytest.raises(lpmm.ConfigError, match="add_param_group"):
        opt.step()
    opt.param_groups[0]["params"].pop()
    # Moved to another group: refused (lpmm keeps it under its first group).
    opt.param_groups[0]["params"].append(opt.param_groups[1]["params"].pop())
    with pytest.raises(lpmm.ConfigError, match="moved"):
        opt.step()


def test_a_refused_load_keeps_the_param_group_objects():
    w = matrix()
    opt = lpmm.torch.AdamW8bit([w])
    g0 = opt.param_groups[0]
    groups = opt.param_groups
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = "abc"
    with pytest.raises(lpmm.StateDictError):
        opt.load_state_dict(sd)
    assert opt.param_groups is groups and opt.param_groups[0] is g0
    g0["lr"] = 0.0
    g0["weight_decay"] = 0.0
    before = w.detach().clone()
    w.grad = torch.randn_like(w)
    opt.step()
    assert same_bits(w, before)  # the user's group dict still reaches the step


def damaged(sd, how):
    sd = copy.deepcopy(sd)
    if how == "metadata not UTF-8":
        k = next(iter(sd["state"]))
        sd["state"][k]["lpmm"] = torch.tensor([0xFF, 0xFE, 0xFD], dtype=torch.uint8)
    elif how == "lr None":
        sd["param_groups"][0]["lr"] = None
    elif how == "state a list":
        sd["state"] = list(sd["state"].values())
    elif how == "another number of groups":
        sd["param_groups"].append(dict(sd["param_groups"][0], params=[]))
    elif how == "a region on the meta device":
        k = next(iter(sd["state"]))
        key = next(r for r in sd["state"][k] if r not in ("step", "lpmm"))
        sd["state"][k][key] = torch.empty(4, dtype=torch.uint8, device="meta")
    return sd


@pytest.mark.parametrize(
    "how",
    ["metadata not UTF-8", "lr None", "state a list", "another number of groups", "a region on the meta device"],
)
def test_damaged_state_dicts_raise_lpmms_error(how):
    w = matrix()
    opt = lpmm.torch.AdamW8bit([w])
    w.grad = torch.randn_like(w)
    opt.step()
    sd = opt.state_dict()
    with pytest.raises(lpmm.StateDictError):
        opt.load_state_dict(damaged(sd, how))
    # Nothing changed: the next step is the one an untouched optimizer takes.
    twin = lpmm.torch.AdamW8bit([matrix()])
    twin.load_state_dict(sd)
    w2 = twin.param_groups[0]["params"][0]
    with torch.no_grad():
        w2.copy_(w)
    w.grad = torch.randn_like(w)
    w2.grad = w.grad.clone()
    opt.step()
    twin.step()
    assert same_bits(w, w2)


def test_adafactor_takes_transformers_relative_step():
    """transformers' fine-tuning recipe (a fixed lr, relative_step=False) steps at that lr: the
    rate was dropped (Adafactor's presets take none), so the model never moved. Without a first
    moment or parameter scaling, Adafactor's first step moves a vector's element by lr (its
    second moment is g² + 1e-30, unfactored; the update's RMS is 1, the clipping threshold)."""
    m = torch.nn.Linear(64, 64)
    opt = lpmm.torch.Adafactor(
        m.parameters(),
        scale_parameter=False,
        relative_step=False,
        warmup_init=False,
        lr=1e-3,
        beta1=None,
    )
    assert opt.defaults["lr"] == 1e-3
    bias = m.bias.detach().clone()
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    moved = (m.bias.detach() - bias).abs()
    assert torch.allclose(moved, torch.full_like(moved, 1e-3), rtol=1e-4, atol=0)
    with pytest.raises(lpmm.ConfigError, match="relative_step"):
        lpmm.torch.Adafactor(m.parameters(), lr=1e-3, relative_step=True)
    with pytest.raises(lpmm.ConfigError, match="needs an lr"):
        lpmm.torch.Adafactor(m.parameters(), relative_step=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lpmm.torch.Adafactor(m.parameters())  # the relative step, as before


def test_adafactor_takes_beta1_none_as_transformers_default():
    """beta1=None (transformers' default) is Adafactor without a first moment: no state1 held
    (it raised float()'s TypeError). A group edit between None and a number would add or drop a
    state: refused as a ConfigError that changes nothing, so putting the value back steps on with
    the bits of an optimizer that never saw the edit."""
    ws, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        m = torch.nn.Linear(64, 64)
        ws.append(m.weight)
        opts.append(lpmm.torch.Adafactor(m.parameters(), lr=1e-2, relative_step=False, beta1=None))
    assert opts[0].memory()["state1"] == 0
    before = ws[0].detach().clone()

    def step(k):
        for w, opt in zip(ws, opts):
            torch.manual_seed(k)
            for p in opt.param_groups[0]["params"]:
                p.grad = torch.randn_like(p)
            opt.step()

    step(1)
    assert not same_bits(ws[0], before)
    for value in (0.9, 0.0):
        opts[0].param_groups[0]["beta1"] = value
        with pytest.raises(lpmm.ConfigError, match="which states it keeps"):
            step(2)
        opts[0].param_groups[0]["beta1"] = None
    step(3)
    assert same_bits(ws[0], ws[1])
    # And the other way: a first moment cannot be dropped.
    opt = lpmm.torch.Adafactor([matrix()], lr=1e-2, relative_step=False)
    assert opt.memory()["state1"] > 0
    opt.param_groups[0]["beta1"] = None
    opt.param_groups[0]["params"][0].grad = torch.ones(64, 64)
    with pytest.raises(lpmm.ConfigError, match="state1, state2 before, state2 after"):
        opt.step()


def test_missing_gradients_warn_in_python(capfd):
    a, b = matrix(0), matrix(1)
    opt = lpmm.torch.AdamW8bit([a, b], missing_gradient="warn")
    a.grad = torch.randn_like(a)
    with pytest.warns(lpmm.torch.MissingGradientWarning, match=r"param_groups\[0\]\['params'\]\[1\]"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # the same parameters again: warned once
    assert "lpmm warning" not in capfd.readouterr().err


def test_threads_stepping_and_saving_one_optimizer_take_turns():
    """Two threads stepping one optimizer and a third saving it: each call runs
    whole (lpmm's engine takes one at a time; it raised PyO3's 'Already borrowed' where the
    interpreter switched threads inside one), and 2 x 40 steps of one gradient are 80 steps,
    bit for bit."""
    import sys
    import threading

    def run(threads, with_saver):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(128, 128)) for _ in range(2)]
        opt = lpmm.torch.AdamW8bit(ps, lr=1e-3)
        for p in ps:
            p.grad = torch.full_like(p, 0.01)
        errors = []

        def stepper(n):
            try:
                for _ in range(n):
                    opt.step()
            except Exception as e:  # noqa: BLE001 (collected for the assertion)
                errors.append(e)

        def saver():
            try:
                for _ in range(20):
                    opt.state_dict()
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        ts = [threading.Thread(target=stepper, args=(80 // threads,)) for _ in range(threads)]
        if with_saver:
            ts.append(threading.Thread(target=saver))
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        finally:
            sys.setswitchinterval(old)
        assert not errors, errors[:3]
        return [p.detach().clone() for p in ps], opt.state_dict()["state"][0]["step"].item()

    (one, steps_one), (many, steps_many) = run(1, False), run(2, True)
    assert steps_one == steps_many == 80
    assert all(same_bits(a, b) for a, b in zip(one, many))
