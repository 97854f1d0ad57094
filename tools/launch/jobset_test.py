"""tools/launch/jobset: v5p-64 manifests (one slice and two) checked against the real JobSet CRD schema
(tools/launch/jobset_crd), the checker shown to reject a misspelled field, a wrong type and a missing field,
and the CLI's bad inputs as named errors with exit status 2."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ling2 import topology
from ling2.config.paths import find_file
from tools.launch import jobset, openapi_check

REPO = Path(__file__).resolve().parents[2]
CRD = "tools/launch/jobset_crd/jobset.x-k8s.io_jobsets.yaml"
ARGS = dict(name="ling2-v5p", image="us-docker.pkg.dev/p/ling2:1", config="configs/train/ling2.yml",
            run_dir="/gcs/runs/ling2", gcs_bucket="ling2-runs")
OVERRIDES = ("steps=1000", "learning_rate=3e-4")


@pytest.fixture(scope="module")
def crd():
    path = find_file(CRD)
    return openapi_check.load_crd(path if path.exists() else REPO / CRD)


def _job(m):
    return m["spec"]["replicatedJobs"][0]


def _pod(m):
    return _job(m)["template"]["spec"]["template"]["spec"]


def test_v5p_64_one_slice(crd):
    m = jobset.render("v5p-64", overrides=OVERRIDES, **ARGS)
    assert openapi_check.object_errors(m, crd) == []
    topo = topology.parse("v5p-64")
    assert topo.chips_per_slice == 32  # v5p-64 counts TensorCores, 2 per chip
    assert (m["apiVersion"], m["kind"], m["metadata"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet",
                                                            {"name": "ling2-v5p", "namespace": "default"})
    job = _job(m)
    assert (job["name"], job["replicas"]) == ("slice", 1)
    spec = job["template"]["spec"]
    assert (spec["parallelism"], spec["completions"]) == (8, 8)  # 32 chips / 4 per host
    assert (spec["backoffLimit"], spec["completionMode"]) == (0, "Indexed")
    assert m["spec"]["failurePolicy"] == {"maxRestarts": 3}
    assert m["spec"]["network"] == {"enableDNSHostnames": True}
    pod = _pod(m)
    shape = pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
    assert shape == "x".join(map(str, topo.shape))
    assert sorted(int(d) for d in shape.split("x")) == [2, 4, 4]  # 32 chips, GKE's v5p-64 shape
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5p-slice"
    assert (pod["restartPolicy"], pod["hostNetwork"], pod["dnsPolicy"]) == ("Never", True, "ClusterFirstWithHostNet")
    (c,) = pod["containers"]
    assert c["image"] == ARGS["image"]
    assert c["resources"] == {"requests": {"google.com/tpu": 4}, "limits": {"google.com/tpu": 4}}
    assert {"name": "LING2_DISTRIBUTED", "value": "auto"} in c["env"]
    assert c["command"] == ["python", "-m", "ling2.train.train", "--config=configs/train/ling2.yml",
                            "--run_dir=/gcs/runs/ling2", "--preempted_exit_code=75", "--", *OVERRIDES]
    assert pod["terminationGracePeriodSeconds"] == 300
    assert c["volumeMounts"] == [{"name": "gcs", "mountPath": "/gcs"}]
    assert pod["volumes"][0]["csi"] == {"driver": "gcsfuse.csi.storage.gke.io",
                                        "volumeAttributes": {"bucketName": "ling2-runs"}}
    assert _job(m)["template"]["spec"]["template"]["metadata"] == {"annotations": {"gke-gcsfuse/volumes": "true"}}
    assert "annotations" not in m["metadata"]


def test_v5p_64_two_slices(crd):
    m = jobset.render("v5p-64", num_slices=2, max_restarts=5, namespace="training", **ARGS)
    assert openapi_check.object_errors(m, crd) == []
    assert _job(m)["replicas"] == 2
    assert _job(m)["template"]["spec"]["parallelism"] == 8  # per slice
    assert m["metadata"]["namespace"] == "training"
    assert m["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    assert m["spec"]["failurePolicy"] == {"maxRestarts": 5}


@pytest.mark.parametrize("name,hosts,accelerator,shape", [
    ("v4-16", 2, "tpu-v4-podslice", "2x2x2"), ("v5p-128", 16, "tpu-v5p-slice", "4x4x4"),
    ("v5e-16", 4, "tpu-v5-lite-podslice", "4x4"), ("v6e-256", 64, "tpu-v6e-slice", "16x16")])
def test_other_multi_host_slices(crd, name, hosts, accelerator, shape):
    m = jobset.render(name, **ARGS)
    assert openapi_check.object_errors(m, crd) == []
    assert _job(m)["template"]["spec"]["completions"] == hosts
    assert _pod(m)["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": accelerator,
                                       "cloud.google.com/gke-tpu-topology": shape}


JOB = "$.spec.replicatedJobs[0].template.spec"
CONTAINER = JOB + ".template.spec.containers[0]"


def _rename(d, old, new):
    d[new] = d.pop(old)


@pytest.mark.parametrize("mutate,expected", [
    (lambda m: _rename(_job(m)["template"]["spec"], "parallelism", "parallelizm"), f"{JOB}.parallelizm: unknown field"),
    (lambda m: _job(m)["template"]["spec"].update(parallelism="8"), f"{JOB}.parallelism: expected integer, got str"),
    (lambda m: _job(m)["template"]["spec"].update(parallelism=True), f"{JOB}.parallelism: expected integer, got bool"),
    (lambda m: _pod(m)["containers"][0].pop("name"), f"{CONTAINER}.name: required field missing"),
    (lambda m: _job(m)["template"]["spec"].pop("template"), f"{JOB}.template: required field missing"),
    (lambda m: m["spec"]["failurePolicy"].update(restartStrategy="Restart"),
     "$.spec.failurePolicy.restartStrategy: 'Restart' is not one of"),
    (lambda m: _job(m).update(replicas=-1), "$.spec.replicatedJobs[0].replicas: -1 outside [0,"),
    (lambda m: _job(m).update(replicas=2**31), "$.spec.replicatedJobs[0].replicas: 2147483648 out of int32 range"),
    (lambda m: _pod(m)["containers"][0]["resources"]["limits"].update({"google.com/tpu": "four"}),
     f"{CONTAINER}.resources.limits['google.com/tpu']: 'four' does not match"),
    (lambda m: _pod(m)["containers"][0]["resources"]["limits"].update({"google.com/tpu": 4.0}),
     f"{CONTAINER}.resources.limits['google.com/tpu']: expected integer or string"),
    (lambda m: _pod(m)["containers"][0]["env"].append({"name": "LING2_DISTRIBUTED", "value": "x"}),
     f"{CONTAINER}.env: duplicate key ('LING2_DISTRIBUTED',)"),
    (lambda m: m["metadata"].update(nmae="x"), "$.metadata.nmae: unknown field"),
    (lambda m: m.pop("metadata"), "$.metadata: required field missing"),
    (lambda m: m.update(apiVersion="jobset.x-k8s.io/v1"), "$.apiVersion: 'jobset.x-k8s.io/v1' is not one of"),
])
def test_checker_rejects(crd, mutate, expected):
    m = copy.deepcopy(jobset.render("v5p-64", **ARGS))
    mutate(m)
    errs = openapi_check.object_errors(m, crd)
    assert any(e.startswith(expected) for e in errs), errs


def test_name_limit_follows_pod_names():
    # pod names are <name>-slice-<job>-<pod>-<5 random>: 16 characters more for v5p-64 (8 hosts), at most 63
    assert jobset.render("v5p-64", **{**ARGS, "name": "a" * 47})["metadata"]["name"] == "a" * 47
    with pytest.raises(jobset.JobSetError, match="at most 47 characters"):
        jobset.render("v5p-64", **{**ARGS, "name": "a" * 48})


def _cli(*argv, cwd=REPO):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "tools.launch.jobset", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def _argv(**kw):
    opts = {"topology": "v5p-64", **ARGS, **kw}
    return [f"--{k}={v}" for k, v in opts.items() if v is not None]


def test_cli_writes_the_manifest(crd, tmp_path):
    r = _cli(*_argv(num_slices=2), "--", *OVERRIDES)
    assert r.returncode == 0, r.stderr
    m = yaml.safe_load(r.stdout)
    assert m == jobset.render("v5p-64", num_slices=2, overrides=OVERRIDES, **ARGS)
    assert openapi_check.object_errors(m, crd) == []
    r = _cli(*_argv(out=tmp_path / "js.yaml"))
    assert (r.returncode, r.stdout) == (0, "")
    assert yaml.safe_load((tmp_path / "js.yaml").read_text()) == jobset.render("v5p-64", **ARGS)


@pytest.mark.parametrize("kw,extra,message", [
    (dict(topology="v100-8"), (), "error: --topology: unknown topology 'v100-8'"),
    (dict(topology="h100-16"), (), "error: --topology h100-16: not a GKE TPU slice (cuda)"),
    (dict(topology="v5p-8"), (), "error: --topology v5p-8: a single-host slice (4 chips)"),
    (dict(topology="v6e-8"), (), "error: --topology v6e-8: a single-host slice (8 chips)"),
    (dict(name="Ling2_Run"), (), "error: --name 'Ling2_Run': must be a DNS-1035 label"),
    (dict(name="a" * 60), (), "error: --name '" + "a" * 60 + "': too long"),
    (dict(num_slices=0), (), "error: --num_slices 0: must be a positive integer"),
    (dict(namespace="Team A"), (), "error: --namespace 'Team A'"),
    (dict(max_restarts=-1), (), "error: --max_restarts -1"),
    (dict(image=None), (), "error: --image is required"),
    (dict(run_dir=None), (), "error: --run_dir is required"),
    (dict(run_dir="gs://b/r"), (), "error: --run_dir 'gs://b/r': must be an absolute path every host sees"),
    (dict(gcs_bucket="Bad Bucket"), (), "error: --gcs_bucket 'Bad Bucket': not a Cloud Storage bucket name"),
    (dict(topology=None), (), "error: --topology is required"),
    ({}, ("--", "train.steps"), "error: override 'train.steps': expected key=value"),
])
def test_cli_bad_input(kw, extra, message):
    r = _cli(*_argv(**kw), *extra)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""
    assert message in r.stderr, r.stderr
