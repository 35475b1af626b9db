"""Which decode linears take the skinny kernel (engine/choices.py `gemv_choice`), and the engine over it.

The choice is driven here by made-up timings (the timer is injected: no GPU needed): a shape and row count
takes the kernel only where its best config beats F.linear by the margin, above 8 rows only its tl.dot
configs; rows above 32 are never timed and always take F.linear; the record says how many shapes took it at
each row count. Then the engine with the kernel forced, in Triton's interpreter: the same greedy tokens as a
cache-free loop, log-probs within 1e-4 of F.linear's.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (see conftest)

import pytest  # noqa: E402
import torch  # noqa: E402

from svrmad_local.engine import choices, gemv  # noqa: E402
from svrmad_local.engine.engine import Engine, EngineConfig  # noqa: E402
from svrmad_local.engine.families import gated_key, linear_call  # noqa: E402
from svrmad_local.engine.params import SamplingParams  # noqa: E402
from svrmad_local.kernels import _backend, skinny  # noqa: E402

from .model_zoo import loop_greedy, make_zoo_model, rand_prompt  # noqa: E402

CPU = torch.device("cpu")


def fake_timer_for(table, asked, gated_asked=None):
    """timer_for(linear[, plain, prologue]) -> timer(rows, candidate): F.linear takes 1.0; a config takes
    table[(N, K)][rows] scaled by its place in CONFIGS (the first the fastest); None: the configs raise (cannot
    compile). With `plain` (a linear with the op before it in its prologue, timed as it runs): "torch" (that
    op, then the plain pick) takes 1.0, a config table[(N, K, prologue)][rows][config] where given, else it
    raises (does not launch); `gated_asked` collects (shape, plain, rows, candidate), the shape's key with its
    prologue ("silu": (N, K); "norm": (N, K, "norm"))."""
    gated_asked = [] if gated_asked is None else gated_asked

    def timer_for(m, plain=None, prologue="silu", unsummed=False):
        shape = tuple(m.weight.shape)
        key = (*shape, prologue)
        if unsummed:
            table.setdefault("unsummed", []).append((shape, plain is not None))

        def timer(rows, candidate):
            if plain is not None:
                gated_asked.append((shape if prologue == "silu" else key, plain, rows, candidate))
                if candidate == "torch":
                    return 1.0
                t = table.get(key, {}).get(rows, {}).get(str(candidate))
                if t is None:
                    raise RuntimeError("does not launch here")
                return t
            asked.append((rows, candidate))
            if candidate == "torch":
                return 1.0
            t = table[shape].get(rows)
            if t is None:
                raise RuntimeError("does not compile here")
            return t * (1 + 0.01 * skinny.CONFIGS.index(candidate))
        return timer
    return timer_for


def test_the_choice_follows_the_timings(tmp_path):
    model = make_zoo_model("llama")
    shapes = sorted(gemv.decode_linears(model))
    assert len(shapes) >= 3, shapes
    fast, even, broken = shapes[:3]
    table = {shape: dict.fromkeys(skinny.ROWS, 1.5) for shape in shapes}  # slower everywhere...
    table[fast] = {1: 0.6, 2: 0.7, 4: 0.97, 8: 1.2, 32: 0.5}  # ...but here at 1, 2 and 32 rows (4: inside the margin)
    table[even] = dict.fromkeys(skinny.ROWS, 0.96)  # never 5% faster
    table[broken] = {}  # no config compiles
    asked = []
    picks, choice = choices.gemv_choice(model, "auto", "auto", CPU, fake_timer_for(table, asked), tmp_path)
    first_dot = next(c for c in skinny.CONFIGS if c.dot)  # above 8 rows only the tl.dot configs are timed
    assert picks == {fast: {1: skinny.CONFIGS[0], 2: skinny.CONFIGS[0], 32: first_dot}}
    assert {r for r, _ in asked} == set(skinny.ROWS)  # rows above 32 are never timed
    assert all(c == "torch" or skinny.runs(c, r) for r, c in asked) and (32, first_dot) in asked
    assert not any(c != "torch" and not c.dot and r > skinny.BROADCAST_ROWS for r, c in asked)
    n = len(shapes)
    assert choice.value == f"skinny for 1 of {n} shapes at 1 row, 1 of {n} shapes at 2 rows, 0 of {n} shapes at " \
                           f"4 rows, 0 of {n} shapes at 8 rows, 0 of {n} shapes at 16 rows, 1 of {n} shapes at 32 rows"
    assert "5% faster" in choice.reason and f"{fast[0]}x{fast[1]}: 1:{skinny.CONFIGS[0]}" in choice.reason
    # the decoder's call of a linear of that shape: the kernel at 1 and 2 rows, F.linear at 4 and above 8
    linear = next(m for m in model.modules() if type(m) is torch.nn.Linear and tuple(m.weight.shape) == fast)
    assert linear_call(linear, picks).picks == picks[fast]
    seen = []
    with pytest.MonkeyPatch.context() as mp:  # 24 rows (a graph's padded batch) take 32's pick; 33 F.linear
        mp.setattr(skinny, "skinny_linear", lambda x, w, b, cfg, unsummed=False: (seen.append((x.shape[0], cfg)), x)[1])
        call = linear_call(linear, picks)
        for m in (1, 3, 24, 33):
            call(torch.zeros(m, fast[1]))
    assert seen == [(1, skinny.CONFIGS[0]), (24, first_dot)]
    other = next(m for m in model.modules() if type(m) is torch.nn.Linear and tuple(m.weight.shape) == even)
    assert linear_call(other, picks) is other


def test_a_gated_down_projection_is_timed_as_it_runs(tmp_path, monkeypatch):
    """The down projection that reads SiLU(gate) * up is another kernel with the activation in its prologue:
    timed apart, against act_mul then the plain shape's pick, over the plain shape's PROLOGUE_TRIES fastest
    configs at each row count; taken where that much faster. The decoder's call follows those picks, and
    elsewhere act_mul, then the plain shape's own call (here the kernel at 1 row, F.linear at 2)."""
    model = make_zoo_model("llama")
    (down,) = gemv.gated_downs(model)
    assert down == tuple(model.model.layers[0].mlp.down_proj.weight.shape)
    table = {shape: dict.fromkeys(skinny.ROWS, 1.5) for shape in gemv.decode_linears(model)}
    table[down][1] = 0.5  # the plain kernel wins at 1 row only: CONFIGS[0] (the fastest), then [1], [2]
    first, second = (str(c) for c in skinny.CONFIGS[:2])
    # gated: at 1 row the fastest plain config loses to act_mul + its plain twin, the second wins; at 2 rows
    # (F.linear's) the second wins too; at 4 rows none launches; elsewhere they are all slower
    table[gated_key(down)] = {r: {c: 1.5 for c in map(str, skinny.CONFIGS)} for r in skinny.ROWS}
    table[gated_key(down)][1].update({first: 1.2, second: 0.7})
    table[gated_key(down)][2].update({second: 0.8})
    table[gated_key(down)][4] = {}
    asked, gated_asked = [], []
    picks, choice = choices.gemv_choice(model, "auto", "auto", CPU, fake_timer_for(table, asked, gated_asked),
                                        tmp_path)
    assert picks[down] == {1: skinny.CONFIGS[0]}
    assert picks[gated_key(down)] == {1: skinny.CONFIGS[1], 2: skinny.CONFIGS[1]}
    assert {(s, str(p)) for s, p, _r, _c in gated_asked} == {(down, str({1: skinny.CONFIGS[0]}))}
    for r in skinny.ROWS:  # "torch", then the plain shape's fastest configs at r rows (the first that run), gated
        tried = [c for _s, _p, rr, c in gated_asked if rr == r]
        assert tried == ["torch", *[c for c in skinny.CONFIGS if skinny.runs(c, r)][:gemv.PROLOGUE_TRIES]], (r, tried)
    assert f"{down[0]}x{down[1]} silu: 1:{skinny.CONFIGS[1]}, 2:{skinny.CONFIGS[1]}" in choice.reason
    assert choice.value.startswith("skinny for 1 of 5 shapes at 1 row, 0 of 5 shapes at 2 rows")
    # the decoder's call: the gated kernel at 1 and 2 rows; at 3-4 rows act_mul, then F.linear
    seen, acts = [], []
    monkeypatch.setattr(skinny, "_GATED_RUNS", {})
    monkeypatch.setattr(skinny, "skinny_linear",
                        lambda x, w, b, cfg, up=None, unsummed=False: (seen.append((x.shape[0], cfg, up is not None)),
                                                                                x[:, :1])[1])
    from svrmad_local.engine.families import Dense

    dense = Dense(model.model.layers[0].mlp, picks)
    seen.clear()
    for m in (1, 2, 3):
        g = torch.randn(m, down[1])
        dense.act_down(g, g, lambda a, b, act: (acts.append((a.shape[0], act)), a * b)[1])
    assert seen == [(1, skinny.CONFIGS[1], True), (2, skinny.CONFIGS[1], True)] and acts == [(3, "silu")]


def test_forced_skinny_runs_the_gated_down_projection_with_the_default_configs():
    model = make_zoo_model("llama")
    picks, _choice = choices.gemv_choice(model, "skinny", "auto", CPU)
    (down,) = gemv.gated_downs(model)
    assert picks[gated_key(down)] == picks[down] == {r: skinny.default(r) for r in skinny.ROWS}


def test_the_linears_after_a_norm_are_the_one_gemm_q_k_v_and_gate_up():
    """Only a fused q/k/v or gate/up (one GEMM: models/linear.fuse_dense, a GPU's layout) or Phi-3's one
    projection reads the norm's rows alone; separate q/k/v linears, a latent attention's and the experts' do not."""
    from svrmad_local.models.linear import fuse_dense

    assert gemv.normed_linears(make_zoo_model("llama")) == {}
    model = make_zoo_model("llama")
    fuse_dense(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert set(gemv.normed_linears(model)) == {tuple(attn.q_proj.group.weight.shape), tuple(mlp.up_proj.group.weight.shape)}
    phi = make_zoo_model("phi3-sliding")
    assert set(gemv.normed_linears(phi)) == {tuple(phi.model.layers[0].self_attn.qkv_proj.weight.shape),
                                             tuple(phi.model.layers[0].mlp.gate_up_proj.weight.shape)}
    moe = make_zoo_model("qwen3-moe")
    fuse_dense(moe)
    assert set(gemv.normed_linears(moe)) == {tuple(moe.model.layers[0].self_attn.q_proj.group.weight.shape)}
    ds = make_zoo_model("deepseek-v3")
    fuse_dense(ds)
    dense_mlp = ds.model.layers[0].mlp  # the first layer is dense: its gate/up; the latent attention's none
    assert set(gemv.normed_linears(ds)) == {tuple(dense_mlp.up_proj.group.weight.shape)}


def test_o_proj_and_down_are_timed_with_their_shares_left_to_the_norm_after_them(tmp_path):
    """The shapes whose every linear leaves its split-K partials to the norm after it (families.shares_left:
    o_proj and a dense down, outside tensor parallelism and Gemma 3's sandwich norms) are timed so, the gated
    down projection's timing too; a shape another linear shares (separate q/k/v on the CPU's layout: q_proj
    is o_proj's shape) is timed with its sum kernel, as that linear runs."""
    from svrmad_local.engine.families import shares_left
    from svrmad_local.models.linear import fuse_dense

    model = make_zoo_model("qwen3")
    layer = model.model.layers[0]
    o, down = tuple(layer.self_attn.o_proj.weight.shape), tuple(layer.mlp.down_proj.weight.shape)
    assert gemv.unsummed_shapes(model) == {down}  # q_proj has o_proj's shape here
    fuse_dense(model)
    assert gemv.unsummed_shapes(model) == {o, down}
    assert shares_left(layer, "qwen3", sharded=True) == set()
    assert gemv.unsummed_shapes(make_zoo_model("gemma3")) == set()
    moe = make_zoo_model("qwen3-moe")
    fuse_dense(moe)
    assert gemv.unsummed_shapes(moe) == {tuple(moe.model.layers[0].self_attn.o_proj.weight.shape)}
    table = {shape: dict.fromkeys(skinny.ROWS, 1.5) for shape in gemv.decode_linears(model)}
    choices.gemv_choice(model, "auto", "auto", CPU, fake_timer_for(table, []), tmp_path)
    assert sorted(table["unsummed"]) == [(o, False), (down, False), (down, True)]


def test_a_linear_after_a_norm_is_timed_with_the_norm_in_its_prologue(tmp_path, monkeypatch):
    """A fused q/k/v or gate/up linear with the add + RMSNorm before it in the kernel's prologue is timed apart,
    against add_rms_norm then the plain shape's pick, over that shape's PROLOGUE_TRIES fastest configs; taken
    where that much faster. The decoder's call follows those picks (one call, the new residual from the
    kernel), and elsewhere the norm, then the plain call."""
    from svrmad_local.engine.families import normed_columns, normed_key
    from svrmad_local.models.linear import fuse_dense

    model = make_zoo_model("qwen3")
    fuse_dense(model)
    qkv = tuple(model.model.layers[0].self_attn.q_proj.group.weight.shape)
    assert qkv in gemv.normed_linears(model)
    table = {shape: dict.fromkeys(skinny.ROWS, 1.5) for shape in gemv.decode_linears(model)}
    table[qkv][1] = table[qkv][2] = 0.5
    second = str(skinny.CONFIGS[1])
    table[normed_key(qkv)] = {r: {c: 1.5 for c in map(str, skinny.CONFIGS)} for r in skinny.ROWS}
    table[normed_key(qkv)][1].update({second: 0.9})  # faster than add_rms_norm + the plain pick at 1 row only
    asked, prologue_asked = [], []
    picks, choice = choices.gemv_choice(model, "auto", "auto", CPU, fake_timer_for(table, asked, prologue_asked),
                                        tmp_path)
    assert picks[normed_key(qkv)] == {1: skinny.CONFIGS[1]} and picks[qkv] == {1: skinny.CONFIGS[0],
                                                                                 2: skinny.CONFIGS[0]}
    normed_plain = {str(p) for s, p, _r, _c in prologue_asked if s == normed_key(qkv)}
    assert normed_plain == {str({1: skinny.CONFIGS[0], 2: skinny.CONFIGS[0]})}
    tried = [c for s, _p, r, c in prologue_asked if s == normed_key(qkv) and r == 1]
    assert tried == ["torch", *skinny.CONFIGS[:gemv.PROLOGUE_TRIES]]
    assert f"{qkv[0]}x{qkv[1]} norm: 1:{skinny.CONFIGS[1]}" in choice.reason
    # the decoder's call: the normed kernel at 1 row (x + res from it); at 2 rows add_rms_norm, then the plain call
    seen, norms = [], []

    def kernel(x, w, b, cfg, up=None, unsummed=False, norm=None, residual=None):
        seen.append((x.shape[0], cfg, norm is not None))
        out = torch.zeros(x.shape[0], w.shape[0])
        return (out, residual + 1) if norm is not None else out

    class Ops:
        def add_rms_norm(self, x, res, w, eps, style):
            norms.append(x.shape[0])
            return x, x + res

        def rms_norm(self, x, w, eps, style):
            return x

    monkeypatch.setattr(skinny, "skinny_linear", kernel)
    layer = model.model.layers[0]
    from svrmad_local.engine.families import norm_parts, qkv_linears

    call = normed_columns(norm_parts(layer.input_layernorm), qkv_linears(layer.self_attn), picks)
    assert call.picks == {1: skinny.CONFIGS[1]}
    (q, k, v), res = call(torch.ones(1, qkv[1]), torch.ones(1, qkv[1]), Ops())
    assert torch.equal(res, torch.full((1, qkv[1]), 2.0)) and q.shape[1] + k.shape[1] + v.shape[1] == qkv[0]
    (q, k, v), res = call(torch.ones(2, qkv[1]), torch.ones(2, qkv[1]), Ops())
    assert torch.equal(res, torch.full((2, qkv[1]), 2.0)) and norms == [2]
    assert [(m, n) for m, _c, n in seen] == [(1, True), (2, False)]  # at 2 rows the plain pick, on the normed rows


def test_slower_everywhere_takes_f_linear_and_says_so(tmp_path):
    model = make_zoo_model("llama")
    table = {shape: dict.fromkeys(skinny.ROWS, 1.2) for shape in gemv.decode_linears(model)}
    picks, choice = choices.gemv_choice(model, "auto", "auto", CPU, fake_timer_for(table, []), tmp_path)
    assert picks == {} and choice.value == "torch" and "as fast at every shape" in choice.reason


def test_the_figures_are_kept_so_a_later_engine_picks_the_same_without_timing(tmp_path):
    """A second choice on the same machine and shapes reads the first's figures: the same picks (the same
    bits run to run) and nothing timed; another cache folder, or an unreadable file, times again."""
    model = make_zoo_model("llama")
    table = {shape: {1: 0.5, 2: 0.9, 4: 1.3, 8: 1.3} for shape in gemv.decode_linears(model)}
    first, second = [], []
    picks, choice = choices.gemv_choice(model, "auto", "auto", CPU, fake_timer_for(table, first), tmp_path)
    again, kept = choices.gemv_choice(model, "auto", "auto", CPU, fake_timer_for(table, second), tmp_path)
    assert first and second == [] and again == picks and "kept from an earlier build" in kept.reason
    assert kept.value == choice.value
    (path,) = (tmp_path / "calibration").glob("gemv-*.json")
    path.write_text("{not json")
    third = []
    assert choices.gemv_choice(model, "auto", "auto", CPU, fake_timer_for(table, third), tmp_path)[0] == picks and third


def test_off_a_gpu_auto_is_f_linear_and_torch_is_never_timed():
    model = make_zoo_model("llama")
    picks, choice = choices.gemv_choice(model, "auto", "auto", CPU)
    assert picks == {} and choice.value == "torch" and "off a GPU" in choice.reason and not choice.fell_back
    timed = []
    picks, choice = choices.gemv_choice(model, "torch", "auto", CPU, fake_timer_for({}, timed))
    assert picks == {} and timed == [] and choice.reason == "as asked"


def test_on_a_gpu_a_small_model_keeps_f_linear_without_timing(monkeypatch, tmp_path):
    # the test models are kilobytes: a GPU engine of them compiles and times nothing
    monkeypatch.setattr(choices.kernels, "select_impl", lambda impl, device, name: "triton")
    monkeypatch.setattr(gemv, "measured", lambda *a, **k: pytest.fail("timed a model of kilobytes"))
    picks, made = choices.gemv_choice(make_zoo_model("llama"), "auto", "auto", torch.device("cuda"), cache=str(tmp_path))
    assert picks == {} and made.value == "torch" and "MiB of weights" in made.reason and "launches" in made.reason


def test_where_the_models_modules_run_the_layers_nothing_is_timed_or_claimed(tmp_path):
    """The model's own modules call F.linear: "auto" times nothing and says so; "skinny" is refused."""
    model, timed = make_zoo_model("llama"), []
    picks, choice = choices.gemv_choice(model, "auto", "auto", CPU, fake_timer_for({}, timed), tmp_path, ours=False)
    assert picks == {} and timed == [] and choice.value == "torch" and "modules" in choice.reason
    with pytest.raises(ValueError, match="gemv='skinny' needs our decoder"):
        choices.gemv_choice(model, "skinny", "auto", CPU, ours=False)
    eng = Engine(model, None, EngineConfig(kv_cache_memory=4 * 2**20, block_size=4, linear="aten", decoder="modules"))
    assert eng.execution.gemv.value == "torch" and "modules" in eng.execution.gemv.reason
    eng.close()


def test_a_routers_shape_is_not_timed():
    """A mixture-of-experts router is called as a module, never through the picks: left out of the shapes."""
    model = make_zoo_model("qwen3-moe")
    routers = {tuple(layer.mlp.gate.weight.shape) for layer in model.model.layers}
    others = {tuple(m.weight.shape) for m in model.modules() if type(m) is torch.nn.Linear
              and all(m is not layer.mlp.gate for layer in model.model.layers)}
    only_routers = routers - others
    assert only_routers and not only_routers & set(gemv.decode_linears(model)), routers


def test_a_bad_gemv_setting_is_refused_in_one_line():
    with pytest.raises(ValueError, match="gemv must be one of auto, skinny, torch"):
        EngineConfig(gemv="fast")


GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def run(model, prompts, gemv, **kw):
    eng = Engine(model, None, EngineConfig(kv_cache_memory=4 * 2**20, block_size=4, linear="aten", gemv=gemv, **kw))
    try:
        return [r.completions[0] for r in eng.generate_sync(prompts, GREEDY)], eng.execution.gemv
    finally:
        eng.close()


@pytest.mark.parametrize("graphs", ["off", "static"])
def test_forced_skinny_in_the_interpreter_is_token_exact(graphs, monkeypatch):
    """Every decode linear and the LM head through the kernel (interpreted), on the dynamic path and on the
    static one (rows padded to the graphs' sizes): the same greedy tokens as a cache-free loop of the model,
    log-probs within 1e-4 of the engine over F.linear; and the kernel did run, the head's shape included."""
    if not (_backend.HAS_TRITON and _backend.interpreter_ready()):
        pytest.skip("Triton's interpreter is not available in this process")
    calls = []
    real = skinny.skinny_linear
    monkeypatch.setattr(skinny, "skinny_linear",
                        lambda x, w, *a, **k: calls.append((x.shape[0], w.shape[0])) or real(x, w, *a, **k))
    model = make_zoo_model("llama")
    prompts = [rand_prompt(11, 3), rand_prompt(6, 4)]
    got, record = run(model, prompts, "skinny", cuda_graphs=graphs)
    assert record.value.startswith("skinny for") and calls
    rows = {m for m, _ in calls}  # prefill chunks of 9-32 rows through its tl.dot config (skinny.DEFAULT_DOT)
    assert rows <= set(range(1, skinny.MAX_ROWS + 1)) and max(rows) > skinny.BROADCAST_ROWS, rows
    assert model.config.vocab_size in {n for _, n in calls}
    for p, out in zip(prompts, got):
        assert out.token_ids == loop_greedy(model, p, GREEDY.max_tokens)
    ref, plain = run(model, prompts, "torch", cuda_graphs=graphs)
    assert plain.value == "torch"
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids
        assert (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_forced_skinny_over_fused_siblings_is_token_exact(name, monkeypatch):
    """A GPU's layout (q/k/v and gate/up fused on their plain weights, models/linear.fuse_dense): the fused
    shapes are among the decode linears and go through the kernel, one call each, with the same greedy tokens
    as a cache-free loop of the unfused model; down reads SiLU(gate) * up in its prologue (Llama), or after
    act_mul where the activation is another (Gemma 3's GELU)."""
    if not (_backend.HAS_TRITON and _backend.interpreter_ready()):
        pytest.skip("Triton's interpreter is not available in this process")
    from svrmad_local.models.linear import fuse_dense

    model, plain = make_zoo_model(name), make_zoo_model(name)
    fuse_dense(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    fused = {tuple(attn.q_proj.group.weight.shape), tuple(mlp.up_proj.group.weight.shape)}
    assert fused <= set(gemv.decode_linears(model))
    calls, gated = [], []
    real = skinny.skinny_linear

    def counted(x, w, *a, up=None, **kw):
        calls.append(tuple(w.shape))
        gated.append(up is not None)
        return real(x, w, *a, up=up, **kw)

    monkeypatch.setattr(skinny, "skinny_linear", counted)
    prompts = [rand_prompt(11, 3), rand_prompt(6, 4)]
    got, record = run(model, prompts, "skinny", cuda_graphs="static")
    assert fused <= set(calls) and tuple(attn.k_proj.dense_weight().shape) not in calls
    down = tuple(mlp.down_proj.weight.shape)
    assert {g for c, g in zip(calls, gated) if c == down} == {name == "llama"}
    for p, out in zip(prompts, got):
        assert out.token_ids == loop_greedy(plain, p, GREEDY.max_tokens)


# split-K configs that split every linear of the zoo's models in two (K >= 32): every o_proj and down leaves
# its partials to the add + RMSNorm after it (kernels/shares.py)
SPLIT_IN_TWO = (skinny.Config(16, 16, 2), skinny.Config(16, 16, 2, dot=True))


@pytest.mark.parametrize("name,kernel_impl", [("llama", "auto"), ("qwen3", "triton"), ("gemma3", "auto")])
def test_split_k_partials_summed_by_the_next_norm_change_no_bit(name, kernel_impl, monkeypatch):
    """Every linear forced through a split-K config: o_proj's and down's partials go to the add + RMSNorm after
    them unsummed (the compiled CPU norm sums them first, the Triton norm as it loads them) and the engine's
    greedy tokens and log-probs are the bits of the same engine with every split summed by its own kernel,
    and the tokens a cache-free loop's. Gemma 3's norms after its blocks keep theirs summed."""
    if not (_backend.HAS_TRITON and _backend.interpreter_ready()):
        pytest.skip("Triton's interpreter is not available in this process")
    from svrmad_local.kernels.shares import Shares

    monkeypatch.setattr(skinny, "default", lambda rows: SPLIT_IN_TWO[rows > skinny.BROADCAST_ROWS])
    real, left = skinny.skinny_linear, []

    def split(x, w, *a, unsummed=False, **k):
        out = real(x, w, *a, unsummed=unsummed and state["fold"], **k)
        left.append(isinstance(out, Shares))
        return out

    monkeypatch.setattr(skinny, "skinny_linear", split)
    model = make_zoo_model(name)
    prompts = [rand_prompt(11, 3), rand_prompt(6, 4)]
    state = {"fold": True}
    got, _ = run(model, prompts, "skinny", cuda_graphs="static", kernel_impl=kernel_impl)
    assert any(left) == (name != "gemma3")
    left.clear()
    state["fold"] = False
    want, _ = run(model, prompts, "skinny", cuda_graphs="static", kernel_impl=kernel_impl)
    assert left and not any(left)
    for a, b, p in zip(got, want, prompts):
        assert a.token_ids == b.token_ids == loop_greedy(model, p, GREEDY.max_tokens)
        assert a.logprobs == b.logprobs


def test_forced_skinny_where_triton_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(_backend, "interpreter_ready", lambda: False)  # a CPU process without the interpreter
    with pytest.raises(ValueError, match="gemv='skinny' cannot run here"):
        choices.gemv_choice(make_zoo_model("llama"), "skinny", "auto", CPU)
