"""FT_PRESET=demo: a tiny Qwen3 model, tokenizer and chat dataset, built offline and deterministically.

The task (reverse the user's list of words) can only be solved by attending to the user turn, so a
model that learns it proves the data path end to end: template, masking, labels, saving, loading.  Each prompt
has one right answer (`example`), so an answer is scored exactly (trainer/evaluation/scoring.py); `held_out` gives
prompts the training rows do not hold.
"""

from __future__ import annotations

import json
import os
import random

from trainer.core.files import staged
from trainer.core.volume import Volume
from trainer.data import chatml

WORDS = (
    "apple river stone cloud tiger maple ocean piano rocket silver garden winter "
    "lemon castle forest candle desert violet copper falcon harbor meadow thunder pepper"
).split()


def example(words: list[str]) -> tuple[str, str]:
    """The task: the user's prompt for a list of words, and its one right answer."""
    return "Reverse: " + " ".join(words), " ".join(reversed(words))


def reversal_conversation(rng: random.Random) -> dict:
    prompt, answer = example(rng.sample(WORDS, rng.randint(3, 6)))
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.2:
        messages.insert(0, {"role": "system", "content": "You reverse lists of words."})
    return {"messages": messages}


def conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [reversal_conversation(rng) for _ in range(n)]


ROWS, SEED = 2000, 1234  # the demo's data/train.jsonl


def held_out(n: int, seed: int = 20_251) -> list[tuple[str, str]]:
    """`n` (prompt, answer) pairs whose prompt no row of the demo's data holds (drawn with another seed)."""
    seen = {row["messages"][-2]["content"] for row in conversations(ROWS, SEED)}
    rng, pairs = random.Random(seed), []
    while len(pairs) < n:
        pair = example(rng.sample(WORDS, rng.randint(3, 6)))
        if pair[0] not in seen and pair not in pairs:
            pairs.append(pair)
    return pairs


def build_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=chatml.TEMPLATE,
        model_max_length=512,
    )


def build_model(vocab_size: int, pad_token_id: int, eos_token_id: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
    )
    return Qwen3ForCausalLM(config)


TASK = "fulltune_demo_reverse"  # the demo's benchmark (FT_EVAL_TASKS of the preset): an lm-eval task over local rows

TASK_YAML = """# The demo's benchmark, written with the demo (trainer/data/demo.py): which of three orders of a held-out
# list is its reversal, by the model's log-likelihood of each.  A task of one's own looks the same
# (docs/tracking-and-serving.md#a-task-of-ones-own).
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {rows}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def task_rows(n: int = 48, seed: int = 7) -> list[dict]:
    """The benchmark's documents: held-out prompts, each with its reversal, the list as given and another order."""
    rng, rows = random.Random(seed), []
    for prompt, answer in held_out(n, seed=30_011):
        words = prompt.removeprefix("Reverse: ").split()
        shuffled = words[:]
        while " ".join(shuffled) in (answer, " ".join(words)):
            rng.shuffle(shuffled)
        choices = [answer, " ".join(words), " ".join(shuffled)]
        rng.shuffle(choices)
        rows.append({"prompt": prompt, "choices": choices, "answer": choices.index(answer)})
    return rows


def write_eval_task(folder: str) -> None:
    """The benchmark's YAML and rows; written at every start, because the YAML names its rows by absolute path and a
    volume may be mounted elsewhere next time."""
    os.makedirs(folder, exist_ok=True)
    rows = os.path.join(folder, "rows.jsonl")
    with open(rows, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in task_rows())
    with open(os.path.join(folder, f"{TASK}.yaml"), "w", encoding="utf-8") as f:
        f.write(TASK_YAML.format(task=TASK, rows=json.dumps(os.path.abspath(rows))))


def ensure_demo(output_dir: str, rows: int = ROWS) -> str:
    """Build the volume's demo folder once (model, tokenizer, data/train.jsonl); later calls reuse it."""
    demo = Volume(output_dir).demo
    if os.path.exists(os.path.join(demo, "COMPLETE")):
        write_eval_task(os.path.join(demo, "eval-tasks"))
        return demo
    data = conversations(rows, seed=SEED)
    texts = [m["content"] for row in data for m in row["messages"]]
    tokenizer = build_tokenizer(texts + ["system user assistant"])
    model = build_model(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    with staged(demo) as partial:  # a half-built demo from an interrupted start is rebuilt
        model.save_pretrained(os.path.join(partial, "model"))
        tokenizer.save_pretrained(os.path.join(partial, "model"))
        os.makedirs(os.path.join(partial, "data"))
        with open(os.path.join(partial, "data", "train.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in data)
        with open(os.path.join(partial, "COMPLETE"), "w") as f:
            f.write("ok\n")
    write_eval_task(os.path.join(demo, "eval-tasks"))
    return demo
