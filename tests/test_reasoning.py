"""Reasoning models: the effort through the chat template, the split of a completion into hidden
reasoning and final response, and what the debate backend does with each part."""

from __future__ import annotations

import asyncio

import pytest

from svrmad_local.debate.engine_backend import EngineBackend
from svrmad_local.debate.trace import row_initial, trace_row
from svrmad_local.debate.types import Question
from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.params import SamplingParams
from svrmad_local.models.chat import ChatFormat
from svrmad_local.models.reasoning import Harmony, ThinkTags, detect, effort_kwargs, template_variables

from .conftest import build_tokenizer, make_model
from .forced import ForcedEngine

Q = Question(id="q1", question="What is 2 + 3?", gold="5")
USER = [{"role": "user", "content": "What is 2 + 3?"}]
FINAL = "The answer is \\boxed{5}. Confidence: 80%"


@pytest.fixture(scope="module")
def toks():
    return {f: build_tokenizer(f) for f in ("chatml", "harmony", "qwen3", "deepseek_v3.1")}


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def fmt(tok, effort=None):
    chat = ChatFormat(tok, template_kwargs=effort_kwargs(tok.chat_template, effort, "m"))
    return chat, detect(tok, chat.generation_prompt(), chat.eos_ids)


# ------------------------------------------------------------------ the effort, through the template

def test_template_variables_of_each_family(toks):
    assert "reasoning_effort" in template_variables(toks["harmony"].chat_template)
    qwen = template_variables(toks["qwen3"].chat_template)
    assert "enable_thinking" in qwen and "thinking" not in qwen
    assert {"thinking", "enable_thinking"} <= template_variables(toks["deepseek_v3.1"].chat_template)
    assert not {"reasoning_effort", "thinking", "enable_thinking"} & template_variables(toks["chatml"].chat_template)


@pytest.mark.parametrize("family,effort,kwargs,prompt_has,prompt_ends", [
    ("harmony", None, {}, "Reasoning: medium", "<|start|>assistant"),  # the template's own default
    ("harmony", "low", {"reasoning_effort": "low"}, "Reasoning: low", "<|start|>assistant"),
    ("harmony", "high", {"reasoning_effort": "high"}, "Reasoning: high", "<|start|>assistant"),
    ("qwen3", "medium", {"enable_thinking": True}, "", "<|im_start|>assistant\n"),
    ("qwen3", "none", {"enable_thinking": False}, "", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ("deepseek_v3.1", "medium", {"thinking": True}, "", "<｜Assistant｜><think>"),
    ("deepseek_v3.1", "none", {"thinking": False}, "", "<｜Assistant｜></think>"),
])
def test_effort_reaches_the_prompt(toks, family, effort, kwargs, prompt_has, prompt_ends):
    tok = toks[family]
    assert effort_kwargs(tok.chat_template, effort, "m") == kwargs
    text = tok.decode(fmt(tok, effort)[0].encode(USER))
    assert prompt_has in text and text.endswith(prompt_ends)


@pytest.mark.parametrize("family,effort,why", [
    ("harmony", "none", "takes reasoning_effort low/medium/high and cannot turn reasoning off"),
    ("qwen3", "low", r"only switches thinking on or off \(enable_thinking\)"),
    ("qwen3", "high", r"only switches thinking on or off \(enable_thinking\)"),
    ("deepseek_v3.1", "high", r"only switches thinking on or off \(thinking\)"),
    ("chatml", "medium", "has no reasoning setting"),
    ("chatml", "max", "expected one of none, low, medium, high"),
])
def test_an_effort_the_template_cannot_take_is_refused(toks, family, effort, why):
    with pytest.raises(ValueError, match=why) as err:
        effort_kwargs(toks[family].chat_template, effort, "tiny-" + family)
    assert "\n" not in str(err.value) and (effort == "max" or f"tiny-{family}" in str(err.value))


def test_run_refuses_an_effort_in_one_line(tmp_path, toks, capsys):
    from svrmad_local import cli

    ck = tmp_path / "model"
    make_model("llama", vocab=len(toks["chatml"])).save_pretrained(ck)
    toks["chatml"].save_pretrained(ck)
    data = tmp_path / "qs.jsonl"
    data.write_text('{"id": "q0", "question": "What is 1 + 2?", "gold": "3"}\n')
    assert cli.main(["run", "--model", str(ck), "--dataset", str(data), "--out", str(tmp_path / "run"),
                     "--device", "cpu", "--kv-cache-memory", "1MiB", "--reasoning-effort", "low"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("svrmad run: reasoning effort low: the chat template of ") and str(ck) in err
    assert not (tmp_path / "run" / "trace.jsonl").exists()


def test_the_backend_refuses_before_computing_anything(toks):
    eng = Engine(make_model("llama", vocab=len(toks["chatml"])), toks["chatml"], EngineConfig(kv_cache_memory=2**20))
    with pytest.raises(ValueError, match="chat template of llama has no reasoning setting"):
        EngineBackend(eng, reasoning_effort="low")
    with pytest.raises(ValueError, match="own_turn='api'"):
        EngineBackend(eng, own_turn="api")
    assert eng.totals.requests == 0


# ------------------------------------------------------------------ the split

def test_detected_format_follows_the_vocabulary_and_generation_prompt(toks):
    assert fmt(toks["chatml"])[1] is None
    assert isinstance(fmt(toks["harmony"])[1], Harmony)
    qwen, ds_on, ds_off = fmt(toks["qwen3"])[1], fmt(toks["deepseek_v3.1"], "medium")[1], fmt(toks["deepseek_v3.1"])[1]
    assert isinstance(qwen, ThinkTags) and not qwen.opened  # Qwen3 writes <think> itself
    assert ds_on.opened and not ds_off.opened  # DeepSeek-V3.1's generation prompt opens (or closes) it


def _final(tok, f, completion):
    s = f.split(completion)
    return s, tok.decode(completion[:s.start]), tok.decode(completion[s.start:s.end]) if s.final else None


@pytest.mark.parametrize("family,effort,text,reasoning,final", [
    ("harmony", None, "<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>final<|message|>"
     f"{FINAL}<|return|>", "Add them.", FINAL),
    ("harmony", None, "<|channel|>commentary<|message|>Thinking aloud.<|end|><|start|>assistant<|channel|>analysis"
     f"<|message|>Add them.<|end|><|start|>assistant<|channel|>final<|message|>{FINAL}<|return|>", "Thinking aloud.", FINAL),
    ("harmony", None, "<|channel|>analysis<|message|>Add them and", "Add them and", None),  # cut in the analysis
    ("harmony", None, "<|channel|>analysis<|message|>Add.<|end|><|start|>assistant<|channel|>fi", "Add.", None),
    ("harmony", None, "<|channel|>analysis<|message|>Add.<|end|><|start|>assistant<|channel|>final<|message|>The ans",
     "Add.", "The ans"),  # cut inside the final response: what an API returns with finish_reason length
    ("qwen3", None, f"<think>\nAdd them.\n</think>\n\n{FINAL}<|im_end|>", "Add them.", FINAL),
    ("qwen3", None, "<think>\nAdd them and", "Add them and", None),
    ("qwen3", None, f"{FINAL}<|im_end|>", "", FINAL),  # the model skipped thinking
    ("qwen3", "none", f"{FINAL}<|im_end|>", "", FINAL),
    ("deepseek_v3.1", "medium", f"Add them.</think>{FINAL}<｜end▁of▁sentence｜>", "Add them.", FINAL),
    ("deepseek_v3.1", "medium", "Add them and", "Add them and", None),
    ("deepseek_v3.1", None, f"{FINAL}<｜end▁of▁sentence｜>", "", FINAL),
])
def test_split_into_reasoning_and_final(toks, family, effort, text, reasoning, final):
    tok = toks[family]
    completion = ids(tok, text)
    s, hidden, shown = _final(tok, fmt(tok, effort)[1], completion)
    assert reasoning in hidden and (final is None or final not in hidden)
    assert shown == final and s.final == (final is not None)
    assert s.start <= s.end <= len(completion) and (s.final or s.start == s.end == len(completion))


# ------------------------------------------------------------------ prompts: final response or exact tokens

def test_exact_own_turn_extends_the_earlier_prompt_token_for_token(toks):
    tok = toks["harmony"]
    chat = ChatFormat(tok)
    gen = ids(tok, f"<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>final<|message|>{FINAL}<|return|>")
    head = chat.encode(USER)
    nxt = {"role": "user", "content": "Again?"}
    exact = chat.encode(USER + [{"role": "assistant", "content": gen, "generated": True}, nxt])
    assert exact[:len(head) + len(gen) - 1] == head + gen[:-1]  # <|return|> left to the template...
    assert tok.decode(exact[len(head) + len(gen) - 1:]) == "<|end|><|start|>user<|message|>Again?<|end|><|start|>assistant"
    final = chat.encode(USER + [{"role": "assistant", "content": ids(tok, FINAL)}, nxt])
    assert "Add them" not in tok.decode(final)  # ...while the API-faithful turn is the final channel alone
    assert f"<|start|>assistant<|channel|>final<|message|>{FINAL}<|end|>" in tok.decode(final)
    # an exact turn inside an exact turn: round 2 extends round 1's prompt
    r2 = chat.encode(USER + [{"role": "assistant", "content": gen, "generated": True}, nxt,
                             {"role": "assistant", "content": gen, "generated": True}, nxt])
    assert r2[:len(exact)] == exact


def contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def _scripted(tok, completions):
    """Initial samples by index from `completions`; every debate answers with the last one."""
    initial_len = []

    def script(prompt, i):
        if not initial_len or len(prompt) == initial_len[0]:
            initial_len[:1] = [len(prompt)]
            text, reason = completions[i]
        else:
            text, reason = completions[-1]
        return ids(tok, text), reason

    return script


HARMONY_AGENTS = [
    (f"<|channel|>analysis<|message|>SECRET plan: add.<|end|><|start|>assistant<|channel|>final<|message|>{FINAL}<|return|>",
     "stop"),
    ("<|channel|>analysis<|message|>SECRET and still thinking about it", "length"),
    ("<|channel|>analysis<|message|>SECRET check.<|end|><|start|>assistant<|channel|>final<|message|>"
     "Still \\boxed{5}.<|return|>", "stop"),
]


def forced_backend(tok, completions, **kw):
    eng = Engine(make_model("llama", vocab=len(tok), seed=1), tok, EngineConfig(kv_cache_memory=8 * 2**20, block_size=4))
    forced = ForcedEngine(eng, _scripted(tok, completions))
    return forced, EngineBackend(forced, SamplingParams(max_tokens=64), **kw)


@pytest.mark.parametrize("signals_over", ["final", "completion"])
def test_responses_keep_both_parts_and_read_the_final_one(toks, signals_over):
    tok = toks["harmony"]
    forced, backend = forced_backend(tok, HARMONY_AGENTS, reasoning_effort="high", signals_over=signals_over)
    ok, cut = asyncio.run(backend.initial(Q, 2))
    assert "Reasoning: high" in tok.decode(forced.prompts[0])
    gen = ids(tok, HARMONY_AGENTS[0][0])
    assert ok.tokens == gen and ok.completion_tokens == len(gen)  # billed: reasoning + final
    assert (ok.text, ok.answer, ok.signals["self_conf"], ok.final, ok.finish_reason) == (FINAL, "5", 0.8, True, "stop")
    assert "SECRET plan" in ok.reasoning and "SECRET" not in ok.text
    assert tok.decode(ok.final_tokens) == FINAL
    assert (cut.answer, cut.text, cut.final, cut.finish_reason, cut.signals["self_conf"]) == (None, "", False, "length", None)
    assert cut.completion_tokens == len(ids(tok, HARMONY_AGENTS[1][0])) and "still thinking" in cut.reasoning
    # min-LL over the final response's tokens (what an API returns logprobs for), or the whole completion
    lp = asyncio.run(forced.engine.score(forced.prompts[0], gen)).logprobs
    start = len(gen) - len(ok.final_tokens) - 1  # the final body, then <|return|>
    want = min(lp[start:start + len(ok.final_tokens)]) if signals_over == "final" else min(lp)
    assert ok.signals["min_ll"] == pytest.approx(want, abs=1e-5)
    assert (cut.signals["min_ll"] is None) == (signals_over == "final")
    row = trace_row(Q, [ok, cut], [])
    assert [(a["final"], a["finish_reason"], "SECRET" in a["reasoning"]) for a in row["agents"]] == [
        (True, "stop", True), (False, "length", True)]
    back = row_initial(row)
    assert [(r.text, r.reasoning, r.final, r.finish_reason) for r in back] == [
        (r.text, r.reasoning, r.final, r.finish_reason) for r in (ok, cut)]


@pytest.mark.parametrize("own_turn", ["final", "exact"])
def test_peers_see_the_final_response_only(toks, own_turn):
    tok = toks["harmony"]
    forced, backend = forced_backend(tok, HARMONY_AGENTS, own_turn=own_turn)
    ok, cut = asyncio.run(backend.initial(Q, 2))
    after = asyncio.run(backend.debate(Q, cut, [ok]))  # the cut agent hears the one that answered
    prompt = forced.prompts[-1]
    text = tok.decode(prompt)
    assert text.count("SECRET plan") == 0 and text.count(FINAL) == 1  # the peer's final response, its reasoning hidden
    assert contains(prompt, ok.final_tokens)  # as the exact tokens it generated
    assert ("SECRET and still thinking" in text) == (own_turn == "exact")  # the receiver's own earlier reasoning
    assert (after.answer, after.prompt_tokens, after.completion_tokens) == ("5", len(prompt), len(ids(tok, HARMONY_AGENTS[2][0])))
    assert "SECRET check" in after.reasoning and after.text == "Still \\boxed{5}."


def test_exact_own_turn_reuses_the_cache_and_bills_the_reasoning(toks):
    """The cost of the choice on one small example (docs/methods.md quotes it): the receiver's own
    answer as its final response (API-faithful) or as the exact tokens it generated."""
    tok = toks["harmony"]
    long = [(f"<|channel|>analysis<|message|>{'SECRET plan: add the two numbers. ' * 4}<|end|><|start|>assistant"
             f"<|channel|>final<|message|>{FINAL}<|return|>", "stop")] * 3
    header = len(ids(tok, "<|channel|>final<|message|>"))  # what the template writes before a final response
    cost = {}
    for own_turn in ("final", "exact"):
        forced, backend = forced_backend(tok, long, own_turn=own_turn)
        a, b = asyncio.run(backend.initial(Q, 2))
        d = asyncio.run(backend.debate(Q, a, [b]))
        head, ran = len(forced.prompts[0]), len(a.tokens) - 1  # the initial prompt; the completion, <|return|> aside
        cost[own_turn] = (d.prompt_tokens, d.computed_tokens)
        if own_turn == "exact":  # everything up to the end of its own completion is reused
            assert d.computed_tokens == d.prompt_tokens - head - ran
        else:  # reused up to the first generated token (<|channel|>, which the final turn also opens with)
            assert d.computed_tokens == d.prompt_tokens - head - 1
    (billed_f, computed_f), (billed_x, computed_x) = cost["final"], cost["exact"]
    hidden = ran - len(a.final_tokens) - header  # analysis message + the final message's header, as generated
    assert billed_x - billed_f == hidden  # exact bills the hidden reasoning on every debate...
    assert computed_f - computed_x == len(a.final_tokens) + header - 1  # ...final recomputes the final response


@pytest.mark.parametrize("family,effort,text,cut", [
    ("qwen3", None, f"<think>\nSECRET: add.\n</think>\n\n{FINAL}<|im_end|>", "<think>\nSECRET, still"),
    ("deepseek_v3.1", "medium", f"SECRET: add.</think>{FINAL}<｜end▁of▁sentence｜>", "SECRET, still"),
])
def test_think_tag_models_through_the_backend(toks, family, effort, text, cut):
    tok = toks[family]
    forced, backend = forced_backend(tok, [(text, "stop"), (cut, "length"), (text, "stop")], reasoning_effort=effort)
    ok, stopped = asyncio.run(backend.initial(Q, 2))
    assert (ok.answer, ok.text, "SECRET" in ok.reasoning, ok.final) == ("5", FINAL, True, True)
    assert (stopped.answer, stopped.final, stopped.finish_reason) == (None, False, "length")
    after = asyncio.run(backend.debate(Q, stopped, [ok]))
    prompt = tok.decode(forced.prompts[-1])
    assert "SECRET" not in prompt and FINAL in prompt and after.answer == "5"
