"""The user's own task: held-out validation rows answered by the base and the fine-tuned model, and scored.

FT_EVAL_ROWS rows of the validation split, chosen with FT_SEED when the data is prepared (before training) and
kept on the volume (`evaluation/rows.json`), so that a restart that only evaluates needs no data.  Each row is
split as the sample answers split it (trainer/evaluation/samples.py): the conversation up to its last assistant turn
is the prompt, that turn is the reference.  Answers are greedy, at most FT_EVAL_MAX_NEW_TOKENS, in batches.

Scores: exact match (trainer/evaluation/scoring.py's rule) and chrF (sacrebleu's, 0-100: character n-gram overlap,
which credits a nearly right answer and needs no tokenizer or language); the corpus chrF over all rows is the
headline, each row's sentence chrF orders the best and worst examples kept.
"""

from __future__ import annotations

import os
from typing import Any

from trainer.core.files import read_json, write_json
from trainer.evaluation import samples, scoring

BATCH = 8  # rows per `generate` call: the cache of 8 long prompts stays small beside a 4B model
KEPT = 3  # best and worst examples kept for the log, the report and MLflow


def keep_rows(eval_rows: Any, n: int, seed: int, tokenizer: Any, path: str) -> int:
    """Choose the rows once (the same ones on every attempt) and keep them in `path`; return how many."""
    chosen = samples.pick(eval_rows, n, seed, tokenizer) if n and eval_rows is not None else []
    write_json(path, [{"row": c["row"], "prompt_ids": c["prompt_ids"], "reference_ids": c["reference_ids"]} for c in chosen])
    return len(chosen)


def kept_rows(path: str) -> list[dict]:
    return read_json(path, []) if os.path.exists(path) else []


def answer(net: Any, tokenizer: Any, rows: list[dict], max_new_tokens: int, bf16: bool) -> list[dict]:
    """Each row with the model's answer and its scores."""
    from sacrebleu.metrics import CHRF

    chrf = CHRF()
    scored = []
    for start in range(0, len(rows), BATCH):
        batch = rows[start : start + BATCH]
        replies = samples.answers(net, tokenizer, [row["prompt_ids"] for row in batch], max_new_tokens, bf16)
        for row, ids in zip(batch, replies, strict=True):
            reference, reply = samples.decode(tokenizer, row["reference_ids"]), samples.decode(tokenizer, ids)
            scored.append({"row": row["row"], "prompt": tokenizer.decode(row["prompt_ids"]), "reference": reference, "answer": reply,
                           "exact": scoring.exactly_right(reply, reference), "chrf": round(chrf.sentence_score(reply, [reference]).score, 2)})
    return scored


def summary(rows: list[dict]) -> dict[str, float]:
    """exact_match (a share) and chrf (corpus chrF, 0-100) over the answered rows."""
    from sacrebleu.metrics import CHRF

    if not rows:
        return {}
    right, answered = scoring.tally(rows)
    corpus = CHRF().corpus_score([row["answer"] for row in rows], [[row["reference"] for row in rows]]).score
    return {"exact_match": right / answered, "chrf": round(corpus, 2)}


def examples(base: list[dict], tuned: list[dict]) -> dict[str, list[dict]]:
    """The fine-tuned model's best and worst answers by chrF, each beside the base model's answer to the same row."""
    before = {row["row"]: row["answer"] for row in base}
    ordered = sorted(tuned, key=lambda row: (row["chrf"], row["row"]))
    pick = lambda rows: [row | {"base_answer": before.get(row["row"], "")} for row in rows]  # noqa: E731
    return {"best": pick(ordered[::-1][:KEPT]), "worst": pick(ordered[:KEPT])}
