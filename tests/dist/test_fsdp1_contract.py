"""torch FSDP1's contract where ``FullyShardedDataParallel`` used to differ:
per-unit settings (``unit.cpu_offload``, ...), ignored modules' tensors and
buffers in state dicts (the module's own tensors, original dtype), the
errors torch raises (auto-wrap over units, a unit in ``ignored_modules``,
``apply()`` inside ``summon_full_params``, bad arguments) and the dtype and
warning of ``clip_grad_norm_``.

torch FSDP1 needs an accelerator, so the expectations are written from its
source (torch 2.13, ``torch/distributed/fsdp/``). Every case runs in one
spawned single-rank gloo group; each is its own test.
"""
from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard import (
    BackwardPrefetch,
    CPUOffload,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardedOptimStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from fullshard.wrap import ModuleWrapPolicy, enable_wrap, wrap
from tests.dist.harness import run_ranks

FP16 = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)


# ------------------------------------------------------- per-unit settings
class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.nested_lin = wrap(nn.Linear(3, 3, bias=False))

    def forward(self, x):
        return self.nested_lin(x)


class Manual(nn.Module):
    """Wrapped by hand, one child with its own CPUOffload (a ``wrap`` override)."""

    def __init__(self):
        super().__init__()
        self.lin1 = wrap(nn.Linear(3, 3))
        self.lin2 = wrap(nn.Linear(3, 3), cpu_offload=CPUOffload(offload_params=True))
        self.lin3 = wrap(Nested())

    def forward(self, x):
        return self.lin3(self.lin2(self.lin1(x)))


def _unit_settings():
    kw = dict(backward_prefetch=BackwardPrefetch.BACKWARD_POST, forward_prefetch=True,
              sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    with enable_wrap(wrapper_cls=FSDP, **kw):
        model = wrap(Manual())
    units = model.units()
    assert len(units) == 5
    for u in units:
        want_offload = CPUOffload(offload_params=u is model.lin2)
        assert u.cpu_offload == want_offload, (u.unit.name, u.cpu_offload)
        assert u.backward_prefetch is BackwardPrefetch.BACKWARD_POST
        assert u.forward_prefetch is True
        assert u.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
        assert u.mixed_precision == MixedPrecision()
        assert u.process_group is dist.group.WORLD and (u.rank, u.world_size) == (0, 1)
        assert u.compute_device == torch.device("cpu")
    model(torch.randn(2, 3)).sum().backward()  # they run with these settings
    # The prefetch settings are read at every use: assigning them takes effect.
    model.lin1.forward_prefetch = False
    model.lin1.backward_prefetch = None
    knobs = model.lin1._runtime.settings
    assert knobs.forward_prefetch is False and knobs.backward_prefetch is None
    with pytest.raises(ValueError, match="backward_prefetch"):
        model.lin1.backward_prefetch = "BACKWARD_PRE"
    with pytest.raises(AttributeError):
        model.lin1.cpu_offload = CPUOffload(offload_params=True)  # fixed at construction: no silent no-op
    # Auto-wrap: children take the root's settings; a full-precision norm unit reports its own policy.
    bf16 = MixedPrecision(param_dtype=torch.bfloat16)
    auto = FSDP(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)), mixed_precision=bf16,
                auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), cpu_offload=CPUOffload(offload_params=True))
    got = {u.unit.name: (u.mixed_precision.param_dtype, u.cpu_offload.offload_params) for u in auto.units()}
    assert got == {"Sequential": (torch.bfloat16, True), "0": (torch.bfloat16, True),
                   "1": (None, True), "2": (torch.bfloat16, True)}, got


# --------------------------------------------- ignored modules in state dicts
class Model(nn.Module):
    """torch's ``test_state_dict_with_ignored_modules`` model: ``inner`` wrapped
    (optionally ignoring its own module), ``outer`` ignored by the root."""

    def __init__(self, ignore_inner: bool, mp):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.inner.buffer = nn.Buffer(torch.randn(3))
        self.inner.register_buffer("non_persistent", torch.randn(3), persistent=False)
        self.inner = FSDP(self.inner, ignored_modules=[self.inner] if ignore_inner else None, mixed_precision=mp)
        self.outer = nn.Linear(4, 5)
        self.outer.buffer = nn.Buffer(torch.randn(3))

    def forward(self, x):
        return self.outer(self.inner(x))


def _ignored_state_dict():
    for ignore_inner in (False, True):
        for mp in (None, FP16):
            for sd_type in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
                what = (ignore_inner, mp is not None, sd_type.name)
                model = Model(ignore_inner, mp)
                own = {"outer.weight": model.outer.weight, "outer.bias": model.outer.bias,
                       "outer.buffer": model.outer.buffer}
                if ignore_inner:
                    own |= {"inner.weight": model.inner.weight, "inner.bias": model.inner.bias}
                if ignore_inner or mp is None:
                    own["inner.buffer"] = model.inner.buffer
                inner_buffer = model.inner.buffer.detach().clone()
                root = FSDP(model, ignored_modules=[model.outer], mixed_precision=mp)
                with FSDP.state_dict_type(root, sd_type):
                    sd = root.state_dict(prefix="foo.")
                for name, t in own.items():  # the module's own tensors, not copies
                    assert sd[f"foo.{name}"].data_ptr() == t.data_ptr(), (what, name)
                for name in ("inner.buffer", "outer.buffer"):  # original dtype, values unchanged
                    assert sd[f"foo.{name}"].dtype == torch.float32, (what, name, sd[f"foo.{name}"].dtype)
                want = inner_buffer if ignore_inner or mp is None else inner_buffer.half().float()
                assert torch.equal(sd["foo.inner.buffer"], want), what
                if not ignore_inner and mp is not None:  # the running buffer stays in buffer_dtype
                    assert model.inner.buffer.dtype == torch.float16, what
                with FSDP.state_dict_type(root, sd_type):
                    root.load_state_dict({k.removeprefix("foo."): v for k, v in sd.items()})


# ----------------------------------------------------------------- errors
def _twin():
    return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))


def _auto_wrap_over_units():
    flat = nn.Sequential(FSDP(nn.Linear(3, 3)), nn.Linear(3, 3))
    with pytest.raises(ValueError, match="'0' is already a FullyShardedDataParallel"):
        FSDP(flat, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    deep = nn.Sequential(nn.Sequential(nn.Linear(3, 3), FSDP(nn.Linear(3, 3))), nn.Linear(3, 3))
    with pytest.raises(ValueError, match="'0.1' is already"):
        FSDP(deep, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    FSDP(deep)  # nesting by hand, without a policy, stays allowed


def _ignored_unit():
    model = _twin()
    model[0] = FSDP(model[0])
    with pytest.raises(ValueError, match="ignored_modules holds unit"):
        FSDP(model, ignored_modules=[model[0]])


def _ignored_not_a_module():
    with pytest.raises(TypeError, match="ignored_modules must hold nn.Module"):
        FSDP(_twin(), ignored_modules=[torch.zeros(2)])


def _apply_in_summon():
    model = FSDP(_twin())
    with model.summon_full_params():
        with pytest.raises(ValueError, match="apply\\(\\) inside summon_full_params"):
            model.apply(lambda m: None)
    assert model.apply(lambda m: None) is model  # outside the context it runs


def _param_init_fn_not_callable():
    with torch.device("meta"):
        model = _twin()
    with pytest.raises(ValueError, match="param_init_fn to be callable"):
        FSDP(model, param_init_fn=42)


def _state_dict_config_mismatch():
    model = FSDP(_twin())
    with pytest.raises(RuntimeError, match="FullStateDictConfig"):
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, FullStateDictConfig()):
            pass
    with pytest.raises(RuntimeError, match="ShardedOptimStateDictConfig"):
        FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                 optim_state_dict_config=ShardedOptimStateDictConfig())


def _replace_through_a_unit():
    """``unit.weight = ...`` through a nested unit's forwarded attribute (torch.func.functional_call does it
    by the original names) reaches the wrapped module, where it is refused, not the unit, where the forward
    never read it: functional_call silently gave the plain forward (SHARD_GRAD_OP, NO_SHARD after a
    forward) and an earlier failed call broke later ones."""
    from torch.func import functional_call

    torch.manual_seed(0)
    plain, x = _twin(), torch.randn(2, 3)
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        model = FSDP(_twin(), sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        model.load_state_dict(plain.state_dict())
        for _ in range(2):
            assert torch.equal(model(x), plain(x))
            with pytest.raises(RuntimeError, match="cannot be replaced by a plain tensor"):
                functional_call(model, {"0.weight": torch.zeros(3, 3)}, (x,))
        assert "weight" not in vars(model.module[0]) and torch.equal(model(x), plain(x))
        model.module[0].weight = nn.Parameter(torch.zeros(3, 3))  # lands on the Linear: the engine refuses it
        with pytest.raises(RuntimeError, match="'weight' was replaced"):
            model(x)
    # While the wrapper is built, its own attributes stay its own, even where the module has one of that name
    holder = nn.Linear(3, 3)
    holder.use_orig_params = "the module's"
    wrapper = FSDP(holder)
    assert holder.use_orig_params == "the module's" and "use_orig_params" in vars(wrapper)
    # A name neither the wrapper nor the wrapped module has: the error names the wrapper, not only the module
    with pytest.raises(AttributeError, match=r"'FullyShardedDataParallel' object \(wrapping Sequential\) has no "
                                             "attribute 'register_comm_hook'"):
        model.register_comm_hook()


def _root_only_on_a_nested_unit_before_forward():
    """no_sync() on a nested unit before the root's first forward made that unit a root of its own, and the
    backwards inside it still reduce-scattered (silently); it raises as after the first forward."""
    model = FSDP(_twin(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    for _ in range(2):  # before the root's first forward, then after it
        with pytest.raises(RuntimeError, match=r"no_sync\(\) must be called on the root"):
            with model.module[0].no_sync():
                pass
        with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(\) must be called on the root"):
            model.module[0].clip_grad_norm_(1.0)
        model(torch.randn(2, 3)).sum().backward()
    with model.no_sync():
        model(torch.randn(2, 3)).sum().backward()


def _cast_root_forward_inputs():
    """torch FSDP1's MixedPrecision.cast_root_forward_inputs (default True): the root casts its inputs even
    with cast_forward_inputs=False (fp32 inputs failed in the first matmul); nested units do not."""
    x = torch.randn(2, 3)
    for root_cast in (True, False):
        mp = MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=False, cast_root_forward_inputs=root_cast)
        model = FSDP(_twin(), mixed_precision=mp, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        seen = []
        model.module[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
        if root_cast:
            assert model(x).dtype == torch.bfloat16 and seen == [torch.bfloat16]
            with pytest.raises(RuntimeError, match="dtype"):
                model.module[1](x)  # a nested unit's fp32 input: not cast
        else:
            with pytest.raises(RuntimeError, match="dtype"):
                model(x)


def _custom_policy():
    """fullshard.wrap.CustomPolicy (torch FSDP1's): False, True, or a dict overriding the wrapper's
    constructor arguments for that unit; the model still computes as the plain one."""
    from fullshard.wrap import CustomPolicy

    torch.manual_seed(0)
    plain, x = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.ReLU()), torch.randn(2, 3)
    first = plain[0]

    def choose(module):
        if module is first:
            return {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP, "cpu_offload": CPUOffload(True)}
        return isinstance(module, nn.Linear)

    model = FSDP(plain, auto_wrap_policy=CustomPolicy(choose))
    a, b = model.module[0], model.module[1]
    assert isinstance(a, FSDP) and isinstance(b, FSDP) and not isinstance(model.module[2], FSDP)
    assert (a.sharding_strategy, b.sharding_strategy) == (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.FULL_SHARD)
    assert a.cpu_offload.offload_params and not b.cpu_offload.offload_params
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.ReLU())
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    with pytest.raises(TypeError, match="CustomPolicy takes a callable"):
        CustomPolicy(3)


# -------------------------------------------------------- clip_grad_norm_
def _clip_no_gradients():
    model = FSDP(_twin(), mixed_precision=MixedPrecision(param_dtype=torch.float16))
    model(torch.randn(2, 3))
    with pytest.warns(UserWarning, match="on rank 0 with no gradients -- returning the total norm in the default "
                                         "dtype torch.float32"):
        norm = model.clip_grad_norm_(1.0)
    assert norm.dtype == torch.float32 and norm.item() == 0.0


def _clip_low_precision_dtype():
    for mp, want in ((MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True), torch.bfloat16),
                     (MixedPrecision(param_dtype=torch.bfloat16), torch.float32)):
        torch.manual_seed(0)
        model = FSDP(_twin(), mixed_precision=mp)
        model(torch.randn(4, 3)).square().sum().backward()
        grads = [p.grad for p in model.parameters()]
        assert {g.dtype for g in grads} == {want}
        fp32 = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        norm = model.clip_grad_norm_(1e-3)
        assert norm.dtype == want, (mp, norm.dtype)
        assert norm == fp32.to(want), (norm, fp32)  # computed in fp32, rounded once


def _clip_root_module():
    """fullshard.clip_grad_norm_ on a root module: the wrapper's own norm and clipped gradients, bit for
    bit (fp32 here); a nested unit is refused."""
    import fullshard

    runs = []
    for clip in (lambda m: m.clip_grad_norm_(1e-3), lambda m: fullshard.clip_grad_norm_(m, 1e-3)):
        torch.manual_seed(0)
        model = FSDP(_twin(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        model(torch.randn(4, 3)).square().sum().backward()
        runs.append((clip(model), [p.grad.clone() for p in model.parameters()]))
    (want, want_grads), (got, got_grads) = runs
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
    with pytest.raises(RuntimeError, match="must be called on the root module"):
        fullshard.clip_grad_norm_(model.module[0], 1.0)


CASES = {f.__name__.lstrip("_"): f for f in (
    _unit_settings, _ignored_state_dict, _auto_wrap_over_units, _ignored_unit, _ignored_not_a_module,
    _apply_in_summon, _replace_through_a_unit, _root_only_on_a_nested_unit_before_forward, _param_init_fn_not_callable,
    _state_dict_config_mismatch, _cast_root_forward_inputs, _custom_policy,
    _clip_no_gradients, _clip_low_precision_dtype, _clip_root_module)}


def _all_cases(rank, world):
    failures = {}
    for name, case in CASES.items():
        try:
            case()
        except BaseException:  # pytest's Failed too: report each case's own failure
            failures[name] = traceback.format_exc()
    return failures


@pytest.fixture(scope="module")
def failures():
    return run_ranks(_all_cases, 1, timeout_s=300)[0]


@pytest.mark.fast
@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp1_contract(case, failures):
    assert case not in failures, failures[case]
