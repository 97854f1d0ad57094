"""A Kubernetes JobSet that runs the Ling2 trainer on a GKE multi-host TPU slice (or several).

    python -m tools.launch.jobset --topology=v5p-64 [--num_slices=2] --name=ling2-run \\
        --image=IMAGE --config=configs/train/FILE.yml --gcs_bucket=BUCKET --run_dir=/gcs/runs/x \\
        [--out=FILE] [-- key=value ...]

One replicated Job per slice, one pod per TPU host (GKE schedules the pods of a slice onto one
node pool by its TPU node selectors). Every pod runs the same trainer command with
LING2_DISTRIBUTED=auto, so the trainer starts multi-host JAX from JAX's own detection of the
slice. A failed pod (a preempted or broken host) fails its Job and JobSet recreates every Job, up
to --max_restarts times; the trainer then resumes from the last checkpoint in --run_dir, a path every
host sees: --gcs_bucket mounts a Cloud Storage bucket at /gcs (GKE's Cloud Storage FUSE CSI driver).
Hosts and chips come from `ling2.topology`; bad input is an `error: ...` line and exit status 2.
"""

import re
import sys

import yaml

from ling2 import topology
from ling2.config import cli
from ling2.config.paths import user_path

# GKE's `cloud.google.com/gke-tpu-accelerator` node label per TPU generation.
ACCELERATORS = {"v4": "tpu-v4-podslice", "v5e": "tpu-v5-lite-podslice", "v5p": "tpu-v5p-slice",
                "v6e": "tpu-v6e-slice"}
CHIPS_PER_HOST = 4  # every GKE multi-host TPU slice of these generations
SINGLE_HOST_MAX_CHIPS = {"v4": 4, "v5p": 4, "v5e": 8, "v6e": 8}  # a slice this small is one VM
REPLICATED_JOB = "slice"
PREEMPTED_EXIT_CODE = 75
GCS_MOUNT = "/gcs"
_BUCKET = re.compile(r"[a-z0-9][-_.a-z0-9]{1,220}[a-z0-9]")
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_MAX_NAME = 63  # a DNS label; JobSet checks the names it derives (`<jobset>-<rjob>-<job>-<pod>-xxxxx`)


class JobSetError(ValueError):
    """Bad input for the manifest; the message names the option."""


def slice_hosts(topo: topology.Topology) -> int:
    """TPU hosts (pods) per slice of a multi-host TPU topology; JobSetError for anything else."""
    gen = topo.chip.generation
    if topo.chip.platform != "tpu" or gen not in ACCELERATORS:
        raise JobSetError(f"--topology {topo.name}: not a GKE TPU slice ({topo.chip.platform}); "
                          f"TPU generations: {', '.join(ACCELERATORS)}")
    if topo.chips_per_slice <= SINGLE_HOST_MAX_CHIPS[gen]:
        raise JobSetError(f"--topology {topo.name}: a single-host slice ({topo.chips_per_slice} chips); "
                          f"this manifest is for multi-host slices (more than {SINGLE_HOST_MAX_CHIPS[gen]} chips)")
    return topo.chips_per_slice // CHIPS_PER_HOST


def check_name(name: str, num_slices: int, hosts: int) -> None:
    """JobSetError unless `name` is a DNS-1035 label short enough for every derived pod name."""
    if not name or not _DNS1035.fullmatch(name):
        raise JobSetError(f"--name {name!r}: must be a DNS-1035 label (lower-case letters, digits and '-', "
                          "starting with a letter, ending with a letter or digit)")
    longest = f"{name}-{REPLICATED_JOB}-{num_slices - 1}-{hosts - 1}-abcde"  # a pod's generated name
    if len(longest) > _MAX_NAME:
        limit = len(name) - (len(longest) - _MAX_NAME)
        raise JobSetError(f"--name {name!r}: too long for this slice; pod names such as {longest!r} would "
                          f"exceed {_MAX_NAME} characters (at most {limit} characters here)")


def render(topology_name: str, name: str, image: str, config: str, run_dir: str, num_slices: int = 1,
           namespace: str = "default", max_restarts: int = 3, overrides: tuple = (), grace_s: int = 300,
           gcs_bucket: str | None = None) -> dict:
    """The JobSet manifest (plain dicts) for `num_slices` slices of `topology_name`."""
    for opt, value in (("topology", topology_name), ("name", name), ("image", image), ("config", config),
                       ("run_dir", run_dir)):
        if not value:
            raise JobSetError(f"--{opt} is required")
    if not isinstance(num_slices, int) or num_slices < 1:
        raise JobSetError(f"--num_slices {num_slices!r}: must be a positive integer")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise JobSetError(f"--max_restarts {max_restarts!r}: must be a non-negative integer")
    if not run_dir.startswith("/"):
        raise JobSetError(f"--run_dir {run_dir!r}: must be an absolute path every host sees (e.g. under "
                          f"{GCS_MOUNT} with --gcs_bucket)")
    if gcs_bucket is not None and not _BUCKET.fullmatch(gcs_bucket):
        raise JobSetError(f"--gcs_bucket {gcs_bucket!r}: not a Cloud Storage bucket name")
    if not isinstance(grace_s, int) or grace_s < 1:
        raise JobSetError(f"--grace_s {grace_s!r}: must be a positive integer (seconds)")
    if not _DNS1123.fullmatch(namespace or "") or len(namespace) > _MAX_NAME:
        raise JobSetError(f"--namespace {namespace!r}: must be a DNS-1123 label")
    for o in overrides:
        if "=" not in o or o.startswith("-"):
            raise JobSetError(f"override {o!r}: expected key=value")
    try:
        topo = topology.parse(topology_name, num_slices)
    except ValueError as e:
        raise JobSetError(f"--topology: {e}") from e
    hosts = slice_hosts(topo)
    check_name(name, num_slices, hosts)

    chips = {"google.com/tpu": CHIPS_PER_HOST}
    container = {
        "name": "trainer",
        "image": image,
        # a preempted trainer saves, then fails its pod (75): JobSet restarts the slices, which resume
        "command": ["python", "-m", "ling2.train.train", f"--config={config}", f"--run_dir={run_dir}",
                    f"--preempted_exit_code={PREEMPTED_EXIT_CODE}", "--", *overrides],
        "env": [{"name": "LING2_DISTRIBUTED", "value": "auto"}],
        # libtpu's ports (8471: TPU runtime, 8080: multi-slice transfers), as GKE's TPU examples open.
        "ports": [{"containerPort": 8471}, {"containerPort": 8080}],
        "resources": {"requests": dict(chips), "limits": dict(chips)},
    }
    pod_spec = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": grace_s,  # SIGTERM to SIGKILL: the checkpoint's time to save
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": ACCELERATORS[topo.chip.generation],
                         "cloud.google.com/gke-tpu-topology": "x".join(map(str, topo.shape))},
        "containers": [container],
    }
    if gcs_bucket:
        pod_spec["volumes"] = [{"name": "gcs", "csi": {"driver": "gcsfuse.csi.storage.gke.io",
                                                       "volumeAttributes": {"bucketName": gcs_bucket}}}]
        container["volumeMounts"] = [{"name": "gcs", "mountPath": GCS_MOUNT}]
    pod_template = {"spec": pod_spec}
    if gcs_bucket:  # GKE injects the FUSE sidecar into pods so annotated
        pod_template["metadata"] = {"annotations": {"gke-gcsfuse/volumes": "true"}}
    job_spec = {"parallelism": hosts, "completions": hosts, "backoffLimit": 0, "completionMode": "Indexed",
                "template": pod_template}
    metadata = {"name": name, "namespace": namespace}
    if num_slices > 1:  # one slice per node pool: no two Jobs share a slice's hosts
        metadata["annotations"] = {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "failurePolicy": {"maxRestarts": max_restarts},
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": num_slices, "template": {"spec": job_spec}}],
        },
    }


def to_yaml(manifest: dict) -> str:
    """The manifest as YAML, keys in the order written."""
    return yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False)


def main(argv=None) -> int:
    """The CLI: the manifest on stdout (or --out); bad input is `error: ...` on stderr and 2."""
    p = cli.ArgumentParser(prog="jobset", description=__doc__.split("\n")[0])
    p.add_argument("--topology", help="one slice, e.g. v5p-64 (ling2.topology names)")
    p.add_argument("--num_slices", type=int, default=1, help="identical slices joined over DCN")
    p.add_argument("--name", help="JobSet name (a DNS-1035 label)")
    p.add_argument("--namespace", default="default")
    p.add_argument("--image", help="container image holding the repository and its TPU venv")
    p.add_argument("--config", help="trainer config, as the image sees it")
    p.add_argument("--run_dir", help="trainer run directory every host sees (absolute; under /gcs with --gcs_bucket)")
    p.add_argument("--gcs_bucket", help="Cloud Storage bucket mounted at /gcs in every pod")
    p.add_argument("--max_restarts", type=int, default=3, help="JobSet restarts (each resumes from a checkpoint)")
    p.add_argument("--grace_s", type=int, default=300,
                   help="seconds from SIGTERM to SIGKILL: enough for the trainer to save a checkpoint")
    p.add_argument("--out", help="write the manifest here instead of stdout")
    p.add_argument("overrides", nargs="*", help="trainer config overrides key=value (after --)")
    args = p.parse_args(argv)
    try:
        text = to_yaml(render(args.topology, args.name, args.image, args.config, args.run_dir, args.num_slices,
                              args.namespace, args.max_restarts, tuple(args.overrides), args.grace_s,
                              args.gcs_bucket))
    except JobSetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out:
        with open(user_path(args.out), "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
