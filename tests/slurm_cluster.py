"""A real single-node Slurm for the tests: munged, slurmctld and slurmd started from the
Debian packages (slurmctld slurmd slurm-client munge) with a private configuration (its own
key, munge socket, ports, state and spool folders under one temporary folder), so that
nothing in /etc is touched and another Slurm on the machine is not disturbed; every daemon
started is stopped again, by its pid."""
import os
import shutil
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")
PACKAGES = "slurmctld slurmd slurm-client munge"


def missing() -> str:
    """Why a Slurm cannot be started here, or ''."""
    absent = [d for d in DAEMONS if shutil.which(d) is None
              and not Path("/usr/sbin", d).exists()]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install -y {PACKAGES})"
    if os.geteuid() != 0:
        return "starting slurmd and munged needs root"
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(root, munge_socket):
    cpus = os.cpu_count()
    return "\n".join([
        "ClusterName=moagen", "SlurmctldHost=localhost",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={munge_socket}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
        f"NodeName=localhost NodeHostname={socket.gethostname()} CPUs={cpus} RealMemory=1000 "
        "State=UNKNOWN",
        "PartitionName=moagen Nodes=localhost Default=YES MaxTime=INFINITE State=UP", ""])


@contextmanager
def single_node_slurm(timeout=60):
    """Yields the environment in which sbatch, sinfo and squeue talk to this Slurm."""
    root = Path(tempfile.mkdtemp(prefix="moagen-slurm-", dir="/tmp"))
    root.chmod(0o755)
    munge = root / "munge"
    munge.mkdir(mode=0o700)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    shutil.chown(munge, "munge", "munge")
    shutil.chown(key, "munge", "munge")
    for folder in ("state", "spool"):
        (root / folder).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(_config(root, munge / "munge.sock"))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started = []
    try:
        started.append(subprocess.Popen(
            ["munged", "--foreground", "--force",
             f"--socket={munge / 'munge.sock'}", f"--key-file={key}",
             f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
             f"--seed-file={munge / 'munged.seed'}"], user="munge", group="munge",
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        _wait(lambda: (munge / "munge.sock").exists(), timeout, "munged's socket", root)
        started.append(subprocess.Popen(["slurmctld", "-D", "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        started.append(subprocess.Popen(["slurmd", "-D", "-N", "localhost", "-f", str(conf)],
                                        env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT))
        _wait(lambda: subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                     text=True).stdout.strip() == "idle",
              timeout, "the node to be idle (sinfo)", root)
        yield env
    finally:
        for process in reversed(started):
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(root, ignore_errors=True)


def _wait(ready, timeout, what, root):
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}"
                             for p in sorted(root.rglob("*.log")))
            raise TimeoutError(f"waited {timeout} s for {what}\n{logs}")
        time.sleep(0.5)
