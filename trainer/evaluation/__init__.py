"""After training, in the same job and MLflow run: did the fine-tune help, and what did it forget?

    stage.py       the stage: base then fine-tuned model, resumable unit by unit, the gate (exit 9)
    own_task.py    FT_EVAL_ROWS held-out validation rows answered and scored (exact match, chrF)
    tasks.py       FT_EVAL_TASKS: lm-eval task names and folders of one's own, checked before training
    harness.py     one lm-evaluation-harness task on one loaded model
    base_scores.py the base model's benchmark scores, kept per (model, revision, task, limit)
    compare.py     base against fine-tuned: the table, the log line, the registry's tags, the gate's drops
"""
