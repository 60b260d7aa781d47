"""The run report: one HTML page on the volume and in the MLflow run, whose charts are the run's metric history,
and which a browser shows with its images."""

from __future__ import annotations

import base64
import html
import io
import itertools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import mlflow
import pytest
from PIL import Image

from conftest import job_env, run_job
from trainer.report import report

CHROMIUM = shutil.which("chromium")


@pytest.fixture(scope="module")
def reported_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "volume"
    result = run_job(job_env(out, FT_PRESET="demo", FT_MAX_STEPS="6", FT_EVAL_STEPS="3", FT_SAVE_STEPS="3", FT_LOGGING_STEPS="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow/mlflow.db")
    run = mlflow.search_runs(search_all_experiments=True, output_format="list")[0]
    return out, result.stdout, run, (out / "report.html").read_text(encoding="utf-8")


def chart_data(page: str) -> dict:
    return json.loads(re.search(r'<script id="chart-data" type="application/json">(.*?)</script>', page, re.S).group(1))


def charts(page: str) -> dict[str, tuple[str, bytes]]:
    """Each chart's image in the page: chart id -> (the img tag, the PNG bytes)."""
    found = re.findall(r'(<img data-chart="([a-z_]+)"[^>]*src="data:image/png;base64,([^"]+)">)', page)
    return {chart: (tag, base64.b64decode(data)) for tag, chart, data in found}


def table_after(page: str, heading: str) -> list[list[str]]:
    """The text of each cell of the first table after an <h2> heading, row by row."""
    section = page.split(f"<h2>{heading}</h2>", 1)[1].split("<h2>", 1)[0]
    rows = re.findall(r"<tr>(.*?)</tr>", section, re.S)
    return [[html.unescape(re.sub(r"<[^>]+>", "", cell)) for cell in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S)] for row in rows]


BLUE, ORANGE = (31, 119, 180), (255, 127, 14)  # tab10's first two line colours (as matplotlib draws them): a chart's first and second metric


def plotted(png: bytes, colour: tuple[int, int, int], points: list[list[float]], steps: tuple[float, float], values: tuple[float, float]) -> list:
    """How far (pixels) from where each (step, value) point belongs the nearest pixel of `colour` in its column is (None:
    nothing of that colour there).  Where it belongs: steps left to right and values bottom to top inside the axes' black
    frame, spanning the given ranges plus 5 % margins (matplotlib's default `axes.xmargin`/`ymargin`, which the charts keep)."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    width, height = image.size
    px = image.load()
    rows = [y for y in range(height) if sum(px[x, y] == (0, 0, 0) for x in range(width)) > width / 2]
    columns = [x for x in range(width) if sum(px[x, y] == (0, 0, 0) for y in range(height)) > height / 2]
    left, right, top, bottom = columns[0], columns[-1], rows[0], rows[-1]
    (s0, s1), (v0, v1) = steps, values
    s0, s1, v0, v1 = s0 - 0.05 * (s1 - s0), s1 + 0.05 * (s1 - s0), v0 - 0.05 * (v1 - v0), v1 + 0.05 * (v1 - v0)
    offsets = []
    for step, value in points:
        x, y = round(left + (step - s0) / (s1 - s0) * (right - left)), bottom - (value - v0) / (v1 - v0) * (bottom - top)
        offsets.append(min((abs(row - y) for row in range(top, bottom) if px[x, row] == colour), default=None))
    return offsets


def test_a_chart_draws_each_logged_value_at_its_step_in_step_order():
    """A zigzag, so that a dropped point, a wrong scale, swapped axes or an unsorted line all move a drawn pixel."""
    loss = [[3, 3.0], [1, 4.0], [2, 1.0], [5, 0.5], [4, 2.0]]  # unsorted, as a step redone after a resume logs it
    eval_loss = [[2, 3.5], [4, 2.5]]
    png = report.chart_png("Loss (training, validation)", {"loss": loss, "eval_loss": eval_loss})
    assert Image.open(io.BytesIO(png)).size == (640, 360)
    near = lambda offsets: all(offset is not None and offset <= 3 for offset in offsets)  # noqa: E731 - the marker's radius
    assert near(plotted(png, BLUE, loss, (1, 5), (0.5, 4.0))), plotted(png, BLUE, loss, (1, 5), (0.5, 4.0))
    assert near(plotted(png, ORANGE, eval_loss, (1, 5), (0.5, 4.0))), plotted(png, ORANGE, eval_loss, (1, 5), (0.5, 4.0))
    ordered = sorted(loss)
    halfway = [[(s + t) / 2, (v + w) / 2] for (s, v), (t, w) in itertools.pairwise(ordered)]  # the line joins them in step order
    assert near(plotted(png, BLUE, halfway, (1, 5), (0.5, 4.0))), plotted(png, BLUE, halfway, (1, 5), (0.5, 4.0))
    # the last value, 0.5 at step 5, is the lowest point at the right end: not where a mirrored chart would put it
    assert not near(plotted(png, BLUE, [[5, 4.0], [1, 0.5]], (1, 5), (0.5, 4.0))), "the axes are not swapped or mirrored"


@pytest.mark.slow  # the demo job, 6 steps, in a subprocess
def test_each_chart_draws_the_runs_mlflow_metric_history(reported_job):
    out, log, run, page = reported_job
    client = mlflow.MlflowClient()
    data, images = chart_data(page), charts(page)
    assert set(data) == set(images) == {"loss", "learning_rate", "grad_norm", "tokens_per_s", "memory"}
    for chart, series in data.items():
        for key, points in series.items():
            history = [[m.step, m.value] for m in client.get_metric_history(run.info.run_id, key)]
            assert points == history and len(points) >= 2, (chart, key)
    loss, eval_loss = data["loss"]["loss"], data["loss"]["eval_loss"]
    values = [v for _, v in loss + eval_loss]
    for colour, points in ((BLUE, loss), (ORANGE, eval_loss)):  # the loss chart's image shows those points where they belong
        offsets = plotted(images["loss"][1], colour, points, (1, 6), (min(values), max(values)))
        assert all(offset is not None and offset <= 3 for offset in offsets), offsets
    assert [p[0] for p in data["loss"]["loss"]] == [1, 2, 3, 4, 5, 6] and [p[0] for p in data["loss"]["eval_loss"]] == [3, 6]
    written = re.findall(r"^fulltune: run report \(([^)]+)\): (\S+) in [0-9.]+ s$", log, re.M)
    assert written == [("step 3", str(out / "report.html")), ("step 6", str(out / "report.html")), ("final", str(out / "report.html"))]


def conversation(prompt: str) -> str:
    """A ChatML prompt's turns as the page's cell reads once its tags are stripped: each role, then what it said."""
    return "".join(role + text.strip() for role, text in re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", prompt, re.S))


@pytest.mark.slow  # the demo job, 6 steps, in a subprocess
def test_the_report_is_on_the_volume_and_in_the_mlflow_run_with_what_a_user_looks_for(reported_job, tmp_path):
    out, _, run, page = reported_job
    artifact = mlflow.MlflowClient().download_artifacts(run.info.run_id, "report.html", str(tmp_path))
    assert Path(artifact).read_text(encoding="utf-8") == page, "the run's artifact is the page on the volume"
    assert "finished: the final model is saved, registered as demo.default.tiny_qwen3_assistant/1" in page
    assert html.escape(str(out / "final" / "model")) in page and run.info.run_id in page
    samples = [json.loads(line) for line in (out / "eval-samples.jsonl").read_text().splitlines()]
    shown = lambda s: ("✓ " if s["answer"] == s["reference"] else "") + s["answer"] if s["answer"] else "(empty: only special tokens or none)"  # noqa: E731
    before, after = ([s for s in samples if s["step"] == step] for step in (0, 6))
    expected = [["Prompt", "Reference", "Step 0 (base model)", "Step 6"]]
    expected += [[conversation(b["prompt"]), b["reference"], shown(b), shown(a)] for b, a in zip(before, after, strict=True)]
    assert table_after(page, "Sample answers") == expected and len(expected) == 1 + 8  # the demo preset answers 8 prompts
    assert "im_start" not in page.split("<h2>Sample answers</h2>", 1)[1].split("<h2>", 1)[0], "prompts shown as turns, not as template markup"
    peak = max(m.value for m in mlflow.MlflowClient().get_metric_history(run.info.run_id, "mem_gb"))
    assert f"<th>measured peak</th><th class=n>{peak:.3g} GB</th>" in page and "<th>planned peak</th>" in page
    assert html.escape((out / "data-report.txt").read_text(encoding="utf-8")) in page
    assert re.search(r"<td>eval_loss</td><td class=n>[0-9.]+</td>", page)
    assert not list(out.glob("report.html.*")), "no temporary file left beside it"


@pytest.mark.slow  # the demo job, 6 steps, in a subprocess
def test_the_page_is_titled_by_the_run_and_shows_its_settings_attempts_units_and_absolute_locations(reported_job):
    out, _, run, page = reported_job
    assert f"<h1>{html.escape(run.info.run_name)}</h1>" in page
    settings = dict(row for row in table_after(page, "Hyperparameters"))
    assert settings["FT_MAX_STEPS"] == "6" and settings["FT_OUTPUT_DIR"] == str(out) and settings["FT_PRESET"] == "demo"
    attempts = table_after(page, "Attempts")
    assert [row[2:4] for row in attempts] == [["Training", "Ended"], ["from step 0", "finished at step 6"]]
    assert re.search(r"Wall time \d+ s over 1 attempt\(s\)\.", page)
    where = dict(table_after(page, "Where things are"))
    assert where["Final model (transformers folder)"] == str(out / "final" / "model") and where["Run report"] == str(out / "report.html")
    assert where["Checkpoints"].startswith(f"{out / 'checkpoints'} (committed: checkpoint-3, checkpoint-6")
    assert re.search(r"<td>tokens_per_s</td><td class=n>[0-9.e+]+</td><td>tokens/s</td>", page) and "<h3>Validation</h3>" in page
    assert "data-plan-gb" not in charts(page)["memory"][0], "on CPU the GPU plan is not drawn against the process's RSS"


def test_secrets_are_masked_each_attempt_is_a_row_and_prompts_are_turns():
    page = report.render(
        {
            "title": "my-run", "status": "stopped", "final": False, "written": "now",
            "job": {"model": "m", "data": "d", "precision": "fp32", "max_steps": 10},
            "history": {}, "run": {}, "data": "",
            "samples": [{"step": 0, "row": 1, "prompt": "<|im_start|>user\nReverse: a b<|im_end|>\n<|im_start|>assistant\n",
                         "reference": "b a", "answer": "b a"}],
            "plan": {"peak": 2e9, "breakdown": {"weights": 2e9}, "described": "plan", "cuda": True},
            "where": {"checkpoints": "/v/checkpoints", "committed": ["checkpoint-4"]},
            "hyperparameters": {"FT_MAX_STEPS": "10", "FT_API_TOKEN": "tok-do-not-leak", "FT_DATASET": "https://bob:pw-do-not-leak@host/d.jsonl",
                                "FT_EVAL_SAMPLE_TOKENS": "16"},
            "attempts": [
                {"started": 1000.0, "from_step": 0, "ended": 1060.0, "outcome": "stopped by a signal at step 4 (exit 75)"},
                {"started": 1100.0, "from_step": 4, "ended": 1130.0, "outcome": "finished at step 10"},
            ],
        }
    )
    assert "do-not-leak" not in page
    assert table_after(page, "Sample answers")[1][0] == "userReverse: a b" and "im_start" not in page, "the prompt as its turns"
    assert dict(table_after(page, "Hyperparameters"))["FT_API_TOKEN"] == "****"
    assert dict(table_after(page, "Hyperparameters"))["FT_EVAL_SAMPLE_TOKENS"] == "16", "a count of tokens is no secret"
    assert [row[2:] for row in table_after(page, "Attempts")[1:]] == [
        ["from step 0", "stopped by a signal at step 4 (exit 75)", "60 s"],
        ["resumed from step 4", "finished at step 10", "30 s"],
    ]
    assert "Wall time 90 s over 2 attempt(s)." in page and 'data-plan-gb="2.0"' in page  # on a GPU the plan is drawn


DECODED = """<script>
window.addEventListener("load", () => {
  const images = [...document.images];
  document.body.dataset.decoded = images.filter((i) => i.complete && i.naturalWidth > 0).length + "/" + images.length;
  document.body.dataset.widths = images.map((i) => i.naturalWidth).join(",");
});
</script>"""


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"]
    return subprocess.run([CHROMIUM, *flags, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # the demo job, 6 steps, in a subprocess
def test_the_page_renders_in_headless_chromium_with_every_chart(reported_job, tmp_path):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: .ci/run installs Debian's package")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    out, _, _, page = reported_job
    checked = tmp_path / "checked.html"  # the same page, plus a script that records whether each image decoded
    checked.write_text(page.replace("</body>", DECODED + "\n</body>"), encoding="utf-8")
    dom = chromium("--dump-dom", "--virtual-time-budget=10000", checked.as_uri(), profile=tmp_path / "profile")
    assert dom.returncode == 0, dom.stderr
    body = re.search(r"<body[^>]*>", dom.stdout).group(0)
    assert 'data-decoded="5/5"' in body and 'data-widths="640,640,640,640,640"' in body, body

    screenshot = tmp_path / "report.png"
    shot = chromium(f"--screenshot={screenshot}", "--window-size=1280,2000", (out / "report.html").as_uri(), profile=tmp_path / "profile")
    print(f"screenshot of the run report: {screenshot}")
    assert shot.returncode == 0 and screenshot.exists(), shot.stderr
    image = Image.open(screenshot).convert("RGB")
    assert image.size == (1280, 2000)
    assert len(image.getcolors(maxcolors=1 << 20)) > 100, "the screenshot shows the charts' colours, not a blank page"


def test_a_report_written_before_any_value_is_logged_still_has_every_chart():
    page = report.render(
        {
            "title": "t", "status": "training: step 0 of 10", "final": False, "written": "now",
            "job": {"model": "m", "data": "d", "precision": "fp32", "max_steps": 10},
            "history": {}, "run": {}, "samples": [], "data": "<data report>",
            "plan": {"peak": 2e9, "breakdown": {"weights": 2e9}, "described": "plan", "cuda": False},
            "where": {"checkpoints": "/v/checkpoints", "committed": []},
        }
    )
    assert all(not points for series in chart_data(page).values() for points in series.values())
    for chart, (_, png) in charts(page).items():
        assert Image.open(io.BytesIO(png)).size == (640, 360), chart
    assert "&lt;data report&gt;" in page and "not measured yet" in page and "committed: none yet" in page
