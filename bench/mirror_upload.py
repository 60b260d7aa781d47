#!/usr/bin/env python3
"""What a mirrored checkpoint costs: MB/s of one checkpoint upload and one verified download through the job's own code
(trainer/checkpointing/mirror.py), against moto's S3 server on loopback, and the seconds that makes for Qwen3-4B.

    .venv/bin/python bench/mirror_upload.py [--mb 512] [--files 4]

Loopback only: no network, no real store's limits (S3 takes ~100 MB/s per connection and more in parallel), and moto
keeps every byte in this machine's memory, in Python; it measures what the job's side costs (reading, checksums, the
client), not a cloud's bandwidth.  A checkpoint of `--files` files totalling `--mb` MB of random bytes is committed
(its manifest written) and uploaded, then downloaded back with every checksum verified.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--files", type=int, default=4)
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench-secret",
                          AWS_DEFAULT_REGION="us-east-1")
        from trainer.checkpointing import manifest
        from trainer.checkpointing.mirror import Mirror

        mirror = Mirror("s3://fulltune-bench/run")
        mirror.fs.mkdir("fulltune-bench")
        with tempfile.TemporaryDirectory() as scratch:
            folder = os.path.join(scratch, "checkpoint-10")
            os.makedirs(folder)
            for i in range(args.files):
                with open(os.path.join(folder, f"part-{i}.bin"), "wb") as f:
                    f.write(os.urandom((args.mb << 20) // args.files))
            manifest.commit(folder, 10)
            committed = manifest.read_manifest(folder)
            size = manifest.committed_bytes(folder)
            began = time.perf_counter()
            sent = mirror.upload_checkpoint(folder, committed)
            up = time.perf_counter() - began
            began = time.perf_counter()
            problem = mirror.download("checkpoint-10", mirror.committed()[10], os.path.join(scratch, "back"))
            down = time.perf_counter() - began
        assert sent == size and problem is None, problem
        from checksum import qwen3_4b_checkpoint_bytes  # parameters from bench/qwen3-4b-config.json x checkpoint bytes per parameter

        qwen3_4b = qwen3_4b_checkpoint_bytes()["bf16-mixed"]
        up_rate, down_rate = size / up / 1e6, size / down / 1e6
        print(json.dumps({"bytes": size, "files": args.files, "upload_s": round(up, 2), "upload_mb_s": round(up_rate, 1),
                          "download_verified_s": round(down, 2), "download_mb_s": round(down_rate, 1),
                          "qwen3_4b_checkpoint_gb": round(qwen3_4b / 1e9, 1), "qwen3_4b_upload_s_at_this_rate": round(qwen3_4b / up_rate / 1e6)}))
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
