"""Child processes the kernels start (the C compiler, numba's warm-up), on any thread."""
import os


def spawn(cmd, log_fd):
    """The pid of `cmd` started with stdin from /dev/null and stdout and stderr to `log_fd`.

    NOTE(gevent): under gevent's worker a model loads on a thread with a hub of its own, and
    gevent's subprocess (and its os.posix_spawnp) cannot watch a child there: "child watchers are
    only available on the default loop". The `posix` module's own posix_spawnp and waitpid, which
    gevent leaves alone, work on any thread; output goes to a file, not a pipe to read."""
    import posix
    return posix.posix_spawnp(cmd[0], cmd, os.environ, file_actions=[
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_DUP2, log_fd, 1), (os.POSIX_SPAWN_DUP2, log_fd, 2)])


def wait(pid, timeout=None):
    """The exit status of child `pid` (see spawn), or None where another watcher reaped it first;
    killed past `timeout` seconds (TimeoutError)."""
    import posix
    import time
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            done, code = posix.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if done:
            return os.waitstatus_to_exitcode(code)
        if deadline is not None and time.monotonic() > deadline:
            os.kill(pid, 9)
            posix.waitpid(pid, 0)
            raise TimeoutError(f"ran past {timeout} s")
        time.sleep(0.02)
