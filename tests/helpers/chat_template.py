"""ChatML as src/lm/data/chat.py renders it, with transformers' {% generation %} markers around what the
assistant says: what transformers' return_assistant_tokens_mask reads (an independent account of the assistant's
tokens, tests/test_chat.py) and what TRL's SFTTrainer needs for assistant_only_loss (bench/compare/sft.py)."""

from src.lm.data.chat import CHATML

MARKED = CHATML.replace(
    "<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n{{ call.function | tojson }}\n</tool_call>{% endfor %}"
    "{{ eos_token }}",
    "<|im_start|>{{ message.role }}\n{% if message.role == 'assistant' %}{% generation %}"
    "{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n{{ call.function | tojson }}\n</tool_call>{% endfor %}"
    "{{ eos_token }}{% endgeneration %}{% else %}{{ message.content or '' }}{{ eos_token }}{% endif %}",
)
assert "generation" in MARKED, "CHATML changed: update the markers"
