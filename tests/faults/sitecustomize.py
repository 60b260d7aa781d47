"""Fault injection for the tests, from outside the product: put this folder on PYTHONPATH and Python runs it in
every process of the job (entrypoint.py and the training process), where it patches trainer modules as
they are imported.  Nothing in trainer/ knows about it.  Each fault is switched on by a variable:

  FAULT_SECONDS_PER_STEP=0.15          sleep after each optimizer step (a signal lands while training)
  FAULT_SIGTERM_AT_STEP=13              when step 13 ends, SIGTERM goes to entrypoint.py (as a container stop sends it to
                                       PID 1), which forwards it: a stop that lands at a known step
  FAULT_HANG_AT_STEP=12:6              when step 12 ends, the training thread sleeps 6 s before that step's other callbacks
                                       run (a hung GPU or volume; 600: for good)
  FAULT_HOLD_AT_STEP=3:<file>          when step 3 ends, the training thread writes <file>.held and waits (up to 600 s) until
                                       <file> exists, before that step's other callbacks run (a stop that lands at a known
                                       step, once what the test waits for, say a commit, has happened)
  FAULT_KILL_BEFORE_COMMIT_AT_STEP=20  SIGKILL the training process after checkpoint 20's files are written,
                                       before its manifest is (provably inside the save)
  FAULT_SLOW_CHECKPOINT_WRITE=20:30:<file>  the background write of checkpoint 20 writes <file> (its step) and sleeps 30 s
                                       before writing the weights and optimizer states (a stop or a kill that lands
                                       while a save is in flight, training going on); `*:4:<file>`: every checkpoint's
                                       write sleeps 4 s (a slow volume)
  FAULT_SLOW_STEPS_WHILE_WRITING=0.5  each optimizer step that runs while a background checkpoint write is in flight sleeps
                                       0.5 s inside `optimizer.step()`: what copy-on-write faults and a writer on the same
                                       cores cost a loaded machine, made deterministic
  FAULT_FILL_VOLUME=<file>:<bytes>       fill the volume holding <file> with <file>, leaving <bytes> free (not the job's file:
                                       deleting it is making room), at the moment FAULT_FILL_VOLUME_AT says:
  FAULT_FILL_VOLUME_AT=4               after checkpoint 4 is committed; `final`: just before the final model is saved
  FAULT_HOLD_START=<file>              the training process writes <file> and sleeps before anything else
                                       (a stop that lands while it starts)
  FAULT_HOLD_DATA=<file>               the training process writes <file> and sleeps 5 s as its data preparation starts, its
                                       stop handler installed (a stop that lands while it starts, before training)
  FAULT_HOLD_AFTER_STOP_COMMIT=<file>  once a stop's checkpoint is committed, write <file> and sleep 8 s (what
                                       follows, the run report and closing the MLflow run, taking long)
  FAULT_COUNT_PARSES=<file>            append a line to <file> each time the FT_* settings are parsed
  FAULT_CHILD_ENV=FT_MAX_STEPS=3       the training process starts with this variable changed
  FAULT_RECORD_LAUNCHER_MODULES=<file> entrypoint.py writes to <file>, as it exits, the heavy libraries it imported (JSON)
  FAULT_OOM_ABOVE_SEQUENCES=2          a training forward pass of more than 2 sequences (padding-free: position ids restarting
                                       at 0) raises torch.OutOfMemoryError, as CUDA would for a plan too large for the card
  FAULT_OOM_AFTER_PASSES=2             ... only after that many training passes have run in the process (a later, longer batch)
  FAULT_OOM_ON_RANK=1                  ... only in the process of that global rank (RANK): one of several runs out, the others wait
  FAULT_HANG_BESIDE_OOM=<file>         ... and the others, in the pass where it runs out, write the time to <file> and block there,
                                       ignoring SIGTERM, as a rank held in an NCCL collective does (its host blocked in a CUDA call)
  FAULT_OOM_KIND=cublas                ... raised as another library words it instead of torch.OutOfMemoryError: cublas (cuBLAS
                                       creating its handle), cudnn, nccl (a DistBackendError), cuda (a plain CUDA error)
  FAULT_SECONDS_PER_PASS=2             each training forward pass sleeps 2 s first: a device far slower than this CPU, whose
                                       steps take long without keeping a core busy (a run that is still training when a
                                       time budget ends)
  FAULT_RECORD_LOAD_MEMORY=<file>      rank 0 appends to <file>, for each part of a resume (weights, optimizer states), a
                                       JSON line with its resident memory before and its peak during it, in bytes
                                       (/proc/self/status VmRSS and VmHWM, the peak reset first through /proc/self/clear_refs)


  FAULT_WRITE_SPEED=1000               the volume's write speed measured at start is this many bytes/s (a slow network disk)
  FAULT_HOLD_EVALUATION=<file>:2       once the evaluation stage has written its 2nd unit's result, write <file> and sleep 60 s
                                       (a stop that lands during the stage)
  FAULT_RECORD_EXIT=<file>             each training process appends to <file>, as it exits, a JSON line: its rank, the time, whether
                                       its process group was still initialised, whether the final model existed, and the variables
                                       of RECORDED_ENV it ran with


  FAULT_RECORD_DDP=<file>              each training process appends to <file>, when DDP wraps its model, a JSON line with its
                                       RANK and the wrapper's `gradient_as_bucket_view`
  FAULT_RECORD_OPTIMIZER=<file>        each training process appends to <file>, at its first step of the bf16-sr optimizer, a JSON
                                       line with its RANK and the kinds (DTensor or Tensor) and dtypes of the parameters, their
                                       gradients and AdamW states it steps
  FAULT_RECORD_GATHERED=<file>         rank 0 writes to <file> the names of the weights it saves when the Trainer's `_save` is
                                       given them (the final model gathered from its FSDP shards), as JSON
  FAULT_NAN_LOSS_ON_RANK=1:15          the training process of rank 1 returns a NaN loss from its 15th training pass (only that
                                       one): its gradients are NaN, the other ranks' are finite until they are averaged
"""

import atexit
import importlib.abc
import json
import os
import signal
import sys
import time

TRAINING_PROCESS = "FULLTUNE_CONFIG" in os.environ  # set by trainer/launch/launcher.py for the child only


def _step_faults(module):
    seconds = float(os.environ.get("FAULT_SECONDS_PER_STEP") or 0)
    stop_at = int(os.environ.get("FAULT_SIGTERM_AT_STEP") or 0)
    hang_at, _, hang_seconds = (os.environ.get("FAULT_HANG_AT_STEP") or "0:0").partition(":")
    hold_at, _, hold_until = (os.environ.get("FAULT_HOLD_AT_STEP") or "0:").partition(":")
    original = module.StopOnSignal.on_step_end

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(seconds)
        if state.global_step == int(hang_at):
            time.sleep(float(hang_seconds))
        if state.global_step == int(hold_at):
            with open(f"{hold_until}.held", "w") as f:
                f.write(str(state.global_step))
            began = time.monotonic()
            while not os.path.exists(hold_until) and time.monotonic() - began < 600:
                time.sleep(0.05)
        if state.global_step == stop_at:
            os.kill(os.getppid(), signal.SIGTERM)
            time.sleep(1)  # the forwarded signal arrives within this step
        return original(self, args, state, control, **kwargs)

    module.StopOnSignal.on_step_end = on_step_end


def _hold_after_stop_commit(module):
    original = module.StopOnSignal.on_save

    def on_save(self, args, state, control, **kwargs):
        result = original(self, args, state, control, **kwargs)
        if self.requested:
            path = os.environ["FAULT_HOLD_AFTER_STOP_COMMIT"]
            with open(f"{path}.tmp", "w") as f:
                f.write(str(state.global_step))
            os.replace(f"{path}.tmp", path)  # the test reads it as soon as it exists: never empty
            time.sleep(8)
        return result

    module.StopOnSignal.on_save = on_save


def _preemption_faults(module):
    if any(os.environ.get(name) for name in ("FAULT_SECONDS_PER_STEP", "FAULT_SIGTERM_AT_STEP", "FAULT_HANG_AT_STEP", "FAULT_HOLD_AT_STEP")):
        _step_faults(module)
    if os.environ.get("FAULT_HOLD_AFTER_STOP_COMMIT"):
        _hold_after_stop_commit(module)


def _kill_before_commit(module):
    step = int(os.environ["FAULT_KILL_BEFORE_COMMIT_AT_STEP"])
    original = module.write_json

    def write_json(path, value):
        if os.path.basename(path) == module.MANIFEST and value.get("step") == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(path, value)

    module.write_json = write_json


def _slow_checkpoint_write(module):
    step, seconds, marker = os.environ["FAULT_SLOW_CHECKPOINT_WRITE"].split(":", 2)
    original = module.write_snapshot

    def write_snapshot(trainer, folder, staged):
        if step == "*" or os.path.basename(folder) == f"checkpoint-{step}":
            with open(marker, "w") as f:
                f.write(os.path.basename(folder).rsplit("-", 1)[1])
            time.sleep(float(seconds))
        return original(trainer, folder, staged)

    module.write_snapshot = write_snapshot


def _slow_steps_while_writing(module):
    import threading

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    seconds, writing = float(os.environ["FAULT_SLOW_STEPS_WHILE_WRITING"]), threading.Event()
    original = module.Saves.start

    def start(self, job):
        def job_in_flight():
            try:
                job()
            finally:
                writing.clear()

        writing.set()
        original(self, job_in_flight)

    module.Saves.start = start
    register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: time.sleep(seconds) if writing.is_set() else None)


def _saving_faults(module):
    if os.environ.get("FAULT_SLOW_CHECKPOINT_WRITE"):
        _slow_checkpoint_write(module)
    if TRAINING_PROCESS and os.environ.get("FAULT_SLOW_STEPS_WHILE_WRITING"):
        _slow_steps_while_writing(module)
    if os.environ.get("FAULT_WRITE_SPEED"):
        speed = float(os.environ["FAULT_WRITE_SPEED"])
        module.write_speed = lambda folder: speed


def _fill_volume():
    """Write <file> until the volume has only <bytes> left (tmpfs and ext4 count whole 4 KiB pages)."""
    import shutil

    path, _, leave = os.environ["FAULT_FILL_VOLUME"].rpartition(":")
    free = shutil.disk_usage(os.path.dirname(path)).free
    with open(path, "ab") as f:
        f.write(b"\0" * max(0, free - int(leave)))
    print(f"fault: {path} filled the volume: {shutil.disk_usage(os.path.dirname(path)).free} bytes left", flush=True)


def _fill_after_commit(module):
    """Fill the volume right after checkpoint FAULT_FILL_VOLUME_AT is committed (in the save's background thread,
    before the next save can start: one save is in flight at a time)."""
    step = int(os.environ["FAULT_FILL_VOLUME_AT"])
    original = module.CommitCheckpoints._commit

    def _commit(self, folder, committed_step, best):
        result = original(self, folder, committed_step, best)
        if committed_step == step:
            _fill_volume()
        return result

    module.CommitCheckpoints._commit = _commit


def _fill_before_final_save(module):
    original = module.save_final

    def save_final(*args, **kwargs):
        _fill_volume()
        return original(*args, **kwargs)

    module.save_final = save_final


def _count_parses(module):
    original = module.load

    def load(*args, **kwargs):
        with open(os.environ["FAULT_COUNT_PARSES"], "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")
        return original(*args, **kwargs)

    module.load = load


def _out_of_memory_above(module):
    """A forward pre-hook on the model the job prepares: CUDA's error, raised where a real allocation would fail."""
    import torch

    limit = int(os.environ["FAULT_OOM_ABOVE_SEQUENCES"])
    after = int(os.environ.get("FAULT_OOM_AFTER_PASSES") or 0)
    hang = ""
    if os.environ.get("FAULT_OOM_ON_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
        hang = os.environ.get("FAULT_HANG_BESIDE_OOM", "")
        if not hang:
            return  # another rank's card is the small one
    passes = []

    def check(net, args, kwargs):
        if not torch.is_grad_enabled():  # evaluation and sample answers: only training passes are sized by the plan
            return
        ids, positions = kwargs.get("input_ids", args[0] if args else None), kwargs.get("position_ids")
        sequences = int((positions == 0).sum()) if positions is not None and ids.shape[0] == 1 else ids.shape[0]
        passes.append(sequences)
        if len(passes) > after and sequences > limit:
            if hang:  # the pass in which the other rank runs out: wait for good, deaf to torchrun's SIGTERM
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                with open(hang, "a") as f:
                    f.write(f"{time.time()}\n")
                time.sleep(3600)
            raise _out_of_memory(os.environ.get("FAULT_OOM_KIND", "torch"), f"injected: a pass of {sequences} sequences, more than {limit}")

    _before_each_pass(module, check)


def _before_each_pass(module, hook):
    """`hook(net, args, kwargs)` runs before every forward pass of the model the job prepares (recipe.prepare_model)."""
    original = module.prepare_model

    def prepare_model(net, *args, **kwargs):
        net = original(net, *args, **kwargs)
        net.register_forward_pre_hook(hook, with_kwargs=True)
        return net

    module.prepare_model = prepare_model


def _out_of_memory(kind, why):
    """Out of device memory as each library raises it (their own words; torch wraps the others in RuntimeError)."""
    import torch

    if kind == "cublas":
        return RuntimeError(f"CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)` ({why})")
    if kind == "cudnn":
        return RuntimeError(f"cuDNN error: CUDNN_STATUS_ALLOC_FAILED ({why})")
    if kind == "nccl":
        return torch.distributed.DistBackendError(f"NCCL error in: ProcessGroupNCCL.cpp:3640, unhandled cuda error (run with NCCL_DEBUG=INFO for "
                                                  f"details), NCCL version 2.27.5\nLast error:\nCuda failure 'out of memory' ({why})")
    if kind == "cuda":
        return RuntimeError(f"CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported ({why})")
    return torch.OutOfMemoryError(f"CUDA out of memory ({why}). Tried to allocate 2.00 GiB.")


def _status_bytes(field):
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _record_load_memory(module):
    """Measured on rank 0 only, around transformers' own two loads of a resume."""
    import json

    if os.environ.get("RANK", "0") != "0":
        return

    def measured(name):
        original = getattr(module.Trainer, name)

        def load(self, *args, **kwargs):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM restarts from the current resident size
            before = _status_bytes("VmRSS")
            result = original(self, *args, **kwargs)
            with open(os.environ["FAULT_RECORD_LOAD_MEMORY"], "a", encoding="utf-8") as f:
                f.write(json.dumps({"load": name, "rss_before": before, "peak": _status_bytes("VmHWM")}) + "\n")
            return result

        setattr(module.Trainer, name, load)

    measured("_load_from_checkpoint")
    measured("_load_optimizer_and_scheduler")


def _record_gathered(module):
    original = module.Trainer._save

    def _save(self, output_dir=None, state_dict=None, *args, **kwargs):
        if state_dict is not None:
            with open(os.environ["FAULT_RECORD_GATHERED"], "w", encoding="utf-8") as f:
                json.dump(sorted(state_dict), f)
        return original(self, output_dir, state_dict, *args, **kwargs)

    module.Trainer._save = _save


def _trainer_faults(module):
    if os.environ.get("FAULT_RECORD_LOAD_MEMORY"):
        _record_load_memory(module)
    if os.environ.get("FAULT_RECORD_GATHERED"):
        _record_gathered(module)


def _record_ddp(module):
    original = module.DistributedDataParallel.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        with open(os.environ["FAULT_RECORD_DDP"], "a", encoding="utf-8") as f:
            f.write(json.dumps({"rank": os.environ.get("RANK"), "gradient_as_bucket_view": self.gradient_as_bucket_view}) + "\n")

    module.DistributedDataParallel.__init__ = __init__


def _record_optimizer(module):
    original = module.StochasticRoundingAdamW.step
    recorded = []

    def kinds(tensors):
        return sorted({f"{type(t).__name__} {str(t.dtype).removeprefix('torch.')}" for t in tensors})

    def step(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if not recorded:
            recorded.append(1)
            params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            states = [self.state[p][key] for p in params for key in ("exp_avg", "exp_avg_sq")]
            line = {"rank": os.environ.get("RANK", "0"), "params": kinds(params), "grads": kinds([p.grad for p in params]), "states": kinds(states)}
            with open(os.environ["FAULT_RECORD_OPTIMIZER"], "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        return result

    module.StochasticRoundingAdamW.step = step


def _nan_loss_on_rank(module):
    """A forward hook on the prepared model's last norm, in one rank's process only: that pass's hidden states times
    NaN, so its loss is NaN whichever way the trainer computes it (TRL's fused head never returns `loss`)."""
    rank, _, at = os.environ["FAULT_NAN_LOSS_ON_RANK"].partition(":")
    passes = []
    original = module.prepare_model

    def poison(norm, args, output):
        import torch

        if not torch.is_grad_enabled():  # evaluation and sample answers
            return output
        passes.append(1)
        if len(passes) != int(at):
            return output
        print(f"fault: rank {rank}: training pass {at} returns a NaN loss", file=sys.stderr, flush=True)  # rank 1's stdout is not shown
        return output * float("nan")

    def prepare_model(net, *args, **kwargs):
        net = original(net, *args, **kwargs)
        if os.environ.get("RANK") == rank:
            net.model.norm.register_forward_hook(poison)
        return net

    module.prepare_model = prepare_model


def _model_faults(module):
    if os.environ.get("FAULT_SECONDS_PER_PASS"):
        _slow_passes(module)
    if os.environ.get("FAULT_OOM_ABOVE_SEQUENCES"):
        _out_of_memory_above(module)
    if os.environ.get("FAULT_NAN_LOSS_ON_RANK"):
        _nan_loss_on_rank(module)


def _slow_passes(module):
    """A forward pre-hook that sleeps before each training pass (evaluation passes run at this CPU's speed)."""
    import torch

    seconds = float(os.environ["FAULT_SECONDS_PER_PASS"])

    def pause(net, args, kwargs):
        if torch.is_grad_enabled():
            time.sleep(seconds)

    _before_each_pass(module, pause)


def _hold_evaluation(module):
    marker, _, after = os.environ["FAULT_HOLD_EVALUATION"].rpartition(":")
    original = module._progress

    def progress(model, unit, result, finished, total, spent):
        original(model, unit, result, finished, total, spent)
        if finished == int(after):
            with open(marker, "w") as f:
                f.write(f"{model} {unit}\n")
            time.sleep(60)

    module._progress = progress


def _hold_data(module):
    original = module.prepare

    def prepare(*args, **kwargs):
        with open(os.environ["FAULT_HOLD_DATA"], "w") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(5)
        return original(*args, **kwargs)

    module.prepare = prepare


PATCHES = {  # module -> (variables, patch)
    "trainer.data.prepare": (("FAULT_HOLD_DATA",), _hold_data),
    "trainer.evaluation.stage": (("FAULT_HOLD_EVALUATION",), _hold_evaluation),
    "trainer.checkpointing.preemption": (("FAULT_SECONDS_PER_STEP", "FAULT_SIGTERM_AT_STEP", "FAULT_HANG_AT_STEP", "FAULT_HOLD_AT_STEP",
                                          "FAULT_HOLD_AFTER_STOP_COMMIT"), _preemption_faults),
    "trainer.checkpointing.manifest": (("FAULT_KILL_BEFORE_COMMIT_AT_STEP",), _kill_before_commit),
    "trainer.core.settings": (("FAULT_COUNT_PARSES",), _count_parses),
    "trainer.model.recipe": (("FAULT_OOM_ABOVE_SEQUENCES", "FAULT_NAN_LOSS_ON_RANK", "FAULT_SECONDS_PER_PASS"), _model_faults),
    "trainer.checkpointing.saving": (("FAULT_SLOW_CHECKPOINT_WRITE", "FAULT_WRITE_SPEED", "FAULT_SLOW_STEPS_WHILE_WRITING"), _saving_faults),
    "transformers.trainer": (("FAULT_RECORD_LOAD_MEMORY", "FAULT_RECORD_GATHERED"), _trainer_faults),
    "torch.nn.parallel.distributed": (("FAULT_RECORD_DDP",), _record_ddp),
    "trainer.model.optim": (("FAULT_RECORD_OPTIMIZER",), _record_optimizer),
}
if TRAINING_PROCESS and os.environ.get("FAULT_FILL_VOLUME"):
    when = os.environ.get("FAULT_FILL_VOLUME_AT", "")
    target, fill = ("trainer.publishing.final_model", _fill_before_final_save) if when == "final" else ("trainer.checkpointing.commits", _fill_after_commit)
    PATCHES[target] = (("FAULT_FILL_VOLUME",), fill)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the module as Python would, then applies the patch right after the module has run."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES or not any(os.environ.get(variable) for variable in PATCHES[name][0]):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            PATCHES[name][1](module)

        spec.loader.exec_module = patched
        return spec


sys.meta_path.insert(0, _PatchOnImport())

if TRAINING_PROCESS and os.environ.get("FAULT_CHILD_ENV"):  # NAME=VALUE: the training process sees another environment
    name, _, value = os.environ["FAULT_CHILD_ENV"].partition("=")
    os.environ[name] = value

if TRAINING_PROCESS and os.environ.get("FAULT_HOLD_START"):
    with open(os.environ["FAULT_HOLD_START"], "w") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(600)

RECORDED_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "NCCL_DEBUG", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")

if TRAINING_PROCESS and os.environ.get("FAULT_RECORD_EXIT"):
    def _record_exit(path=os.environ["FAULT_RECORD_EXIT"]):
        distributed = sys.modules.get("torch.distributed")
        final = os.path.join(os.environ.get("FT_OUTPUT_DIR", ""), "final", "model")
        line = {"rank": int(os.environ.get("RANK", "0")), "time": time.time(), "group": bool(distributed and distributed.is_initialized()),
                "final_model": os.path.isdir(final), "env": {name: os.environ.get(name) for name in RECORDED_ENV}}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    atexit.register(_record_exit)

if not TRAINING_PROCESS and os.environ.get("FAULT_RECORD_LAUNCHER_MODULES"):
    def _record_launcher_modules(path=os.environ["FAULT_RECORD_LAUNCHER_MODULES"]):
        heavy = ("torch", "transformers", "mlflow", "trl", "datasets", "accelerate", "matplotlib")
        with open(path, "w") as f:
            json.dump(sorted(set(heavy) & set(sys.modules)), f)

    atexit.register(_record_launcher_modules)
