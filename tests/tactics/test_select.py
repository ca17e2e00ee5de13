"""The selector's numerical check of a candidate against the reference."""

import torch

from kiln.builder.tactic_selection import _close

FP8 = torch.float8_e4m3fn


def test_float_outputs_are_judged_as_a_share_of_the_range():
    ref = torch.tensor([100.0, -50.0, 1.0])
    assert _close(ref + 1.0, ref, "float16")[0]  # 1% of the range
    ok, why = _close(ref + torch.tensor([0.0, 0.0, 3.0]), ref, "float16")
    assert not ok and "3.00e-02 of output range" in why
    assert not _close(torch.tensor([float("nan"), 0.0, 1.0]), ref, "float16")[0]


def test_an_fp8_output_may_differ_by_one_step_plus_the_float_share_of_the_range():
    ref = torch.tensor([448.0, 416.0, 1.0, 0.0]).to(FP8)
    one_step = torch.tensor([416.0, 448.0, 1.125, 2.0 ** -9]).to(FP8)  # 7% of the range at the top
    assert _close(one_step, ref, "fp8")[0]
    near_zero = torch.tensor([448.0, 416.0, 1.0, 8.0]).to(FP8)  # 8 = 0.018 x 448: float error, not a bug
    assert _close(near_zero, ref, "fp8")[0]
    two_steps = torch.tensor([384.0, 416.0, 1.0, 0.0]).to(FP8)
    ok, why = _close(two_steps, ref, "fp8")
    assert not ok and "8-bit values" in why


def test_an_int8_output_may_differ_by_one_step():
    ref = torch.tensor([127, -128, 0, 5], dtype=torch.int8)
    assert _close(ref + torch.tensor([0, 1, -1, 1], dtype=torch.int8), ref, "int8")[0]
    assert _close(ref + torch.tensor([0, 0, 0, 3], dtype=torch.int8), ref, "int8")[0]  # 1 step + 2% of 127
    assert not _close(ref + torch.tensor([0, 0, 0, 4], dtype=torch.int8), ref, "int8")[0]
    assert not _close(torch.tensor([0, -128, 0, 5], dtype=torch.int8), ref, "int8")[0]  # 127 steps
    assert not _close(ref.float(), ref, "int8")[0]  # floats where 8-bit values were due


# --- what the selector times, reuses from the timing cache, and skips -------------------------------------------
def _selector_rig(monkeypatch, times=None, small_only=(), fails=()):
    """Three real tactics for ONNX Relu (A at level 1, B at level 4, C needing 1 MiB of workspace), a clock that
    reports each tactic's time from `times` (name -> fixed ms, or a function of the input's size; CUDA events need
    a GPU), and a counter of how often each one ran. Tactics in small_only apply to inputs under 100 elements;
    those in `fails` raise a bare AssertionError (as a Gluon layout check does)."""
    from types import SimpleNamespace

    from kiln import tactics
    from kiln.builder import tactic_selection as select
    from kiln.ir.graph import Node
    from kiln.tactics import Tactic
    from kiln.tactics.cache import TimingCache

    runs, last = {}, []

    def relu_as(name):
        def fn(node, x):
            runs[name] = runs.get(name, 0) + 1
            last.append((name, x.numel()))
            if name in fails:
                raise AssertionError
            return torch.relu(x)
        return fn

    def applies(name):
        return lambda n, a: name not in small_only or a[0].numel() < 100

    rig = [Tactic("tac_a", relu_as("tac_a"), applies("tac_a")),
           Tactic("tac_b", relu_as("tac_b"), applies("tac_b"), level=4),
           Tactic("tac_c", relu_as("tac_c"), applies("tac_c"), workspace=lambda n, a: 2**20)]
    monkeypatch.setitem(tactics._TACTICS, ("", "Relu"), rig)
    times = times or {"tac_a": 0.3, "tac_b": 0.1, "tac_c": 0.2}

    def clock(fn, **kw):
        last.clear()
        fn()
        if not last:  # the reference records no name
            return 1.0
        name, size = last[-1]
        return times[name](size) if callable(times[name]) else times[name]

    monkeypatch.setattr(select, "median_ms", clock)
    monkeypatch.setattr(select, "synchronizes", lambda fn: False)
    node = Node("Relu", ["x"], ["y"], {}, name="relu", opset=17)
    engine = SimpleNamespace(target=SimpleNamespace(name="test GPU", capability=(9, 0), device="cpu"), versions={},
                             graph=SimpleNamespace(nodes=[node], initializers={}), profiles=[None])
    cache = TimingCache(None)

    def select_once(level=3, cap=None, exclude=(), inputs=((4, 8),)):
        """One selection over len(inputs) profiles, the p-th running the layer on an input of shape inputs[p]."""
        engine.profiles = [None] * len(inputs)
        sel = select.Selector(engine, level, cap, cache, exclude=exclude)
        for p, shape in enumerate(inputs):
            sel.profile = p
            sel.visit(node, [torch.randn(*shape)])
        return sel.assign()[0], node

    return select_once, runs


def test_a_higher_level_times_only_the_tactics_the_cache_lacks(monkeypatch):
    select_once, runs = _selector_rig(monkeypatch)
    first, _ = select_once(level=3)
    assert set(first["timings"]) == {"reference", "tac_a", "tac_c"} and first["chosen"] == "tac_c"
    ran = dict(runs)
    second, _ = select_once(level=4)  # same timing cache: only tac_b is new
    assert set(second["timings"]) == {"reference", "tac_a", "tac_b", "tac_c"} and second["chosen"] == "tac_b"
    assert runs["tac_a"] == ran["tac_a"] and runs["tac_c"] == ran["tac_c"] and runs["tac_b"] > 0


def test_excluded_and_capped_tactics_are_reported_not_run_and_not_cached(monkeypatch):
    select_once, runs = _selector_rig(monkeypatch)
    rep, _ = select_once(level=4, cap=2**19, exclude=("tac_b*",))
    assert rep["chosen"] == "tac_a" and set(rep["timings"]) == {"reference", "tac_a"}
    assert "--excludeTactics (tac_b*)" in rep["excluded"]["tac_b"] and "workspace" in rep["excluded"]["tac_c"]
    assert "tac_b" not in runs and "tac_c" not in runs
    rep, _ = select_once(level=4)  # another build without the exclusions times both
    assert rep["chosen"] == "tac_b" and not rep["excluded"]


def test_a_tactic_that_raises_without_a_message_is_dropped_and_the_next_one_runs(monkeypatch):
    select_once, _ = _selector_rig(monkeypatch, fails=("tac_b",))
    rep, _ = select_once(level=4)
    assert rep["chosen"] == "tac_c" and rep["excluded"] == {"tac_b": "failed: AssertionError"}


def test_an_exclusion_that_matches_no_tactic_is_refused():
    import pytest

    import kiln
    from kiln.errors import ConfigError
    from kiln.models import tiny_cnn

    with pytest.raises(ConfigError, match="'trion_tma_\\*' matches no tactic"):
        kiln.build(tiny_cnn(), kiln.BuildConfig(device="cpu", progress=False, exclude_tactics=("trion_tma_*",)))


def test_each_profile_gets_its_fastest_tactic(monkeypatch):
    # tac_a wins on small inputs, tac_c on large ones; tac_b (level 4) is not offered
    select_once, _ = _selector_rig(monkeypatch, {"tac_a": lambda n: 0.1 if n < 100 else 0.9,
                                                 "tac_b": 0.05, "tac_c": lambda n: 0.2})
    rep, node = select_once(inputs=((4, 8), (64, 8)))
    assert node.profile_tactics == ["tac_a", "tac_c"] and rep["chosen_per_profile"] == ["tac_a", "tac_c"]
    assert node.tactic == "tac_c"  # 0.4 ms over both profiles against tac_a's 1.0
    assert node.tactic_for(0) == "tac_a" and node.tactic_for(1) == "tac_c"
    rep, node = select_once(inputs=((64, 8),))  # one profile: no per-profile list
    assert node.profile_tactics == [] and node.tactic_for(0) == node.tactic == "tac_c"


def test_a_tactic_that_applies_in_one_profile_only_is_not_the_overall_choice(monkeypatch):
    # tac_a is fastest but applies to small inputs only (split-K at batch 1, say)
    select_once, _ = _selector_rig(monkeypatch, {"tac_a": 0.01, "tac_b": 0.05, "tac_c": 0.2}, small_only=("tac_a",))
    rep, node = select_once(inputs=((4, 8), (64, 8)))
    assert node.profile_tactics == ["tac_a", "tac_c"]
    assert node.tactic == "tac_c"  # before, tac_a won on its batch-1 time alone and fell back to the reference


def test_a_quantized_layer_is_timed_with_its_weights_out_of_l2_and_its_other_inputs_in_it(monkeypatch):
    """The selector's L2 reset (timer.L2Reset, which needs a GPU: recorded here) re-reads the layer's activation
    inputs and not its weights; a CPU build gets none."""
    from types import SimpleNamespace

    from kiln.builder import tactic_selection as select
    from kiln.ir.graph import Node
    from kiln.tactics.cache import TimingCache

    class Reset:
        def __init__(self, device):
            self.device = device

        def keeping(self, tensors):
            self.keep = list(tensors)
            return self

    monkeypatch.setattr(select, "L2Reset", Reset)
    x, w, scale = torch.ones(4, 8), torch.ones(8, 8), torch.ones(8)
    engine = SimpleNamespace(target=SimpleNamespace(device="cuda"), graph=SimpleNamespace(
        initializers={"w": w, "w_scale": scale}))
    sel = select.Selector(engine, 3, None, TimingCache(None))
    node = Node("QGemm", ["x", "w", "", "w_scale"], ["y"], {}, domain="kiln")
    reset = sel._l2_reset(node, [x, w, None, scale])
    assert reset.device.type == "cuda" and [t is x for t in reset.keep] == [True, False]  # x, and None
    assert "QGemm" in select._TIMED_COLD and "FusedGemm" not in select._TIMED_COLD
    engine.target.device = "cpu"
    assert sel._l2_reset(node, [x, w, None, scale]) is None


def test_a_quantized_layer_is_timed_warm_with_the_cold_option_off(monkeypatch):
    """BuildConfig.time_quantized_cold off (bench/ab_tactics.py --off compares builds so): no reset before the
    timing; the build records the option."""
    from types import SimpleNamespace

    from kiln.builder import tactic_selection as select
    from kiln.ir.graph import Node
    from kiln.tactics.cache import TimingCache

    monkeypatch.setattr(select, "L2Reset", lambda device: SimpleNamespace(keeping=lambda tensors: "reset"))
    monkeypatch.setattr(select, "lookup", lambda op, domain: SimpleNamespace(impl=lambda node, *args: None))
    befores = []
    monkeypatch.setattr(select, "median_ms", lambda fn, before=None, **kw: befores.append(before) or 1.0)
    engine = SimpleNamespace(target=SimpleNamespace(device="cuda"), graph=SimpleNamespace(initializers={}))
    node = Node("QGemm", ["x", "w"], ["y"], {}, domain="kiln")
    for cold in (True, False):
        select.Selector(engine, 3, None, TimingCache(None), time_quantized_cold=cold)._measure(
            node, [torch.ones(2), torch.ones(2)], [])
    assert befores == ["reset", None]
    from kiln import BuildConfig

    assert BuildConfig().time_quantized_cold and not BuildConfig(time_quantized_cold=False).to_json()["time_quantized_cold"]


def test_an_l2_resets_own_time_is_measured_once_per_layer_and_taken_off_every_candidate(monkeypatch):
    """timer.median_ms with an L2Reset: the reset alone is timed once per layer (its `keeping` copy), so every
    candidate of the layer has the same time taken off and their ranking rests on their own timings. The GPU
    measurements are stood in for here (tests/gpu/test_tactic_timer.py times real ones); a reset that times 30
    ms at first and 40 afterwards shows which was subtracted."""
    from kiln.tactics import timer

    base = timer.L2Reset.__new__(timer.L2Reset)  # L2Reset() needs a GPU for its buffer
    base.keep, base.own_ms = [], None
    reset = base.keeping([])
    seen = []

    def measured(fn, warmup, runs, may_sync):
        seen.append(fn)
        if fn is reset:
            return 30.0 if seen.count(reset) == 1 else 40.0
        return 47.0  # the reset and a candidate

    monkeypatch.setattr(timer, "_median_ms", measured)
    assert timer.median_ms(lambda: None, before=reset) == timer.median_ms(lambda: None, before=reset) == 17.0
    assert seen.count(reset) == 1 and reset.own_ms == 30.0 and base.own_ms is None
    assert reset.keeping([]).own_ms is None  # another layer's reset reads other bytes: timed again
    plain = lambda: None  # noqa: E731  any other `before` is timed with each candidate
    timer.median_ms(lambda: None, before=plain)
    timer.median_ms(lambda: None, before=plain)
    assert seen.count(plain) == 2
