# Regenerates golden.json: every fixture template in templates/ rendered by
# real Jinja for a set of conversations, the way Hugging Face's
# apply_chat_template renders them (trim_blocks, lstrip_blocks, its tojson and
# raise_exception, strftime_now fixed to 2025-03-09). TestRenderGolden checks
# that the Go renderers produce the same strings.
#
#   python3 golden.py   (needs jinja2; run from this directory)
import datetime, json, os
import jinja2
from jinja2 import ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(msg):
    raise jinja2.exceptions.TemplateError(msg)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = lambda f: datetime.datetime(2025, 3, 9).strftime(f)

BOS = {"llama3": "<|begin_of_text|>", "mistral": "<s>", "gemma": "<bos>", "chatml": "<|endoftext|>"}
TEMPLATES = {
    "llama3-instruct.jinja": "llama3",
    "llama3.1-instruct.jinja": "llama3",
    "llama3.2-instruct.jinja": "llama3",
    "qwen2-instruct.jinja": "chatml",
    "qwen2.5-instruct.jinja": "chatml",
    "qwen3.jinja": "chatml",
    "chatml.jinja": "chatml",
    "mistral-7b-instruct-v0.1.jinja": "mistral",
    "mistral-7b-instruct-v0.2.jinja": "mistral",
    "mistral-7b-instruct-v0.3.jinja": "mistral",
    "mistral-nemo-instruct-2407.jinja": "mistral",
    "mistral-large-2411.jinja": "mistral",
    "gemma-2-it.jinja": "gemma",
    "gemma-3-it.jinja": "gemma",
}


def m(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = {
    "user": [m("user", "Hello")],
    "sys_user": [m("system", "You are terse."), m("user", "Hi")],
    "multi": [m("user", "What is 2+2?"), m("assistant", "4"), m("user", "And 3+3?")],
    "sys_multi": [m("system", "You are a calculator."), m("user", "What is 2+2?"), m("assistant", "4"), m("user", "And 3+3?")],
    "spaces": [m("system", "  Be brief.\n"), m("user", " Hi there \n"), m("assistant", "\n Hello! \n"), m("user", "Bye ")],
    "prefill": [m("system", "S"), m("user", "U"), m("assistant", "A")],
    "think": [m("user", "q1"), m("assistant", "<think>\nr1\n</think>\n\na1"), m("user", "q2")],
    "think_last": [m("user", "q1"), m("assistant", "<think>\nr1\n</think>\n\na1")],
    "tools": [m("user", "weather?"), m("assistant", "calling"), m("tool", '{"t": 20}'), m("tool", 'sunny "ok"\n'), m("user", "thanks")],
    "unicode_ws": [m("user", "\x1c\u3000 h\u00e9llo \U0001F600\u2028\x1f"), m("assistant", "\u00a0ok\u0085")],
    "only_sys": [m("system", "lonely")],
}

cases = []
for name, style in TEMPLATES.items():
    with open(os.path.join("templates", name)) as f:
        tmpl = env.from_string(f.read())
    for conv, msgs in CONVERSATIONS.items():
        for agp in (True, False):
            for think in (None, False, True) if name == "qwen3.jinja" else (None,):
                kw = {"add_generation_prompt": agp, "bos_token": BOS[style], "eos_token": "</s>"}
                if think is not None:
                    kw["enable_thinking"] = think
                try:
                    want, err = tmpl.render(messages=msgs, **kw), ""
                except jinja2.exceptions.TemplateError as e:
                    want, err = "", str(e)
                cases.append({"template": name, "conversation": conv, "add_generation_prompt": agp,
                              "enable_thinking": think, "bos": BOS[style], "want": want, "jinja_error": err})

with open("golden.json", "w") as f:
    json.dump({"jinja2": jinja2.__version__, "conversations": CONVERSATIONS, "cases": cases}, f, indent=0, ensure_ascii=False)
    f.write("\n")
