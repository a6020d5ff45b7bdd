"""Tokenizer for the tiny policy: a byte-level BPE trained here (no model hub),
Qwen-style special tokens and a ChatML chat template with Qwen3.5-style tool calls.

The agent works token-in/token-out: it keeps one token list per episode and
appends, after each completion, the tokens of an *observation segment*
(`observation_segment_ids`). The chat template and that function are written
together so that tokenising the rendered conversation gives exactly
prompt + completion + segment + completion + ... (the prefix property,
pinned by tests/test_model_tokenizer.py). Two choices make that hold:

- completions end with `<|im_end|>` (the server returns the stop token), so a
  segment starts with the "\\n" that the template writes after `<|im_end|>`;
- the pre-tokenizer isolates every "\\n", so a boundary right after a newline
  (the prompt ends with "<|im_start|>assistant\\n") is always a token boundary,
  whatever text follows. Special tokens are boundaries anyway.
"""

from __future__ import annotations

import json
import pathlib
import sysconfig
from collections.abc import Iterable, Iterator, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"

# Control tokens: skipped by decode(skip_special_tokens=True).
CONTROL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
# Tool markup: one id each but not "special" (as in Qwen3), so a decode that
# skips special tokens still shows them and vLLM's qwen3_coder parser can find them.
TOOL_TOKENS = [TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END]

# ChatML with Qwen3.5's tool-call layout: tools listed in the system turn; an
# assistant tool call as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n
# </parameter>\n...</function>\n</tool_call>, string values written raw (no JSON
# quoting or escaping: the model copies code into old_str exactly as it reads it);
# consecutive tool results grouped in one user turn, each in <tool_response>.
# Whitespace control is explicit ({%- only), never `-%}` after <|im_end|>:
# that would eat the "\n" the prefix property depends on.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, reply in this format, one <parameter> block per argument'"
    " ' (values as plain text, never quoted or escaped; a value may span lines):\\n<tool_call>\\n'"
    " '<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for tc in message.tool_calls or [] %}"
    "{%- set f = tc.function if tc.function is defined else tc %}"
    "{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n<function=' + f.name + '>\\n' }}"
    "{%- for key, value in f.arguments.items() %}"
    "{{- '<parameter=' + key + '>\\n' }}"
    "{%- if value is string %}{{- value }}{%- else %}{{- value | tojson }}{%- endif %}"
    "{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# GPT-2 style split (contractions, letters, digits, punctuation, spaces), but
# with every "\n" on its own (see the module docstring).
_SPLIT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|[^\S\n]+(?![^\s])|[^\S\n]+|\n"""


def _pre_tokenizer():
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def default_corpus(max_chars: int = 4_000_000) -> Iterator[str]:
    """Text available on any machine: the Python standard library's source
    (code, with English docstrings and comments) and the licence texts in
    /usr/share/common-licenses (plain English). Deterministic order.
    The dataset stage passes the benchmark's own text instead."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))
    files += sorted(p for p in (stdlib / "json").glob("*.py"))
    licences = pathlib.Path("/usr/share/common-licenses")
    if licences.is_dir():
        files += sorted(p for p in licences.iterdir() if p.is_file())
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield text
        total += len(text)
        if total >= max_chars:
            return


def train_tokenizer(corpus: Iterable[str] | None = None, vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of exactly `vocab_size` ids (special tokens included)
    on `corpus` (an iterable of documents; None = `default_corpus()`)."""
    specials = CONTROL_TOKENS + TOOL_TOKENS
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size {vocab_size} < 256 bytes + {len(specials)} special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # Specials get ids 0..6 and are never merged into other tokens.
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(corpus if corpus is not None else default_corpus(), trainer)
    # The trainer registers all of them as special; tool markup is re-registered
    # as non-special added tokens (same ids).
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


# Classes that are the tokenizer.json itself: loading one needs no model configuration.
_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: str | pathlib.Path) -> PreTrainedTokenizerFast:
    """A checkpoint's tokenizer, as AutoTokenizer loads it. For a plain tokenizer.json (ours) without
    AutoTokenizer's import of every model configuration (torch, dynamo, sympy: ~7 s of CPU in each run's
    process); any other class, or remote code, goes through AutoTokenizer."""
    config = pathlib.Path(model_dir) / "tokenizer_config.json"
    settings = json.loads(config.read_text()) if config.is_file() else {}
    if settings.get("tokenizer_class") in _PLAIN_CLASSES and "auto_map" not in settings:
        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def special_token_ids(tokenizer) -> dict[str, int]:
    """Ids of the control and tool tokens; raises if one is not a single id."""
    ids = {}
    for t in CONTROL_TOKENS + TOOL_TOKENS:
        enc = tokenizer.encode(t, add_special_tokens=False)
        if len(enc) != 1:
            raise ValueError(f"{t!r} is not a single token in this tokenizer: {enc}")
        ids[t] = enc[0]
    return ids


def render(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None,
           add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        [_arguments_as_mappings(m) for m in messages], tools=list(tools) if tools else None, tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )


def _arguments_as_mappings(message: dict) -> dict:
    """OpenAI-style messages carry tool-call arguments as JSON strings; the template needs mappings."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for tc in message["tool_calls"]:
        f = tc.get("function", tc)
        if isinstance(f.get("arguments"), str):
            f = dict(f, arguments=json.loads(f["arguments"] or "{}"))
        calls.append(dict(tc, function=f) if "function" in tc else f)
    return dict(message, tool_calls=calls)


def tool_call_text(name: str, arguments: dict) -> str:
    """One tool call as the template writes it (Qwen3.5's XML-style layout)."""
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
                     for k, v in arguments.items())
    return f"{TOOL_CALL}\n<function={name}>\n{params}</function>\n{TOOL_CALL_END}"


def encode(tokenizer, text: str) -> list[int]:
    # Rendered text already carries its special tokens: add nothing.
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids of the initial prompt, ending with "<|im_start|>assistant\\n"."""
    return encode(tokenizer, render(tokenizer, messages, tools, add_generation_prompt=True))


def observation_segment(tool_results: Sequence[str]) -> str:
    """Text appended after a completion that ended with <|im_end|>: the "\\n"
    closing the assistant turn, one user turn holding every tool result, and
    the next assistant header. Equals what CHAT_TEMPLATE renders for that span."""
    if not tool_results:
        raise ValueError("an observation segment needs at least one tool result")
    body = "".join(f"\n{TOOL_RESPONSE}\n{r}\n{TOOL_RESPONSE_END}" for r in tool_results)
    return f"\n{IM_START}user{body}{IM_END}\n{IM_START}assistant\n"


def observation_segment_ids(tokenizer, tool_results: Sequence[str]) -> list[int]:
    """Token ids to append to an episode after a completion (which must end
    with <|im_end|>) given the tool results of that turn, in call order."""
    return encode(tokenizer, observation_segment(tool_results))


def assistant_text(content: str | None, tool_calls: Sequence[dict] = ()) -> str:
    """What the template renders for an assistant turn after its header, up to
    and including <|im_end|>: the completion text a model is trained to emit.
    tool_calls: [{"name": ..., "arguments": {...}}] (or OpenAI's {"function": {...}})."""
    out = content or ""
    for i, tc in enumerate(tool_calls):
        f = tc.get("function", tc)
        args = json.loads(f["arguments"] or "{}") if isinstance(f["arguments"], str) else f["arguments"]
        if i > 0 or content:
            out += "\n"
        out += tool_call_text(f["name"], args)
    return out + IM_END
