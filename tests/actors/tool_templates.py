"""Chat templates that take tools, one per tool-call format, for tiny test checkpoints.

Written for these tests in the shape of the families' own templates: Qwen 2.5's (tools
in the system turn, `<tool_call>` JSON, `<tool_response>` turns), Llama 3.1's JSON one
(`ipython` results, calls as `{"name", "parameters"}`), Gemma 3's, which has no tools,
Mistral Small 3.2's (tools before the last user turn, `[TOOL_CALLS]name[ARGS]{...}`),
gpt-oss's harmony and Gemma 4's (tests/actors/test_http_harmony.py and
test_http_gemma4.py, with their markers as tokens: `with_markers`); and Qwen3-Coder's
OLMo 3's, Granite 3's, GLM-Z1's, LFM2's, GLM-4.6's, Seed-OSS's and Command R7B's own, published
(templates/).
"""

import json
import pathlib
import shutil

HERMES = (
    "{%- if tools %}<|im_start|>system\nYou may call functions.\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'Reply with <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- if message.content %}{{ message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

LLAMA3_JSON = (
    "<|start_header_id|>system<|end_header_id|>\n\n"
    "{%- if tools %}Environment: ipython\n{%- endif %}<|eot_id|>"
    "{%- if tools %}<|start_header_id|>user<|end_header_id|>\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of arguments}.\n'
    "{%- for t in tools %}{{ t | tojson(indent=4) }}\n{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{"name": "{{ message.tool_calls[0].function.name }}", "parameters": '
    "{{ message.tool_calls[0].function.arguments | tojson }}}<|eot_id|>"
    "{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    '{{ {"output": message.content} | tojson }}<|eot_id|>'
    "{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{{ message.content | trim }}<|eot_id|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)

GEMMA = (
    "{{ bos_token }}{%- for message in messages %}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role %}"
    "<start_of_turn>{{ role }}\n{{ message.content | trim }}<end_of_turn>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<start_of_turn>model\n{%- endif %}"
)

MISTRAL = (
    "{%- set ns = namespace(last_user=-1) %}{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{{ bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}"
    "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{%- if message.content %}{{ message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}[TOOL_CALLS]{{ call.function.name }}[ARGS]"
    "{{ call.function.arguments | tojson }}{%- endfor %}{{ eos_token }}"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{%- else %}{{ message.content }}{{ eos_token }}{%- endif %}"
    "{%- endfor %}"
)

# gpt-oss's harmony format: a system turn with the reasoning level, the tools as a
# TypeScript namespace in a developer turn, calls addressed to=functions.NAME on the
# commentary channel, earlier reasoning replayed as `thinking` on the analysis channel.
HARMONY = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{%- for tool in tools %}type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;\n"
    "{%- endfor %}} // namespace functions<|end|>{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.thinking %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>{%- endif %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "<|start|>assistant to=functions.{{ message.tool_calls[0].function.name }}"
    "<|channel|>commentary json<|message|>{{ message.tool_calls[0].function.arguments | tojson }}<|call|>"
    "{%- elif message.role == 'tool' %}<|start|>functions.{{ message.name | default('tool') }} to=assistant"
    "<|channel|>commentary<|message|>{{ message.content | tojson }}<|end|>"
    "{%- elif message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)

# Gemma 4's shape (written for these tests from the markup its releases' template
# writes): turns between `<|turn>` and `<turn|>`, tools declared in the system turn,
# calls as `<|tool_call>call:NAME{key:value}<tool_call|>` with strings between `<|"|>`
# marks, their results as `tool_responses` inside the model's turn, which goes on after
# them, and the generation prompt's empty thought channel when thinking is off.
GEMMA4 = (
    "{{ bos_token }}"
    "{%- if tools or enable_thinking %}<|turn>system\n{%- if enable_thinking %}<|think|>{%- endif %}"
    "{%- for tool in tools %}<|tool>declaration:{{ tool.function.name }}"
    "{{ tool.function.parameters | tojson }}<tool|>{%- endfor %}<turn|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role %}<|turn>{{ role }}\n"
    "{% for call in message.tool_calls or [] %}<|tool_call>call:{{ call.function.name }}{{ '{' }}"
    "{%- for key, value in call.function.arguments | dictsort %}{{ key }}:"
    "{%- if value is string %}<|\"|>{{ value }}<|\"|>{%- else %}{{ value | tojson }}{%- endif %}"
    "{%- if not loop.last %},{% endif %}{%- endfor %}}<tool_call|>{%- endfor %}"
    "{%- for result in message.tool_responses or [] %}<|tool_response>response:{{ result.name }}"
    "{{ result.response | tojson }}<tool_response|>{%- endfor %}"
    "{{ message.content or '' }}{%- if not message.tool_responses %}<turn|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{%- if not (messages[-1].tool_responses) %}<|turn>model\n{%- endif %}"
    "{%- if not enable_thinking %}<|channel>thought\n<channel|>{%- endif %}{%- endif %}"
)

# Qwen3-Coder's published template (as llama.cpp keeps it): calls in XML, in <tool_call>.
QWEN3_CODER = (pathlib.Path(__file__).parent / "templates" / "Qwen-Qwen3-Coder-30B-A3B-Instruct.jinja").read_text()

# OLMo 3.1 Instruct's published template: Python calls in <function_calls>, results as environment turns.
OLMO3 = (pathlib.Path(__file__).parent / "templates" / "allenai-Olmo-3.1-32B-Instruct.jinja").read_text()

# Granite 3.3 Instruct's published template: roles and content alone, tools as `available_tools`.
GRANITE = (pathlib.Path(__file__).parent / "templates" / "ibm-granite-granite-3.3-2b-instruct.jinja").read_text()
# GLM-Z1-9B-0414's published template: a call is a tool's name, then its JSON, results observations.
GLM4 = (pathlib.Path(__file__).parent / "templates" / "THUDM-GLM-Z1-9B-0414.jinja").read_text()

# LFM2-1.2B's published template: the tool list in <|tool_list_start|>, each turn's content alone.
LFM2 = (pathlib.Path(__file__).parent / "templates" / "LiquidAI-LFM2-1.2B.jinja").read_text()

# GLM-4.6's published template: a call is its name and key and value tags, results observations.
GLM45 = (pathlib.Path(__file__).parent / "templates" / "zai-org-GLM-4.6.jinja").read_text()

# Seed-OSS-36B-Instruct's published template (as llama.cpp keeps it): Qwen3-Coder's XML in <seed:tool_call>.
SEED_OSS = (pathlib.Path(__file__).parent / "templates" / "ByteDance-Seed-Seed-OSS-36B-Instruct.jinja").read_text()

# Command R7B's published tool-use template (as llama.cpp keeps it): calls between its action tokens.
COMMAND_R7B = (pathlib.Path(__file__).parent / "templates" / "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja").read_text()

TEMPLATES = {
    "hermes": HERMES,
    "llama3_json": LLAMA3_JSON,
    "gemma": GEMMA,
    "mistral": MISTRAL,
    "qwen3_coder": QWEN3_CODER,
    "olmo3": OLMO3,
    "granite": GRANITE,
    "glm4": GLM4,
    "lfm2": LFM2,
    "glm45": GLM45,
    "seed_oss": SEED_OSS,
    "command_r7b": COMMAND_R7B,
}


def with_template(checkpoint, out_dir, template):
    """A copy of `checkpoint` whose tokenizer ships `template`."""
    shutil.copytree(checkpoint, out_dir)
    config_file = out_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = template
    config_file.write_text(json.dumps(config))
    return out_dir


def with_markers(checkpoint, out_dir, template, markers, stops=(), plain=()):
    """A copy of `checkpoint`, whose tokenizer has room for 8 more tokens, shipping
    `template`, with `markers` as its added tokens, special but for those in `plain`,
    and `stops` among its EOS tokens (a model family's own markup, as its tokenizer and
    generation config hold it)."""
    from runtime.tokenizer import Tokenizer

    with_template(checkpoint, out_dir, template)
    size = Tokenizer.from_dir(out_dir).vocab_size
    tokenizer_file = out_dir / "tokenizer.json"
    raw = json.loads(tokenizer_file.read_text())
    ids = {marker: size + offset for offset, marker in enumerate(markers)}
    raw["added_tokens"] += [
        {"id": token_id, "content": marker, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": marker not in plain}
        for marker, token_id in ids.items()
    ]
    tokenizer_file.write_text(json.dumps(raw))
    generation = json.loads((out_dir / "generation_config.json").read_text())
    generation["eos_token_id"] += [ids[stop] for stop in stops]
    (out_dir / "generation_config.json").write_text(json.dumps(generation))
    return out_dir


def written(checkpoint, markers, *parts):
    """A Lark grammar writing `parts` in order: `markers` as the tokenizer's own tokens,
    anything else as literal text."""
    from runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(checkpoint)
    pieces = [
        f"<[{tokenizer.added_token_id(part)}]>" if part in markers else json.dumps(part) for part in parts
    ]
    return "start: " + " ".join(pieces)
