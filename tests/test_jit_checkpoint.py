"""Why trainer/checkpointing/preemption.py replaces transformers' `enable_jit_checkpoint` instead of using it.

Each test runs a plain transformers Trainer with JIT checkpointing (and our commit callback) in a
real subprocess and sends it a real signal.  If a future transformers fixes one of these, the test
fails and the workaround in preemption.py can go.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, wait_for

pytestmark = pytest.mark.slow  # each test trains in a subprocess until it is signalled

SCRIPT = textwrap.dedent(
    """
    import signal, sys, time
    # Python leaves SIGINT ignored when it started so (a test run in the background of a shell: `pytest ... &`)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from trainer.data import demo
    from trainer.checkpointing.commits import CommitCheckpoints

    out = sys.argv[1]
    tok = demo.build_tokenizer(["a b c d"])
    model = demo.build_model(len(tok), tok.pad_token_id, tok.eos_token_id)
    rows = Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 64, "labels": [[1, 2, 3, 4]] * 64})

    class Slow(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            print(f"step {state.global_step}", flush=True)
            time.sleep(0.2)

    args = TrainingArguments(output_dir=out, max_steps=200, save_strategy="no", enable_jit_checkpoint=True,
                             report_to=[], use_cpu=True, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[Slow(), CommitCheckpoints(keep=2)]).train()
    print("train() returned normally", flush=True)
    """
)


def run_and_signal(tmp_path, signum):
    script = tmp_path / "jit.py"
    script.write_text(SCRIPT)
    log = tmp_path / "log"
    with open(log, "w") as handle:
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "out")], cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
        wait_for(lambda: "step 3" in log.read_text(), timeout=120, what="training to start")
        proc.send_signal(signum)
        code = proc.wait(timeout=60)
    return code, log.read_text()


def test_jit_checkpoint_on_sigterm_returns_as_if_training_succeeded_and_commits_nothing(tmp_path):
    code, log = run_and_signal(tmp_path, signal.SIGTERM)
    assert code == 0 and "train() returned normally" in log  # the caller cannot tell a stop from success
    saved = list((tmp_path / "out").glob("checkpoint-*"))
    assert saved, log
    assert not (saved[0] / "commit.json").exists()  # `on_save` callbacks never ran for the JIT save


def test_jit_checkpoint_ignores_sigint(tmp_path):
    code, log = run_and_signal(tmp_path, signal.SIGINT)
    assert code != 0 and "KeyboardInterrupt" in log
    assert not list((tmp_path / "out").glob("checkpoint-*"))  # Ctrl-C loses everything since the last save
