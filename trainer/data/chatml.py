"""ChatML, the chat layout of Qwen2.5 and Qwen3 (without Qwen3's thinking block): the one template fulltune writes.

It is added to a tokenizer that has no chat template of its own (trainer/model/loading.py), and it is the
template of the demo's tokenizer (trainer/data/demo.py) and of the benchmark's (bench/synthetic.py).  The same
layout as `trl.setup_chat_format(format="chatml")` used to add (removed in TRL 1.x).
"""

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
