"""Chat templates in each family's tool format, for the tiny checkpoints (imported as `templates`).

Written for these tests after the families' published templates: they render the tools and the calls the way
those do (Qwen3's JSON in <tool_call>, Nemotron 3's <function=...> parameters, DeepSeek V3.1's special markers),
with the rest of the conversation in ChatML or DeepSeek's turn markers.
"""

QWEN = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nFunctions:\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "Call one as JSON inside <tool_call> tags.<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}\n<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'assistant' %}\n<|im_start|>assistant\n{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}{% if loop.first and m.content or not loop.first %}\n{% endif %}"
    "<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>"
    "{%- elif m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}\n<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{% endif %}"
    "{%- endif %}{%- endfor %}\n{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

NEMOTRON = (
    "{%- set system = messages[0].content if messages[0].role == 'system' else '' %}"
    "{%- set loop_messages = messages[1:] if messages[0].role == 'system' else messages %}"
    "{%- if system or tools %}<|im_start|>system\n{{ system }}{% if tools %}{% if system %}\n\n{% endif %}"
    "# Tools\n\nYou have access to the following functions:\n\n<tools>"
    "{%- for tool in tools %}{% set f = tool.function %}\n<function>\n<name>{{ f.name }}</name>\n"
    "<description>{{ f.description }}</description>\n<parameters>"
    "{%- for name, p in f.parameters.properties | items %}\n<parameter>\n<name>{{ name }}</name>\n<type>{{ p.type }}</type>\n"
    "</parameter>{% endfor %}\n<required>{{ f.parameters.required | default([]) | tojson }}</required>\n</parameters>\n</function>{% endfor %}"
    "\n</tools>\n\nCall one as:\n<tool_call>\n<function=NAME>\n<parameter=NAME>\nVALUE\n</parameter>\n</function>\n"
    "</tool_call>{% endif %}<|im_end|>\n{% endif %}"
    "{%- for m in loop_messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n<think></think>{{ m.content | trim }}"
    "{%- if m.tool_calls %}{% if m.content | trim %}\n{% endif %}{% for tc in m.tool_calls %}"
    "<tool_call>\n<function={{ tc.function.name }}>\n{% for k, v in tc.function.arguments | items %}<parameter={{ k }}>\n"
    "{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}\n</parameter>\n{% endfor %}"
    "</function>\n</tool_call>\n{% endfor %}{% endif %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}{% if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user\n{% endif %}"
    "<tool_response>\n{{ m.content }}\n</tool_response>\n{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think></think>{% endif %}"
)

# like DeepSeek V3.1's template, this one renders no tools (its model card puts their description in the system prompt)
DEEPSEEK = (
    "{{ bos_token }}{% for m in messages if m.role == 'system' %}{{ m.content }}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{%- elif m.role == 'assistant' %}<｜Assistant｜></think>{{ m.content or '' }}"
    "{%- if m.tool_calls %}<｜tool▁calls▁begin｜>{% for tc in m.tool_calls %}<｜tool▁call▁begin｜>{{ tc.function.name }}"
    "<｜tool▁sep｜>{{ tc.function.arguments | tojson }}<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}"
    "<｜end▁of▁sentence｜>"
    "{%- elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"
)
DEEPSEEK_TOKENS = ("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                   "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock", "description": "The time now",
                                          "parameters": {"type": "object", "properties": {}}}}
