"""Ctrl-C handling: the command ends at once with one line and exit status 130."""

from __future__ import annotations

import os
import signal
import threading

from clover_jax.api.cli.common import INTERRUPTED_STATUS


class ExitOnInterrupt:
    """Ctrl-C ends the process at once: one line on stderr, exit status 130, nothing else runs.

    A KeyboardInterrupt raised in the middle of jax — inside an XLA host callback, while a
    computation or a compilation is in flight, halfway through importing an extension — crashed
    the process (a segfault in most trials) or came back as an unrelated ImportError. So SIGINT
    never becomes an exception here: the C-level handler writes to a wakeup pipe that a daemon
    thread watches, and that thread (or the Python-level handler, whichever runs first) prints
    one line and calls `os._exit`. The thread is what makes it immediate while the main thread is
    held inside a long XLA call. Where SIGINT is ignored (`nohup`, a background job) or this is not
    the main thread, nothing is changed. Leaving the block restores the previous handlers.
    """

    def __init__(self, prog: str):
        self.message = f"{prog}: interrupted\n".encode()
        self.installed = False
        self.leaving = threading.Lock()

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
            return self
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.previous_handler = signal.signal(signal.SIGINT, lambda signum, frame: self.leave())
        self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self.watch, name="clover-jax-interrupt", daemon=True).start()
        self.installed = True
        return self

    def watch(self) -> None:
        while True:
            try:
                received = os.read(self.read_fd, 64)
            except OSError:
                return
            if not received:  # __exit__ closed the pipe
                return
            if signal.SIGINT in received:
                self.leave()

    def leave(self) -> None:
        if not self.leaving.acquire(blocking=False):
            return  # the other path is already leaving
        try:
            os.write(2, self.message)
        finally:
            os._exit(INTERRUPTED_STATUS)

    def __exit__(self, *exc_info) -> None:
        if not self.installed:
            return
        signal.set_wakeup_fd(self.previous_fd)
        signal.signal(signal.SIGINT, self.previous_handler)
        os.close(self.write_fd)  # the watcher reads end-of-file and returns
        os.close(self.read_fd)
