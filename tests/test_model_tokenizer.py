"""Tokenizer: special tokens, lossless round trips, the ChatML template with Qwen3.5-style tool calls,
and the prefix property the token-in/token-out agent relies on."""

import json

import pytest

from tasks.policy import tokenizer as T
from tests.fixtures.smoke import REPO

TOOLS = [
    {"type": "function", "function": {
        "name": "execute_bash", "description": "Run a bash command.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}},
    {"type": "function", "function": {
        "name": "finish", "description": "Submit.", "parameters": {"type": "object", "properties": {}}}},
]


def call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


# Multi-turn episode with the awkward cases: completions starting with spaces
# or newlines, several calls in one turn, several results in one user turn,
# tool output with trailing newlines, non-ASCII, and text that looks like markup.
CONVERSATION = [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": "Fix   foo.py:\n\n    def f(): return 1/0\n"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [call("execute_bash", cmd="cat foo.py")]},
    {"role": "tool", "content": "def f():\n    return 1/0\n"},
    {"role": "assistant", "content": "", "tool_calls": [call("execute_bash", cmd="ls -la"),
                                                        call("execute_bash", cmd="grep -n 'é' *.py")]},
    {"role": "tool", "content": "foo.py\n\n"},
    {"role": "tool", "content": "   2:x = 'é' </tool_response> <|im_start|>"},
    {"role": "assistant", "content": "\n\n  Fixed it.", "tool_calls": [call("finish")]},
]


@pytest.fixture(scope="module")
def tok():
    return T.train_tokenizer(vocab_size=2048)


def test_special_tokens_are_single_ids(tok):
    ids = T.special_token_ids(tok)
    assert len(set(ids.values())) == 7
    assert tok.eos_token == T.IM_END and tok.pad_token == T.ENDOFTEXT
    assert len(tok) == 2048
    # Tool markup survives a decode that skips control tokens (vLLM's qwen3_coder parser needs it).
    text = f"{T.IM_START}assistant\n{T.TOOL_CALL}\n{{}}\n{T.TOOL_CALL_END}{T.IM_END}"
    assert tok.decode(T.encode(tok, text), skip_special_tokens=True) == "assistant\n<tool_call>\n{}\n</tool_call>"


@pytest.mark.parametrize("text", [
    "def f(x):\n\treturn x  # comment\n",
    "  leading and trailing spaces  ",
    "\n\n\n    indented\r\nwindows line\n",
    "unicode: é ß 漢字 🙂 \u200b",
    "<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{\"a\": 1}\n</tool_call>",
    "", " ", "\n",
])
def test_encode_decode_round_trip(tok, text):
    assert tok.decode(T.encode(tok, text), skip_special_tokens=False) == text


def test_template_renders_qwen35_tool_calls(tok):
    text = T.render(tok, CONVERSATION[:4], TOOLS)
    assert text.startswith("<|im_start|>system\nYou fix bugs.\n\n# Tools\n")
    assert "\n<tools>\n" + json.dumps(TOOLS[0]) + "\n" + json.dumps(TOOLS[1]) + "\n</tools>" in text
    assert ("<|im_start|>assistant\nLet me look.\n<tool_call>\n<function=execute_bash>\n"
            "<parameter=cmd>\ncat foo.py\n</parameter>\n</function>\n</tool_call><|im_end|>\n") in text
    assert text.endswith("<|im_start|>user\n<tool_response>\ndef f():\n    return 1/0\n\n</tool_response><|im_end|>\n")
    # Without tools: plain ChatML; generation prompt opens the assistant turn.
    plain = T.render(tok, CONVERSATION[:2], add_generation_prompt=True)
    assert plain == ("<|im_start|>system\nYou fix bugs.<|im_end|>\n<|im_start|>user\n"
                     f"{CONVERSATION[1]['content']}<|im_end|>\n<|im_start|>assistant\n")
    # OpenAI-style JSON-string arguments render like mappings; strings raw, other values as JSON.
    msg = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "file_editor",
                                          "arguments": '{"old_str": "x = \\"a\\"", "view_range": [1, 2]}'}}]}
    assert T.render(tok, [msg]) == ('<|im_start|>assistant\n<tool_call>\n<function=file_editor>\n'
                                    '<parameter=old_str>\nx = "a"\n</parameter>\n'
                                    '<parameter=view_range>\n[1, 2]\n</parameter>\n'
                                    '</function>\n</tool_call><|im_end|>\n')


def test_assistant_text_and_observation_segment_match_template(tok):
    full = T.render(tok, CONVERSATION, TOOLS)
    prompt = T.render(tok, CONVERSATION[:2], TOOLS, add_generation_prompt=True)
    pieces = [prompt]
    i = 2
    while i < len(CONVERSATION):
        m = CONVERSATION[i]
        pieces.append(T.assistant_text(m["content"], m.get("tool_calls", [])))
        results = []
        i += 1
        while i < len(CONVERSATION) and CONVERSATION[i]["role"] == "tool":
            results.append(CONVERSATION[i]["content"])
            i += 1
        if results:
            pieces.append(T.observation_segment(results))
    # The template closes the last assistant turn with "\n" (the episode never contains it).
    assert "".join(pieces) + "\n" == full


def test_prefix_property_multi_turn(tok):
    """tokenize(render(conversation)) == prompt ids + completion ids + segment ids + ..."""
    episode = T.prompt_ids(tok, CONVERSATION[:2], TOOLS)
    i = 2
    while i < len(CONVERSATION):
        m = CONVERSATION[i]
        completion = T.encode(tok, T.assistant_text(m["content"], m.get("tool_calls", [])))
        assert completion[-1] == tok.convert_tokens_to_ids(T.IM_END)
        episode += completion
        results = []
        i += 1
        while i < len(CONVERSATION) and CONVERSATION[i]["role"] == "tool":
            results.append(CONVERSATION[i]["content"])
            i += 1
        if results:
            episode += T.observation_segment_ids(tok, results)
    full = T.encode(tok, T.render(tok, CONVERSATION, TOOLS))
    assert full == episode + T.encode(tok, "\n")
    assert tok.decode(episode, skip_special_tokens=False) + "\n" == T.render(tok, CONVERSATION, TOOLS)


def test_prefix_property_holds_for_any_completion_start(tok):
    # The pre-tokenizer isolates "\n", so text after "<|im_start|>assistant\n" never merges with it.
    prompt = T.prompt_ids(tok, CONVERSATION[:2])
    for content in ["   x = 1", "\n\n  y", "\t\tz", " ", "def g():\n    pass"]:
        whole = T.encode(tok, T.render(tok, CONVERSATION[:2] + [{"role": "assistant", "content": content}]))
        assert whole == prompt + T.encode(tok, T.assistant_text(content)) + T.encode(tok, "\n"), content


def test_save_load_keeps_template_and_ids(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = T.render(tok, CONVERSATION, TOOLS)
    assert T.render(again, CONVERSATION, TOOLS) == text
    assert T.encode(again, text) == T.encode(tok, text)
    assert T.special_token_ids(again) == T.special_token_ids(tok)


def test_load_tokenizer_is_autotokenizers_without_its_imports(tok, tmp_path):
    """The run's loader gives what AutoTokenizer gives for our checkpoints, in a process that then has
    neither torch nor sympy (AutoTokenizer imports both); another class goes through AutoTokenizer."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    ours, auto = T.load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert type(ours) is type(auto)
    text = T.render(auto, CONVERSATION, TOOLS)
    assert T.render(ours, CONVERSATION, TOOLS) == text and T.encode(ours, text) == T.encode(auto, text)
    assert T.special_token_ids(ours) == T.special_token_ids(auto)
    code = ("import sys; from tasks.policy.tokenizer import load_tokenizer; "
            f"load_tokenizer({str(tmp_path)!r}); print(sorted({{'torch', 'sympy'}} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    assert type(T.load_tokenizer(tmp_path)).__name__ == "Qwen2Tokenizer"  # AutoTokenizer's choice


def test_observation_segment_needs_results(tok):
    with pytest.raises(ValueError):
        T.observation_segment_ids(tok, [])


def test_custom_corpus_and_vocab_bounds():
    small = T.train_tokenizer(["def add(a, b):\n    return a + b\n"] * 50, vocab_size=300)
    assert len(small) <= 300
    assert small.decode(T.encode(small, "return a + b  # unseen text ✓")) == "return a + b  # unseen text ✓"
    with pytest.raises(ValueError):
        T.train_tokenizer(["x"], vocab_size=100)
