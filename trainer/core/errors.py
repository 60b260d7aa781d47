"""Every way the job can end, and the exit code a scheduler sees for it.

Kubernetes `podFailurePolicy`, AWS Batch `evaluateOnExit` and SageMaker read only the exit code, so
each class says whose fault it was and whether a retry can help.  The README's table of exit codes
is checked against `EXIT_CODES` by a test.  How the ending is told (the exit line, the termination message,
the code each rank leaves for the launcher) is trainer/core/ending.py's.
"""

from __future__ import annotations

EXIT_CODES = {
    0: "Success: the model is saved, registered (unless FT_REGISTERED_MODEL is empty), and the run is "
       "finished; also a re-run of a job that already finished with the same settings (nothing runs again).",
    1: "Unexpected failure: a bug or an infrastructure fault (printed with a traceback), or, within seconds, before anything is downloaded or "
       "written and without a traceback: the Hugging Face hub not answering for a hub id in FT_MODEL, FT_DATASET or FT_EVAL_DATASET (the message "
       "says how to run offline), or the MLflow server in MLFLOW_TRACKING_URI, or the object store of FT_MIRROR_URL, not answering at start. "
       "A retry may help; it resumes from the last committed checkpoint.",
    2: "Bad configuration or input, found before training, no traceback: an invalid or unknown FT_* value, a misspelled (\"did you mean\") or "
       "lowercase name (all reported together, within a second); a local FT_MODEL or FT_DATASET that does not exist, or a hub id that is neither "
       "cached under HF_HUB_OFFLINE=1 nor on the hub; a volume whose job already finished, re-run with settings that change the result; a choice "
       "this machine cannot run (FT_PRECISION=bf16-mixed or bf16-sr without a bf16 GPU, FT_LIGER without a GPU or liger-kernel); a model without "
       "a readable config or weights; pickle-only weights without FT_ALLOW_PICKLE_WEIGHTS; a model that needs its own code without "
       "FT_TRUST_REMOTE_CODE; a preflight that does not fit GPU memory or the volume (FT_PREFLIGHT=fail); data that cannot be read or has bad "
       "rows (FT_BAD_ROWS=fail); a chat template FT_LOSS_ON=assistant cannot mask; checkpoints on the volume from another configuration, or "
       "written under FSDP for a job without it (or the reverse, or in the gathered FSDP layout of earlier versions); "
       "a mirror (FT_MIRROR_URL) written by another configuration, or one whose bucket does not exist or refuses the credentials; "
       "an MLflow URI this MLflow cannot use; a training process started without entrypoint.py; "
       "`entrypoint.py plan` for a job that does not fit the card. A retry cannot help: fix the named variable, file or row.",
    3: "The model was trained and saved, but registration in MLflow failed, or the MLflow server did not answer "
       "at the end within FT_REGISTRATION_RETRY_SECONDS (the message says where the model is; metrics not sent "
       "are kept on the volume). A retry skips training: it sends what was kept, registers and finishes the run.",
    4: "Out of GPU memory while training at the smallest plan the settings allow, no traceback: the job first steps down by itself (more "
       "passes per step, more recomputation) and records the plan that fits on the volume. The message gives the measured peak, the plan and "
       "what to change (FT_MAX_LENGTH, FT_PRECISION=bf16-sr, FT_NUM_PROCESSES with FSDP, ...). A retry with the same settings cannot help.",
    5: "Training diverged: the logged loss was NaN, infinite or above FT_LOSS_LIMIT for FT_DIVERGENCE_PATIENCE logging steps in a "
       "row, or a checkpoint's weights were not finite (that checkpoint is set aside in incomplete/, never committed). Nothing is "
       "registered and no final model is saved. A retry with the same settings cannot help: the message names the step and the "
       "last good checkpoint; lower FT_LEARNING_RATE, then resume it with FT_ALLOW_CONFIG_CHANGE=true or use a new FT_OUTPUT_DIR.",
    6: "Volume full: a checkpoint, the final model or another file could not be written to FT_OUTPUT_DIR (no space left, or "
       "over quota), no traceback. The message names the volume, its free bytes and about how many the save needed. Every "
       "committed checkpoint is kept; a checkpoint cut short is set aside in incomplete/. A retry with the same volume "
       "fails again: free space on it (or mount a bigger one), then retry: it resumes from the last committed checkpoint.",
    7: "Another job holds this volume's lease: a job started on an FT_OUTPUT_DIR where another job is running (its lease, .fulltune/lease.json, "
       "is refreshed every FT_LEASE_SECONDS / 3) exits within about that time, before anything is written, no traceback; the message names the "
       "other job's host, pid and start time. Also a running job whose lease another job took over after it went FT_LEASE_SECONDS without "
       "refreshing it (a stalled volume or a network partition): it stops at once without saving. A retry helps once the other job has ended "
       "(its lease is released) or stopped refreshing for FT_LEASE_SECONDS (it is then taken over); or use another FT_OUTPUT_DIR.",
    8: "The model was trained and saved on the volume (and registered), but a copy it was to send elsewhere is not there yet: FT_MIRROR_URL did "
       "not take the final model or the last checkpoints within FT_MIRROR_WAIT_SECONDS (the bucket did not answer or refused them), or "
       "FT_PUSH_TO_HUB could not push it to the Hugging Face hub. The message names what is missing and why. A retry skips training: it only "
       "uploads or pushes what is missing.",
    9: "The model was trained and saved, and evaluated, but a benchmark of FT_EVAL_TASKS fell by more than FT_EVAL_MAX_REGRESSION against "
       "the base model, so it was not registered (no new version), no traceback; the message names each task, metric and drop. A retry with "
       "the same settings exits 9 again without training or evaluating; with FT_EVAL_MAX_REGRESSION=0 (or larger) it registers the saved model.",
    75: "Stopped by SIGTERM/SIGINT after committing a checkpoint (a second signal after the commit ends the job at once, still 75). A retry resumes "
        "from it; with a periodic save in flight and no time for another, that save is the one committed; during the evaluation stage "
        "the scores done are kept and the retry evaluates the rest (no training). "
        "Also a job on several nodes where one process ran out of GPU memory: the next plan down is recorded on the volume and every node "
        "ends (on one node the job restarts its processes there by itself); the retry starts at that plan from the last committed checkpoint.",
    76: "Stopped by a second signal or the stop deadline before the checkpoint was committed, or while "
        "the job was starting, before its first training step (nothing new to save: the committed checkpoints are as they were); "
        "or at once, when one checkpoint's write (the volume's speed measured at start) cannot fit "
        "what is left of FT_STOP_DEADLINE_SECONDS (the message names the last committed checkpoint). A retry resumes from the previous "
        "committed checkpoint.",
    77: "Stuck: no optimizer step for FT_STUCK_AFTER_SECONDS while training, with FT_STUCK_EXIT=true (a hung GPU, node, volume or "
        "collective), no traceback. The job ends at once without saving, so that the scheduler starts it again (Kubernetes counts it "
        "against backoffLimit, as exit 1). A retry resumes from the last committed checkpoint.",
}


# The README's table: each code in a few words and whether a retry can help; the whole meaning (EXIT_CODES) is in
# docs/preemption-and-failures.md#exit-codes, generated like it (trainer/core/settings_doc.py).
EXIT_SUMMARY = {
    0: ("success (also a re-run of a job that already finished)", "-"),
    1: ("unexpected failure; or the hub, the MLflow server or the object store not answering at start", "yes: resumes"),
    2: ("bad configuration or input, found before training (the message names the variable, file or row)", "no: fix what it names"),
    3: ("trained and saved; registering in MLflow failed", "yes: registers only"),
    4: ("out of GPU memory at the smallest plan the settings allow", "no: change the settings or the GPU"),
    5: ("training diverged (loss or weights not finite, or above FT_LOSS_LIMIT)", "no: lower the learning rate"),
    6: ("volume full", "after freeing space: resumes"),
    7: ("another job holds this volume's lease", "once that job has ended"),
    8: ("trained and saved; not yet in FT_MIRROR_URL or on the hub (FT_PUSH_TO_HUB)", "yes: uploads only"),
    9: ("trained and saved; a benchmark fell by more than FT_EVAL_MAX_REGRESSION: not registered", "no: FT_EVAL_MAX_REGRESSION=0 registers it"),
    75: ("stopped by a signal after committing a checkpoint; or a step-down across nodes", "yes: resumes"),
    76: ("stopped before the stop's checkpoint was committed", "yes: resumes from the one before"),
    77: ("stuck: no optimizer step for FT_STUCK_AFTER_SECONDS (FT_STUCK_EXIT=true)", "yes: resumes"),
}

class FulltuneError(Exception):
    """Base class: the message is written for the user and ends with what to do."""

    exit_code = 1
    show_traceback = True


class ConfigError(FulltuneError):
    """A setting is invalid or contradicts another one. Retrying cannot help."""

    exit_code = 2
    show_traceback = False


class DataError(FulltuneError):
    """The dataset cannot be read or has rows that cannot be trained on."""

    exit_code = 2
    show_traceback = False


class HubUnreachable(FulltuneError):
    """The Hugging Face hub does not answer; a retry helps once it does (or once the settings point at local files)."""

    exit_code = 1
    show_traceback = False


class TrackingUnreachable(FulltuneError):
    """The MLflow tracking server does not answer at start; a retry helps once it does."""

    exit_code = 1
    show_traceback = False


class GpuUnusable(FulltuneError):
    """torch cannot use the GPU the NVIDIA driver shows (trainer/core/devices.py): the image or the node is at fault."""

    exit_code = 1
    show_traceback = False


class RegistrationFailed(FulltuneError):
    """Training finished and the model is on the volume; only the MLflow registration failed, or the tracking server
    did not answer at the end (what it did not receive is on the volume for the next attempt)."""

    exit_code = 3
    show_traceback = True


class OutOfMemory(FulltuneError):
    """The configuration does not fit the accelerator."""

    exit_code = 4
    show_traceback = False


class SmallestPlanOutOfMemory(OutOfMemory):
    """Out of GPU memory at the smallest plan the settings allow (trainer/model/stepdown.py stepped down to it):
    nothing smaller is left to try, so the settings must change."""

    def __init__(self, measured: str, plan: str, fixes: list[str]):
        super().__init__(f"out of GPU memory at the smallest plan these settings allow ({plan}); measured peak {measured}. To fit, set {'; or '.join(fixes)}")


class StepDownRestart(FulltuneError):
    """Out of GPU memory on one of several processes: the next plan down is recorded on the volume and the processes
    end (the other ranks cannot be told in time); the launcher restarts them at that plan (trainer/launch/launcher.py),
    or, across nodes, the orchestrator's retry does.  75 as after a stop: every deployment here retries it (Kubernetes without counting
    a failure), and the retries end, one plan lower each time, at exit 4 at the latest."""

    exit_code = 75
    show_traceback = False


class Diverged(FulltuneError):
    """The loss or the weights stopped being numbers; the same settings would diverge again."""

    exit_code = 5
    show_traceback = False


class VolumeFull(FulltuneError):
    """The output volume has no room left for a save; it will not make room by itself, so a retry must wait for a person."""

    exit_code = 6
    show_traceback = False


class VolumeInUse(FulltuneError):
    """Another job holds the lease on FT_OUTPUT_DIR (trainer/launch/lease.py); a retry helps once it ends or stops refreshing it."""

    exit_code = 7
    show_traceback = False


class MirrorBehind(FulltuneError):
    """The model is on the volume, but FT_MIRROR_URL has not received all of it in time (trainer/checkpointing/uploads.py):
    a retry only uploads."""

    exit_code = 8
    show_traceback = False


class MirrorUnusable(FulltuneError):
    """FT_MIRROR_URL cannot be read at start (no answer, no such bucket, no permission): nothing was trained or written."""

    exit_code = 1
    show_traceback = False


class HubPushFailed(FulltuneError):
    """The model is on the volume (and in the mirror), but pushing it to FT_PUSH_TO_HUB failed: a retry only pushes."""

    exit_code = 8
    show_traceback = False


class RegressionFound(FulltuneError):
    """The evaluation gate (FT_EVAL_MAX_REGRESSION): the fine-tuned model scored worse than the base; saved, not registered."""

    exit_code = 9
    show_traceback = False


class Preempted(FulltuneError):
    """A stop signal arrived; the checkpoint at the current step is committed."""

    exit_code = 75
    show_traceback = False


class StopAbandoned(FulltuneError):
    """A second signal or the stop deadline cut the final save short, or a stop came while the job started (before
    training: nothing new to save)."""

    exit_code = 76
    show_traceback = False


class Stuck(FulltuneError):
    """No optimizer step for FT_STUCK_AFTER_SECONDS (trainer/telemetry/stuck.py): the training thread is hung, so the
    process ends from the watch's thread; a new start, maybe on another node, resumes from the last committed checkpoint."""

    exit_code = 77
    show_traceback = False
