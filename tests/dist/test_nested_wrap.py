"""Auto-wrap policies that select a module and some of its descendants: the
descendants' units nest inside the module's unit, which nests in the root
(torch FSDP1's nesting). Parity with DDP under FULL_SHARD, SHARD_GRAD_OP and
NO_SHARD, and through ``fully_shard`` applied bottom-up to the modules the
policy picks, the unit tree, tied weights across and inside unit boundaries,
ignored modules, full-precision norm units under mixed precision, and the
full state dict of a nested-wrapped GPT."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import BackwardPrefetch, FullyShardedDataParallel as FSDP, MixedPrecision
from fullshard.wrap import ModuleWrapPolicy, always_wrap_policy, size_based_auto_wrap_policy
from tests.dist import models as M, patterns as P
from tests.dist.common import FULLY_SHARD, BNBlock, BNNet
from tests.dist.harness import run_ranks


class Stack(nn.Module):
    """Containers, parameter-free modules (one called twice) and a root parameter."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 7)) for _ in range(2))
        self.act = nn.Tanh()
        self.head = nn.Linear(7, 5)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        for block in self.blocks:
            x = self.act(block(x)) + x
        return self.head(x) * self.scale


class TiedBlock(nn.Module):
    """``b.weight`` is ``a.weight`` (tied inside the block); ``c.weight`` is
    tied to the parent's ``out.weight`` (across the block's boundary)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.b.weight = self.a.weight
        self.c = nn.Linear(6, 6)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 6)
        self.block = TiedBlock()
        self.out = nn.Linear(6, 6)
        self.out.weight = self.block.c.weight
        self.head = nn.Linear(6, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.out(self.block(torch.relu(self.inp(x))))))


def _seeded(cls):
    torch.manual_seed(0)
    return cls()


def _plain_step(model, opt, rank, step):
    x, y = P.batch(rank, step)
    loss = P.mse(model(x), y)
    loss.backward()
    return loss.detach()


def _gpt_step(model, opt, rank, step):
    x, y = M.batch("gpt", rank, step)
    loss = M.loss_fn("gpt", model, x, y)
    loss.backward()
    return loss.detach()


def nesting(model: nn.Module) -> dict:
    """Unit name -> name of the innermost unit enclosing it (None for the root), in module order."""
    out = {}

    def visit(m, enclosing):
        if isinstance(m, FSDP):
            out[m.unit.name] = enclosing
            enclosing = m.unit.name
        for child in m.children():
            visit(child, enclosing)

    visit(model, None)
    assert list(out) == [u.unit.name for u in FSDP.fsdp_modules(model)]
    return out


def holders(model: nn.Module) -> dict:
    """Unit name -> the full original names of the parameters it shards
    (a nested unit's slots are named relative to it)."""
    return {u.unit.name: sorted(s.fqn if u is model else f"{u.unit.name}.{s.fqn}" for s in u.unit.slots)
            for u in FSDP.fsdp_modules(model)}


def _size0():
    return functools.partial(size_based_auto_wrap_policy, min_num_params=0)


NET_TREE = {"Net": None, "pre": "Net", "enc": "Net", "enc.a": "enc", "enc.b": "enc", "enc.spare": "enc",
            "head": "Net", "extra": "Net"}
SEQ = lambda i: {f"blocks.{i}.0": f"blocks.{i}", f"blocks.{i}.1": f"blocks.{i}",  # noqa: E731
                 f"blocks.{i}.2": f"blocks.{i}"}


def _policies(rank, world):
    out = {}
    policies = {"size_based_min0": _size0, "module_wrap_enc_linear": lambda: ModuleWrapPolicy({P.Enc, nn.Linear}),
                "always_wrap": lambda: always_wrap_policy}
    for name, policy_fn in policies.items():
        assert nesting(FSDP(P.make(), auto_wrap_policy=policy_fn())) == NET_TREE, name
        out[f"net_{name}"] = P.compare(rank, _plain_step, steps=3, policy_fn=policy_fn)
    # Containers and parameter-free modules: always_wrap wraps them all (the
    # ModuleList unit is iterated, never called); size_based skips the ModuleList.
    stack = {"size_based_min0": (_size0, {"Stack": None, "blocks.0": "Stack", **SEQ(0), "blocks.1": "Stack",
                                          **SEQ(1), "act": "Stack", "head": "Stack"}),
             "always_wrap": (lambda: always_wrap_policy, {"Stack": None, "blocks": "Stack", "blocks.0": "blocks",
                                                          **SEQ(0), "blocks.1": "blocks", **SEQ(1), "act": "Stack",
                                                          "head": "Stack"})}
    for name, (policy_fn, tree) in stack.items():
        model = FSDP(_seeded(Stack), auto_wrap_policy=policy_fn())
        assert nesting(model) == tree, (name, nesting(model))
        assert holders(model)["Stack"] == ["scale"] and holders(model)["blocks.0.1"] == []
        out[f"stack_{name}"] = P.compare(rank, _plain_step, steps=3, make_fn=functools.partial(_seeded, Stack),
                                         policy_fn=policy_fn, strategies=P.STRATEGIES)
        # fully_shard refuses the 0-dim scale (as torch FSDP2 does): its 1-D twin.
        out[f"stack_{name}[fully_shard]"] = P.compare(
            rank, _plain_step, steps=3, make_fn=lambda: M.vector_scale(_seeded(Stack)), policy_fn=policy_fn,
            strategies=(FULLY_SHARD,))
    return out


def test_nested_policies_match_ddp():
    worst = run_ranks(_policies, 2)[0]
    print({k: f"{v:.2e}" for k, v in worst.items()})


def _tied_ignored_mixed(rank, world):
    out = {}
    # Tied weights: the one shared inside the block goes to the block's unit,
    # the one shared across its boundary to the root; the Linear units keep their biases.
    for name, policy_fn in {"module_wrap": lambda: ModuleWrapPolicy({TiedBlock, nn.Linear}),
                            "always_wrap": lambda: always_wrap_policy}.items():
        model = FSDP(_seeded(TiedNet), auto_wrap_policy=policy_fn())
        held = holders(model)
        assert held["TiedNet"] == ["block.c.weight"], (name, held)
        assert held["block"] == ["block.a.weight"], (name, held)
        assert held["block.b"] == ["block.b.bias"] and held["out"] == ["out.bias"], (name, held)
        assert nesting(model)["block.c"] == "block", name
        out[f"tied_{name}"] = P.compare(rank, _plain_step, steps=3, make_fn=functools.partial(_seeded, TiedNet),
                                        policy_fn=policy_fn)
    # ignored_modules: an ignored module is neither wrapped nor entered.
    for ignore in ("enc.spare", "enc"):
        net = P.make()
        model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({P.Enc, nn.Linear}),
                     ignored_modules=[net.get_submodule(ignore)])
        tree = {k: v for k, v in NET_TREE.items() if not k.startswith(ignore)}
        assert nesting(model) == tree, (ignore, nesting(model))
        assert model.enc.spare.weight.shape == (3, 3)  # whole, not a shard
        x, y = P.batch(rank, 0)
        P.mse(model(x), y).backward()
    # Mixed precision: BatchNorm units (full precision, made first) nest in
    # the nested policy's units.
    bf16 = MixedPrecision(param_dtype=torch.bfloat16)
    torch.manual_seed(0)
    base = BNNet()
    ref = DDP(P._clone(base), broadcast_buffers=False)  # per-rank statistics, as ours
    ref_losses, _, _ = P.run(ref, _plain_step, rank, 3)
    for name, policy in {"module_wrap": ModuleWrapPolicy({BNBlock, nn.Linear}),
                         "always_wrap": always_wrap_policy}.items():
        for strategy in P.STRATEGIES:
            model = FSDP(P._clone(base), sharding_strategy=strategy, auto_wrap_policy=policy, mixed_precision=bf16)
            assert nesting(model) == {"BNNet": None, "inp": "BNNet", "bn": "BNNet", "block": "BNNet",
                                      "block.lin": "block", "block.bn": "block", "out": "BNNet"}, name
            dtypes = {u.unit.name: u.unit.compute_dtype for u in model.units() if u.unit.slots}
            assert dtypes == {"inp": torch.bfloat16, "bn": torch.float32, "block.lin": torch.bfloat16,
                              "block.bn": torch.float32, "out": torch.bfloat16}, (name, dtypes)
            losses, _, _ = P.run(model, _plain_step, rank, 3)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0.05, atol=0.02)
            out[f"bn_bf16_{name}[{strategy.value}]"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    return out


def test_nested_tied_ignored_mixed_precision():
    worst = run_ranks(_tied_ignored_mixed, 2)[0]
    print({k: f"{v:.2e}" for k, v in worst.items()})


def _gpt(rank, world):
    from fullshard.models import TransformerBlock

    out = {}
    layers = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
    tree = {"GPT": None}
    for i in range(2):
        tree[f"layers.{i}"] = "GPT"
        tree.update({f"layers.{i}.{n}": f"layers.{i}" for n in layers})
    tree["output_projection"] = "GPT"
    policy_fn = lambda: ModuleWrapPolicy({TransformerBlock, nn.Linear})  # noqa: E731
    plain = M.make_model("gpt")
    model = FSDP(M.clone(plain), auto_wrap_policy=policy_fn())
    assert nesting(model) == tree, nesting(model)
    held = holders(model)
    # The output projection is tied to the token embedding: its unit is empty, the root holds it.
    assert held["output_projection"] == [] and "embed_tokens.weight" in held["GPT"], held
    assert held["layers.0"] == ["layers.0.ln_1.bias", "layers.0.ln_1.weight", "layers.0.ln_2.bias",
                                "layers.0.ln_2.weight"], held
    # A subclass wraps the root; the units it nests are FullyShardedDataParallel's, named by their path.
    sub = type("SubFSDP", (FSDP,), {})(M.clone(plain), auto_wrap_policy=policy_fn())
    assert [type(u).__name__ for u in sub.units()] == ["SubFSDP"] + ["FullyShardedDataParallel"] * (len(tree) - 1)
    assert nesting(sub) == tree, nesting(sub)
    # Full state dict: the plain model's keys and values; loading a plain one.
    ref = plain.state_dict()
    sd = model.state_dict()
    assert list(sd) == list(ref)
    for k in ref:
        torch.testing.assert_close(sd[k], ref[k], rtol=0, atol=0, msg=k)
    other = M.make_model("gpt", seed=5).state_dict()
    model.load_state_dict(other)
    sd = model.state_dict()
    for k in other:
        torch.testing.assert_close(sd[k], other[k], rtol=0, atol=0, msg=k)
    assert sd["output_projection.weight"].data_ptr() != 0 and torch.equal(sd["output_projection.weight"],
                                                                          sd["embed_tokens.weight"])

    # eps=1e-6: see test_parity.train (a bias with an exactly-zero true gradient).
    def opt_fn(params):
        return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)

    out["gpt_block_and_linear"] = P.compare(rank, _gpt_step, steps=3, make_fn=lambda: M.make_model("gpt"),
                                            policy_fn=policy_fn, opt_fn=opt_fn)
    out["gpt_block_and_linear_prefetch"] = P.compare(
        rank, _gpt_step, steps=3, make_fn=lambda: M.make_model("gpt"), policy_fn=policy_fn, opt_fn=opt_fn,
        fsdp_kwargs=dict(backward_prefetch=BackwardPrefetch.BACKWARD_POST, forward_prefetch=True),
        strategies=P.STRATEGIES)
    out["gpt_always_wrap"] = P.compare(rank, _gpt_step, steps=3, make_fn=lambda: M.make_model("gpt"),
                                       policy_fn=lambda: always_wrap_policy, opt_fn=opt_fn)
    return out


def test_nested_gpt_matches_ddp_and_state_dict():
    worst = run_ranks(_gpt, 2)[0]
    print({k: f"{v:.2e}" for k, v in worst.items()})
