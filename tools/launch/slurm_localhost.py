"""A one-host SLURM cluster in a folder (munged, slurmctld and slurmd from Debian's slurm-wlm, on loopback
ports), to try tools/launch/slurm.sbatch without a cluster; tools/launch/slurm_test.py runs on it.

    python -m tools.launch.slurm_localhost start /tmp/slurm   # prints the SLURM_CONF to export
    python -m tools.launch.slurm_localhost stop /tmp/slurm

Root only (slurmd starts each job's tasks as the job's user); every file and daemon stays in the folder.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
INSTALL = "apt-get install slurmctld slurmd slurm-client munge"


class SlurmSetupError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(folder: Path, cpus: int, ctld_port: int, slurmd_port: int) -> str:
    """slurm.conf for one node named `localhost` (this host), every path inside `folder`. No cgroups (process
    tracking by /proc), no accounting; jobs may be requeued."""
    host = socket.gethostname().split(".")[0]
    return "\n".join([
        "ClusterName=ling2local", f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}", f"SlurmdPort={slurmd_port}",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={folder}/munge/munge.sock",
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={folder}/state", f"SlurmdSpoolDir={folder}/spool",
        f"SlurmctldPidFile={folder}/slurmctld.pid", f"SlurmdPidFile={folder}/slurmd.pid",
        f"SlurmctldLogFile={folder}/log/slurmctld.log", f"SlurmdLogFile={folder}/log/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "SwitchType=switch/none",
        "MpiDefault=none", "SchedulerType=sched/builtin", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "ReturnToService=2", "KillWait=120", "MinJobAge=3600",
        f"NodeName=localhost NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""])


def start(folder, timeout: float = 60.0) -> Path:
    """Starts the three daemons with their state in `folder` and waits for the node to be idle; returns the
    slurm.conf path (SLURM_CONF for sbatch, squeue, scontrol)."""
    missing = [d for d in (*DAEMONS, "sbatch") if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        raise SlurmSetupError(f"{', '.join(missing)} not installed (Debian: {INSTALL})")
    if os.geteuid() != 0:
        raise SlurmSetupError("a local SLURM cluster needs root (slurmd runs the job's tasks as the job's user)")
    folder = Path(folder).resolve()
    for sub in ("state", "spool", "log", "munge"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    key = folder / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = folder / "slurm.conf"
    conf.write_text(config(folder, os.cpu_count() or 1, _free_port(), _free_port()))
    env = dict(os.environ, SLURM_CONF=str(conf))
    m = folder / "munge"
    subprocess.run(["munged", "--force", f"--socket={m}/munge.sock", f"--key-file={key}",
                    f"--pid-file={m}/munged.pid", f"--log-file={folder}/log/munged.log", f"--seed-file={m}/seed"],
                   check=True, env=env)
    subprocess.run(["slurmctld", "-i"], check=True, env=env)
    subprocess.run(["slurmd"], check=True, env=env)
    t = time.time()
    while True:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True).stdout
        if out.strip() == "idle":
            return conf
        if time.time() - t > timeout:
            logs = "\n".join((folder / "log" / f).read_text()[-2000:] for f in ("slurmctld.log", "slurmd.log")
                             if (folder / "log" / f).exists())
            stop(folder)
            raise SlurmSetupError(f"the local node did not come up in {timeout:.0f} s (sinfo: {out.strip()!r})\n"
                                  f"{logs}")
        time.sleep(0.5)


def stop(folder) -> None:
    """Stops the daemons started in `folder` (SIGTERM, then SIGKILL after 10 s)."""
    folder = Path(folder)
    pids = []
    for f in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
        p = folder / f
        if p.exists() and p.read_text().strip().isdigit():
            pid = int(p.read_text())
            try:
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
            except ProcessLookupError:
                pass
    t = time.time()
    for pid in pids:
        while time.time() - t < 10:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main(argv) -> int:
    if len(argv) != 3 or argv[1] not in ("start", "stop"):
        print("usage: python -m tools.launch.slurm_localhost start|stop FOLDER", file=sys.stderr)
        return 2
    if argv[1] == "stop":
        stop(argv[2])
        return 0
    try:
        conf = start(argv[2])
    except SlurmSetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"export SLURM_CONF={conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
