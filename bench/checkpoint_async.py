"""What a checkpoint costs training: the job's synchronous save against its asynchronous one, and a short job with
and without saves.

    python bench/checkpoint_async.py state --out /tmp/ckbench [--hidden 1024 --layers 24 --saves 3]
    python bench/checkpoint_async.py job --out /tmp/ckjob [--hidden 512 --layers 12 --steps 12 --every 2 --rounds 2]

`state`: a random-init Qwen3 (0.3B parameters by default, fp32 weights + AdamW states after one step, as the job
holds them) is saved, alternately, the way the job saved before (transformers' `_save_checkpoint`, then the commit:
fsync, checksums, manifest; all while training waits) and the way it saves now (trainer/checkpointing/saving.py:
training waits for the host snapshot only, the rest runs in the background).  Per save: seconds blocked, seconds
in the background, bytes.

`steps`: where a save's cost is paid, in one process without the Trainer: AdamW steps on the same random-init model,
each kind of snapshot taken before a step, and the time of the steps after it against steps after no snapshot,
interleaved.  `fork-hold`: a forked child that writes nothing and only holds the pages until the next snapshot (the
copy-on-write faults alone); `fork-write`: a child that writes the state with `torch.save` and flushes it (the CPU
path until now); `copy`: a copy into buffers kept from snapshot to snapshot, training waiting (no writer);
`copy-write`: that copy, then a thread writing the buffers with `torch.save` and flushing them.

    python bench/checkpoint_async.py steps --hidden 1048 --layers 8 --rounds 3 [--after 3]

`job`: the job itself (entrypoint.py) on a random-init model of that size with the demo's tokenizer and data, both
arms evaluating every `--every` steps: A saves every `--every` steps, B only at the end (the last step), run A B A B
over `--rounds`; end-to-end wall seconds of each, the ratio of each pair, and what the job's own last cost line says
(the share of its wall time blocked on checkpoints, and the share they cost, the slowed steps included).  The issue's
case, a 101M-parameter model with 1.21 GB of state:

    python bench/checkpoint_async.py job --out /tmp/ckjob --hidden 1048 --layers 8 --steps 16 --every 4 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def random_model(hidden: int, layers: int, vocab: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 512), head_dim=128, tie_word_embeddings=True)
    return Qwen3ForCausalLM(config)


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)


def state(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from trainer.checkpointing import commits, manifest, saving

    shutil.rmtree(args.out, ignore_errors=True)
    torch.manual_seed(0)
    model = random_model(args.hidden, args.layers, 32000)
    rows = Dataset.from_dict({"input_ids": [[1, 2, 3, 4] * 8] * 2, "labels": [[1, 2, 3, 4] * 8] * 2})
    saver = commits.CommitCheckpoints(keep=100)
    trainer = Trainer(
        model=model, train_dataset=rows, callbacks=[saver],
        args=TrainingArguments(
            output_dir=args.out, max_steps=1, save_strategy="no", per_device_train_batch_size=1, report_to=[], use_cpu=True, disable_tqdm=True
        ),
    )
    trainer.train()  # one step: AdamW's states exist, as in the job
    params = sum(p.numel() for p in model.parameters())
    results: dict[str, list[tuple[float, float, int]]] = {"sync": [], "async": []}
    for i in range(args.saves):
        for kind in ("sync", "async"):  # interleaved: the machine's load changes under both alike
            trainer.state.global_step = 10 * i + (1 if kind == "sync" else 2)
            folder = os.path.join(args.out, f"checkpoint-{trainer.state.global_step}")
            if kind == "sync":
                began = time.perf_counter()
                Trainer._save_checkpoint(trainer, trainer.model, None)  # transformers' own, as the job saved before
                manifest.commit(folder, trainer.state.global_step)
                results[kind].append((time.perf_counter() - began, 0.0, folder_bytes(folder)))
            else:
                saving.save(trainer, None, saver.saves, saver._commit)
                blocked = saver.costs.blocked[-1]
                saver.saves.wait()
                results[kind].append((blocked, saver.costs.background[-1], folder_bytes(folder)))
            blocked, background, size = results[kind][-1]
            print(f"{kind} save {i + 1}: blocked {blocked:.2f} s, background {background:.2f} s, {size / 1e9:.2f} GB", flush=True)
            shutil.rmtree(folder)
    saver.saves.close()
    sync_blocked = statistics.median(r[0] for r in results["sync"])
    async_blocked = statistics.median(r[0] for r in results["async"])
    print(f"params_m={params / 1e6:.0f} checkpoint_gb={results['async'][0][2] / 1e9:.2f} load_avg={os.getloadavg()[0]:.1f}")
    print(f"| save | blocked (s), median of {args.saves} | each | background (s) | bytes |")
    print("|---|---|---|---|---|")
    for kind, rows_ in results.items():
        print(f"| {kind} | {statistics.median(r[0] for r in rows_):.2f} | {' · '.join(f'{r[0]:.2f}' for r in rows_)} | "
              f"{statistics.median(r[1] for r in rows_):.2f} | {rows_[0][2]:,} |")
    pairs = " · ".join(f"{a[0] / s[0]:.1%}" for s, a in zip(results["sync"], results["async"], strict=True))
    print(f"async blocks {async_blocked / sync_blocked:.1%} of the synchronous save's time (each interleaved pair: {pairs})")
    shutil.rmtree(args.out, ignore_errors=True)


def steps(args: argparse.Namespace) -> None:
    """Seconds blocked by each kind of snapshot and seconds it adds to the steps after it (see the module's docstring)."""
    import threading

    import torch

    torch.manual_seed(0)
    model = random_model(args.hidden, args.layers, 32000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = torch.randint(0, 32000, (2, 192))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "state.pt")

    def step() -> float:
        began = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - began

    def write(state: dict) -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def live() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    buffers: dict = {}

    def copy() -> dict:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if "stager" not in buffers:
            buffers["stager"] = DefaultStager(StagingOptions(False, False, False, False))
        return buffers["stager"].stage(live())

    step(), step()  # AdamW's states exist and the allocator has settled
    kinds = ("none", "fork-hold", "fork-write", "copy", "copy-write")
    blocked: dict[str, list[float]] = {k: [] for k in kinds}
    after: dict[str, list[float]] = {k: [] for k in kinds}
    for round_ in range(args.rounds):
        for kind in kinds:
            began, child, writer = time.perf_counter(), 0, None
            if kind.startswith("fork"):
                child = os.fork()
                if child == 0:
                    torch.set_num_threads(1)
                    write(live()) if kind == "fork-write" else time.sleep(3600)
                    os._exit(0)
            elif kind.startswith("copy"):
                staged = copy()
                if kind == "copy-write":
                    writer = threading.Thread(target=write, args=(staged,))
                    writer.start()
            blocked[kind].append(time.perf_counter() - began)
            after[kind].append(sum(step() for _ in range(args.after)))
            if kind == "fork-hold":
                os.kill(child, signal.SIGKILL)
            if child:
                os.waitpid(child, 0)
            if writer is not None:
                writer.join()
            print(f"round {round_ + 1} {kind}: blocked {blocked[kind][-1]:.2f} s, next {args.after} steps {after[kind][-1]:.2f} s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    base = statistics.median(after["none"])
    params = sum(p.numel() for p in model.parameters())
    print(f"params_m={params / 1e6:.0f} state_gb={12 * params / 1e9:.2f} threads={torch.get_num_threads()}")
    print(f"| snapshot | blocked (s), median of {args.rounds} | next {args.after} steps (s), each round | excess over none's median (s) "
          "| cost per save (s) |")
    print("|---|---|---|---|---|")
    for kind in kinds:
        excess = statistics.median(after[kind]) - base
        print(f"| {kind} | {statistics.median(blocked[kind]):.2f} | {' · '.join(f'{a:.2f}' for a in after[kind])} | {excess:+.2f} | "
              f"{statistics.median(blocked[kind]) + excess:.2f} |")
    shutil.rmtree(args.out, ignore_errors=True)


def job(args: argparse.Namespace) -> None:
    """The job on a random-init model with the demo's tokenizer and data; wall seconds with saves and without."""
    from trainer.console.progress import parse_line
    from trainer.data import demo

    os.makedirs(args.out, exist_ok=True)
    assets = os.path.join(args.out, "assets")
    demo.ensure_demo(assets)
    model_dir = os.path.join(args.out, "model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.path.join(assets, "demo", "model"))
        model = random_model(args.hidden, args.layers, len(tokenizer))
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        params = sum(p.numel() for p in model.parameters())
        print(f"model: {params / 1e6:.0f}M parameters, checkpoint ~{12 * params / 1e9:.2f} GB", flush=True)
    common = {
        "FT_MODEL": model_dir, "FT_DATASET": os.path.join(assets, "demo", "data", "train.jsonl"), "FT_MAX_STEPS": str(args.steps),
        "FT_BATCH_SIZE": "1", "FT_GRADIENT_ACCUMULATION_STEPS": "2", "FT_MAX_LENGTH": "256", "FT_EVAL_STEPS": str(args.every),
        "FT_EVAL_MAX_SAMPLES": "4", "FT_EVAL_SAMPLES": "0", "FT_EVAL_ROWS": "0", "FT_LOGGING_STEPS": str(args.every), "FT_REGISTERED_MODEL": "",
        "FT_SYSTEM_METRICS": "false", "FT_SAVE_TOTAL_LIMIT": "2", "FT_PLATFORM": "none",
    }
    # each arm: (name, checkout whose entrypoint.py runs, FT_SAVE_STEPS); B last, each A's ratio taken against it
    arms = [(f"A {name}", root, args.every) for name, root in (pair.split("=", 1) for pair in args.also)]
    arms += [("A", ROOT, args.every), ("B", ROOT, args.steps)]
    walls: dict[str, list[float]] = {name: [] for name, _, _ in arms}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in arms}
    blocked: dict[str, list[str]] = {name: [] for name, _, _ in arms}
    overhead: dict[str, list[str]] = {name: [] for name, _, _ in arms}
    for round_ in range(args.rounds):
        for name, root, save_steps in arms:  # interleaved: the machine's load changes under every arm alike
            out = os.path.join(args.out, "run")
            shutil.rmtree(out, ignore_errors=True)
            env = {k: v for k, v in os.environ.items() if not k.startswith("FT_")} | common | {
                "FT_OUTPUT_DIR": out, "FT_SAVE_STEPS": str(save_steps), "MLFLOW_TRACKING_URI": ""}
            used, began = os.times(), time.perf_counter()
            done = subprocess.run([sys.executable, os.path.join(root, "entrypoint.py")], env=env, cwd=root, capture_output=True, text=True, timeout=3600)
            wall, after = time.perf_counter() - began, os.times()
            if done.returncode != 0:
                raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
            lines = [parse_line(line) for line in done.stdout.splitlines() if "checkpoint_blocked_share=" in line]
            walls[name].append(wall)
            cpu[name].append(after.children_user + after.children_system - used.children_user - used.children_system)
            blocked[name].append(lines[-1]["checkpoint_blocked_share"] if lines else "-")
            overhead[name].append(lines[-1].get("checkpoint_overhead_share", "-") if lines else "-")
            steps = " ".join(f"{line['step']}:{line['tokens_per_s']}" for line in map(parse_line, done.stdout.splitlines()) if "tokens_per_s" in line)
            print(f"round {round_ + 1} {name}: {wall:.1f} s ({cpu[name][-1]:.0f} CPU-s), blocked share {blocked[name][-1]}, "
                  f"overhead share {overhead[name][-1]} (load {os.getloadavg()[0]:.1f}); tokens/s {steps}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    print(f"| job ({args.steps} steps, eval every {args.every}) | wall (s), each round | median | CPU-s, each round | blocked share (the job's "
          "last cost line) | overhead share (same line) |")
    print("|---|---|---|---|---|---|")
    for name, root, save_steps in arms:
        label = f"{name}: one save, at the end" if save_steps == args.steps else f"{name}: a save every {save_steps} steps"
        label += "" if root == ROOT else f" ({root})"
        print(f"| {label} | {' · '.join(f'{w:.1f}' for w in walls[name])} | {statistics.median(walls[name]):.1f} | "
              f"{' · '.join(f'{c:.0f}' for c in cpu[name])} | {' · '.join(blocked[name])} | {' · '.join(overhead[name])} |")
    for name, _, _ in arms[:-1]:
        pairs = " · ".join(f"{a / b:.3f}" for a, b in zip(walls[name], walls["B"], strict=True))
        print(f"{name} / B: {statistics.median(walls[name]) / statistics.median(walls['B']):.3f} by the medians; each round: {pairs}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("state", "steps", "job"))
    parser.add_argument("--out", default="/tmp/fulltune-async-bench")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--after", type=int, default=3, help="steps: the steps timed after each snapshot")
    parser.add_argument("--also", action="append", default=[], metavar="NAME=CHECKOUT",
                        help="job: also run arm A from another checkout (an older commit, a variant), interleaved with the others")
    args = parser.parse_args()
    {"state": state, "steps": steps, "job": job}[args.what](args)


if __name__ == "__main__":
    main()
