"""FT_CHAT_TEMPLATE: a Jinja file that renders every row and is saved with the model, in place of the tokenizer's own."""

from __future__ import annotations

import pytest

from conftest import NO_EVALUATION, job_env, run_job, termination_message
from trainer.core import config, settings
from trainer.core.errors import ConfigError
from trainer.data import chatml
from trainer.model import loading

# ChatML that names the task in a system turn when the row has none (in words no row of the demo's data holds).
TEMPLATE = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nTurn word lists around.<|im_end|>\\n' }}{% endif %}"
            + chatml.TEMPLATE)


def test_the_fingerprint_records_the_templates_content_so_an_edited_file_is_another_configuration(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    job = config.build(settings.load({"FT_PLATFORM": "none", "FT_CHAT_TEMPLATE": str(path)}), cuda=False)
    before = job.fingerprint()["FT_CHAT_TEMPLATE"]
    path.write_text(TEMPLATE.replace("Turn word lists", "Turn lists"))
    assert before.startswith(str(path)) and job.fingerprint()["FT_CHAT_TEMPLATE"] != before


@pytest.mark.faults("FT_CHAT_TEMPLATE that is not a Jinja template")
def test_a_file_that_is_not_a_jinja_template_exits_2_naming_the_line(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for message in messages %}\n{{ message['content'] }\n")
    with pytest.raises(ConfigError, match=r"FT_CHAT_TEMPLATE='.*template.jinja': not a Jinja template: line 2"):
        loading.chat_template(str(path))


@pytest.mark.faults("FT_CHAT_TEMPLATE naming no file")
def test_a_missing_template_file_exits_2_before_the_training_process_starts(tmp_path):
    env = job_env(tmp_path / "volume", FT_PRESET="demo", FT_CHAT_TEMPLATE="./templates/mine.jinja", FT_LOG_LEVEL="debug")
    result = run_job(env, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "FT_CHAT_TEMPLATE=" in result.stderr and "templates/mine.jinja': no such file" in result.stderr
    assert "start-up:" not in result.stdout and "FT_CHAT_TEMPLATE" in termination_message(env)


@pytest.mark.slow  # the demo job, 2 steps, in a subprocess
def test_a_template_file_renders_the_rows_and_is_the_saved_models_template(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    out = tmp_path / "volume"
    result = run_job(job_env(out, FT_PRESET="demo", FT_MAX_STEPS="2", FT_EVAL_STEPS="2", FT_SAVE_STEPS="2", FT_REGISTERED_MODEL="",
                             FT_CHAT_TEMPLATE=str(path), **NO_EVALUATION))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "<|im_start|>system\nTurn word lists around.<|im_end|>" in (out / "data-report.txt").read_text(), "the rows were rendered with it"
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out / "final" / "model").chat_template == TEMPLATE
