"""tiermem.torch's units and next-unit predictor on their own, over a small fake engine (the same
calls as the C++ ZeroEngine the units use: gather, prefetch_gather, reduce_gradients,
set_module_params), so each part's contract is checked without a training run."""

import pytest


class FakeEngine:
    """Holds each unit's values as a flat fp32 vector; records what the units ask of it."""

    def __init__(self, values):
        self.values = [v.clone() for v in values]
        self.calls = []

    def gather(self, index, phase):
        self.calls.append(("gather", index, phase))
        return self.values[index].clone()

    def prefetch_gather(self, index, phase):
        self.calls.append(("prefetch", index, phase))

    def reduce_gradients(self, index, grad, lend=False):
        assert lend, "the units lend their gradient buffer (the engine reads it on its gradient thread)"
        self.calls.append(("reduce", index, grad.clone()))

    def set_module_params(self, index, values):
        self.calls.append(("set", index))
        self.values[index] = values.clone()


class FakeOps:
    unit = -1


def _model(torch):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2, bias=False))
    m[1].weight.requires_grad_(False)  # frozen: a frozen unit
    return m


def _attached(torch, dist=False):
    from tiermem.torch._predictor import NextUnitPredictor
    from tiermem.torch._unit import EngineLink, build_units
    model = _model(torch)
    link = EngineLink(model, [], NextUnitPredictor())
    units = build_units(model, (), link)
    engine = FakeEngine([u.flat_values() for u in units.units])
    link.engine = engine
    if dist:
        link.dist_ops = FakeOps()
    for u in units.units:
        u.release()
    return model, units, engine


def test_units_of_a_model(torch_or_skip):
    torch = torch_or_skip
    model, units, _ = _attached(torch)
    # model[1]'s weight is frozen: a unit of its own (engine state, no optimizer state).
    assert [(u.index, u.name, u.numel, u.n_trainable, u.frozen) for u in units.units] == \
        [(0, "0", 8, 2, False), (1, "1[frozen]", 4, 0, True)]
    assert units.frozen_flags() == [False, True]
    assert units.trainable_params() == [model[0].weight, model[0].bias]
    assert units.module_units == {id(model[0]): [units.units[0]], id(model[1]): [units.units[1]]}
    assert units.unit_of[id(model[0].bias)] == (units.units[0], model[0].bias)


def test_gather_views_release_placeholders(torch_or_skip):
    torch = torch_or_skip
    model, units, engine = _attached(torch)
    u = units.units[0]
    w = model[0].weight
    assert w.stride() == (0, 0) and not u.is_gathered()  # a placeholder between uses
    want = engine.values[0]
    flat = u.gather("forward")
    assert engine.calls == [("gather", 0, "forward")]
    assert torch.equal(w.detach().reshape(-1), want[:6]) and w.data_ptr() == flat.data_ptr()
    assert u.gather() is flat and len(engine.calls) == 1  # gathered: no second engine call
    u.acquire()
    u.acquire()
    u.drop()
    assert u.is_gathered()
    u.drop()
    assert not u.is_gathered() and w.stride() == (0, 0)
    copy = u.gather("outside", copy=True)
    assert copy.data_ptr() != engine.values[0].data_ptr() and torch.equal(copy, want)


def test_gradient_buffer_reduces_when_complete_or_at_the_end(torch_or_skip):
    torch = torch_or_skip
    model, units, engine = _attached(torch)
    u = units.units[0]
    w, b = model[0].weight, model[0].bias
    u.accumulate_grad(w, torch.ones(2, 3, dtype=torch.bfloat16))  # copied into the fp32 buffer
    assert engine.calls == []
    u.accumulate_grad(b, torch.full((2,), 5.0))
    (kind, index, grad), = engine.calls
    assert (kind, index) == ("reduce", 0)
    assert grad.dtype == torch.float32 and grad.tolist() == [1.0] * 6 + [5.0, 5.0]
    assert u.grad is None and u.received == 0
    # A backward that reached only the weight: reduced at its end, the bias's slice zero.
    u.accumulate_grad(w, torch.ones(2, 3))
    u.end_backward()
    assert engine.calls[-1][2].tolist() == [1.0] * 6 + [0.0, 0.0]
    u.end_backward()  # nothing left: no second reduce
    assert len(engine.calls) == 2


def test_set_values_writes_back(torch_or_skip):
    torch = torch_or_skip
    _, units, engine = _attached(torch)
    u = units.units[0]
    u.set_values(torch.arange(8, dtype=torch.float32))
    assert engine.calls == [("set", 0)]
    assert u.gather("outside").tolist() == list(range(8))


def test_several_ranks_prefetch_the_predicted_unit(torch_or_skip):
    torch = torch_or_skip
    torch.manual_seed(0)
    from tiermem.torch._predictor import NextUnitPredictor
    from tiermem.torch._unit import EngineLink, build_units
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(3)])
    link = EngineLink(model, [], NextUnitPredictor())
    units = build_units(model, (), link)
    engine = FakeEngine([u.flat_values() for u in units.units])
    link.engine, link.dist_ops = engine, FakeOps()
    a, b, c = units.units
    for u in (a, b, c):
        u.gather("forward")
        u.release()
    assert [x[0] for x in engine.calls] == ["gather"] * 3  # nothing recorded yet: no prefetch
    link.predictor.end_pass()
    engine.calls.clear()
    a.gather("forward")
    assert engine.calls == [("gather", 0, "forward"), ("prefetch", 1, "forward")]
    assert link.dist_ops.unit == -1
    b.gather("forward")
    assert engine.calls[-1] == ("prefetch", 2, "forward")
    engine.calls.clear()
    c.gather("forward")  # the end of the order: nothing more
    assert engine.calls == [("gather", 2, "forward")]


def test_predictor_position_by_position():
    from tiermem.torch._predictor import NextUnitPredictor
    p = NextUnitPredictor()
    assert [p.record("forward", i) for i in (0, 1, 2)] == [None, None, None]
    assert [p.record("backward", i) for i in (2, 1, 0)] == [None, None, None]
    p.end_pass()
    assert [p.record("forward", i) for i in (0, 1, 2)] == [1, 2, None]
    assert [p.record("backward", i) for i in (2, 1, 0)] == [1, 0, None]
    assert p.record("outside", 0) is None  # eval, generate(): no recorded order
    p.end_pass()
    # Another control flow: where it departs from the last order, nothing is predicted.
    assert [p.record("forward", i) for i in (0, 2, 2)] == [1, None, None]
    p.end_pass()
    assert [p.record("forward", i) for i in (0, 2)] == [2, 2]  # the order [0, 2, 2] recorded last
    # A phase that gathered nothing in a pass keeps its last order.
    assert [p.record("backward", i) for i in (2, 1)] == [1, 0]


if __name__ == "__main__":
    pytest.main([__file__])
