"""A real S3-compatible server on loopback for the tests: moto's standalone server, in a process of its own.

    server = S3Server(folder).start()       # python tests/s3server.py PORT STATE: moto's server on 127.0.0.1:PORT
    env = server.env()                      # AWS_ENDPOINT_URL and fake credentials, as a job gets them
    server.stop(); ...; server.start()      # SIGTERM: the process ends (connections refused), its buckets kept in STATE

moto keeps its buckets in memory only, so a stopped server would come back empty: on SIGTERM this process writes
moto's S3 state to STATE (a pickle, which moto's objects support) before it exits, and reads it back when it starts
again, as a real store keeps what it holds across a restart.  SIGKILL loses what changed since the last stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

KEY_ID = "AKIAFULLTUNETESTKEY0"
SECRET_KEY = "s3-secret-do-not-leak-0123456789abcdef"  # must appear in no log, param, report or termination message


class S3Server:
    def __init__(self, folder: Path, port: int | None = None):
        from conftest import free_port

        self.folder, self.port = Path(folder), port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = self.folder / "s3-state.pickle"
        self.process: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        # AWS_MAX_ATTEMPTS=2: botocore's own retries of a refused connection end in about 1 s, not 10 s (its default, 5 attempts)
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_MAX_ATTEMPTS": "2"}

    def start(self) -> S3Server:
        from conftest import wait_for

        log = open(self.folder / "s3server.log", "a")  # noqa: SIM115 - closed with the process
        self.process = subprocess.Popen([sys.executable, __file__, str(self.port), str(self.state)], stdout=log, stderr=subprocess.STDOUT)
        wait_for(self.answers, timeout=60, what="the S3 server")
        return self

    def answers(self) -> bool:
        import urllib.request

        assert self.process.poll() is None, (self.folder / "s3server.log").read_text()
        try:
            with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGUSR1)
            time.sleep(1)
            self.process.kill()
            raise AssertionError("the S3 server did not stop: " + (self.folder / "s3server.log").read_text()[-6000:]) from None
        assert code == 0, (self.folder / "s3server.log").read_text()[-2000:]

    def filesystem(self):
        """An s3fs client of this server, for the test itself."""
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.url, key=KEY_ID, secret=SECRET_KEY,
                                 skip_instance_cache=True, use_listings_cache=False)


def _serve(port: int, state: str) -> None:
    import pickle

    from moto.s3.models import s3_backends
    from moto.server import ThreadedMotoServer

    if os.path.exists(state):
        with open(state, "rb") as f:
            for account, backend in pickle.load(f).items():
                s3_backends[account] = backend
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()

    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # the threads' stacks into the log, when a stop does not end the process

    def stop(_signum, _frame) -> None:
        # No server.stop(): its shutdown can wait on a client's open connection.  The state is written, then the process
        # ends, which closes the port and every connection at once, as a crashed server's would be.
        for _ in range(50):
            try:
                saved = pickle.dumps(dict(s3_backends))
                break
            except RuntimeError:  # a request changed a bucket while it was pickled: again
                time.sleep(0.1)
        with open(f"{state}.tmp", "wb") as f:
            f.write(saved)
        os.replace(f"{state}.tmp", state)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    while True:  # short sleeps: a signal the kernel hands to a request thread wakes no long sleep of this one, where the handler runs
        time.sleep(0.2)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2])
