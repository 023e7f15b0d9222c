"""Tensors: stepped in place with no copy (counted), and every tensor lpmm cannot step in place
refused with an exception naming the parameter, nothing changed."""

import warnings

import pytest
import torch

import lpmm
import lpmm.torch
from lpmm import _lpmm
from conftest import bits, mlp, train


def snapshot(params):
    return [bits(p) for p in params]


def same(params, before):
    return all(torch.equal(bits(p), b) for p, b in zip(params, before))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [lpmm.torch.AdamW8bit, lpmm.torch.AdamW4bit, lpmm.torch.Lion8bit])
@pytest.mark.parametrize("non_finite", ["skip_step", "skip_elements"])
def test_steps_in_place_without_copies(dtype, cls, non_finite):
    """The parameters are the tensors' own memory, stepped in place, and the gradients are read
    where torch wrote them: a step allocates no tensor in torch (torch's profiler) and no buffer
    of the parameters' size in lpmm (the extension's allocations, counted). The non-finite check
    of "skip_step" reads the gradients through lpmm-optim's 256 KB scratch per thread; without
    it ("skip_elements") a step allocates nothing of the model's size at all."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(2048, 2048).to(dtype) * 0.1) for _ in range(2)]
    opt = cls(params, lr=1e-3, non_finite=non_finite)
    assert all(i["lent"] for i in opt.param_info())
    for p in params:
        p.grad = (torch.randn(p.shape) * 1e-2).to(dtype)
    opt.step()  # the first step, outside the counts
    ptrs = [(p.data_ptr(), p.grad.data_ptr()) for p in params]
    before = snapshot(params)
    _, bytes0, live0, _ = _lpmm.allocations(reset_peak=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    _, bytes1, live1, peak = _lpmm.allocations()
    torch_bytes = sum(max(e.cpu_memory_usage, 0) for e in prof.events())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    assert torch_bytes == 0, f"torch allocated {torch_bytes} bytes during the step"
    assert peak - live0 < param_bytes / 4, f"lpmm held {peak - live0} bytes at once"
    assert live1 - live0 < 4096, "the step kept memory"
    if non_finite == "skip_elements":
        assert bytes1 - bytes0 < 64 * 1024, f"lpmm allocated {bytes1 - bytes0} bytes"
    assert [(p.data_ptr(), p.grad.data_ptr()) for p in params] == ptrs
    assert not same(params, before), "the tensors changed in place"
    assert opt.memory()["param"] == 0 and opt.memory()["grad"] == 0


def test_held_parameters_are_written_into_the_tensor():
    """LPMM-SGDM's 8-bit parameter is lpmm's: the tensor receives it, in place."""
    m = mlp()
    opt = lpmm.torch.LPMMSGDM(m.parameters(), lr=0.1)
    info = opt.param_info()
    assert not info[0]["lent"] and "linear8" in info[0]["storage"].lower() or "8" in info[0]["storage"]
    ptr = m[0].weight.data_ptr()
    before = bits(m[0].weight)
    train(m, opt, 2)
    assert m[0].weight.data_ptr() == ptr and not torch.equal(bits(m[0].weight), before)
    assert opt.memory()["param"] > 0


def refused(exc, match, fn):
    with pytest.raises(exc, match=match) as e:
        fn()
    return e.value


def test_non_contiguous_parameter():
    p = torch.nn.Parameter(torch.randn(96, 64).t())
    e = refused(lpmm.LayoutError, "not contiguous", lambda: lpmm.torch.AdamW8bit([("enc.w", p)]))
    assert e.param == "enc.w"
    # Made non-contiguous after the optimizer was created: the step is refused, nothing changes.
    m = mlp()
    opt = lpmm.torch.AdamW8bit(m.named_parameters(), lr=1e-2)
    train(m, opt, 1)
    before = snapshot(m.parameters())
    state = opt.state_dict()
    w = m[2].weight
    w.data = w.data.t().contiguous().t()
    (m(torch.randn(4, 64)) ** 2).mean().backward()
    e = refused(lpmm.LayoutError, "parameter 2.weight: it is not contiguous", opt.step)
    assert e.param == "2.weight"
    assert same(m.parameters(), before)
    w.data = w.data.contiguous()
    for k, entry in opt.state_dict()["state"].items():
        for key in entry:
            assert torch.equal(entry[key], state["state"][k][key])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int32])
def test_wrong_dtype(dtype):
    p = torch.nn.Parameter(torch.zeros(10, dtype=dtype), requires_grad=dtype != torch.int32)
    e = refused(lpmm.DtypeError, "dtype", lambda: lpmm.torch.AdamW8bit([("w", p)]))
    assert e.param == "w" and isinstance(e, TypeError)


def test_dtype_changed_after_construction():
    m = mlp()
    opt = lpmm.torch.AdamW8bit(m.named_parameters(), lr=1e-2)
    m.to(torch.bfloat16)
    before = snapshot(m.parameters())
    (m(torch.randn(4, 64, dtype=torch.bfloat16)).float() ** 2).mean().backward()
    e = refused(lpmm.DtypeError, "was a 6144-element f32 tensor", opt.step)
    assert e.param == "0.weight"
    assert same(m.parameters(), before)


def test_wrong_device():
    p = torch.nn.Parameter(torch.zeros(10, device="meta"))
    e = refused(lpmm.DeviceError, "meta", lambda: lpmm.torch.AdamW8bit([("w", p)]))
    assert e.param == "w" and "no copy to the host" in str(e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_are_refused():
    p = torch.nn.Parameter(torch.zeros(10, device="cuda"))
    refused(lpmm.CudaError, "CPU tensors only", lambda: lpmm.torch.AdamW8bit([("w", p)]))


def test_aliased_parameters():
    base = torch.zeros(300)
    a = torch.nn.Parameter(base[:200])
    b = torch.nn.Parameter(base[100:])
    e = refused(lpmm.AliasError, "shares memory", lambda: lpmm.torch.AdamW8bit([("a", a), ("b", b)]))
    assert e.param in ("a", "b")
    refused(lpmm.AliasError, "listed twice", lambda: lpmm.torch.AdamW8bit([a, a]))
    # A parameter group added later that aliases a registered parameter: refused, not added.
    opt = lpmm.torch.AdamW8bit([("a", a)])
    refused(lpmm.AliasError, "shares memory", lambda: opt.add_param_group({"params": [("b", b)]}))
    assert len(opt.param_groups) == 1


def test_gradient_aliasing_its_parameter():
    m = mlp()
    opt = lpmm.torch.AdamW8bit(m.named_parameters(), lr=1e-2)
    train(m, opt, 1)
    before = snapshot(m.parameters())
    (m(torch.randn(4, 64)) ** 2).mean().backward()
    m[0].bias.grad = m[0].bias.detach()  # the gradient is the parameter's memory
    e = refused(lpmm.AliasError, "parameter 0.bias shares memory with the gradient of 0.bias", opt.step)
    assert e.param == "0.bias"
    assert same(m.parameters(), before)


def test_tensor_subclass():
    class Tagged(torch.nn.Parameter):
        pass

    p = Tagged(torch.zeros(10))
    refused(lpmm.TensorError, "Tagged", lambda: lpmm.torch.AdamW8bit([("w", p)]))


def test_sparse_gradient():
    emb = torch.nn.Embedding(100, 64, sparse=True)
    opt = lpmm.torch.AdamW8bit(emb.named_parameters(), lr=1e-2)
    before = snapshot(emb.parameters())
    emb(torch.tensor([1, 2, 3])).sum().backward()
    assert emb.weight.grad.is_sparse
    e = refused(lpmm.LayoutError, "sparse", opt.step)
    assert e.param == "weight"
    assert same(emb.parameters(), before)


def test_negated_view():
    t = torch._neg_view(torch.ones(10))
    assert t.is_neg()
    refused(lpmm.LayoutError, "negated", lambda: _lpmm.check(["w"], [t]))


def test_not_a_tensor():
    refused(lpmm.TensorError, "not a torch.Tensor", lambda: _lpmm.check(["w"], [object()]))


def test_non_leaf_parameter():
    x = torch.zeros(10, requires_grad=True) * 2
    with pytest.raises(ValueError, match="non-leaf"):
        lpmm.torch.AdamW8bit([x])


def test_non_finite_initial_values():
    p = torch.nn.Parameter(torch.tensor([1.0, float("inf"), 2.0]))
    refused(lpmm.TensorError, "NaN or infinite", lambda: lpmm.torch.AdamW8bit([("w", p)]))
    # A group added later with such a parameter, or with a name already taken: not added, and the
    # optimizer goes on.
    m = mlp()
    opt = lpmm.torch.AdamW8bit(m.named_parameters(), lr=1e-2)
    refused(lpmm.TensorError, "NaN or infinite", lambda: opt.add_param_group({"params": [("w", p)]}))
    q = torch.nn.Parameter(torch.ones(3))
    refused(lpmm.ConfigError, "named '0.bias'", lambda: opt.add_param_group({"params": [("0.bias", q)]}))
    assert len(opt.param_groups) == 1
    train(m, opt, 1)


@pytest.mark.parametrize("policy", ["skip_step", "skip_elements"])
def test_nan_gradients(policy):
    m = mlp()
    opt = lpmm.torch.AdamW8bit(m.named_parameters(), lr=1e-2, non_finite=policy)
    train(m, opt, 1)
    before = snapshot(m.parameters())
    state = opt.state_dict()
    (m(torch.randn(4, 64)) ** 2).mean().backward()
    m[0].weight.grad[3, 5] = float("nan")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt.step()
    assert any(issubclass(x.category, lpmm.torch.NonFiniteGradientWarning) for x in w)
    assert opt.last_report["non_finite"] == ["0.weight"]
    if policy == "skip_step":
        assert opt.last_report["skipped"]
        assert same(m.parameters(), before)
        now = opt.state_dict()["state"]
        assert all(torch.equal(now[k][key], state["state"][k][key]) for k in now for key in now[k])
    else:
        assert not opt.last_report["skipped"]
        assert bits(m[0].weight)[(3 * 64 + 5) * 4 : (3 * 64 + 6) * 4].tolist() == before[0][
            (3 * 64 + 5) * 4 : (3 * 64 + 6) * 4
        ].tolist()
        assert not same(m.parameters(), before)
    train(m, opt, 1)  # training goes on


def test_bad_configuration():
    m = mlp()
    refused(lpmm.ConfigError, "unknown preset", lambda: lpmm.torch.LpmmOptimizer(m.parameters(), "adamw_9bit"))
    refused(lpmm.ConfigError, "no hyperparameter 'momentum'", lambda: lpmm.torch.AdamW8bit(m.parameters(), momentum=0.9))
    refused(lpmm.ConfigError, "lr", lambda: lpmm.torch.AdamW8bit(m.parameters(), lr=-1.0))
    refused(lpmm.ConfigError, "param_storage", lambda: lpmm.torch.AdamW8bit(m.parameters(), param_storage="fp8"))
    refused(lpmm.ConfigError, "grad_release", lambda: lpmm.torch.AdamW8bit(m.parameters(), grad_release=True, max_grad_norm=1.0))
    refused(lpmm.ConfigError, "beta1", lambda: lpmm.torch.AdamW8bit(m.parameters(), betas=(1.5, 0.9)))
    opt = lpmm.torch.AdamW8bit(m.parameters(), lr=1e-2)
    train(m, opt, 1)
    opt.param_groups[0]["lr"] = float("nan")
    before = snapshot(m.parameters())
    (m(torch.randn(4, 64)) ** 2).mean().backward()
    refused(lpmm.ConfigError, "lr", opt.step)
    assert same(m.parameters(), before)
