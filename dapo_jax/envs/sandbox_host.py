"""What the sandbox takes from the host: the interpreter a program runs under, the read-only view
of the host's file system bwrap builds for it, and the seccomp filter on its system calls.

The view holds /usr (without /usr/local), the /bin /sbin /lib* links, `ETC_FILES` of /etc, the
interpreter's prefixes with their site-packages emptied but for `PACKAGES`, and the tools the
sandbox runs; nothing else of the host (checkouts, workdirs, home directories, data) is in it.

`SandboxError` is what every part of the sandbox raises when it cannot be built or torn down.
"""
import errno
import os
import platform
import shutil
import site
import sys
import sysconfig

from dapo_jax import errors

# The top-level packages of the interpreter's site-packages a program may import; the rest (this
# project, benchmark packages with their reference solutions, ...) is not in the sandbox.
PACKAGES = tuple(p for p in os.environ.get("DAPO_SANDBOX_PACKAGES", "numpy").split(",") if p)
# The files of /etc a program may need (the dynamic loader's cache, names of users and hosts, time).
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "passwd", "group", "nsswitch.conf",
             "hosts", "mime.types")
# Calls no program needs, and the kernel surface most escapes go through. unshare/setns/clone with a
# CLONE_NEW* flag: no new namespaces (a new user namespace would make the program root in it);
# clone3 answers ENOSYS, so the C library falls back to clone, whose flags the filter can read.
SECCOMP_DENIED = (
    "unshare", "setns",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "open_tree_attr", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "quotactl_fd", "syslog", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "sethostname", "setdomainname", "iopl", "ioperm", "open_by_handle_at", "name_to_handle_at",
    "fanotify_init", "lookup_dcookie", "vhangup", "uselib", "memfd_secret", "nfsservctl", "_sysctl",
)
# Calls newer than some libseccomp releases know, by their number (the same on x86_64 and arm64).
_NEWER_SYSCALLS = {"open_tree_attr": 467}
_CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)


class SandboxError(errors.UserError, RuntimeError):
  """The sandbox itself could not be built or torn down (not the program's failure)."""


def interpreter() -> str:
  """This process's python (a venv's, with its site-packages), else python3 on PATH."""
  if sys.executable and os.path.isabs(sys.executable) and os.path.exists(sys.executable):
    return sys.executable
  return os.path.realpath(shutil.which("python3") or "/usr/bin/python3")


def seccomp_program() -> bytes:
  """The compiled seccomp filter (BPF): SECCOMP_DENIED and namespace-making clones answer EPERM."""
  try:
    import pyseccomp  # noqa: PLC0415
  except ImportError:
    raise SandboxError("sandbox: the seccomp binding is missing (pip install pyseccomp)") from None
  except Exception as e:  # The binding loads libseccomp when imported.
    raise SandboxError(f"sandbox: libseccomp cannot be loaded (apt-get install libseccomp2): {e}") from None
  if platform.machine() not in ("x86_64", "aarch64"):  # Where clone's flags are its first argument.
    raise SandboxError(f"sandbox: the seccomp filter is written for x86_64 and aarch64, not {platform.machine()}")
  deny = pyseccomp.ERRNO(errno.EPERM)
  f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
  f.set_attr(pyseccomp.Attr.ACT_BADARCH, pyseccomp.KILL_PROCESS)  # Other ABIs' calls (int 0x80, x32).
  arch = pyseccomp.system_arch()
  for name in SECCOMP_DENIED:
    number = pyseccomp.resolve_syscall(arch, name)
    if number < 0:
      number = _NEWER_SYSCALLS.get(name, number)
    if number >= 0:  # Negative: not a call of this architecture.
      f.add_rule(deny, number)
  f.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
  for flag in _CLONE_NEW_FLAGS:
    f.add_rule(deny, "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
  fd = os.memfd_create("seccomp", os.MFD_CLOEXEC)
  try:
    with open(fd, "wb", closefd=False) as out:
      f.export_bpf(out)
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 1 << 20)
  finally:
    os.close(fd)


def view(tools: list[str]) -> list[str]:
  """bwrap arguments for the read-only root: /usr without /usr/local, /etc's needed files, the
  interpreter's prefixes with only `PACKAGES` left in their site-packages, and the tools."""
  args = ["--ro-bind", "/usr", "/usr", "--size", str(1 << 20), "--tmpfs", "/usr/local"]
  for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
    if os.path.islink(top):
      args += ["--symlink", os.readlink(top), top]
    elif os.path.isdir(top):
      args += ["--ro-bind", top, top]
  args += ["--perms", "0755", "--dir", "/etc"]
  for name in ETC_FILES:
    args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
  made = set()

  def bind(path: str) -> None:
    parents = []
    for parent in _ancestors(path):
      if parent not in made and not _covered(parent):
        parents.append(parent)
      made.add(parent)
    for parent in parents:  # Parents bwrap would make mode 0700, which the program's uid cannot cross.
      args.extend(["--perms", "0755", "--dir", parent])
    args.extend(["--ro-bind", path, path])
    made.add(path)

  prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)}
  python = interpreter()
  prefixes |= {os.path.dirname(os.path.dirname(os.path.realpath(python)))}
  for prefix in sorted(prefixes):
    if not _covered(prefix) and os.path.isdir(prefix):
      bind(prefix)
  for tool in tools + [python, os.path.realpath(python)]:
    if not _covered(tool) and not any(tool.startswith(p + "/") for p in prefixes):
      bind(tool)
  sites = {os.path.realpath(p) for p in site.getsitepackages()}
  for prefix in prefixes:  # A venv's base interpreter has site-packages of its own.
    sites |= {os.path.realpath(sysconfig.get_path(key, vars={"base": prefix, "platbase": prefix}))
              for key in ("purelib", "platlib")}
  for sp in sorted(p for p in sites if os.path.isdir(p)):
    if not (_covered(sp) or any(sp.startswith(p + "/") for p in prefixes)):
      continue  # Not in the sandbox anyway.
    args += ["--size", str(1 << 20), "--perms", "0755", "--tmpfs", sp]
    for name in PACKAGES:
      for entry in (name, name + ".libs", name + ".py"):
        if os.path.exists(os.path.join(sp, entry)):
          args += ["--ro-bind", os.path.join(sp, entry), os.path.join(sp, entry)]
    args += ["--remount-ro", sp]
  return args + ["--remount-ro", "/usr/local"]


def _ancestors(path: str) -> list[str]:
  parts = path.strip("/").split("/")[:-1]
  return ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]


def _covered(path: str) -> bool:
  """Inside the /usr bind (and not /usr/local, which the sandbox sees empty)."""
  return (path == "/usr" or path.startswith("/usr/")) and not (path == "/usr/local" or path.startswith("/usr/local/"))
