"""What the cluster sees of a running job: its TrainJob's progress, its Prometheus metrics and the stuck signal.

Kubeflow Trainer's status server is played by an HTTPS server on loopback with a certificate from a CA this test
makes, and a token file that it rotates, as the kubelet does; the three variables the Trainer's controller injects
point the job at it.  One job runs three times on one volume (three starts of the demo are the cost of it all):
stopped by SIGTERM at step 20 after a 6 s hang at step 12; resumed, hung at step 26 (for 120 s, 40 times the
threshold) with FT_STUCK_EXIT=true (exit 77); resumed again to the end, while the server first holds a post unanswered and then refuses one.
"""

from __future__ import annotations

import dataclasses
import datetime
import http.server
import ipaddress
import json
import os
import re
import ssl
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from deploy_files import unknown_fields

from conftest import QUICK_DEMO, committed_steps, free_port, job_env, run_job, termination_message, with_faults

STATUS_PATH = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs/reverser/status"  # the controller's, for TrainJob team-a/reverser
HOLD_S = 6  # a held post gets no answer for this long: longer than the job's timeout for one post
MAX_STEPS = int(QUICK_DEMO["FT_MAX_STEPS"])


def make_tls(folder: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate it signs for 127.0.0.1: (ca.crt, tls.crt, tls.key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def certificate(subject, issuer, key, signer, ca: bool, names=()):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(hours=1)).add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubeflow-trainer-test-ca")])
    ca = certificate(ca_name, ca_name, ca_key, ca_key, ca=True)
    server = certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]), ca_name, server_key, ca_key, ca=False,
                         names=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    paths = folder / "ca.crt", folder / "tls.crt", folder / "tls.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return paths


@dataclasses.dataclass
class Post:
    attempt: str
    received: float  # time.monotonic()
    token: str  # the bearer token sent
    current: str  # the token file's content when the post arrived
    body: dict
    registered: bool  # the volume said the model was registered when the post arrived


class StatusServer:
    """The Trainer's status endpoint: POST STATUS_PATH over TLS with a bearer token, 200 and the body back, as
    pkg/statusserver answers.  After the first post it rotates the token file (written aside, then renamed over,
    as the kubelet's projected volume is updated) and accepts only the new token from then on.  `plan`: what the next
    posts get instead of 200: "hold" (recorded, then no answer for HOLD_S) or "refuse" (503 Service Unavailable)."""

    def __init__(self, folder: Path, volume: Path):
        self.ca, cert, key = make_tls(folder)
        self.token_file, self.volume = folder / "token", volume
        self.current = self._rotate("token-1")
        self.posts: list[Post] = []
        self.holds: list[tuple[float, float]] = []  # (start, end) of each held post
        self.attempt, self.plan = "", []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.path == STATUS_PATH and self.headers["Content-Type"] == "application/json"
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                server.record(token, body)
                what = server.plan.pop(0) if server.plan else "ok"
                if what == "hold":
                    started = time.monotonic()
                    time.sleep(HOLD_S)
                    server.holds.append((started, time.monotonic()))
                    self.close_connection = True
                    return
                code = 503 if what == "refuse" else 200 if token == server.current else 403
                answer = json.dumps(body if code == 200 else {"status": "Failure", "code": code}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
                if len(server.posts) == 1:
                    server.current = server._rotate("token-2")

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}{STATUS_PATH}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def _rotate(self, token: str) -> str:
        aside = self.token_file.with_suffix(".new")
        aside.write_text(token)
        os.replace(aside, self.token_file)
        return token

    def record(self, token: str, body: dict) -> None:
        status = self.volume / ".fulltune" / "status.json"
        registered = status.exists() and bool(json.loads(status.read_text()).get("registered"))
        self.posts.append(Post(self.attempt, time.monotonic(), token, self.current, body, registered))

    def env(self) -> dict[str, str]:
        return {"KUBEFLOW_TRAINER_SERVER_URL": self.url, "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(self.ca),
                "KUBEFLOW_TRAINER_SERVER_TOKEN": str(self.token_file)}


class Scraper:
    """GET /metrics every 0.1 s while the job runs: (time.monotonic(), {sample name and labels: value}) per scrape."""

    def __init__(self, port: int):
        self.url, self.samples, self._done = f"http://127.0.0.1:{port}/metrics", [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        while not self._done.wait(0.1):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as answer:
                    text = answer.read().decode()
            except OSError:
                continue  # not listening yet, or gone
            values = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    values[sample.name + "".join(f"[{v}]" for v in sample.labels.values())] = sample.value
            self.samples.append((time.monotonic(), values))

    def stop(self) -> list[tuple[float, dict]]:
        self._done.set()
        self._thread.join()
        return self.samples


@dataclasses.dataclass
class Attempt:
    code: int
    log: str
    termination: str
    posts: list[Post]
    scrapes: list[tuple[float, dict]]

    def percentages(self) -> list[int]:
        return [post.body["trainerStatus"]["progressPercentage"] for post in self.posts]

    def series(self, name: str, stage: str | None = None) -> list[float]:
        """`name`'s value in each scrape that has one (and, given `stage`, was taken in that stage)."""
        return [values[name] for _, values in self.scrapes if name in values and (stage is None or values[f"fulltune_stage[{stage}]"] == 1)]


def test_progress_is_the_whole_jobs_by_stage_and_100_only_when_it_is_done():
    from trainer.telemetry.feed import Telemetry

    telemetry = Telemetry()
    assert telemetry.snapshot().percentage() == 0  # starting: nothing is posted then
    telemetry.stage("training", step=10, max_steps=40)  # resumed at step 10
    assert telemetry.snapshot().percentage() == 22  # 90 % x 10/40
    telemetry.step(40, last=True)
    assert telemetry.snapshot().percentage() == 90 and telemetry.snapshot().seconds_since_last_step(time.monotonic()) is None
    telemetry.stage("saving")
    assert telemetry.snapshot().percentage() == 90
    telemetry.stage("evaluating")
    assert telemetry.snapshot().percentage() == 93
    telemetry.stage("registering")
    assert telemetry.snapshot().percentage() == 97
    telemetry.close(3)  # registration failed: not done
    assert telemetry.snapshot().percentage() == 97
    telemetry.close(0)
    assert telemetry.snapshot().percentage() == 100


CLUSTER_DOC = Path(__file__).resolve().parents[1] / "docs" / "deployment.md"


def test_the_docs_give_each_stage_the_share_and_each_metric_the_name_the_code_has():
    """docs/deployment.md's stage shares of the TrainJob's progress are feed.SHARES, and its table of metrics names every metric the
    endpoint serves (a counter with Prometheus' _total), each stage among the stage gauge's labels."""
    from trainer.telemetry import feed, metrics

    text = CLUSTER_DOC.read_text()
    by_stage = text.split("**The whole job, by stage**", 1)[1].split("\n- ", 1)[0]
    assert {stage: int(share) for stage, share in re.findall(r"`(\w+)`(?:\s+\([^)]*\))?\s+(\d+) %", by_stage)} == feed.SHARES

    class Everything:  # every metric present: a training step with every value, a checkpoint, an ETA
        cuda, stuck_after_seconds = True, 1800

        def snapshot(self):
            return feed.Snapshot(stage="training", step=1, max_steps=2, values=dict.fromkeys(["loss", "eval_loss", "lr", "tokens_per_s", "mfu", "mem_gb"], 1.0),
                                 eta_s=5.0, eta_at=time.monotonic(), last_step_at=time.monotonic(), steps_expected=True, checkpoints=1)

    served = {family.name + ("_total" if family.type == "counter" else "") for family in metrics.Collector(Everything()).collect()}
    table = text.split("\n### Metrics\n", 1)[1].split("\n#", 1)[0]
    documented = set(re.findall(r"`(fulltune_\w+)(?:\{\w+\})?`", table))
    assert documented == served
    stage_row = next(line for line in table.splitlines() if line.startswith("| `fulltune_stage{stage}`"))
    assert re.findall(r"`(\w+)`", stage_row.split("|")[3]) == list(metrics.STAGES)


@pytest.mark.faults("the TrainJob status server refuses connections")
def test_a_status_server_that_is_down_costs_one_line_per_outage_and_returns_at_once(capfd):
    from trainer.telemetry import kubeflow
    from trainer.telemetry.feed import Snapshot

    port = free_port()  # nothing listens there
    reporter = kubeflow.Reporter(f"https://127.0.0.1:{port}/status", None, None, Snapshot)
    started = time.monotonic()
    for step in (1, 2):
        reporter.transition(Snapshot(stage="training", step=step, max_steps=4, observed=time.time()))
        time.sleep(0.2)
    assert time.monotonic() - started < 1  # the caller never waits for the server
    reporter.close(Snapshot(stage="done", step=4, max_steps=4, observed=time.time()))  # the last one, 5 s after the previous
    lines = [line for line in capfd.readouterr().err.splitlines() if "TrainJob status: not sent" in line]
    assert len(lines) == 1 and "ConnectionRefusedError" in lines[0], lines


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The three attempts, each its Attempt; the server; the volume."""
    folder = tmp_path_factory.mktemp("trainjob")
    volume = folder / "volume"
    server = StatusServer(folder, volume)
    base = job_env(volume, **QUICK_DEMO, FT_STUCK_AFTER_SECONDS="3", **server.env())
    attempts = {}
    for name, faults, settings, plan in [
        ("stopped", {"seconds_per_step": "0.4", "hang_at_step": "12:6", "sigterm_at_step": "20"}, {}, []),
        ("stuck", {"seconds_per_step": "0.4", "hang_at_step": "26:120"}, {"FT_STUCK_EXIT": "true"}, []),
        ("finished", {"seconds_per_step": "0.5"}, {"FT_STUCK_AFTER_SECONDS": "0"}, ["hold", "refuse"]),
    ]:
        server.attempt, server.plan = name, plan
        port = free_port()
        scraper = Scraper(port)
        env = with_faults(base | {"FT_METRICS_PORT": str(port)} | settings, **faults)
        result = run_job(env, timeout=400)
        scrapes = scraper.stop()
        attempts[name] = Attempt(result.returncode, result.stdout + result.stderr, termination_message(env),
                                 [p for p in server.posts if p.attempt == name], scrapes)
    return attempts, server, volume


@pytest.mark.slow
def test_each_attempt_ends_as_its_faults_say(job):
    attempts, _, volume = job
    assert attempts["stopped"].code == 75, attempts["stopped"].log[-3000:]
    assert attempts["stuck"].code == 77, attempts["stuck"].log[-3000:]
    assert attempts["finished"].code == 0, attempts["finished"].log[-3000:]
    assert "fulltune: summary exit=0" in attempts["finished"].log and "steps=40/40" in attempts["finished"].log
    assert committed_steps(volume) == [20, 40]


@pytest.mark.slow
def test_the_trainjob_hears_0_first_then_rising_and_100_only_once_the_job_has_finished(job):
    attempts, server, _ = job
    stopped, finished = attempts["stopped"].percentages(), attempts["finished"].percentages()
    assert stopped[0] == 0 and stopped == sorted(stopped) and 0 < stopped[1] < stopped[-1], stopped
    assert stopped[-1] == 90 * 20 // MAX_STEPS  # stopped at step 20 of 40: half of training's 90 %
    assert finished == sorted(finished) and finished[-1] == 100 and len(set(finished)) >= 3, finished
    hundreds = [post for post in server.posts if post.body["trainerStatus"]["progressPercentage"] == 100]
    assert hundreds == [server.posts[-1]]  # once, the last post of all
    assert hundreds[0].registered  # after the model was saved and registered, not when training returned
    last_metrics = {m["name"]: m["value"] for m in server.posts[-1].body["trainerStatus"]["metrics"]}
    assert last_metrics["stage"] == "done" and last_metrics["step"] == "40" and float(last_metrics["eval_loss"]) > 0


@pytest.mark.slow
def test_every_post_is_a_valid_status_update_sent_with_the_current_token_at_most_every_5_s(job):
    from kubeflow_trainer_api.models import TrainerV1alpha1UpdateTrainJobStatusRequest as Request

    _, server, _ = job
    assert len(server.posts) >= 8
    for post in server.posts:
        assert post.token == post.current, post  # the rotated token from the post after the rotation on
        assert unknown_fields(Request, post.body) == [] and Request.from_dict(post.body).to_dict()["trainerStatus"]
        status = post.body["trainerStatus"]
        assert set(status) <= {"progressPercentage", "estimatedRemainingSeconds", "metrics", "lastUpdatedTime"}
        assert isinstance(status["progressPercentage"], int) and 0 <= status["progressPercentage"] <= 100
        assert isinstance(status.get("estimatedRemainingSeconds", 0), int) and status.get("estimatedRemainingSeconds", 0) >= 0
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", status["lastUpdatedTime"])  # RFC 3339, as metav1.Time reads it
        assert 1 <= len(status["metrics"]) <= 256
        for metric in status["metrics"]:  # the CRD: strings of 1 to 64 characters
            assert isinstance(metric["value"], str) and 1 <= len(metric["value"]) <= 64 and 1 <= len(metric["name"]) <= 64, metric
        assert {m["name"] for m in status["metrics"]} >= {"stage", "step", "max_steps"}  # fulltune's posts, no other reporter's
    assert {post.current for post in server.posts} == {"token-1", "token-2"}
    for attempt in ("stopped", "stuck", "finished"):
        times = [post.received for post in server.posts if post.attempt == attempt]
        assert all(later - earlier > 4.5 for earlier, later in zip(times, times[1:], strict=False)), attempt  # 5 s apart where they leave the job


@pytest.mark.slow
def test_a_restart_posts_from_where_the_job_was(job):
    attempts, _, _ = job
    for name in ("stuck", "finished"):  # both resumed from checkpoint-20
        first = attempts[name].posts[0].body["trainerStatus"]
        assert first["progressPercentage"] == attempts["stopped"].percentages()[-1] == 45, name
        assert {m["name"]: m["value"] for m in first["metrics"]}["step"] == "20"


@pytest.mark.slow
@pytest.mark.faults("the TrainJob status server holds a post unanswered, then refuses one")
def test_a_status_server_that_does_not_answer_costs_one_log_line_and_no_step(job):
    attempts, server, _ = job
    finished = attempts["finished"]
    assert finished.log.count("fulltune: TrainJob status: not sent") == 1, finished.log  # two failed posts, one outage, one line
    assert "TimeoutError" in finished.log or "timed out" in finished.log
    assert finished.posts[0].body["trainerStatus"]["progressPercentage"] == 45 and len(finished.posts) >= 3  # held, refused, then taken
    ((start, end),) = server.holds
    steps = [values["fulltune_step"] for at, values in finished.scrapes if start <= at <= end]
    assert steps and steps[-1] - steps[0] >= 4, steps  # training went on while the job's post waited for an answer
    for name in ("stopped", "stuck"):
        assert "TrainJob status: not sent" not in attempts[name].log


@pytest.mark.slow
def test_metrics_show_the_step_rising_tokens_per_s_and_the_time_since_the_last_step_resetting(job):
    attempts, _, _ = job
    stopped = attempts["stopped"]
    assert stopped.series("fulltune_stage[starting]")[0] == 1  # served before the first step
    steps = stopped.series("fulltune_step")
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] >= 19, steps
    assert max(stopped.series("fulltune_tokens_per_second")) > 0
    assert stopped.series("fulltune_max_steps")[-1] == MAX_STEPS
    idle = stopped.series("fulltune_seconds_since_last_step")
    longest = idle.index(max(idle))
    assert idle[longest] >= 3 and min(idle[longest:]) < 1, idle  # the 6 s hang at step 12, then steps again
    progress = stopped.series("fulltune_progress_ratio")
    assert progress == sorted(progress) and progress[-1] == 0.45
    finished = attempts["finished"].series("fulltune_step", stage="training")
    assert finished[0] == 20 and finished[-1] == MAX_STEPS  # a resumed job counts from its checkpoint


@pytest.mark.slow
@pytest.mark.faults("no optimizer step for FT_STUCK_AFTER_SECONDS (a hung step)")
def test_a_hung_job_is_flagged_stuck_once_and_with_stuck_exit_ends_77_saving_nothing(job):
    attempts, _, _ = job
    stopped, stuck = attempts["stopped"], attempts["stuck"]
    assert stopped.log.count("fulltune: stuck: ") == 1 and "after step 11/40" in stopped.log  # the hang at step 12's end
    assert stopped.log.count("fulltune: no longer stuck") == 1
    flagged = stopped.series("fulltune_stuck")
    assert 1 in flagged and flagged[-1] == 0 and flagged.index(1) > 0
    assert stuck.termination.startswith("exit 77: stuck: no optimizer step for 3 s (FT_STUCK_AFTER_SECONDS) after step 25/40"), stuck.termination
    assert "fulltune: exit 77: stuck" in stuck.log and "Traceback" not in stuck.log
    assert "fulltune: stuck: " not in attempts["finished"].log

