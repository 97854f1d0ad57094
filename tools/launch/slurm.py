"""Submits Ling2 training to SLURM (tools/launch/slurm.sbatch), after checking the request against the cluster.

    python -m tools.launch.slurm --nodes=8 --run_dir=/shared/runs/x --config=configs/train/ling2-32k.yml \
        [--tasks_per_host=1] [--partition=P] [--time=24:00:00] [--dry_run] -- key=value ...

One task per host by default (JAX drives every accelerator of its host); --tasks_per_host=8 gives one per GPU.
Prints the job id. Bad requests (more hosts than the partition has, a relative run dir) exit 2 before anything
is submitted. The job's output goes to <run_dir>/slurm-<job>.out, appended across requeues.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from ling2.config import cli

SCRIPT = Path(__file__).with_name("slurm.sbatch")


class LaunchError(ValueError):
    pass


def partition_hosts(partition: str | None, env=None) -> tuple[str, int]:
    """(partition name, its host count) from sinfo; the default partition when none is named."""
    out = subprocess.run(["sinfo", "-h", "-o", "%P %D"], capture_output=True, text=True, env=env)
    if out.returncode:
        raise LaunchError(f"sinfo failed: {out.stderr.strip()}")
    hosts = {}
    default = None
    for line in out.stdout.split("\n"):
        if line.strip():
            name, count = line.split()
            if name.endswith("*"):
                name = default = name[:-1]
            hosts[name] = hosts.get(name, 0) + int(count)
    name = partition or default
    if name not in hosts:
        raise LaunchError(f"--partition={partition}: no such partition (sinfo lists {', '.join(sorted(hosts))})"
                          if partition else "no default partition: name one with --partition")
    return name, hosts[name]


def sbatch_command(args, hosts_available: int) -> list:
    """The sbatch argv for `args`; LaunchError names the flag of a request the cluster cannot hold."""
    if args.nodes < 1:
        raise LaunchError(f"--nodes={args.nodes}: at least 1")
    if args.tasks_per_host < 1:
        raise LaunchError(f"--tasks_per_host={args.tasks_per_host}: at least 1")
    if args.nodes > hosts_available:
        raise LaunchError(f"--nodes={args.nodes}: more hosts than partition {args.partition_name!r} has "
                          f"({hosts_available}); {args.nodes * args.tasks_per_host} task(s) at "
                          f"{args.tasks_per_host} per host need {args.nodes} hosts")
    if not args.run_dir.startswith("/"):
        raise LaunchError(f"--run_dir={args.run_dir}: must be absolute, on storage every host sees")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise LaunchError(f"override {bad[0]!r} is not key=value")
    cmd = ["sbatch", "--parsable", f"--nodes={args.nodes}", f"--ntasks-per-node={args.tasks_per_host}",
           f"--job-name={args.job_name}", f"--output={args.run_dir}/slurm-%j.out", f"--partition={args.partition_name}"]
    if args.time:
        cmd.append(f"--time={args.time}")
    return cmd + [str(SCRIPT), *args.overrides]


def parse(argv):
    p = cli.ArgumentParser(prog="python -m tools.launch.slurm", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, required=True, help="Hosts (SLURM nodes).")
    p.add_argument("--run_dir", required=True, help="Run directory on storage every host sees (absolute).")
    p.add_argument("--config", default=None, help="Trainer root config file (the trainer's --config).")
    p.add_argument("--tasks_per_host", type=int, default=1, help="Trainer processes per host (1, or 1 per GPU).")
    p.add_argument("--partition", default=None, help="SLURM partition (default: the cluster's default).")
    p.add_argument("--time", default=None, help="Time limit (sbatch --time); TERM 300 s before it saves.")
    p.add_argument("--job_name", default="ling2")
    p.add_argument("--dry_run", action="store_true", help="Print the sbatch command instead of submitting.")
    p.add_argument("overrides", nargs="*", help="Trainer key=value overrides (after --).")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if shutil.which("sbatch") is None:
        print("error: sbatch not found: not a SLURM login node (Debian: apt-get install slurm-client)",
              file=sys.stderr)
        return 2
    cwd = os.environ.get("BUILD_WORKING_DIRECTORY", os.getcwd())
    try:
        args.partition_name, hosts = partition_hosts(args.partition)
        cmd = sbatch_command(args, hosts)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env = dict(os.environ, LING2_RUN_DIR=args.run_dir, LING2_TASKS_PER_HOST=str(args.tasks_per_host))
    if args.config:
        env["LING2_CONFIG"] = args.config
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    Path(args.run_dir).mkdir(parents=True, exist_ok=True)
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if out.returncode:
        print(f"error: sbatch refused the job: {out.stderr.strip()}", file=sys.stderr)
        return 2
    print(out.stdout.strip().split(";")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
