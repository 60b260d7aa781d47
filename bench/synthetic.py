"""Capybara-like synthetic conversations and a word-level tokenizer, so lengths are known exactly.

Each word is one token, so a conversation's token count is its words plus 3 per message
(`<|im_start|>`, the role, `<|im_end|>`).  Lengths follow a log-normal with sigma 0.8 (median = mean /
1.377), clipped to [32, 8 x mean]: for mean 1100 that is a median of ~800 tokens and a tail past 4k,
like trl-lib/Capybara (15.8k rows, ~1.1k tokens per row) under the Qwen3 tokenizer.  1 to 4
user/assistant exchanges, 20 % with a system message.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil

from trainer.data import chatml

WORDS = 8000
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}


def tokenizer(words: int = WORDS):
    """A word per token: the specials, the roles, [UNK], then `words` words (vocabulary = words + 7)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + ["system", "user", "assistant", "[UNK]"] + [f"w{i}" for i in range(words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"],
                                   chat_template=chatml.TEMPLATE, model_max_length=1 << 20)


def length(rng: random.Random, mean_tokens: int) -> int:
    """A conversation's token count: log-normal, sigma 0.8, clipped to [32, 8 x mean]."""
    sigma = 0.8
    return int(min(max(rng.lognormvariate(math.log(mean_tokens) - sigma**2 / 2, sigma), 32), 8 * mean_tokens))


def conversation(rng: random.Random, mean_tokens: int, words_in_vocab: int = WORDS) -> tuple[dict, int]:
    total = length(rng, mean_tokens)
    exchanges = rng.randint(1, 4)
    roles = (["system"] if rng.random() < 0.2 else []) + ["user", "assistant"] * exchanges
    words = max(total - 3 * len(roles), len(roles))
    weights = [rng.random() * (0.3 if r == "system" else 1.0) + 0.05 for r in roles]
    counts = [max(1, int(words * w / sum(weights))) for w in weights]
    messages = [{"role": r, "content": " ".join(f"w{rng.randrange(words_in_vocab)}" for _ in range(n))} for r, n in zip(roles, counts, strict=True)]
    return {"messages": messages}, sum(counts) + 3 * len(roles)


def build(work: str, rows: int, mean_tokens: int, gpu: bool, config_path: str, vocab: int = WORDS + 7) -> dict:
    """Write work/model (config, tokenizer, and on CPU the tiny model's weights) and work/data/train.jsonl.

    `vocab`: the tokenizer's size (the tiny model's vocabulary on CPU): `vocab - 7` distinct words.
    """
    done, request = os.path.join(work, "READY.json"), [rows, mean_tokens, gpu, vocab]
    if os.path.exists(done):
        with open(done) as f:
            ready = json.load(f)
        if ready.get("request") == request:  # built already, for the same request
            return ready["stats"]
    words = vocab - len(SPECIALS) - 4
    rng = random.Random(1234)
    data, lengths = zip(*(conversation(rng, mean_tokens, words) for _ in range(rows)), strict=True)
    os.makedirs(os.path.join(work, "data"), exist_ok=True)
    with open(os.path.join(work, "data", "train.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in data)
    model_dir = os.path.join(work, "model")
    shutil.rmtree(model_dir, ignore_errors=True)
    tok = tokenizer(words)
    tok.save_pretrained(model_dir)
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if gpu:
        shutil.copy(config_path, os.path.join(model_dir, "config.json"))  # the weights are built on the GPU (bench/child.py)
        from safetensors.torch import save_file

        # the job's trust check wants safetensors weights
        save_file({}, os.path.join(model_dir, "model.safetensors"), metadata={"note": "no weights: bench/child.py builds them on the GPU"})
    else:
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=len(tok), max_position_embeddings=8 * mean_tokens, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, bos_token_id=None, **TINY)
        Qwen3ForCausalLM(config).save_pretrained(model_dir)
    ordered = sorted(lengths)
    stats = {"rows": rows, "mean_tokens": round(sum(lengths) / rows), "p5": ordered[rows // 20], "p50": ordered[rows // 2],
             "p90": ordered[int(rows * 0.9)], "p95": ordered[int(rows * 0.95)], "max": ordered[-1], "vocab": len(tok)}
    with open(done, "w") as f:
        json.dump({"request": request, "stats": stats}, f)
    return stats
