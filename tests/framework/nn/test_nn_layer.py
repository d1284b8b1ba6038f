"""Layer: registration, traversal, state dicts, hooks, modes, casting, repr."""

from __future__ import annotations

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import nn


class Block(nn.Layer):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.RMSNorm(dim)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("scale", lf.ones(dim))
        self.register_buffer("cache", lf.zeros(dim), persistent=False)

    def forward(self, x: lf.Tensor) -> lf.Tensor:
        return self.drop(self.norm(self.fc(x))) * self.scale


class Net(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.LayerList([Block(), Block()])
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids: lf.Tensor) -> lf.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_attribute_assignment_registers_parameters_buffers_and_sublayers():
    net = Net()
    names = [n for n, _ in net.named_parameters()]
    assert names == [
        "emb.weight",
        "blocks.0.fc.weight",
        "blocks.0.fc.bias",
        "blocks.0.norm.weight",
        "blocks.1.fc.weight",
        "blocks.1.fc.bias",
        "blocks.1.norm.weight",
    ]  # head.weight is emb.weight: listed once, under its first name
    assert len(net.parameters()) == 7
    assert net.num_parameters() == 40 + 2 * (16 + 4 + 4)
    assert [n for n, _ in net.named_buffers()] == [
        "blocks.0.scale",
        "blocks.0.cache",
        "blocks.1.scale",
        "blocks.1.cache",
    ]
    assert [n for n, _ in net.named_sublayers()][:4] == ["emb", "blocks", "blocks.0", "blocks.0.fc"]
    assert [type(c).__name__ for c in net.children()] == ["Embedding", "LayerList", "Linear"]
    assert net.modules()[0] is net and net not in net.sublayers()
    assert [n for n, _ in net.blocks[0].named_parameters(prefix="b", recurse=False)] == []
    assert [n for n, _ in net.blocks[0].fc.named_parameters(prefix="b", recurse=False)] == [
        "b.weight",
        "b.bias",
    ]


def test_reassigning_and_deleting_members():
    layer = nn.Linear(2, 3)
    layer.bias = None
    assert [n for n, _ in layer.named_parameters()] == ["weight"] and layer.bias is None
    with pytest.raises(TypeError, match="bias"):
        layer.bias = lf.zeros(3)  # a plain tensor is not a Parameter
    layer.weight = lf.Parameter(lf.zeros(3, 2))
    assert layer.weight.shape == (3, 2)
    del layer.weight
    assert layer.parameters() == []
    with pytest.raises(AttributeError, match="weight"):
        _ = layer.weight


def test_forgetting_super_init_and_bad_names_are_clear_errors():
    class Bad(nn.Layer):
        def __init__(self) -> None:
            self.w = lf.Parameter(lf.zeros(1))

    with pytest.raises(AttributeError, match="super"):
        Bad()
    layer = nn.Layer()
    with pytest.raises(KeyError, match="without '\\.'"):
        layer.register_buffer("a.b", lf.zeros(1))
    with pytest.raises(KeyError, match="training"):
        layer.register_buffer("training", lf.zeros(1))


def test_state_dict_round_trip_into_a_fresh_model():
    lf.seed(0)
    a = Net()
    lf.seed(1)
    b = Net()
    sd = a.state_dict()
    # Every path of the tied weight and the persistent buffers; never the non-persistent cache.
    assert "head.weight" in sd and "blocks.1.scale" in sd and "blocks.0.cache" not in sd
    assert all(type(v) is lf.Tensor for v in sd.values())
    ids = lf.tensor([[1, 2, 3]])
    a.eval(), b.eval()
    assert not np.array_equal(a(ids).numpy(), b(ids).numpy())
    result = b.load_state_dict(sd)
    assert result == ([], []) and result.missing_keys == []
    np.testing.assert_array_equal(a(ids).numpy(), b(ids).numpy())
    assert b.head.weight is b.emb.weight  # loading keeps identities (ties survive)


def test_state_dict_is_a_snapshot_and_loading_copies():
    layer = nn.Linear(2, 2)
    sd = layer.state_dict()
    before = sd["weight"].numpy().copy()
    with lf.no_grad():
        layer.weight.set_value(layer.weight * 2.0)
    np.testing.assert_array_equal(sd["weight"].numpy(), before)
    src = {"weight": np.ones((2, 2), np.float64), "bias": np.zeros(2)}
    layer.load_state_dict(src)
    assert layer.weight.dtype == np.float32  # cast to the parameter's dtype
    src["weight"][0, 0] = 7.0
    assert layer.weight.numpy()[0, 0] == 1.0  # copied, not aliased


def test_strict_load_lists_missing_unexpected_and_misshaped_keys_in_one_error():
    layer = Block()
    sd = layer.state_dict()
    del sd["fc.bias"]
    sd["extra.weight"] = lf.zeros(1)
    sd["norm.weight"] = lf.ones(5)
    before = layer.fc.weight.numpy().copy()
    with pytest.raises(nn.StateDictError) as info:
        layer.load_state_dict(sd)
    msg = str(info.value)
    assert "missing keys (1): 'fc.bias'" in msg
    assert "unexpected keys (1): 'extra.weight'" in msg
    assert "'norm.weight': Block has [4], state dict has [5]" in msg
    np.testing.assert_array_equal(layer.fc.weight.numpy(), before)  # nothing loaded


def test_non_strict_load_returns_the_skipped_keys_but_still_rejects_bad_shapes():
    layer = Block()
    sd = layer.state_dict()
    del sd["fc.bias"]
    sd["extra"] = lf.zeros(1)
    sd["fc.weight"] = lf.full([4, 4], 3.0)
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    assert (missing, unexpected) == (["fc.bias"], ["extra"])
    assert (layer.fc.weight.numpy() == 3.0).all()
    sd["scale"] = lf.ones(2)
    with pytest.raises(nn.StateDictError, match=r"'scale': Block has \[4\], state dict has \[2\]"):
        layer.load_state_dict(sd, strict=False)


def test_forward_hooks_fire_modify_and_remove():
    layer = nn.Linear(3, 2)
    calls = []
    pre = layer.register_forward_pre_hook(lambda m, args: (args[0] * 0.0,))
    post = layer.register_forward_hook(lambda m, args, out: calls.append(out.shape) or out + 1.0)
    y = layer(lf.randn(5, 3))
    assert calls == [(5, 2)]
    np.testing.assert_allclose(y.numpy(), np.broadcast_to(layer.bias.numpy() + 1.0, (5, 2)), rtol=1e-6)
    pre.remove()
    post.remove()
    post.remove()  # idempotent
    x = lf.randn(5, 3)
    np.testing.assert_allclose(layer(x).numpy(), lf.ops.linear(x, layer.weight, layer.bias).numpy())
    assert calls == [(5, 2)]


def test_train_eval_reaches_every_sublayer_and_controls_dropout():
    net = Net()
    assert all(m.training for m in net.modules())
    assert net.eval() is net
    assert not any(m.training for m in net.modules())
    x = lf.randn(64)
    np.testing.assert_array_equal(net.blocks[0].drop(x).numpy(), x.numpy())
    net.train()
    assert net.blocks[1].drop.training
    assert (net.blocks[0].drop(x).numpy() == 0).sum() > 10


def test_to_casts_floating_tensors_in_place_and_keeps_identity():
    net = Net()
    net.register_buffer("ids", lf.tensor([1, 2]))
    w = net.blocks[0].fc.weight
    net(lf.tensor([[1, 2]])).sum().backward()
    assert net.to("float64") is net
    assert w is net.blocks[0].fc.weight and w.dtype == np.float64 and w.grad.dtype == np.float64
    assert all(p.dtype == np.float64 for p in net.parameters())
    assert net.blocks[0].scale.dtype == np.float64 and net.ids.dtype == np.int64
    assert net(lf.tensor([[1, 2]])).dtype == np.float64
    net.to(lf.bfloat16)
    assert net.emb.weight.dtype == lf.bfloat16
    net.to("cpu")
    with pytest.raises(TypeError, match="unsupported dtype"):
        net.to("float8")


def test_apply_zero_grad_and_parameter_counts():
    net = Net()
    seen = []
    net.apply(lambda m: seen.append(type(m).__name__))
    assert seen[-1] == "Net" and seen.count("Linear") == 3
    net(lf.tensor([[1, 2]])).sum().backward()
    assert all(p.grad is not None for p in net.parameters())
    net.zero_grad(set_to_none=False)
    assert all((p.grad.numpy() == 0).all() for p in net.parameters())
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())
    net.blocks[0].fc.weight.requires_grad = False
    assert net.num_parameters(trainable_only=True) == net.num_parameters() - 16


def test_repr_is_a_readable_tree():
    text = repr(Net())
    assert text.startswith("Net(\n  (emb): Embedding(10, 4)\n  (blocks): LayerList(\n    (0): Block(\n")
    assert "      (fc): Linear(in_features=4, out_features=4, bias=True)" in text
    assert "      (norm): RMSNorm(4, eps=1e-06)" in text and "(drop): Dropout(p=0.5)" in text
    assert text.endswith("  (head): Linear(in_features=4, out_features=10, bias=False)\n)")
    assert nn.Module is nn.Layer and repr(nn.GELU("tanh")) == "GELU(approximate='tanh')"


def test_layer_without_forward_says_so():
    with pytest.raises(NotImplementedError, match="LayerList defines no forward"):
        nn.LayerList()(lf.zeros(1))
