"""``nn.Module.state_dict``'s contract on wrapped models: PyTorch's FSDP
tutorial model (a root unit without parameters), extra state and every kind
of state-dict hook, ``keep_vars``, plain roots holding units, units around
checkpoint wrappers, and LOCAL_STATE_DICT. Each case is checked against the
plain model's own state dict."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.dist.harness import run_ranks


class TutorialNet(nn.Module):
    """The model of PyTorch's FSDP tutorial (MNIST)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def _tutorial(rank, world):
    from fullshard import FSDP, CPUOffload
    from fullshard.wrap import size_based_auto_wrap_policy

    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=100)
    x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(rank))
    for offload in (False, True):
        torch.manual_seed(0)
        model = FSDP(TutorialNet(), auto_wrap_policy=policy, cpu_offload=CPUOffload(offload_params=offload))
        assert not model.unit.slots, "the tutorial's root unit holds no parameter of its own"
        opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
        F.nll_loss(model(x), y).backward()
        opt.step()
        sd = model.state_dict()  # every rank, as the tutorial does
        plain = TutorialNet()
        assert list(sd) == list(plain.state_dict()), offload
        plain.load_state_dict(sd)
        model.eval()
        plain.eval()
        with torch.no_grad():
            torch.testing.assert_close(plain(x), model(x), rtol=0, atol=0)
        # and back: a fresh wrapped model loads the plain one's state dict
        torch.manual_seed(1)
        fresh = FSDP(TutorialNet(), auto_wrap_policy=policy, cpu_offload=CPUOffload(offload_params=offload))
        fresh.load_state_dict(plain.state_dict())
        fresh.eval()
        with torch.no_grad():
            torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)
    return True


def test_tutorial_model_state_dict_round_trip():
    """PyTorch's FSDP tutorial: save on every rank, load into a plain Net()."""
    run_ranks(_tutorial, 2)


class Scaled(nn.Module):
    """A linear layer with quantization-style extra state (a scale and metadata), of version 2: it
    records the version its loads see (``nn.Module`` passes it in ``local_metadata``)."""

    _version = 2

    def __init__(self, n_in, n_out):
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)
        self.scale = torch.tensor(1.0)
        self.fmt = "e4m3"
        self.versions_seen = []

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        self.versions_seen.append(local_metadata.get("version"))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)

    def forward(self, x):
        return self.lin(x) * self.scale

    def get_extra_state(self):
        return {"scale": self.scale.clone(), "fmt": self.fmt}

    def set_extra_state(self, state):
        self.scale = state["scale"].clone()
        self.fmt = state["fmt"]


class Hooked(nn.Module):
    """Units below hold ``Scaled`` layers; hooks of every kind are registered."""

    def __init__(self):
        super().__init__()
        self.a = Scaled(6, 8)
        self.b = Scaled(8, 4)
        self.head = nn.Linear(4, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _add_hooks(model: Hooked, log: list) -> None:
    """A pre-hook, a private post-hook that adds a key (as many libraries do),
    a load pre-hook that accepts a legacy name and a load post-hook."""
    model.b.register_state_dict_pre_hook(lambda m, prefix, keep_vars: log.append(("pre", prefix)))

    def add_version(m, sd, prefix, meta):
        sd[prefix + "version"] = torch.tensor(3)
        return sd

    model.b._register_state_dict_hook(add_version)

    def legacy(m, sd, prefix, *args):
        sd.pop(prefix + "version", None)
        if prefix + "lin.w" in sd:
            sd[prefix + "lin.weight"] = sd.pop(prefix + "lin.w")

    model.b._register_load_state_dict_pre_hook(legacy, with_module=True)
    model.b.register_load_state_dict_post_hook(lambda m, keys: log.append(("post", len(keys.missing_keys))))


class Grown(nn.Module):
    """A table grown since the save: its load copies the saved rows and keeps the new ones (it reads the
    parameter's current value during the load)."""

    def __init__(self, rows):
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, 4))

    def forward(self, x):
        return x @ self.table

    def _load_from_state_dict(self, state_dict, prefix, *args):
        saved = state_dict.pop(prefix + "table")
        with torch.no_grad():
            self.table[:len(saved)].copy_(saved)


def _partial_load(rank, world) -> None:
    """A full-state-dict load through such a module equals the plain model's (the rows it keeps were
    uninitialized memory before)."""
    from fullshard import FSDP

    torch.manual_seed(0)
    small = Grown(3).state_dict()
    torch.manual_seed(1)
    plain = Grown(5)
    torch.manual_seed(1)
    model = FSDP(Grown(5))
    plain.load_state_dict(small)
    model.load_state_dict(small)
    torch.testing.assert_close(model.state_dict()["table"], plain.table.detach(), rtol=0, atol=0)

    # A load post-hook that edits the loaded parameters in place (on a module above the units): its edits
    # stay, as on the plain model; a load that then raises still leaves every shard as it was.
    from fullshard.wrap import ModuleWrapPolicy

    def halve(module, keys):
        with torch.no_grad():
            for p in module.parameters():
                p.mul_(0.5)
    nets = []
    for wrapped in (False, True):
        torch.manual_seed(2)
        net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        net.register_load_state_dict_post_hook(halve)
        nets.append(FSDP(net, auto_wrap_policy=ModuleWrapPolicy({nn.Linear})) if wrapped else net)
    torch.manual_seed(3)
    source = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).state_dict()
    for net in nets:
        net.load_state_dict(source)
    want, got = nets[0].state_dict(), nets[1].state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)
    bad = {**source, "2.weight": torch.zeros(1)}
    with pytest.raises(RuntimeError, match="Unexpected key"):
        nets[1].load_state_dict(bad)
    for k, v in nets[1].state_dict().items():
        torch.testing.assert_close(v, got[k], rtol=0, atol=0, msg=k)

    # Parameters with no elements, 0 rows or 0 columns, load from a full state dict as into a plain
    # model (0 rows failed: "cannot reshape tensor of 0 elements into shape [0, -1]").
    for shape in ((0, 4), (4, 0)):
        net = nn.Module()
        net.lin, net.empty = nn.Linear(4, 2), nn.Parameter(torch.randn(*shape))
        full = {k: v.clone() for k, v in net.state_dict().items()}
        torch.manual_seed(4)
        loaded = FSDP(copy.deepcopy(net).apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None))
        loaded.load_state_dict(full)
        got = loaded.state_dict()
        assert sorted(got) == sorted(full)
        for k in full:
            torch.testing.assert_close(got[k], full[k], rtol=0, atol=0, msg=k)


def _extra_state_and_hooks(rank, world, tmp):
    from fullshard import FSDP, ShardingStrategy, StateDictType, checkpoint
    from fullshard.wrap import ModuleWrapPolicy

    def build(seed, log):
        torch.manual_seed(seed)
        m = Hooked()
        m.a.scale.fill_(0.5 + seed)
        m.a.fmt = f"fmt{seed}"
        _add_hooks(m, log)
        return m

    plain_log, log = [], []
    plain = build(0, plain_log)
    ref = plain.state_dict()
    ref_vars = plain.state_dict(keep_vars=True)
    assert "b.version" in ref and "a._extra_state" in ref
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
        model = FSDP(build(0, log), sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Scaled}))
        log.clear()
        sd = model.state_dict()
        assert list(sd) == list(ref), (strategy, list(sd))
        # Hooks inside a unit see the prefix of the recursion (wrapper segments
        # included, as under torch FSDP1); the keys they add come out clean.
        assert [p.replace("_fsdp_wrapped_module.", "") for kind, p in log if kind == "pre"] == ["b."], log
        for k, v in ref.items():
            if k.endswith("_extra_state"):
                assert sd[k]["fmt"] == v["fmt"] and torch.equal(sd[k]["scale"], v["scale"]), k
            else:
                torch.testing.assert_close(sd[k], v, rtol=0, atol=0, msg=k)
        kv = model.state_dict(keep_vars=True)
        for k, v in ref_vars.items():
            assert isinstance(kv[k], nn.Parameter) == isinstance(v, nn.Parameter), k
            if isinstance(v, nn.Parameter):
                assert kv[k].requires_grad == v.requires_grad, k
        # A legacy name goes through the user's load pre-hook; extra state is set.
        other = build(7, [])
        legacy = other.state_dict()  # with its _metadata (module versions)
        legacy["b.lin.w"] = legacy.pop("b.lin.weight")
        log.clear()
        model.load_state_dict(legacy)
        assert ("post", 0) in log, log
        # Each module's version travels with the state dict, under the plain names both ways.
        assert model.module.a.versions_seen == model.module.b.versions_seen == [2], strategy
        back = build(9, [])
        back.load_state_dict(model.state_dict())
        assert back.a.versions_seen == back.b.versions_seen == [2], strategy
        got = model.state_dict()
        for k, v in other.state_dict().items():
            if not k.endswith("_extra_state"):
                torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
        assert model.module.a.fmt == "fmt7" and float(model.module.a.scale) == 7.5
        # Sharded: the same keys, extra state included; it round-trips.
        if strategy is ShardingStrategy.FULL_SHARD:
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                ssd = model.state_dict()
                assert list(ssd) == list(ref)
                fresh = FSDP(build(3, []), sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Scaled}))
                with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
                    fresh.load_state_dict(ssd)
            assert fresh.module.a.fmt == "fmt7"
            for k, v in fresh.state_dict().items():
                if not k.endswith("_extra_state"):
                    torch.testing.assert_close(v, got[k], rtol=0, atol=0, msg=k)
        # checkpoint.save / load keep extra state and run the hooks.
        path = f"{tmp}/{strategy.value}"
        checkpoint.save(path, model)
        again = FSDP(build(5, []), sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Scaled}))
        checkpoint.load(path, again)
        assert again.module.a.fmt == "fmt7" and float(again.module.a.scale) == 7.5
        for k, v in again.state_dict().items():
            if not k.endswith("_extra_state"):
                torch.testing.assert_close(v, got[k], rtol=0, atol=0, msg=k)
    _partial_load(rank, world)
    return True


def test_extra_state_and_state_dict_hooks(tmp_path):
    """get/set_extra_state, state-dict (pre/post) and load (pre/post) hooks and
    keep_vars behave as on the plain model, in full, sharded and saved checkpoints."""
    run_ranks(_extra_state_and_hooks, 2, str(tmp_path))


class Plain(nn.Module):
    """A plain root: ``stage`` becomes a unit by manual wrapping, ``ck`` a
    unit around a checkpoint wrapper; ``tail`` stays unwrapped."""

    def __init__(self):
        super().__init__()
        self.stage = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6))
        self.ck = nn.Linear(6, 6)
        self.tail = nn.Linear(6, 2)

    def forward(self, x):
        return self.tail(self.ck(self.stage(x)))


def _plain_roots(rank, world):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fullshard import FSDP, CheckpointWrapper, StateDictType

    wrappers = {"fullshard": CheckpointWrapper, "torch": checkpoint_wrapper}
    for wname, wrapper in wrappers.items():
        for sd_type in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
            def build(seed):
                torch.manual_seed(seed)
                m = Plain()
                ref = m.state_dict()
                m.stage = FSDP(m.stage)
                m.ck = FSDP(wrapper(m.ck))
                return m, ref

            root, ref = build(0)
            x = torch.randn(3, 5)
            root(x).sum().backward()  # a step, so shards differ from init
            with torch.no_grad():
                for p in root.parameters():
                    p.add_(0.1)
            FSDP.set_state_dict_type(root, sd_type)
            sd = root.state_dict()
            where = f"{wname} {sd_type.value}"
            assert list(sd) == list(ref), (where, list(sd))
            other, _ = build(4)
            FSDP.set_state_dict_type(other, sd_type)
            other.load_state_dict(sd)
            got = other.state_dict()
            for k in sd:
                a, b = got[k], sd[k]
                if hasattr(a, "full_tensor"):
                    a, b = a.full_tensor(), b.full_tensor()
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{where} {k}")
            # A plain model's state dict loads too, and the plain model loads ours.
            plain = Plain()
            other.load_state_dict(plain.state_dict())
            FSDP.set_state_dict_type(other, StateDictType.FULL_STATE_DICT)
            back = Plain()
            back.load_state_dict(other.state_dict())
            for k, v in plain.state_dict().items():
                torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=0, msg=f"{where} {k}")
            with torch.no_grad():
                torch.testing.assert_close(other(x), plain(x), rtol=1e-6, atol=1e-6)
    return True


def test_plain_root_and_wrapped_wrappers_round_trip():
    """A plain root holding units and FSDP(checkpoint_wrapper(layer)) save and
    load under the plain names, FULL and SHARDED, ours and torch's wrapper."""
    run_ranks(_plain_roots, 2)


def _local(rank, world):
    from fullshard import FSDP, LocalStateDictConfig, StateDictType
    from fullshard.wrap import ModuleWrapPolicy

    def build(seed):
        torch.manual_seed(seed)
        return FSDP(Hooked(), auto_wrap_policy=ModuleWrapPolicy({Scaled}))

    model = build(0)
    model(torch.randn(2, 6)).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        lsd = model.state_dict()
        with pytest.raises(ValueError, match="optimizer.state_dict"):
            FSDP.optim_state_dict(model, opt)
    assert sorted(k for k in lsd if k.endswith("_flat_param")) == ["_flat_param", "a._flat_param", "b._flat_param"]
    assert "head.weight" not in lsd and "steps" in lsd and "a._extra_state" in lsd
    for u in model.units():
        key = (u.unit.name + "." if u is not model else "") + "_flat_param"
        assert lsd[key.replace("Hooked.", "")].data_ptr() == u.unit.flat_shard.data_ptr()
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig(offload_to_cpu=True)):
        copied = model.state_dict()
    assert copied["_flat_param"].data_ptr() != lsd["_flat_param"].data_ptr()
    fresh = build(9)
    with FSDP.state_dict_type(fresh, StateDictType.LOCAL_STATE_DICT):
        fresh.load_state_dict(copied)
    for k, v in model.state_dict().items():
        if not k.endswith("_extra_state"):
            torch.testing.assert_close(fresh.state_dict()[k], v, rtol=0, atol=0, msg=k)
    # A load that raises (an unexpected key) changes no shard, LOCAL and SHARDED alike.
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
    for sd_type, sd in ((StateDictType.LOCAL_STATE_DICT, copied), (StateDictType.SHARDED_STATE_DICT, sharded)):
        other = build(11)
        before = other.state_dict()
        with FSDP.state_dict_type(other, sd_type):
            with pytest.raises(RuntimeError, match="Unexpected key"):
                other.load_state_dict({**sd, "nonsense.weight": torch.zeros(1)})
        for k, v in other.state_dict().items():
            if not k.endswith("_extra_state"):
                torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=f"{sd_type} {k}")
    # Another layout (here: a model without the nested units) is refused by size.
    torch.manual_seed(0)
    flat_only = FSDP(Hooked())
    with FSDP.state_dict_type(flat_only, StateDictType.LOCAL_STATE_DICT):
        with pytest.raises((ValueError, RuntimeError), match="_flat_param"):
            flat_only.load_state_dict(copied)
    return True


def test_local_state_dict():
    """LOCAL_STATE_DICT: each rank's flat shards (live, or copied with
    offload_to_cpu) reload at the same world size; other layouts are refused."""
    run_ranks(_local, 2)
