"""The code sandbox against real programs, hostile ones included: each is contained and the host is
unchanged afterwards. No mocks: every test builds real namespaces (root on Linux, as in CI)."""
import concurrent.futures as cf
import fcntl
import hashlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import textwrap
import threading

import pytest

from dapo_jax.envs import sandbox
from dapo_jax.envs.sandbox import Limits, processes_of_uid, run_python

FAST = Limits(cpu_s=1, wall_s=3)


@pytest.fixture(scope="module", autouse=True)
def available():
  sandbox.check_available()  # A host that cannot sandbox fails here, saying why.


def run(source: str, **kwargs) -> sandbox.Result:
  return run_python(textwrap.dedent(source), **kwargs)


def assert_no_processes_left(result: sandbox.Result) -> None:
  assert result.uid is not None and processes_of_uid(result.uid) == []


@pytest.fixture
def visible_dir():
  """A host directory the sandbox can see (read-only): under /opt, outside the hidden directories
  (a checkout may itself live under one of them, e.g. a CI clone in /tmp)."""
  os.makedirs("/opt", exist_ok=True)
  path = tempfile.mkdtemp(prefix=".sandbox_test_", dir="/opt")
  os.chmod(path, 0o755)
  yield path
  shutil.rmtree(path, ignore_errors=True)


def test_runs_python_with_stdin_files_and_an_unprivileged_uid():
  r = run("""
      import os
      print(input()[::-1], open('data/x.txt').read(), os.getuid(), os.getgid(), os.getgroups(), os.getcwd())
      print(open('/proc/self/status').read().split('CapBnd:')[1].split()[0])
      """, stdin="olleh", files={"data/x.txt": "42"})
  assert r.ok and r.exit_code == 0 and r.stderr == "", r
  words = r.stdout.split()
  assert words[:2] == ["hello", "42"] and int(words[2]) == r.uid >= sandbox.UID_BASE
  assert words[3] == str(r.uid) and words[4] == "[]" and words[5] == "/tmp"
  assert int(words[6], 16) == 0  # No capability can come back.


def test_exit_codes_and_exceptions():
  assert run("raise SystemExit(3)").exit_code == 3
  r = run("1/0")
  assert r.exit_code == 1 and "ZeroDivisionError" in r.stderr and not r.ok


def test_files_may_not_leave_the_working_directory():
  with pytest.raises(ValueError, match="leaves"):
    run_python("", files={"../x": ""})


def test_network_is_unreachable_even_to_a_host_server():
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen()
  port = server.getsockname()[1]
  accepted = []

  def accept():
    try:
      accepted.append(server.accept())
    except OSError:  # Closed at the end of the test.
      pass

  thread = threading.Thread(target=accept, daemon=True)
  thread.start()
  try:
    r = run(f"""
        import socket
        for addr in [("127.0.0.1", {port}), ("1.1.1.1", 80), ("8.8.8.8", 53)]:
          try:
            socket.create_connection(addr, timeout=1)
            print("CONNECTED", addr)
          except OSError as e:
            print("blocked", e.errno)
        print(sorted(n for _, n in socket.if_nameindex()))
        """)
    assert r.exit_code == 0, r
    assert "CONNECTED" not in r.stdout and r.stdout.count("blocked") == 3
    assert r.stdout.strip().splitlines()[-1] == "['lo']"
    assert not accepted
  finally:
    server.close()


def test_host_secrets_are_unreadable(visible_dir):
  secrets = []
  for d in ("/root", tempfile.gettempdir(), visible_dir):  # Hidden dirs, and a visible 0600 file.
    fd, path = tempfile.mkstemp(prefix="sandbox_secret_", dir=d)
    os.write(fd, b"TOPSECRET")
    os.close(fd)
    os.chmod(path, 0o600)
    secrets.append(path)
  try:
    r = run(f"""
        for path in {secrets!r} + ["/etc/shadow", "/proc/1/environ", "/proc/1/root/etc/hostname"]:
          try:
            print(path, open(path).read()[:20])
          except OSError as e:
            print(path, "denied", type(e).__name__)
        """)
    assert r.exit_code == 0 and "TOPSECRET" not in r.stdout, r
    assert r.stdout.count("denied") == len(secrets) + 3, r.stdout
  finally:
    for path in secrets:
      os.remove(path)


def test_no_host_process_is_visible():
  r = run("""
      import os
      pids = [p for p in os.listdir('/proc') if p.isdigit()]
      print(len(pids), any(b"pytest" in open(f"/proc/{p}/cmdline", "rb").read() for p in pids))
      """)
  assert r.stdout.split() == ["3", "False"], r  # The sandbox's own init, timeout, and python.


def test_writes_outside_the_working_directory_change_nothing(visible_dir):
  readable = os.path.join(visible_dir, "public.txt")
  with open(readable, "w") as f:
    f.write("original")
  os.chmod(readable, 0o666)  # World-writable on the host, yet the mount is read-only.
  watched = ["/etc/passwd", "/etc/hostname", readable]
  before = {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in watched}
  targets = watched + ["/usr/bin/sandbox_was_here", "/etc/sandbox_was_here", os.path.join(visible_dir, "new"),
                       "/root/sandbox_was_here", "/var/tmp/sandbox_was_here", "/dev/sandbox_was_here",
                       "/proc/sys/kernel/hostname"]
  r = run(f"""
      for path in {targets!r}:
        try:
          with open(path, "a") as f:
            f.write("pwned")
          print("WROTE", path)
        except OSError as e:
          print("denied", path, type(e).__name__)
      open("mine.txt", "w").write("ok")   # Its own directory is writable.
      open("/dev/shm/x", "w").write("ok")
      print(open("mine.txt").read())
      """)
  assert r.exit_code == 0, r
  assert "WROTE" not in r.stdout and r.stdout.count("denied") == len(targets), r.stdout
  assert r.stdout.strip().endswith("ok")
  assert before == {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in watched}
  for path in targets[len(watched):-1]:
    assert not os.path.exists(path), path


def test_other_users_files(visible_dir):
  """A file of another uid (say another sandbox's) with mode 0600 is unreadable; 0644 is read-only."""
  private, shared = os.path.join(visible_dir, "private"), os.path.join(visible_dir, "shared")
  for path, mode in ((private, 0o600), (shared, 0o644)):
    with open(path, "w") as f:
      f.write("other user's data")
    os.chown(path, sandbox.UID_BASE + sandbox.SLOTS - 1, sandbox.UID_BASE + sandbox.SLOTS - 1)
    os.chmod(path, mode)
  r = run(f"""
      import os
      try:
        open({private!r}).read(); print("READ private")
      except OSError: print("denied private")
      print(open({shared!r}).read())
      for act in (lambda: open({shared!r}, "a"), lambda: os.chmod({shared!r}, 0o777),
                  lambda: os.chown({shared!r}, os.getuid(), -1), lambda: os.unlink({shared!r})):
        try:
          act(); print("CHANGED")
        except OSError: print("denied")
      """)
  assert r.exit_code == 0, r
  assert "READ" not in r.stdout and "CHANGED" not in r.stdout and "other user's data" in r.stdout
  assert r.stdout.count("denied") == 5
  assert open(shared).read() == "other user's data" and os.stat(shared).st_mode & 0o777 == 0o644


def test_fork_bomb_is_limited_and_all_killed():
  r = run("""
      import os, time
      n = 0
      try:
        while True:
          if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
          n += 1
      except OSError as e:
        print("stopped after", n, e.errno)
      """, limits=Limits(cpu_s=1, wall_s=5, processes=16))
  assert r.exit_code == 0 and "stopped after" in r.stdout, r
  assert int(r.stdout.split()[2]) < 16
  assert_no_processes_left(r)


def test_background_process_is_killed_at_the_end():
  r = run("""
      import subprocess, os
      subprocess.Popen(["sleep", "1000"], start_new_session=True)
      if os.fork() == 0:            # A double-forked daemon, too.
        os.setsid()
        if os.fork() == 0:
          import time; time.sleep(1000)
        os._exit(0)
      print("left them running")
      """)
  assert r.exit_code == 0 and r.wall_s < 5, r  # Far below wall_s=10: nothing waited for them.
  assert_no_processes_left(r)


def test_memory_hog_is_stopped():
  r = run("""
      chunks = []
      while True:
        chunks.append(bytearray(16 << 20))
      """, limits=Limits(cpu_s=2, wall_s=5, memory_mb=256))
  assert r.exit_code != 0 and "MemoryError" in r.stderr, r


def test_cpu_loop_times_out_within_the_limit():
  r = run("while True: pass", limits=Limits(cpu_s=1, wall_s=10))
  assert r.timed_out and not r.ok and r.killed_by_signal in (signal.SIGXCPU, signal.SIGKILL), r
  assert r.wall_s < 8  # Stopped by the CPU limit, before wall_s.


def test_sleeping_past_wall_time_is_killed():
  r = run("import time; time.sleep(100)", limits=Limits(cpu_s=1, wall_s=1))
  assert r.timed_out and r.killed_by_signal == signal.SIGKILL and 0.9 < r.wall_s < 4, r
  assert_no_processes_left(r)


def test_output_flood_is_truncated():
  r = run("""
      import sys
      while True:
        sys.stdout.write("x" * 65536); sys.stderr.write("y" * 65536)
      """, limits=Limits(cpu_s=1, wall_s=3, output_bytes=10_000))
  assert r.truncated and len(r.stdout) == 10_000 and len(r.stderr) == 10_000 and set(r.stdout) == {"x"}, r.exit_code


def test_file_size_and_disk_are_limited():
  r = run("""
      try:
        open("big", "wb").write(b"x" * (8 << 20)); print("WROTE big")
      except OSError as e: print("file limit", e.errno)
      written = 0
      try:
        for i in range(100):
          open(f"f{i}", "wb").write(b"x" * (3 << 20)); written += 3
      except OSError as e: print("disk limit", written)
      """, limits=Limits(file_mb=4, disk_mb=16))
  assert "WROTE" not in r.stdout and "file limit" in r.stdout and "disk limit" in r.stdout, r
  assert int(r.stdout.split()[-1]) <= 16


def test_signals_to_its_parent_and_everyone_are_harmless():
  r = run("""
      import os, signal, subprocess
      for pid in (os.getppid(), 1, -1):
        try:
          os.kill(pid, signal.SIGKILL)
        except OSError as e:
          print("refused", pid, e.errno, flush=True)
      subprocess.run(["kill", "-9", "-1"])
      """)
  # `kill -9 -1` from a child killed the program (its only other process of the same uid); the host
  # and the sandbox's root-owned init and `timeout` survive and report it.
  assert r.killed_by_signal == signal.SIGKILL and not r.timed_out, r
  assert r.stdout.count("refused") == 2, r  # Its parent (`timeout`) and init; kill(-1) finds no one.
  os.kill(os.getpid(), 0)  # This process is alive.
  assert_no_processes_left(r)


def test_privilege_cannot_be_regained():
  r = run("""
      import os, subprocess
      for fn in (lambda: os.setuid(0), lambda: os.chroot("/"), lambda: os.setgroups([0])):
        try: fn(); print("GAINED")
        except OSError: print("denied")
      print(subprocess.run(["su", "-c", "id"], capture_output=True).returncode != 0)
      print(open("/proc/self/status").read().split("NoNewPrivs:")[1].split()[0])
      """)
  assert r.stdout.split() == ["denied"] * 3 + ["True", "1"], r


def test_temp_dirs_and_slots_are_released():
  before = set(os.listdir(tempfile.gettempdir()))
  r = run("print(1)")
  leftover = {d for d in set(os.listdir(tempfile.gettempdir())) - before if d.startswith("dapo_sandbox_")}
  assert r.stdout == "1\n" and not leftover
  with open(os.path.join(sandbox._LOCK_DIR, f"{r.uid - sandbox.UID_BASE}.lock")) as lock:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # Free again: raises if still held.


def test_concurrent_runs_from_threads():
  programs = [f"import time; time.sleep(0.2); print(sum(range({i})))" for i in range(8)]
  with cf.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(run_python, programs))
  assert [r.stdout.strip() for r in results] == [str(sum(range(i))) for i in range(8)]
  with sandbox.SandboxPool(4) as pool:
    results = pool.map(programs)
  assert [r.stdout.strip() for r in results] == [str(sum(range(i))) for i in range(8)]
  assert len({r.uid for r in results}) >= 2


def test_unsandboxed_mode_warns_and_still_limits(caplog, monkeypatch):
  monkeypatch.setattr(sandbox, "_warned_none", False)
  with caplog.at_level(logging.WARNING):
    r = run_python("import os; print(os.getuid())", sandbox="none")
    slow = run_python("while True: pass", sandbox="none", limits=Limits(cpu_s=1, wall_s=5))
  assert r.stdout.strip() == "0" and r.mode == "none"
  assert slow.timed_out and slow.wall_s < 8
  warnings = [rec for rec in caplog.records if "sandbox='none'" in rec.getMessage()]
  assert len(warnings) == 1  # Once, however many calls.
  monkeypatch.setenv("DAPO_SANDBOX", "none")
  assert run_python("print(2)").mode == "none"
  monkeypatch.setenv("DAPO_SANDBOX", "chroot")
  with pytest.raises(ValueError, match="DAPO_SANDBOX"):
    run_python("print(3)")


def test_check_available_says_what_is_missing(monkeypatch):
  monkeypatch.setattr(sandbox, "_available", None)
  monkeypatch.setattr(sandbox, "TOOLS", sandbox.TOOLS + ("no-such-tool",))
  with pytest.raises(RuntimeError, match=r"missing programs \['no-such-tool'\].*DAPO_SANDBOX=none"):
    sandbox.check_available()
  monkeypatch.setattr(sandbox, "_available", None)
  monkeypatch.setattr(sandbox, "TOOLS", sandbox.TOOLS[:-1])
  monkeypatch.setattr(sandbox, "UID_BASE", 0)  # root's uid is in that range.
  with pytest.raises(RuntimeError, match="DAPO_SANDBOX_UID_BASE"):
    sandbox.check_available()
  monkeypatch.setattr(sandbox, "_available", None)
